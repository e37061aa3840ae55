"""What check, inspect, dump and export say of runs that went wrong (issue 35), with real trainings:
two jobs that set one TRAINREC_RUN_ID, an older damaged launch beside a good one, a config that is a
FIFO or a device, a disk that refuses writes mid-run, a duplicated block, per-step durability under
kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from trainrec.replay.reader import read_log
from trainrec.replay.run import open_run
from trainrec.replay.run_select import list_runs
from trainrec.schema import layout
from trainrec.schema.events import StepEnded
from trainrec.tools.cli import main

pytestmark = pytest.mark.slow

TIMEOUT = 120

TRAIN = textwrap.dedent("""
    import os, sys, time
    import torch
    from trainrec.recorder import record
    seed, out, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with record(model, opt, output_dir=out, config={"wg_distribution": True, "ops": ["norm", "max"]}) as rec:
        for step in range(steps):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(step, flush=True)
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
            if os.environ.get("PAUSE_AT") == str(step):
                time.sleep(600)
""")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINREC_RUN_ID", "DYNAMIC_MONITOR", "RANK",
                                                             "WORLD_SIZE", "TRAINREC_DURABILITY")}
    env.update(extra)
    return env


def _train(out: str, seed: int, steps: int, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAIN, str(seed), out, str(steps)], env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(*procs: subprocess.Popen) -> list[tuple[str, str]]:
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return outs


def test_two_trainings_sharing_a_run_id_are_kept_apart(tmp_path, capsys):
    out = str(tmp_path / "out")
    _finish(_train(out, 1, 4, TRAINREC_RUN_ID="shared"), _train(out, 2, 6, TRAINREC_RUN_ID="shared"))
    runs = list_runs(out)
    assert sorted(r.run_id for r in runs) == ["shared", "shared#2"] and all(r.conflict for r in runs)
    for rid in ("shared", "shared#2"):
        rows = open_run(out, run_id=rid).to_rows()
        keys = list(zip(rows["step"], rows["kind"], rows["name"], rows["op"], strict=True))
        assert keys and len(keys) == len(set(keys)), rid  # one value per (step, tensor, op)
    from trainrec.replay.follow import follow

    tail = [ev.step for ev in follow(out, until_closed=True, idle_timeout=30, types="se")]
    assert tail and len(tail) == len(set(tail))  # the latest launch only, as replay keeps it
    writers = {open_run(out, run_id=rid).log_files(0)[0].header.writer_id for rid in ("shared", "shared#2")}
    assert len(writers) == 2 and "" not in writers
    assert main(["check", out]) == 1
    text = capsys.readouterr().out
    assert "conflict" in text and "shared by 2 launches" in text and "note: 1 other launch(es)" in text
    assert main(["inspect", out]) == 0
    assert "WRITERS KEPT APART" in capsys.readouterr().out
    assert main(["dump", out, "--type", "se"]) == 0
    captured = capsys.readouterr()
    assert "shared by 2 launches" in captured.err
    steps = [json.loads(line)["step"] for line in captured.out.splitlines()]
    assert len(steps) == len(set(steps))
    csv_dir = str(tmp_path / "csv")
    assert main(["export", "csv", out, "--run-id", "shared", "-o", csv_dir]) == 0
    capsys.readouterr()
    for root, _, files in os.walk(csv_dir):
        for name in files:
            if name.endswith(".csv"):
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    lines = f.read().splitlines()[1:]
                assert len(lines) == len(set(lines)), name  # each row once


def test_a_declared_resume_is_no_conflict(tmp_path, capsys):
    out = str(tmp_path / "out")
    _finish(_train(out, 1, 3, TRAINREC_RUN_ID="resumed"))
    (rank_dir,) = os.listdir(out)
    stamp = layout.parse_rank_dir(rank_dir)[0]
    script = TRAIN.replace('config={"wg_distribution": True, "ops": ["norm", "max"]}',
                           f'config={{"wg_distribution": True, "ops": ["norm", "max"], "append_output": ["{stamp}", "{stamp}"]}}')
    proc = subprocess.Popen([sys.executable, "-c", script, "1", out, "2"], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _finish(proc)
    assert [r.run_id for r in list_runs(out)] == ["resumed"]
    assert main(["check", out]) == 0
    assert "conflict" not in capsys.readouterr().out


def test_check_says_which_launch_it_checked_and_all_checks_every_one(tmp_path, capsys):
    out = str(tmp_path / "out")
    _finish(_train(out, 1, 3, TRAINREC_RUN_ID="older"))
    (older,) = [os.path.join(out, d) for d in os.listdir(out)]
    log = layout.list_logs(older)[0]
    with open(log, "r+b") as f:  # one flipped bit in the middle of the older launch's log
        f.seek(os.path.getsize(log) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x04]))
    _finish(_train(out, 2, 3, TRAINREC_RUN_ID="newer"))
    assert main(["check", out]) == 0
    text = capsys.readouterr().out
    assert text.startswith("checked run newer") and "1 other launch(es)" in text and "older" in text
    assert main(["check", out, "--all"]) == 1
    text = capsys.readouterr().out
    assert "checked run older" in text and "checked run newer" in text and "FAILED: older" in text
    assert main(["check", out, "--all", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["ok"]) for r in doc["launches"]] == [("older", False), ("newer", True)]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_config_that_is_a_fifo_or_a_device_is_refused_at_once(tmp_path, kind):
    if kind == "fifo":
        path = str(tmp_path / "monitor_config.json")
        os.mkfifo(path)
    else:
        path = "/dev/zero"
        if not os.path.exists(path):
            pytest.skip("no /dev/zero")
    script = TRAIN.replace('config={"wg_distribution": True, "ops": ["norm", "max"]}', f"config={path!r}")
    done = subprocess.run([sys.executable, "-c", script, "1", str(tmp_path / "out"), "1"], env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)  # (it blocked for good before)
    assert done.returncode != 0
    what = "a FIFO" if kind == "fifo" else "a character device"
    assert f"it is {what}, not a regular file" in done.stderr and "ConfigError" in done.stderr


def test_a_write_failure_mid_run_is_said_once_and_check_does_not_claim_completeness(tmp_path, capsys):
    """The log may grow to 48 KiB only (RLIMIT_FSIZE): the writer fails mid-run, training goes on; the
    failure is logged once, its note goes to a sidecar (the file may not grow), and check fails on it."""
    out = str(tmp_path / "out")
    limited = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (48 << 10, 48 << 10))\n")
    proc = subprocess.Popen([sys.executable, "-c", limited + TRAIN, "1", out, "300"], env=_env(STEP_SLEEP="0.003"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # (a run of ~1 s)
    (stdout, stderr), = _finish(proc)
    assert stdout.split()[-1] == "299"  # training survived
    assert stderr.count("failed") == 1, stderr
    (rank_dir,) = os.listdir(out)
    log = layout.list_logs(os.path.join(out, rank_dir))[0]
    assert os.path.getsize(log) <= 48 << 10 and os.path.exists(log + ".failed.json")
    assert main(["check", out]) == 1
    text = capsys.readouterr().out
    assert "the writer failed to write" in text and "were never written" in text
    assert "no bytes lost" not in text
    with open(log + ".failed.json", encoding="utf-8") as f:
        note = json.load(f)
    assert 0 < note["last_step"] < 299 and note["discarded"] > 0  # mid-run: the steps after it never written


FILLING = textwrap.dedent("""
    import os, resource, signal, sys, time
    from trainrec.recorder.writer import LogWriter
    from trainrec.schema.events import StepBegan, StepEnded
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, resource.RLIM_INFINITY))  # the disk fills at 8 KiB
    w = LogWriter(sys.argv[1], flush_interval=0.01)
    step = 0
    while w.error is None:
        w.write(StepBegan(step=step))
        w.write(StepEnded(step=step))
        step += 1
        time.sleep(0.001)
    if sys.argv[2] == "sidecar-later":  # not a byte more anywhere, until after the close
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
    else:  # space returned before the close
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        w.close()
    except Exception as exc:
        print("close:", type(exc).__name__, file=sys.stderr)
    print(w.path, flush=True)
    if sys.argv[2] == "sidecar-later":
        print(os.path.exists(w.path + ".failed.json"), flush=True)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        time.sleep(5)  # the retry (every 2 s) writes it
        print(os.path.exists(w.path + ".failed.json"), flush=True)
""")


@pytest.mark.parametrize("when", ["in-log", "sidecar-later"])
def test_the_writer_leaves_its_failure_where_space_allows(tmp_path, capsys, when):
    """Disk full (a file size limit) mid-run: where space returns before the close, the WriterFailed
    record and the FileClosed go into the log itself; where not even a sidecar can be written at the
    close, the sidecar is written once space returns. check fails on what was never written."""
    out = str(tmp_path / "out")
    rdir = os.path.join(out, "Nov30_11-13-33-rank0-0000beef")
    done = subprocess.run([sys.executable, "-c", FILLING, rdir, when], env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    log = lines[0]
    assert done.stderr.count("log writer for") == 1, done.stderr
    reader, _ = read_log(log)
    if when == "in-log":
        assert not os.path.exists(log + ".failed.json")
        assert reader.failure is not None and reader.failure.discarded > 0 and reader.closed_cleanly
    else:
        assert lines[1:] == ["False", "True"] and reader.failure is None
    assert main(["check", out]) == 1
    text = capsys.readouterr().out
    assert "the writer failed to write" in text and "were never written" in text


def _last_step_ended(out: str) -> int:
    (rank_dir,) = os.listdir(out)
    _, events = read_log(layout.list_logs(os.path.join(out, rank_dir))[0])
    return max((ev.step for ev in events if isinstance(ev, StepEnded)), default=-1)


@pytest.mark.parametrize("durability", ["step", "interval"])
def test_per_step_durability_survives_kill_9(tmp_path, durability):
    """Killed with SIGKILL while paused after step 5 (the writer's interval made long): with per-step
    durability every step that ended is in the log; without, what the last interval held is lost."""
    out = str(tmp_path / "out")
    script = TRAIN.replace("with record(", "import trainrec.recorder.writer as W\n"
                           "W.LogWriter.__init__.__kwdefaults__['flush_interval'] = 60.0\nwith record(")
    proc = subprocess.Popen([sys.executable, "-c", script, "1", out, "20"],
                            env=_env(PAUSE_AT="5", TRAINREC_DURABILITY=durability), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "5":
                break
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    last = _last_step_ended(out)
    if durability == "step":
        assert last >= 4  # (step 5's StepEnded is handed over at step 6's start)
    else:
        assert last == -1


def test_dump_prints_a_duplicated_block_once_and_says_so(tmp_path, capsys):
    out = str(tmp_path / "out")
    _finish(_train(out, 1, 6))
    assert main(["dump", out]) == 0
    clean = capsys.readouterr().out
    (rank_dir,) = os.listdir(out)
    log = layout.list_logs(os.path.join(out, rank_dir))[0]
    with open(log, "rb") as f:
        data = f.read()
    a, b = len(data) // 3, 2 * len(data) // 3
    with open(log, "wb") as f:
        f.write(data[:b] + data[a:b] + data[b:])
    assert main(["dump", out]) == 0
    got = capsys.readouterr()
    assert got.out == clean and "duplicate frame(s) dropped" in got.err
    assert main(["check", out]) == 1
    assert "duplicate frame(s) dropped" in capsys.readouterr().out
