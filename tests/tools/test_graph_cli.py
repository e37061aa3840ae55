"""`trainrec graph build|compare|ranks` and `python -m trainrec.tools.graph -i compare.json`: verdicts
printed and written as JSON, and bad input as one clear line (exit 2), never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from graph_runs import DUMP_DIR, copy_dump, record_run  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402
from trainrec.tools.graph import main as reference_main  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("graphcli")
    return {"bench": record_run(base / "bench", steps=3), "scaled": record_run(base / "scaled", steps=3, scale_at=1)}


def test_compare_prints_and_writes_the_first_divergence(runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["graph", "compare", runs["scaled"], runs["bench"], "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "FIRST DIVERGENCE: step 1, node Module.blk.Scaled.forward.0" in text
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["first_divergence"]["node"] == "Module.blk.Scaled.forward.0"
    assert verdict["steps"] == [0, 1, 2] and verdict["unmatched_debug"] == 0
    assert (out / "compare.html").stat().st_size > 1000


def test_build_writes_a_viewer(runs, tmp_path, capsys):
    assert main(["graph", "build", runs["bench"], "-o", str(tmp_path / "b")]) == 0
    assert "built" in capsys.readouterr().out
    html = (tmp_path / "b" / "graph.html").read_text()
    assert "Module.blk.Scaled.forward.0" in html and "http" not in html.split("<script>", 1)[1]


def test_the_reference_command_line_with_compare_json(tmp_path, capsys):
    spec = tmp_path / "compare.json"
    spec.write_text(json.dumps({"npu_path": DUMP_DIR, "bench_path": copy_dump(tmp_path), "is_print_compare_log": True}))
    out = tmp_path / "ref"
    assert reference_main(["-i", str(spec), "-o", str(out), "-f", "-oc", "-cs"]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert json.loads((out / "verdict.json").read_text())["matched"] == 12
    mapping = tmp_path / "mapping.yaml"
    mapping.write_text("TopLayer:\n  fc1: fc1\n")
    assert reference_main(["-i", str(spec), "-o", str(out), "-lm", str(mapping)]) == 0
    capsys.readouterr()
    mapping.write_text("GPTModel:\n  language_model: module\n")
    assert reference_main(["-i", str(spec), "-o", str(out), "-lm", str(mapping)]) == 2
    assert "names no class of" in capsys.readouterr().err
    spec.write_text(json.dumps({"npu_path": DUMP_DIR}))
    assert reference_main(["-i", str(spec), "-o", str(out)]) == 0 and (out / "graph.html").exists()


def test_ranks_names_the_departing_rank(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ranks"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TRAINREC_RUN_ID", "cli-ranks")
    for rank, scale_at in ((0, None), (1, 2)):
        monkeypatch.setenv("RANK", str(rank))
        record_run(out, steps=3, scale_at=scale_at)
    assert main(["graph", "ranks", str(out), "--scope", "all", "-o", str(tmp_path / "r")]) == 0
    assert "FIRST DEPARTURE: rank 1 at step 2, node Module.blk.Scaled.forward.0" in capsys.readouterr().out
    assert json.loads((tmp_path / "r" / "ranks.json").read_text())["departs"]["rank"] == 1
    assert "Module.blk.Scaled.forward.0" in (tmp_path / "r" / "ranks.html").read_text()


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainrec.tools.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_bad_input_is_one_clear_line(runs, tmp_path):
    d = copy_dump(tmp_path)
    os.remove(os.path.join(d, "step0", "rank", "construct.json"))
    noxy = record_run(tmp_path / "noxy", steps=1, config={"wg_distribution": True, "ops": ["norm"]})
    other = tmp_path / "other"
    other.mkdir()
    cases = [
        ((d, DUMP_DIR), "missing construct.json"),
        ((noxy, runs["bench"]), "xy_distribution: true"),
        ((runs["bench"], DUMP_DIR), "two different models"),
        ((str(other), DUMP_DIR), "nor is it a dump directory"),
    ]
    for (debug, bench), expected in cases:
        res = _cli("graph", "compare", debug, bench, "-o", str(tmp_path / "x"))
        assert res.returncode == 2, res.stderr
        assert expected in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    res = _cli("graph", "compare", DUMP_DIR, DUMP_DIR, "-o", str(tmp_path / "x"), "--mapping", str(empty))
    assert res.returncode == 2 and "it names nothing to map" in res.stderr and "Traceback" not in res.stderr
    spec = tmp_path / "c.json"
    spec.write_text("{}")
    res = subprocess.run([sys.executable, "-m", "trainrec.tools.graph", "-i", str(spec), "-o", str(tmp_path / "y")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "npu_path is missing" in res.stderr and "Traceback" not in res.stderr


def test_the_reference_command_on_real_msprobe_dumps(tmp_path, capsys):
    dumps = os.path.join(os.path.dirname(DUMP_DIR), "msprobe_dump")
    spec = tmp_path / "compare.json"
    spec.write_text(json.dumps({"npu_path": os.path.join(dumps, "scaled"), "bench_path": os.path.join(dumps, "bench"),
                                "is_print_compare_log": True}))
    assert reference_main(["-i", str(spec), "-o", str(tmp_path / "out")]) == 0
    assert "FIRST DIVERGENCE: step 1, node Module.blk.Scaled.forward.0" in capsys.readouterr().out
