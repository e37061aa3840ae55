"""``trainrec inspect`` of a run with more ranks than fit a screen: ranks that read alike share one entry."""

from __future__ import annotations

import os

import pytest
from trainrec.recorder.writer import LogWriter
from trainrec.schema.events import OPS, StepBegan, StepEnded, TensorStatsRecorded, pack_array
from trainrec.tools.cli import main

WORLD = 12


def _write_rank(out: str, rank: int, steps: int) -> str:
    """One rank of a run of WORLD ranks; rank 7 names one tensor more, so its files are larger."""
    w = LogWriter(os.path.join(out, f"Nov30_11-13-33-rank{rank}-0000beef"), rank=rank, world_size=WORLD,
                  run_id="many", flush_interval=0.01)
    names = ["embed.weight", "head.bias"] + (["a.much.longer.tensor.name"] if rank == 7 else [])
    ids = w.intern(names)[:2]
    for s in range(steps):
        w.write(StepBegan(rank=rank, step=s))
        w.write(TensorStatsRecorded(rank=rank, step=s, kind="param", ops=OPS, dtype="f",
                                    name_ids=pack_array("I", ids), values=pack_array("f", [1.0] * 2 * len(OPS))))
        w.write(StepEnded(rank=rank, step=s, duration=0.1, collected=True))
    w.close()
    return w.path


@pytest.fixture()
def run(tmp_path):
    out = str(tmp_path / "out")
    for r in range(WORLD):
        _write_rank(out, r, steps=5 if r == 4 else 3)  # rank 4 ran two steps more
    return out


@pytest.mark.parametrize("quick", [False, True])
def test_ranks_that_read_alike_share_one_entry(run, capsys, quick):
    assert main(["inspect", run] + (["--quick"] if quick else [])) == 0
    out = capsys.readouterr().out
    sizes = {r: os.path.getsize(os.path.join(run, f"Nov30_11-13-33-rank{r}-0000beef", "trainrec-00000.trl"))
             for r in range(WORLD)}
    alike = [sizes[r] for r in range(WORLD) if r != 4]
    assert max(alike) == sizes[7] > min(alike)
    head = "ranks 0-3,5-11 (11 alike), each: 3 steps (0..2)"
    assert sum(line.startswith(head) for line in out.splitlines()) == 1, out
    assert sum(line.startswith("rank 4: 5 steps (0..4)") for line in out.splitlines()) == 1, out
    assert not any(line.startswith(("rank 0:", "rank 7:")) for line in out.splitlines()), out
    assert f"  trainrec-00000.trl  {min(alike)}-{max(alike)} bytes  " in out  # the alike ranks' size range
    if not quick:
        first, last = (os.path.join(run, f"Nov30_11-13-33-rank{r}-0000beef") for r in (0, 11))
        assert f"  dirs {first} .. {last}\n" in out


def test_per_rank_lists_every_rank_and_the_json_is_per_rank_anyway(run, capsys):
    assert main(["inspect", run, "--per-rank"]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("rank ")] == [
        f"rank {r}" for r in range(WORLD)]
    assert "alike" not in out
    assert main(["inspect", run, "--json"]) == 0
    assert capsys.readouterr().out.count('"rank":') >= WORLD


def test_a_few_ranks_are_listed_one_by_one(tmp_path, capsys):
    out = str(tmp_path / "out")
    for r in range(3):
        _write_rank(out, r, steps=3)
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "alike" not in text and "rank 2: 3 steps (0..2)" in text
