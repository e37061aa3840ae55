"""``--steps`` on dump, anomalies and export: the same answer with and without the logs' step indexes,
and the answer of the whole run for those steps."""

from __future__ import annotations

import filecmp
import json
import os
import sys

import pytest
from trainrec.tools.cli import main

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, os.pardir, "analyzers"))
sys.path.insert(0, os.path.join(HERE, os.pardir, "replay"))
from index_logs import copy_run  # noqa: E402
from varied_logs import write_varied_run  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, str]:
    """A run (3 ranks, 40 steps, rank 1 resumed at 22, rank 2 torn) and its copy without step indexes."""
    base = tmp_path_factory.mktemp("steps")
    run = write_varied_run(str(base / "run"), ranks=3, steps=40)
    return run, copy_run(run, str(base / "old"))


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _plain(out: str) -> list[dict]:
    """Dump lines as dicts, without FileClosed's index columns (a file's, not its content's)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("index_")} for line in out.splitlines()]


@pytest.mark.parametrize("sel", ["20-26", "5:6,38-"])
def test_dump_steps(runs, capsys, sel):
    run, old = runs
    code, out, _ = cli(capsys, "dump", run, "--steps", sel)
    assert code == 0 and out
    assert _plain(cli(capsys, "dump", old, "-s", sel)[1]) == _plain(out)
    assert cli(capsys, "dump", run, "-s", sel, "-j", "2")[1] == out
    _, whole, _ = cli(capsys, "dump", run)
    wanted = (lambda s: 20 <= s <= 26) if sel == "20-26" else (lambda s: s in (5, 6) or s >= 38)
    got = _plain(out)
    assert {d["step"] for d in got} == {d["step"] for d in _plain(whole) if wanted(d["step"])}
    assert got == [d for d in _plain(whole) if wanted(d["step"])]


def test_anomalies_steps_redetect(runs, capsys, tmp_path):
    run, old = runs
    args = ["--rule", "AnomalyTurbulence", "--threshold", "0.3", "--all", "--json"]
    code, out, err = cli(capsys, "anomalies", run, *args, "-s", "20-30")
    assert code == 0
    assert cli(capsys, "anomalies", old, *args, "-s", "20-30")[1] == out
    assert cli(capsys, "anomalies", run, *args, "-s", "20-30", "-j", "2")[1] == out
    whole = json.loads(cli(capsys, "anomalies", run, *args)[1])
    mine = json.loads(out)
    assert mine and mine == [a for a in whole if 20 <= a["step"] <= 30]


def test_anomalies_steps_outside_the_run(runs, capsys):
    run, old = runs
    code, _, err = cli(capsys, "anomalies", run, "-s", "500-600")
    assert code == 2 and "the recorded steps are 0..44" in err
    assert cli(capsys, "anomalies", old, "-s", "500-600")[:2] == (2, "")


def test_export_csv_steps(runs, capsys, tmp_path):
    run, old = runs
    outs = {}
    for name, src, extra in (("idx", run, ["--steps", "20-24"]), ("old", old, ["--steps", "20-24"]),
                             ("all", run, [])):
        out = str(tmp_path / name)
        code, _, err = cli(capsys, "export", "csv", src, "-o", out, *extra)
        assert code == 0, err
        outs[name] = out
    for rank_dir in sorted(os.listdir(outs["idx"])):
        if rank_dir.startswith("."):
            continue
        names = sorted(os.listdir(os.path.join(outs["idx"], rank_dir)))
        assert names and names == sorted(os.listdir(os.path.join(outs["old"], rank_dir)))
        for name in names:
            a = os.path.join(outs["idx"], rank_dir, name)
            assert filecmp.cmp(a, os.path.join(outs["old"], rank_dir, name), shallow=False), name
            assert filecmp.cmp(a, os.path.join(outs["all"], rank_dir, name), shallow=False), name


def test_inspect_quick_answers_from_the_indexes(runs, capsys, tmp_path):
    run, old = runs
    code, out, _ = cli(capsys, "inspect", run, "--quick", "--json")
    assert code == 0
    quick = json.loads(out)
    assert cli(capsys, "inspect", run, "--quick", "--json", "-j", "2")[1] == out
    full = json.loads(cli(capsys, "inspect", run, "--json")[1])
    plain = json.loads(cli(capsys, "inspect", old, "--quick", "--json")[1])
    for q, f, p in zip(quick["per_rank"], full["per_rank"], plain["per_rank"], strict=True):
        assert (q["steps"], q["first_step"], q["last_step"]) == (f["steps"], f["first_step"], f["last_step"])
        assert [x["records"] for x in q["files"]] == [x["events"] for x in f["files"]]
        strip = [{k: v for k, v in x.items() if k not in ("source", "path", "bytes")} for x in q["files"]]
        assert strip == [{k: v for k, v in x.items() if k not in ("source", "path", "bytes")} for x in p["files"]]
    sources = [x["source"] for r in quick["per_rank"] for x in r["files"]]
    assert sources == ["index", "index", "index", "scan"]  # (rank 2 has bytes after its close)
    assert {x["source"] for r in plain["per_rank"] for x in r["files"]} == {"scan"}
    text = cli(capsys, "inspect", run, "--quick")[1]
    assert "rank 1: 45 steps (0..44), 395 records" in text and "6 stray bytes after it" in text


def test_inspect_quick_with_a_hostile_index(runs, capsys, tmp_path):
    run, _ = runs
    bad = copy_run(run, str(tmp_path / "bad"), index_steps=b"\x01" * 8, index_offsets=b"\xff" * 8,
                   index_seqs=b"\x01" + b"\x00" * 7, index_low_steps=b"\x01" + b"\x00" * 7)
    quick = json.loads(cli(capsys, "inspect", bad, "--quick", "--json")[1])
    good = json.loads(cli(capsys, "inspect", run, "--quick", "--json")[1])
    files = [x for r in quick["per_rank"] for x in r["files"]]
    assert all(x["source"].startswith("scan (step index ignored: ") for x in files[:3])
    assert [(r["steps"], r["records"]) for r in quick["per_rank"]] == [(r["steps"], r["records"]) for r in good["per_rank"]]


def test_anomalies_steps_recorded(capsys, tmp_path):
    from export_logs import write_rank_log
    from logbuild import rank_dir

    run = tmp_path / "run"
    for r in range(2):
        write_rank_log(rank_dir(run, r), rank=r, steps=range(30), seed=r)
    old = copy_run(str(run), str(tmp_path / "old"))
    code, out, _ = cli(capsys, "anomalies", run, "-s", "2-4,25", "--all", "--json")
    assert code == 0 and json.loads(out)
    assert cli(capsys, "anomalies", old, "-s", "2-4,25", "--all", "--json")[1] == out
    assert cli(capsys, "anomalies", run, "-s", "2-4,25", "--all", "--json", "-j", "2")[1] == out
    whole = json.loads(cli(capsys, "anomalies", run, "--all", "--json")[1])
    assert json.loads(out) == [a for a in whole if 2 <= a["step"] <= 4 or a["step"] == 25]
    text = cli(capsys, "anomalies", run, "-s", "1-3")[1]
    assert "(steps 0..29, ranks 0-1)" in text
