"""``-j N`` on the commands that read many ranks: by rank partition, the serial answer byte for byte.

The run (tests/analyzers/varied_logs.py) has three ranks, a resume superseding records, placeholders,
NaN, a layout change and a torn tail, so every part has something of its own to say."""

from __future__ import annotations

import os
import sys

import pytest
from trainrec.tools.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "analyzers"))
from varied_logs import write_varied_run  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    return write_varied_run(str(tmp_path_factory.mktemp("jobs")), ranks=3, steps=24, seed=2)


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [
    ("inspect",), ("inspect", "--json"), ("check",), ("check", "--json", "--strict"),
    ("dump",), ("dump", "--rank", "1", "--rank", "2", "--type", "ts,se,rr", "--per-record"),
    ("dump", "--kind", "param"),
    ("anomalies", "--rule", "AnomalyTurbulence", "--threshold", "0.2", "--all", "--json"),
])
def test_jobs_answer_as_serial(run_dir, capsys, argv):
    serial = cli(capsys, argv[0], run_dir, *argv[1:])
    assert serial[1], serial
    for jobs in (2, 3):
        assert cli(capsys, argv[0], run_dir, *argv[1:], "-j", jobs) == serial


def test_dump_follow_takes_no_jobs(run_dir, capsys):
    code, _, err = cli(capsys, "dump", run_dir, "-f", "-j", "2")
    assert code == 2
    assert "leave out -j" in err


def test_inspect_names_rank_ranges(run_dir, capsys):
    code, out, _ = cli(capsys, "inspect", run_dir, "-j", "2")
    assert code == 0
    assert "ranks 0-2" in out


def test_jobs_on_damaged_logs(run_dir, tmp_path, capsys):
    """A flipped byte in the middle of rank 0's log: the same notes and answers with -j 2 as with -j 1."""
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(run_dir, out)
    logs = sorted(str(p) for p in out.rglob("*.trl"))
    with open(logs[0], "r+b") as f:
        f.seek(os.path.getsize(logs[0]) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    for argv in (("inspect",), ("check",), ("dump", "--type", "ts"), ("anomalies", "--rule", "NaNInf", "--all")):
        serial = cli(capsys, argv[0], out, *argv[1:])
        assert cli(capsys, argv[0], out, *argv[1:], "-j", "2") == serial
        if argv[0] in ("dump", "anomalies"):
            assert "bad frame header" in serial[2] or "CRC" in serial[2], serial[2]
