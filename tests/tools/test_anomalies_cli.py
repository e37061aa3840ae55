"""``trainrec anomalies RUN``: listing recorded anomalies, re-detection, JSON output, bad input."""

from __future__ import annotations

import json
import os
import sys

import pytest
from trainrec.replay.run import open_run
from trainrec.schema import layout
from trainrec.tools.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "analyzers"))
from anomaly_logs import write_rank  # noqa: E402

ALERT = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out"))
    dump = os.path.join(out, "anomaly_detected")
    write_rank(out, 0, alert=ALERT, dump_dir=dump, inject=(12, 2, 1.8), steps=30)
    write_rank(out, 1, alert=ALERT, dump_dir=dump, inject=(20, 3, 100.0), steps=30)
    return out


def cli(capsys, *argv):
    code = main(["anomalies", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_lists_recorded_anomalies_in_execution_order(run_dir, capsys):
    code, out, err = cli(capsys, run_dir, "-k", 5)
    assert code == 0, err
    lines = out.splitlines()
    recorded = sum(1 for _ in open_run(run_dir).events(types=["AnomalyDetected"]))
    assert recorded > 40
    assert lines[0].startswith(f"{recorded} anomalies recorded in run testrun (steps 0..29, ranks 0-1)")
    assert lines[1].split()[:12] == ["#", "rank", "step", "micro", "phase", "stage", "call", "op", "value",
                                     "baseline", "rule", "tag"]
    first = lines[2].split()
    assert first[:8] == ["1", "0", "12", "0", "fwd", "0", "5", "min"]
    assert first[-1] == "0:layer2_0/rank0/output"
    assert len(lines) == 2 + 5


def test_json_output_and_file(run_dir, capsys, tmp_path):
    target = tmp_path / "sub" / "first.json"
    code, out, err = cli(capsys, run_dir, "-s", "[20,21]", "-k", 3, "--json", "-o", target)
    assert code == 0, err
    printed = json.loads(out)
    written = json.loads(target.read_text())
    assert printed == written and len(written) == 3
    rec = written[0]
    assert set(rec) == {"rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message",
                        "group_mates", "op", "value", "baseline", "rule", "kind", "phase"}
    assert (rec["rank"], rec["step"], rec["tag_name"], rec["op"]) == (1, 20, "0:layer3_0/rank1/output", "min")
    assert rec["value"] / rec["baseline"] > 50
    assert "wrote 3 anomalies" in err


def test_redetect_with_another_rule_and_threshold(run_dir, capsys):
    code, out, err = cli(capsys, run_dir, "--rule", "AnomalyTurbulence", "--threshold", 1.0, "--all", "--json")
    assert code == 0, err
    strict = json.loads(out)
    assert {r["step"] for r in strict} == {20}
    code, out, _ = cli(capsys, run_dir, "--rule", "anomalyturbulence", "--threshold", 0.3, "--all", "--json")
    loose = json.loads(out)
    key = lambda r: (r["rank"], r["step"], r["call_id"], r["tag_name"], r["op"])  # noqa: E731
    assert {key(r) for r in strict} < {key(r) for r in loose}
    code, out, _ = cli(capsys, run_dir, "--rule", "ZScore", "--threshold", 8, "--window", 8, "--arg", "floor=0.01",
                       "--kinds", "actv", "-k", 1)
    assert code == 0 and "re-detected with ZScore(threshold=8.0, window=8" in out
    code, out, err = cli(capsys, run_dir, "--rule", "NaNInf")
    assert code == 0 and "no anomalies re-detected with NaNInf()" in err


def test_torn_tail_is_used_and_reported(tmp_path, capsys):
    write_rank(str(tmp_path), 0, alert=ALERT, inject=(20, 3, 100.0), steps=30)
    (rank_dir,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    (log,) = layout.list_logs(rank_dir)
    size = os.path.getsize(log)
    with open(log, "r+b") as f:
        f.truncate(int(size * 0.8))
    code, out, err = cli(capsys, rank_dir, "-k", 1)
    assert code == 0
    assert "incomplete record" in err
    assert out.splitlines()[2].split()[2] == "20"


@pytest.mark.parametrize(
    ("argv", "code", "text"),
    [
        (["-k", "0"], 2, "the top k number must be greater than 0"),
        (["-k", "x"], 2, "must be a positive integer"),
        (["-s", "100-200"], 2, "steps 100-200 are outside the recorded range of run testrun: the recorded steps are 0..29"),
        (["-s", "[1,two]"], 2, "bad step range 'two'"),
        (["--threshold", "0.3"], 2, "error: option --rule: --threshold, --window, --warmup and --arg need --rule"),
        (["--rule", "Bogus"], 2, "unknown rule 'Bogus'"),
        (["--rule", "NaNInf", "--threshold", "1"], 2,
         "error: option --threshold: no chosen rule takes threshold (NaNInf takes no arguments)"),
        (["--rule", "NaNInf", "--rule", "ZScore", "--arg", "noise=4"], 2,
         "error: option --arg: no chosen rule takes noise (NaNInf takes no arguments; ZScore takes threshold, "
         "window, warmup, floor)"),
        (["--rule", "AnomalyTurbulence", "--threshold", "-1"], 2, "must be >= 0.0"),
        (["--rule", "AnomalyTurbulence"], 2, "needs the argument 'threshold'"),
        (["--kinds", "actv"], 2, "error: option --kinds: --kinds selects what to re-detect on and needs --rule"),
    ],
)
def test_bad_input(run_dir, capsys, argv, code, text):
    try:
        got = main(["anomalies", run_dir, *argv])
    except SystemExit as exc:  # argparse rejects the value itself
        got = exc.code
    _, err = capsys.readouterr()
    assert got == code
    assert text in err


def test_steps_partly_outside_are_noted(run_dir, capsys):
    code, out, err = cli(capsys, run_dir, "-s", "20,500")
    assert code == 0
    assert "steps 500 are outside the recorded range" in err
    assert "anomalies recorded" in out


def test_no_anomalies(tmp_path, capsys):
    write_rank(str(tmp_path), 0, steps=5)
    code, out, err = cli(capsys, tmp_path, "-o", tmp_path / "none.json")
    assert code == 0
    assert "no anomalies recorded in run testrun (steps 0..4, rank 0, 20 stats records)" in err
    assert "--rule AnomalyTurbulence" in err
    assert json.loads((tmp_path / "none.json").read_text()) == []
    code, _, err = cli(capsys, tmp_path / "nowhere")
    assert code == 2 and "error" in err


def test_table_tells_nan_from_inf_and_a_missing_baseline():
    """NaNInf's findings: the value column said "-" for NaN (and "inf" for Inf), so the table could
    not tell a NaN from a missing number; "-" now stands only for a baseline that does not exist."""
    from trainrec.schema.events import AnomalyDetected
    from trainrec.tools.cmd_anomalies import format_table

    evs = [AnomalyDetected(rank=0, step=3, op="norm", value=v, baseline=float("nan"), rule="NaNInf", tag_name=t)
           for v, t in ((float("nan"), "a"), (float("inf"), "b"), (2.5, "c"))]
    lines = format_table(evs).splitlines()
    cells = [line.split() for line in lines[1:]]
    assert [(c[8], c[9]) for c in cells] == [("nan", "-"), ("inf", "-"), ("2.5", "-")]


def test_an_output_file_that_cannot_be_written_is_one_error_line(run_dir, capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code, _, err = cli(capsys, run_dir, "-k", 3, "-o", a_file / "first.json")
    assert code == 2
    assert f"error: cannot write {a_file / 'first.json'}: cannot create the directory {a_file}" in err
    assert "Traceback" not in err
    deep = tmp_path / "no_such_dir" / "deeper" / "y.json"
    code, _, err = cli(capsys, run_dir, "-k", 3, "-o", deep)
    assert code == 0 and len(json.loads(deep.read_text())) == 3  # missing directories are made
    assert not [p for p in tmp_path.rglob("*.tmp*")]  # no temporary file left behind


@pytest.mark.parametrize("argv", [(), ("--rule", "AnomalyTurbulence", "--threshold", "0.3", "--all"),
                                  ("--rule", "NaNInf", "--rule", "ZScore", "--kinds", "actv,param", "-k", "30")])
def test_jobs_give_the_serial_answer(run_dir, tmp_path, capsys, argv):
    """-j 2 (processes by rank partition) prints and writes what -j 1 does, which is what the
    record-by-record scan of the merged stream finds."""
    from trainrec.analyzers.anomalies import AnomalyScan, anomaly_records
    from trainrec.analyzers.ranking import rank_anomalies
    from trainrec.tools.cli import build_parser
    from trainrec.tools.cmd_anomalies import build_rules

    outs = []
    for jobs in ("1", "2"):
        path = tmp_path / f"j{jobs}.json"
        code, out, err = cli(capsys, run_dir, *argv, "-j", jobs, "-o", path)
        assert code == 0, err
        outs.append((out, path.read_bytes()))
    assert outs[0] == outs[1]
    args = build_parser().parse_args(["anomalies", run_dir, *argv])
    scan = AnomalyScan(build_rules(args), args.kinds).feed_all(open_run(run_dir).events())
    ranked = rank_anomalies(scan.anomalies, None if args.all else args.topk)
    assert json.loads(outs[0][1]) == json.loads(json.dumps(anomaly_records(ranked)).replace("NaN", "null"))
    assert len(ranked) > 5
