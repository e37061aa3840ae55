"""trainrec inspect / check / dump through trainrec.tools.cli.main, on real logs."""

from __future__ import annotations

import math
import os
import shutil

import orjson
import pytest
from trainrec.recorder.writer import LogWriter
from trainrec.schema.events import (
    OPS,
    AnomalyDetected,
    ConfigApplied,
    HooksFired,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    pack_array,
)
from trainrec.tools.cli import main

STAMP = "Nov30_11-13-33"
NAMES = ["embed.weight", "head.bias"]


def _values(step: int, rank: int) -> list[float]:
    vals = [float(step * 100 + rank * 10 + i) for i in range(len(NAMES) * len(OPS))]
    if step == 2 and rank == 1:
        vals[0] = math.nan
        vals[1] = math.inf
        vals[2] = -math.inf
    return vals


def _write_rank(out, rank: int, steps: int = 4, close: bool = True) -> str:
    w = LogWriter(os.path.join(out, f"{STAMP}-rank{rank}-0000beef"), rank=rank, world_size=2, run_id="cli-run",
                  flush_interval=0.01)
    ids = w.intern(NAMES)
    w.write(ConfigApplied(rank=rank, step=0, config={"ops": ["min"], "eps": 1e-8, 3: "int key"}, start_step=0))
    for s in range(steps):
        w.write(StepBegan(rank=rank, step=s))
        w.write(HooksFired(rank=rank, step=s, module_ids=pack_array("I", ids), directions=bytes([0, 1]),
                           call_ids=pack_array("I", [0, 1]), micro_steps=pack_array("H", [0, 0])))
        w.write(TensorStatsRecorded(rank=rank, step=s, kind="actv", ops=OPS, dtype="f",
                                    name_ids=pack_array("I", ids), values=pack_array("f", _values(s, rank)),
                                    slots=bytes([1, 2]), call_ids=pack_array("I", [5, 6])))
        if s == 3:
            w.write(AnomalyDetected(rank=rank, step=s, op="norm", value=math.nan, baseline=1.0, name="head.bias",
                                    kind="actv", tag_name="0:head.bias_0/rank0/output"))
        w.write(StepEnded(rank=rank, step=s, duration=0.1, collected=True))
    if close:
        w.close()
    else:
        w.flush(timeout=10)
    return w.path


@pytest.fixture()
def run_dir(tmp_path):
    out = tmp_path / "monitor_output"
    for r in (0, 1):
        _write_rank(str(out), r)
    return str(out)


def _lines(capsys) -> list[dict]:
    out = capsys.readouterr().out
    return [orjson.loads(line) for line in out.splitlines() if line]


def test_inspect_json_and_text(run_dir, capsys):
    assert main(["inspect", run_dir, "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["run_id"] == "cli-run" and doc["ranks"] == [0, 1] and doc["format_versions"] == [1]
    assert doc["world_size"] == 2 and doc["anomalies"] == 2
    r1 = doc["per_rank"][1]
    assert (r1["steps"], r1["first_step"], r1["last_step"]) == (4, 0, 3)
    assert r1["events"]["TensorStatsRecorded"] == 4 and r1["events"]["StepBegan"] == 4
    assert r1["closed_cleanly"] and r1["torn_bytes"] == 0 and r1["damage"] == 0
    assert r1["stat_values"] == 4 * len(NAMES) * len(OPS)
    assert r1["files"][0]["path"].endswith("trainrec-00000.trl")
    assert main(["inspect", run_dir]) == 0
    text = capsys.readouterr().out
    assert "run cli-run" in text and "format version 1" in text and "rank 1: 4 steps (0..3)" in text
    assert "closed cleanly" in text and "anomalies: 2" in text


def test_check_clean_damaged_torn_and_unclosed(run_dir, tmp_path, capsys):
    assert main(["check", run_dir]) == 0
    assert capsys.readouterr().out.strip().endswith("OK")

    damaged = str(tmp_path / "damaged")
    shutil.copytree(run_dir, damaged)
    path = os.path.join(damaged, f"{STAMP}-rank1-0000beef", "trainrec-00000.trl")
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[600] ^= 0x40
        f.seek(0)
        f.write(data[:-5])  # also tear the FileClosed record
        f.truncate()
    assert main(["check", damaged]) == 1
    report = capsys.readouterr().out
    assert "FAILED" in report and path in report and "trainrec-00000.trl" in report
    assert "torn tail of" in report and ("CRC" in report or "header" in report)
    assert main(["check", damaged, "--json"]) == 1
    doc = orjson.loads(capsys.readouterr().out)
    assert not doc["ok"]
    kinds = {f["severity"] for f in doc["findings"]}
    assert kinds == {"damage", "torn"}
    damage = [f for f in doc["findings"] if f["severity"] == "damage"]
    assert damage[0]["path"] == path and damage[0]["offset"] <= 600 and damage[0]["bytes_skipped"] > 0
    assert sum(f["frames_lost"] for f in doc["findings"]) == 1
    assert main(["inspect", damaged]) == 0
    text = capsys.readouterr().out
    assert "NOT closed, torn tail" in text and "torn tails: rank 1" in text and "damage: rank 1" in text

    unclosed = str(tmp_path / "unclosed")
    _write_rank(unclosed, 0, close=False)
    _write_rank(unclosed, 1)
    assert main(["check", unclosed]) == 0
    assert "note" in capsys.readouterr().out
    assert main(["check", unclosed, "--strict"]) == 1
    assert "not closed cleanly" in capsys.readouterr().out


def test_dump_expands_stats_resolves_names_and_filters(run_dir, capsys):
    assert main(["dump", run_dir, "--rank", "1", "--type", "ts"]) == 0
    rows = _lines(capsys)
    assert len(rows) == 4 * len(NAMES) * len(OPS)
    assert {r["rank"] for r in rows} == {1} and {r["type"] for r in rows} == {"TensorStatsRecorded"}
    first = rows[0]
    assert first["name"] == "embed.weight" and first["slot"] == "input" and first["call_id"] == 5
    assert first["op"] == "min" and first["value"] == 10.0 and first["kind"] == "actv"
    step2 = [r["value"] for r in rows if r["step"] == 2 and r["name"] == "embed.weight"]
    assert step2[:3] == ["nan", "inf", "-inf"]

    assert main(["dump", run_dir, "--type", "sb", "--type", "HooksFired"]) == 0
    evs = _lines(capsys)
    assert {e["type"] for e in evs} == {"StepBegan", "HooksFired"}
    assert [(e["step"], e["rank"]) for e in evs if e["type"] == "StepBegan"] == [
        (s, r) for s in range(4) for r in (0, 1)
    ]
    hooks = [e for e in evs if e["type"] == "HooksFired"][0]
    assert hooks["module_ids"] == [0, 1] and hooks["modules"] == NAMES and hooks["directions"] == [0, 1]

    assert main(["dump", run_dir, "--per-record", "--type", "ts", "--rank", "1"]) == 0
    recs = _lines(capsys)
    assert len(recs) == 4 and recs[2]["names"] == NAMES
    assert recs[2]["values"][0][:3] == ["nan", "inf", "-inf"] and len(recs[2]["values"]) == len(NAMES)
    assert recs[0]["slots"] == [1, 2] and recs[0]["micro_steps"] == []

    assert main(["dump", run_dir, "--type", "an", "--type", "ca", "--rank", "0"]) == 0
    evs = _lines(capsys)
    an = [e for e in evs if e["type"] == "AnomalyDetected"][0]
    assert an["value"] == "nan" and an["baseline"] == 1.0
    ca = [e for e in evs if e["type"] == "ConfigApplied"][0]
    assert ca["config"] == {"ops": ["min"], "eps": 1e-8, "3": "int key"}


def test_errors_exit_2_with_a_clear_message(run_dir, tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "no such file" in err
    (tmp_path / "notalog.trl").write_bytes(b"definitely not a log file")
    assert main(["check", str(tmp_path / "notalog.trl")]) == 2
    assert "bad magic" in capsys.readouterr().err
    assert main(["dump", run_dir, "--type", "bogus"]) == 2
    assert "unknown event type 'bogus'" in capsys.readouterr().err
    assert main(["dump", run_dir, "--rank", "7"]) == 2
    assert "rank(s) [7]" in capsys.readouterr().err
    other = os.path.join(run_dir, "Nov30_12-00-00-rank0-0000cafe")
    w = LogWriter(other, rank=0, run_id="cli-other", flush_interval=0.01)
    w.close()
    assert main(["inspect", run_dir, "--run-id", "cli-"]) == 2
    err = capsys.readouterr().err
    assert "2 runs match" in err and "cli-run" in err and "cli-other" in err
    assert main(["inspect", run_dir, "--time-end", "Nov30_11-59-59", "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["run_id"] == "cli-run"


def test_dump_rejects_an_unknown_kind_naming_the_valid_ones(run_dir, capsys):
    """--kind actvv printed no statistics and exited 0, while anomalies --kinds and export --types
    reject a misspelt kind."""
    assert main(["dump", run_dir, "--kind", "actvv"]) == 2
    err = capsys.readouterr().err
    assert "--kind: unknown data type 'actvv'" in err and "actv_grad" in err
    assert main(["dump", run_dir, "--kind", "actv", "--type", "ts"]) == 0
    assert {r["kind"] for r in _lines(capsys)} == {"actv"}


def test_verbose_after_the_subcommand_version_and_plain_help(run_dir, capsys):
    assert main(["inspect", run_dir, "-v"]) == 0  # as well as `trainrec -v inspect RUN`
    assert main(["-v", "inspect", run_dir]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("trainrec ")
    for argv in (["dump", "--help"], ["inspect", "--help"], ["check", "--help"], ["export", "csv", "--help"],
                 ["export", "tb", "--help"], ["anomalies", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        assert "usage: trainrec " in text
        assert "``" not in text and ":mod:" not in text and ":meth:" not in text, argv  # no reST markup
    with pytest.raises(SystemExit):
        main(["export", "tb", "--help"])
    assert "Export TensorBoard event files from a run's log." in capsys.readouterr().out


def test_a_system_error_is_one_line_naming_the_file(run_dir, tmp_path, capsys, monkeypatch):
    """An OSError no command turned into a message of its own (here: reading a log that vanished between
    listing and opening) is one error line with the file, exit 2; with -v, the traceback."""
    import trainrec.tools.cmd_inspect as cmd

    def vanish(args):
        raise FileNotFoundError(2, "No such file or directory", os.path.join(run_dir, "gone.trl"))

    monkeypatch.setattr(cmd, "run", vanish)
    # (the parser binds func when built: patch before main builds it)
    assert main(["inspect", run_dir]) == 2
    err = capsys.readouterr().err
    assert err == f"trainrec inspect: error: {os.path.join(run_dir, 'gone.trl')}: No such file or directory (-v for the traceback)\n"
    with pytest.raises(FileNotFoundError):
        main(["inspect", run_dir, "-v"])


def test_inspect_says_what_the_monitor_reported_going_wrong(tmp_path, capsys):
    """Rejected configs, a stop of monitoring and the first failure of each hook are listed per rank
    (text and --json), not only counted: they say why a log holds less than expected."""
    from trainrec.schema.events import ConfigApplied, ConfigRejected, HookFailed, MonitoringStopped

    rdir = str(tmp_path / "out" / f"{STAMP}-rank0-0000beef")
    with LogWriter(rdir, rank=0, world_size=1, run_id="notes-run", flush_interval=0.01) as w:
        w.write(ConfigApplied(rank=0, step=-1, path="c.json", config={}, start_step=0, reason="static"))
        w.write(ConfigRejected(rank=0, step=0, path="c.json", reason="c.json: config key 'targets.x': nope",
                               keys=("targets.x",)))
        w.write(ConfigApplied(rank=0, step=0, path="c.json", config={}, start_step=4, reason="dynamic"))
        for s in range(3):
            w.write(StepBegan(rank=0, step=s))
            w.write(HookFailed(rank=0, step=s, where="forward hook of 'fc'", error="RuntimeError('boom')"))
            w.write(StepEnded(rank=0, step=s, duration=0.1))
        w.write(MonitoringStopped(rank=0, step=2, reason="collect_times reached", collections=3))
    assert main(["inspect", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "  step 0: config rejected: c.json: config key 'targets.x': nope\n" in text
    assert text.count("failed: RuntimeError('boom')") == 1  # the first failure of that hook only
    assert "  step 0: forward hook of 'fc' failed: RuntimeError('boom')\n" in text
    assert "  step 2: monitoring stopped: collect_times reached\n" in text
    assert "3 hook failures" in text
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    notes = orjson.loads(capsys.readouterr().out)["per_rank"][0]["notes"]
    assert notes == ["step 0: config rejected: c.json: config key 'targets.x': nope",
                     "step 0: monitoring started (dynamic config); first collected step 4",
                     "step 0: forward hook of 'fc' failed: RuntimeError('boom')",
                     "step 2: monitoring stopped: collect_times reached"]


def test_a_rank_whose_log_cannot_be_read_is_missing_not_ignored(run_dir, tmp_path, capsys):
    """Rank 1's only log lost its header: it belongs to no run that can be told. check said OK for the
    run of rank 0 alone; it now fails, naming the unreadable file and the rank the world size misses,
    and every command still opens the readable run (the headerless directory is never "the latest")."""
    out = str(tmp_path / "out")
    shutil.copytree(run_dir, out)
    bad = os.path.join(out, f"{STAMP}-rank1-0000beef", "trainrec-00000.trl")
    with open(bad, "r+b") as f:
        f.write(b"garbage!")
    later = os.path.join(out, "Dec31_23-59-59-rank0-deadbeef")  # a newer stamp, with an empty log
    os.makedirs(later)
    open(os.path.join(later, "trainrec-00000.trl"), "wb").close()
    assert main(["check", out, "--json"]) == 1
    doc = orjson.loads(capsys.readouterr().out)
    found = {(f["severity"], f["path"], f["what"]) for f in doc["findings"]}
    assert found == {
        ("damage", bad, "not a trainrec log (bad magic); no run can be told for it, so it is in none"),
        ("damage", os.path.join(later, "trainrec-00000.trl"), "no file header (empty, or cut before the end of "
         "its header); no run can be told for it, so it is in none"),
        ("missing", out, "rank 1 of world size 2: no log of this run found"),
    }
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert text.startswith("run cli-run ") and "missing: rank(s) 1 of world size 2 have no log here" in text
    assert f"unreadable, in no run: {bad}: not a trainrec log (bad magic)" in text
    # the other commands say so on stderr, and go on with the ranks that are there
    for argv in (["anomalies", out], ["dump", out, "--type", "se"], ["export", "csv", out, "-o", str(tmp_path / "x")]):
        assert main(argv) == 0, argv
        err = capsys.readouterr().err
        assert f"trainrec {argv[0]}: note: rank(s) 1 of world size 2 have no log here; what follows is of the others" in err
        assert f"trainrec {argv[0]}: note: {bad} is in no run" in err
    # one rank directory given on its own: the other ranks are not expected there
    assert main(["check", os.path.join(out, f"{STAMP}-rank0-0000beef")]) == 0
    capsys.readouterr()


def test_dump_follow_prints_a_run_as_it_is_written_and_ends_when_it_closes(tmp_path, capsys):
    import threading
    import time

    out = str(tmp_path / "live")
    started = threading.Event()

    def training():
        w = LogWriter(os.path.join(out, f"{STAMP}-rank0-0000beef"), rank=0, world_size=1, run_id="live-run",
                      flush_interval=0.01)
        ids = w.intern(NAMES)
        for s in range(6):
            w.write(StepBegan(rank=0, step=s))
            w.write(TensorStatsRecorded(rank=0, step=s, kind="actv", ops=OPS, dtype="f", name_ids=pack_array("I", ids),
                                        values=pack_array("f", _values(s, 0)), slots=bytes([1, 2]),
                                        call_ids=pack_array("I", [5, 6])))
            w.write(StepEnded(rank=0, step=s, duration=0.1))
            w.flush(timeout=10)
            started.set()
            time.sleep(0.05)
        w.close()

    t = threading.Thread(target=training)
    t.start()
    assert started.wait(10)
    assert main(["dump", out, "-f", "--poll-interval", "0.02", "--type", "se,ts", "--kind", "actv"]) == 0
    t.join()
    followed = _lines(capsys)
    assert main(["dump", out, "--type", "se", "--type", "ts"]) == 0  # the same, read after the fact
    assert followed == _lines(capsys)
    assert sum(d["type"] == "StepEnded" for d in followed) == 6
    assert main(["dump", out, "-f", "--time-end", STAMP]) == 2
    assert "--follow takes the run by --run-id" in capsys.readouterr().err


def test_a_torn_tail_a_resume_went_on_from_is_a_note_not_a_failure(tmp_path, capsys):
    """kill -9 mid-frame, then the run resumed (append_output) into a later file: the torn tail is
    the crash's, expected, and the resumed launch re-recorded those steps; check lists it as a note
    (failing with --strict), as a missing FileClosed. A torn tail of a rank's last file still fails."""
    from trainrec.schema.events import RunResumed

    out = str(tmp_path / "out")
    d = os.path.join(out, f"{STAMP}-rank0-0000beef")
    w = LogWriter(d, rank=0, world_size=1, run_id="torn-resumed", flush_interval=0.01)
    for s in range(3):
        w.write(StepBegan(rank=0, step=s))
        w.write(StepEnded(rank=0, step=s, duration=0.1))
    w.flush(timeout=10)
    with open(w.path, "rb") as f:
        cut = f.read()
    w.close()
    with open(w.path, "wb") as f:
        f.write(cut[:-5])  # a kill -9 in the middle of the last frame
    w2 = LogWriter(d, rank=0, world_size=1, run_id="torn-resumed", flush_interval=0.01)
    w2.write(RunResumed(rank=0, step=2, last_step=1))
    w2.write(StepEnded(rank=0, step=2, duration=0.1))
    w2.close()
    assert main(["check", out, "--json"]) == 0
    (finding,) = orjson.loads(capsys.readouterr().out)["findings"]
    assert finding["severity"] == "unclosed" and "a resumed launch continues the rank in a later file" in finding["what"]
    assert main(["check", out, "--strict"]) == 1
    capsys.readouterr()
    with open(w2.path, "r+b") as f:  # the last file torn too: that one fails
        f.truncate(os.path.getsize(w2.path) - 5)
    assert main(["check", out]) == 1
    assert "torn tail of" in capsys.readouterr().out


def test_dump_of_a_torn_log_says_what_it_left_out(tmp_path, capsys):
    """kill -9 in the middle of a frame: dump prints every complete event and says on stderr that the
    log ends in an incomplete record (it said nothing: the last events were missing without a word,
    where anomalies and export say so)."""
    out = str(tmp_path / "out")
    for r in (0, 1):
        path = _write_rank(out, r, close=False)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 5)  # rank 1's last frame torn
    assert main(["dump", out, "--type", "se"]) == 0
    cap = capsys.readouterr()
    assert [(e["rank"], e["step"]) for e in map(orjson.loads, cap.out.splitlines())] == [
        (r, s) for s in range(3) for r in (0, 1)] + [(0, 3)]
    assert f"{path} ends in an incomplete record" in cap.err
    assert main(["dump", out, "--rank", "0"]) == 0
    assert "incomplete record" not in capsys.readouterr().err



def _unclosed_in_step_1(out: str) -> None:
    """A log whose writer stopped (or is still) in step 1, after a flush."""
    w = LogWriter(os.path.join(out, f"{STAMP}-rank0-0000beef"), rank=0, world_size=1, run_id="cli-run",
                  flush_interval=0.01)
    w.write(StepBegan(rank=0, step=0))
    w.write(StepEnded(rank=0, step=0, duration=0.1))
    w.write(StepBegan(rank=0, step=1))
    w.flush(timeout=10)


def test_inspect_tells_a_log_still_being_written_from_one_whose_writer_is_gone(tmp_path, capsys):
    """Both were 'not closed (killed after a flush, or still being written)', where export tells them
    apart by the writer's pid: a post-mortem wants to know which."""
    import subprocess
    import sys

    live = str(tmp_path / "live")
    _unclosed_in_step_1(live)  # this process: still running
    assert main(["inspect", live]) == 0
    out = capsys.readouterr().out
    assert f"not closed: still being written (pid {os.getpid()})" in out
    assert "step(s) 1 began and did not end (the process is still in it)" in out
    dead = str(tmp_path / "dead")
    code = ("import os, sys; sys.path.insert(0, sys.argv[2]); from test_cli_inspect_check_dump import "
            "_unclosed_in_step_1; _unclosed_in_step_1(sys.argv[1]); print(os.getpid(), flush=True); os._exit(0)")
    proc = subprocess.run([sys.executable, "-c", code, dead, os.path.dirname(__file__)], capture_output=True,
                          text=True, check=True)
    pid = int(proc.stdout.split()[-1])
    assert main(["inspect", dead]) == 0
    out = capsys.readouterr().out
    assert f"not closed: its writer (pid {pid}) is gone (killed, or crashed after a flush)" in out
    assert "step(s) 1 began and did not end (the process stopped in the middle of it)" in out
    assert main(["inspect", dead, "--json"]) == 0
    (f,) = orjson.loads(capsys.readouterr().out)["per_rank"][0]["files"]
    assert (f["writer_pid"], f["writer_running"]) == (pid, False)


def test_check_says_of_an_unclosed_log_whether_its_writer_still_runs(tmp_path, capsys):
    live = str(tmp_path / "live")
    _unclosed_in_step_1(live)
    assert main(["check", live]) == 0
    out = capsys.readouterr().out
    # (the file ends on a frame boundary, but what the writer still holds is not known: no "no bytes lost")
    assert f"not closed cleanly (still being written, pid {os.getpid()}); the file ends on a frame boundary" in out
    assert "no bytes lost" not in out


def test_inspect_names_the_other_launches_of_the_output_directory(tmp_path, capsys):
    """Two trainings into one output directory: inspect showed the latest only, not that another was
    there (a crashed run followed by a fresh launch), nor how to reach it."""
    out = str(tmp_path / "out")
    for stamp, run_id in (("Nov30_11-13-33", "older-run"), ("Nov30_12-00-00", "newer-run")):
        w = LogWriter(os.path.join(out, f"{stamp}-rank0-0000beef"), rank=0, world_size=1, run_id=run_id,
                      flush_interval=0.01)
        w.write(StepBegan(rank=0, step=0))
        w.write(StepEnded(rank=0, step=0, duration=0.1))
        w.close()
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert text.startswith("run newer-run")
    assert "other launches here (choose one with --run-id PREFIX):\n  run older-run  stamps Nov30_11-13-33  ranks 0\n" in text
    assert main(["inspect", out, "--run-id", "older"]) == 0
    assert "  run newer-run  stamps Nov30_12-00-00  ranks 0\n" in capsys.readouterr().out
    assert main(["inspect", os.path.join(out, "Nov30_12-00-00-rank0-0000beef")]) == 0  # a rank directory: no others
    assert "other launches" not in capsys.readouterr().out


def test_dump_shows_placeholder_rows(tmp_path, capsys):
    w = LogWriter(os.path.join(tmp_path, f"{STAMP}-rank0-0000cafe"), rank=0, world_size=1, run_id="ph-run")
    ids = w.intern(NAMES)
    w.write(TensorStatsRecorded(rank=0, step=0, kind="grad_unreduced", ops=("norm",), dtype="f",
                                name_ids=pack_array("I", ids), values=pack_array("f", [1.0, math.nan]),
                                placeholders=bytes([0, 1])))
    w.close()
    assert main(["dump", str(tmp_path), "--type", "ts"]) == 0
    rows = _lines(capsys)
    assert [(r["name"], r["value"], r.get("placeholder")) for r in rows] == [
        ("embed.weight", 1.0, None), ("head.bias", "nan", True)]
    assert main(["dump", str(tmp_path), "--type", "ts", "--per-record"]) == 0
    (rec,) = _lines(capsys)
    assert rec["placeholders"] == [0, 1]
