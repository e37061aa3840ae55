"""`trainrec export parquet`: read back by pandas, DuckDB and polars, equal to `Run.stats()` row by row."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

pytest.importorskip("pyarrow")
duckdb = pytest.importorskip("duckdb")
pd = pytest.importorskip("pandas")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from export_logs import rank_dir, write_rank_log  # noqa: E402
from trainrec.recorder.writer import LogWriter  # noqa: E402
from trainrec.replay import open_run  # noqa: E402
from trainrec.replay.rows import value_matrix  # noqa: E402
from trainrec.schema.events import (  # noqa: E402
    OPS,
    SLOTS,
    RunResumed,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    pack_array,
)
from trainrec.tools.cli import main  # noqa: E402


def _rich_rank(rdir: str, rank: int) -> None:
    """A rank whose records use every optional column: call ids, placeholders, a subset of ops,
    float64 values; then a resume from step 3 that supersedes the first file's steps 3..4."""
    with LogWriter(rdir, rank=rank, world_size=2, run_id="run-x", flush_interval=0.02) as w:
        ids = w.intern(["a.weight", "b.weight", "c,d.bias"], step=-1)
        for s in range(5):
            w.write(StepBegan(rank=rank, step=s, wall=1.0 + s))
            vals = np.arange(9, dtype="<f4").reshape(3, 3) + s
            w.write(TensorStatsRecorded(
                rank=rank, step=s, wall=1.0 + s, kind="update", ops=("norm", "max", "zeros"), dtype="f",
                name_ids=pack_array("I", ids), values=vals.tobytes(), call_ids=pack_array("I", [7, 8, 9]),
                micro_steps=pack_array("H", [0, 1, 1]), placeholders=bytes([0, 1, 0])))
            w.write(TensorStatsRecorded(
                rank=rank, step=s, wall=1.0 + s, kind="ratio", ops=OPS, dtype="d",
                name_ids=pack_array("I", ids[:1]), values=np.full((1, 6), 0.1 + s, "<f8").tobytes()))
            w.write(StepEnded(rank=rank, step=s, wall=1.5 + s, duration=0.5, collected=True))
    with LogWriter(rdir, rank=rank, world_size=2, run_id="run-x", flush_interval=0.02) as w:
        w.write(RunResumed(rank=rank, step=3, wall=10.0, last_step=2))
        ids = w.intern(["a.weight", "z.weight"], step=3)
        for s in range(3, 6):
            vals = np.full((2, 6), -10.0 * s, "<f4")
            w.write(TensorStatsRecorded(rank=rank, step=s, wall=11.0 + s, kind="update", ops=OPS, dtype="f",
                                        name_ids=pack_array("I", ids), values=vals.tobytes()))
            w.write(StepEnded(rank=rank, step=s, wall=11.5 + s, duration=0.5, collected=True))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    write_rank_log(rank_dir(d, 0), rank=0, steps=range(4), seed=0)
    _rich_rank(rank_dir(d, 1), rank=1)
    return d


def _key(v):
    """A value as compared: NaN equal to NaN, a missing op as None."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan" if v is not None else None
    return float(v)


def _expected(run_dir) -> dict[tuple[str, int], list[tuple]]:
    """Rows per (kind, rank) partition, in order, from Run.stats() (values rounded to float32 as exported)."""
    out: dict[tuple[str, int], list[tuple]] = {}
    for ev, names in open_run(str(run_dir)).stats():
        mat = value_matrix(ev).astype(np.float32).astype(np.float64)
        n = len(ev)
        micro = np.frombuffer(ev.micro_steps, "<u2") if ev.micro_steps else np.zeros(n, int)
        calls = np.frombuffer(ev.call_ids, "<u4") if ev.call_ids else np.full(n, -1)
        vpp = np.frombuffer(ev.vpp_stages, "u1") if ev.vpp_stages else np.zeros(n, int)
        slots = np.frombuffer(ev.slots, "u1") if ev.slots else np.zeros(n, int)
        ph = np.frombuffer(ev.placeholders, "u1") if ev.placeholders else np.zeros(n, int)
        for i in range(n):
            vals = tuple(_key(mat[i, ev.ops.index(op)]) if op in ev.ops else None for op in OPS)
            out.setdefault((ev.kind, ev.rank), []).append(
                (ev.step, int(micro[i]), int(calls[i]), names[i], int(vpp[i]), SLOTS[slots[i]], bool(ph[i]), *vals))
    return out


def _rows(frame) -> list[tuple]:
    """Rows of a pandas frame or of DuckDB's fetchall (the file's columns, in order)."""
    cols = ["step", "micro_step", "call_id", "name", "vpp_stage", "slot", "placeholder", *OPS]
    rows = frame[cols].itertuples(index=False, name=None) if hasattr(frame, "columns") else frame
    return [(int(r[0]), int(r[1]), int(r[2]), r[3], int(r[4]), r[5], bool(r[6]), *(_key(v) for v in r[7:]))
            for r in rows]


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pq") / "out"
    assert main(["export", "parquet", str(run_dir), "-o", str(out)]) == 0
    return out


def test_every_partition_read_by_pandas_and_duckdb_equals_run_stats(run_dir, exported):
    expected = _expected(run_dir)
    found = {}
    for (kind, rank), rows in expected.items():
        path = exported / f"kind={kind}" / f"rank={rank}" / "part-0.parquet"
        # DuckDB tells a missing op (null) from a NaN statistic; pandas reads both as NaN
        found[(kind, rank)] = _rows(duckdb.sql(f"select * from read_parquet('{path}', hive_partitioning=false)").fetchall())
        nan_for_null = [tuple("nan" if v is None else v for v in row) for row in rows]
        assert _rows(pd.read_parquet(path)) == nan_for_null
    assert found == expected
    assert len(expected) == 7 + 2  # rank 0's seven kinds, rank 1's update and ratio
    # the resume: rank 1's update rows of steps >= 3 are the second file's, named through its own table
    upd = expected[("update", 1)]
    assert [r[3] for r in upd if r[0] >= 3] == ["a.weight", "z.weight"] * 3
    assert [r[7] for r in upd if r[0] == 2] == [None] * 3 and {r[9] for r in upd if r[0] == 5} == {-50.0}


def test_the_whole_directory_reads_as_one_table(run_dir, exported):
    expected = _expected(run_dir)
    total = sum(len(v) for v in expected.values())
    df = pd.read_parquet(exported)  # hive partitions: kind and rank become columns
    assert len(df) == total
    assert set(zip(df["kind"].astype(str), df["rank"].astype(int), strict=True)) == set(expected)
    assert df["name"].dtype != "category" and str(df["norm"].dtype) == "float32"
    got = duckdb.sql(f"select kind, rank, count(*) as n from read_parquet('{exported}/**/*.parquet', "
                     "hive_partitioning=true) group by all order by all").fetchall()
    assert got == sorted((k, r, len(v)) for (k, r), v in expected.items())
    # one schema for every file: a column of an op no record of a partition had is there, all null
    counts = duckdb.sql(f"select count(norm), count(min), count(*) from read_parquet('{exported}/kind=update/**/*.parquet')")
    assert counts.fetchall() == [(15, 6, 15)]  # rank 1: 9 rows of 3 ops, then 6 rows of all six


def test_polars_reads_it_as_it_is(exported):
    pl = pytest.importorskip("polars")
    frame = pl.read_parquet(f"{exported}/**/*.parquet", hive_partitioning=True)
    assert {"kind", "rank", "name", "norm"} <= set(frame.columns)
    assert frame.filter(pl.col("kind") == "ratio").height == 3


def test_float64_keeps_double_records_exact_and_float32_says_so(run_dir, tmp_path, capsys):
    assert main(["export", "parquet", str(run_dir), "-o", str(tmp_path / "a"), "--types", "ratio"]) == 0
    assert "3 record(s) hold float64 values, written as float32; pass --float64" in capsys.readouterr().err
    assert main(["export", "parquet", str(run_dir), "-o", str(tmp_path / "b"), "--types", "ratio", "--float64"]) == 0
    err = capsys.readouterr().err
    assert "--float64" not in err
    df = pd.read_parquet(tmp_path / "b")
    assert sorted(df["norm"].tolist()) == [0.1 + s for s in range(3)]  # (3.., superseded)
    assert str(df["norm"].dtype) == "float64"


def test_selection_marker_and_refusals(run_dir, tmp_path, capsys):
    out = tmp_path / "sel"
    assert main(["export", "parquet", str(run_dir), "-o", str(out), "--types", "param,update", "--steps", "1-2",
                 "--ranks", "0", "--compression", "zstd"]) == 0
    df = pd.read_parquet(out)
    assert set(df["kind"].astype(str)) == {"param"} and set(df["step"]) == {1, 2} and set(df["rank"].astype(int)) == {0}
    assert json.loads((out / ".trainrec-export.json").read_text())["format"] == "parquet"
    capsys.readouterr()
    assert main(["export", "parquet", str(run_dir), "-o", str(out)]) == 2  # not empty, no --force
    assert "--force" in capsys.readouterr().err
    assert main(["export", "parquet", str(run_dir), "-o", str(out), "--force", "--steps", "50-60"]) == 2
    assert "outside the recorded range" in capsys.readouterr().err
    assert not out.exists() or not any(p for p in out.iterdir() if p.name != ".trainrec-export.json")



def test_a_kind_that_is_no_plain_name_is_left_out_not_a_path(tmp_path, capsys):
    """A kind names a directory: one from the log like ``../x`` must not write outside DIR."""
    with LogWriter(rank_dir(tmp_path / "run", 0), rank=0, world_size=1, run_id="r", flush_interval=0.02) as w:
        ids = w.intern(["a"], step=-1)
        for kind in ("../../escaped", "param"):
            w.write(TensorStatsRecorded(rank=0, step=0, wall=1.0, kind=kind, ops=OPS, dtype="f",
                                        name_ids=pack_array("I", ids), values=np.ones((1, 6), "<f4").tobytes()))
        w.write(StepEnded(rank=0, step=0, wall=1.0, duration=0.1, collected=True))
    out = tmp_path / "a" / "b" / "out"
    assert main(["export", "parquet", str(tmp_path / "run"), "-o", str(out)]) == 0
    assert "kind '../../escaped' is not a plain name" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [".trainrec-export.json", "kind=param"]
    assert not (tmp_path / "a" / "escaped").exists() and not (tmp_path / "escaped").exists()
