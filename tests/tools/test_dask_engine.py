"""``--engine dask`` / ``--cluster ADDRESS`` on anomalies and export: a local Dask cluster of worker
processes, started here, gives the serial answer."""

from __future__ import annotations

import os
import sys

import pytest

distributed = pytest.importorskip("distributed")

from trainrec.tools.cli import main  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "analyzers"))
from varied_logs import write_varied_run  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    return write_varied_run(str(tmp_path_factory.mktemp("dask")), ranks=3, steps=24, seed=3)


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=40) as c:
        yield c.scheduler_address


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _tree(root) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if not f.startswith("."):
                path = os.path.join(d, f)
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, root)] = fh.read()
    return out


def test_anomalies_on_a_cluster(run_dir, cluster, capsys, tmp_path):
    argv = ("anomalies", run_dir, "--rule", "AnomalyTurbulence", "--threshold", "0.2", "--all")
    serial = cli(capsys, *argv, "-o", tmp_path / "serial.json")
    on_cluster = cli(capsys, *argv, "--cluster", cluster, "-o", tmp_path / "cluster.json")
    assert serial[0] == 0 and serial[1].count("\n") > 10
    assert on_cluster[:2] == serial[:2]
    assert on_cluster[2].replace("cluster.json", "serial.json") == serial[2]
    assert (tmp_path / "serial.json").read_bytes() == (tmp_path / "cluster.json").read_bytes()


@pytest.mark.parametrize("fmt", ["csv", "tb"])
def test_export_on_a_cluster(run_dir, cluster, capsys, tmp_path, fmt):
    code, out, _ = cli(capsys, "export", fmt, run_dir, "-o", tmp_path / "serial")
    assert code == 0, out
    code, out2, _ = cli(capsys, "export", fmt, run_dir, "-o", tmp_path / "cluster", "--cluster", cluster)
    assert code == 0
    serial, on_cluster = _tree(tmp_path / "serial"), _tree(tmp_path / "cluster")
    assert len(serial) >= 3  # (csv: a file per rank, kind and step; tb: per rank)
    if fmt == "csv":
        assert on_cluster == serial
    else:  # TensorBoard event files: the same names (their wall-clock parts aside) and sizes
        assert sorted(map(len, on_cluster.values())) == sorted(map(len, serial.values()))
    assert "ranks 0-2" in out2


def test_dask_engine_needs_no_address(run_dir, capsys):
    argv = ("anomalies", run_dir, "--rule", "NaNInf", "--all", "--json")
    assert cli(capsys, *argv, "--engine", "dask", "-j", "2") == cli(capsys, *argv)
