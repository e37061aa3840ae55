"""live_export follows a log written concurrently by LogWriter and writes what the offline export writes."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from export_logs import OPS, PARAMS, rank_dir, stats_record, write_rank_log  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from trainrec.recorder.writer import LogWriter  # noqa: E402
from trainrec.schema import layout  # noqa: E402
from trainrec.schema.events import RunResumed, StepBegan, StepEnded  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402
from trainrec.tools.live_export import live_export  # noqa: E402

PY = sys.executable


def _spawn(*args):
    return subprocess.Popen(
        [PY, "-m", "trainrec.tools.live_export", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def _end(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
        if p.stderr is not None:
            p.stderr.close()


def _wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _slow_writer(rdir, steps=6, delay=0.03):
    """Write a log step by step, as training would, from this test's thread."""
    w = LogWriter(rdir, rank=0, run_id="live", flush_interval=0.01)
    for s in range(steps):
        write_rank_log(rdir, steps=[s], kinds=("actv", "grad_reduced", "param"), close=False, writer=w, seed=s,
                       anomalies=False)
        time.sleep(delay)
    return w


def _offline(run_dir, fmt, out):
    assert main(["export", fmt, str(run_dir), "-o", str(out)]) == 0
    (name,) = [n for n in os.listdir(out) if not n.startswith(".")]
    return out / name


def _csv_files(d):
    """The CSV files in ``d`` (a live export's output has its record of what it exported beside them)."""
    return sorted(n for n in os.listdir(d) if n.endswith(".csv"))


def _scalars(d):
    ea = EventAccumulator(str(d), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: [(e.step, e.wall_time, e.value if e.value == e.value else "nan") for e in ea.Scalars(t)]
            for t in ea.Tags()["scalars"]}


def _param_steps(rdir, run_id: str, steps) -> None:
    """A closed log of one parameter "p" whose six values at step s are all s."""
    with LogWriter(rdir, rank=0, run_id=run_id, flush_interval=0.01) as w:
        ids = w.intern(["p"], step=-1)
        for s in steps:
            w.write(stats_record(0, s, "param", ids, np.full((1, 6), s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=1.0))


def test_csv_follows_and_exits_at_file_closed(tmp_path):
    rdir = rank_dir(tmp_path / "run", 0)
    out = tmp_path / "live"
    proc = _spawn("--format", "csv", "--rank-dir", rdir, "--out", str(out), "--poll-interval", "0.02")
    try:
        time.sleep(0.2)  # the exporter starts before the log exists, as when the recorder spawns it
        w = _slow_writer(rdir)
        # complete steps are written while the log is still open
        assert _wait_for(lambda: os.path.exists(out / "param_5-5.csv"))
        assert proc.poll() is None  # the file is not closed yet: still following
        w.close()
        proc.wait(timeout=30)
        assert proc.returncode == 0, proc.stderr.read()
    finally:
        _end(proc)
    offline = _offline(tmp_path / "run", "csv", tmp_path / "offline")
    files = sorted(os.listdir(offline))
    assert _csv_files(out) == files and len(files) == 3 * 6
    match, mismatch, errors = filecmp.cmpfiles(out, offline, files, shallow=False)
    assert not mismatch and not errors


def test_tensorboard_follows_into_the_rank_dir(tmp_path):
    rdir = rank_dir(tmp_path / "run", 0)
    os.makedirs(rdir)
    proc = _spawn("--format", "tensorboard", "--rank-dir", rdir, "--poll-interval", "0.02")
    try:
        w = _slow_writer(rdir, steps=4)
        w.close()
        proc.wait(timeout=30)
        assert proc.returncode == 0, proc.stderr.read()
    finally:
        _end(proc)
    assert any(n.startswith("events.out.tfevents.") for n in os.listdir(rdir))
    live = _scalars(rdir)
    offline = _scalars(_offline(tmp_path / "run", "tb", tmp_path / "offline"))
    assert live == offline and len(live) > 100


def test_parent_gone_exports_what_is_complete(tmp_path):
    rdir = rank_dir(tmp_path / "run", 0)
    out = tmp_path / "live"
    parent = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    proc = _spawn("--format", "csv", "--rank-dir", rdir, "--out", str(out), "--poll-interval", "0.02",
                  "--parent-pid", str(parent.pid))
    w = LogWriter(rdir, rank=0, run_id="crash", flush_interval=0.01)
    try:
        write_rank_log(rdir, steps=range(3), kinds=("param",), close=False, writer=w)
        ids = list(range(5, 5 + len(PARAMS)))
        w.write(StepBegan(rank=0, step=3, wall=1.0))
        w.write(stats_record(0, 3, "param", ids, np.ones((len(ids), 6), np.float32)))  # step 3 never ends
        w.flush()
        assert _wait_for(lambda: os.path.exists(out / "param_2-2.csv"))
        assert proc.poll() is None
        parent.kill()
        parent.wait(timeout=10)
        proc.wait(timeout=30)
        assert proc.returncode == 0
        assert "step(s) 3 did not end" in proc.stderr.read()
    finally:
        _end(proc, parent)
        w.close()
    assert _csv_files(out) == [f"param_{s}-{s}.csv" for s in range(3)]


def test_resume_rewinds_superseded_csv_rows(tmp_path):
    """Followed live, a resume removes the rows of superseded steps, even inside a window file."""
    rdir = rank_dir(tmp_path / "run", 0)
    _param_steps(rdir, "res", range(5))
    with LogWriter(rdir, rank=0, run_id="res", flush_interval=0.01) as w:
        w.write(RunResumed(rank=0, step=3, wall=2.0, last_step=2))
        ids = w.intern(["p"], step=-1)
        for s in range(3, 7):
            w.write(stats_record(0, s, "param", ids, np.full((1, 6), 10 * s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=2.0))
    out = tmp_path / "live"
    res = live_export(rdir, "csv", str(out), step_count_per_record=2, poll_interval=0.01, idle_timeout=10)
    assert res.reason == "closed"
    assert main(["export", "csv", str(tmp_path / "run"), "-o", str(tmp_path / "off"), "--step-count-per-record", "2"]) == 0
    offline = tmp_path / "off" / os.path.basename(rdir)
    files = sorted(os.listdir(offline))
    assert _csv_files(out) == files == ["param_0-1.csv", "param_2-3.csv", "param_4-5.csv", "param_6-7.csv"]
    match, mismatch, errors = filecmp.cmpfiles(out, offline, files, shallow=False)
    assert not mismatch and not errors
    assert [line.split(",")[3] for line in (out / "param_2-3.csv").read_text().splitlines()[1:]] == ["2.0", "30.0"]


def test_stop_and_bad_arguments(tmp_path):
    stop = threading.Event()
    stop.set()
    res = live_export(str(tmp_path / "never"), "csv", poll_interval=0.01, stop=stop)
    assert res.reason == "stopped" and res.steps == 0
    with pytest.raises(ValueError, match="format must be one of"):
        live_export(str(tmp_path), "parquet")
    r = subprocess.run([PY, "-m", "trainrec.tools.live_export", "--format", "csv", "--rank-dir", str(tmp_path),
                        "--step-count-per-record", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "must be >= 1" in r.stderr


def test_the_first_poll_is_not_kept_for_the_whole_export(tmp_path, monkeypatch):
    """Started on a log with history (a resume, a restarted export), the first poll is the whole earlier
    log: its decoded events are let go once projected (they stayed alive until the export ended)."""
    import gc
    import warnings

    from trainrec.schema.events import Event
    from trainrec.tools import live_export as le

    rdir = rank_dir(tmp_path / "run", 0)
    _param_steps(rdir, "big", range(300))
    alive = []
    finish = le.CsvProjector.finish

    def counting_finish(self, clean):
        gc.collect()
        with warnings.catch_warnings():  # some of torch's module objects warn when looked at
            warnings.simplefilter("ignore")
            alive.append(sum(type(o).__module__ == Event.__module__ for o in gc.get_objects()))
        return finish(self, clean)

    monkeypatch.setattr(le.CsvProjector, "finish", counting_finish)
    res = live_export(rdir, "csv", str(tmp_path / "live"), poll_interval=0.01, idle_timeout=10)
    assert res.reason == "closed" and res.steps == 300
    assert alive and alive[0] < 50  # 600+ were read


def test_bookkeeping_per_window_file_stays_small(tmp_path, monkeypatch):
    """A live export runs as long as training: what it remembers of each file it wrote (to rewind on a
    resume, to list its files) must stay a few integers, not paths and tuples (~730 bytes per file
    before, 0.5 GB for a 100k-step run with one file per step and kind)."""
    import gc
    import tracemalloc

    from trainrec.tools import live_export as le

    held = {}
    finish = le.CsvProjector.finish

    def measuring_finish(self, clean):
        gc.collect()
        held[len(self.summary.steps)] = tracemalloc.get_traced_memory()[0]
        return finish(self, clean)

    monkeypatch.setattr(le.CsvProjector, "finish", measuring_finish)
    for n in (200, 2200):
        rdir = rank_dir(tmp_path / f"run{n}", 0)
        _param_steps(rdir, f"b{n}", range(n))
        tracemalloc.start()
        try:
            res = live_export(rdir, "csv", str(tmp_path / f"live{n}"), poll_interval=0.01, idle_timeout=10)
        finally:
            tracemalloc.stop()
        assert res.reason == "closed" and res.steps == n and len(res.files) == n
    per_file = (held[2200] - held[200]) / 2000
    assert per_file < 100, f"{per_file:.0f} bytes of bookkeeping per CSV file"


def test_a_window_emptied_by_a_resume_takes_the_resumed_runs_ops(tmp_path):
    """Window 3-5 held step 4 alone (step_interval 2), with ops norm and max; the resume at 4 records
    norm, min and mean: the window file is made again with those columns, as the offline export makes
    it (it kept its old header, and min and mean were lost). A step cut short and re-run is not
    reported as dropped either."""
    from trainrec.schema.events import TensorStatsRecorded

    def rec(step, ops, vals):
        return TensorStatsRecorded(rank=0, step=step, wall=1.0, kind="param", ops=tuple(ops), dtype="f",
                                   name_ids=np.array([0], "<u4").tobytes(),
                                   values=np.array([vals], "<f4").tobytes(), micro_steps=b"", slots=b"",
                                   vpp_stages=b"")

    rdir = rank_dir(tmp_path / "run", 0)
    with LogWriter(rdir, rank=0, run_id="gap", flush_interval=0.01) as w:
        w.intern(["p"], step=-1)
        for s in (0, 2, 4):
            w.write(rec(s, ("norm", "max"), [s, s + 0.5]))
            w.write(StepEnded(rank=0, step=s, wall=1.0))
        w.write(rec(6, ("norm", "max"), [6, 6.5]))  # cut short: no StepEnded
    with LogWriter(rdir, rank=0, run_id="gap", flush_interval=0.01) as w:
        w.write(RunResumed(rank=0, step=4, wall=2.0, last_step=3))
        w.intern(["p"], step=-1)
        for s in (4, 6):
            w.write(rec(s, ("norm", "min", "mean"), [10 * s, 10 * s + 1, 10 * s + 2]))
            w.write(StepEnded(rank=0, step=s, wall=2.0))
    out = tmp_path / "live"
    res = live_export(rdir, "csv", str(out), step_count_per_record=3, poll_interval=0.01, idle_timeout=10)
    assert res.reason == "closed" and res.dropped_steps == []
    assert (out / "param_3-5.csv").read_text() == "vpp_stage,param_name,step,norm,min,mean\n0,p,4,40.0,41.0,42.0\n"
    assert main(["export", "csv", str(tmp_path / "run"), "-o", str(tmp_path / "off"), "--step-count-per-record", "3"]) == 0
    offline = tmp_path / "off" / os.path.basename(rdir)
    files = sorted(os.listdir(offline))
    assert _csv_files(out) == files
    match, mismatch, errors = filecmp.cmpfiles(out, offline, files, shallow=False)
    assert not mismatch and not errors


def test_a_stop_in_a_long_batch_comes_between_events_and_leaves_whole_files(tmp_path, monkeypatch):
    """A resumed launch's export starts on the whole earlier log in one batch: SIGTERM (close()'s
    timeout, a preempted job) was honoured only after it, and the kill that followed left window files
    truncated to nothing. The stop now comes between events, and the files written are closed whole."""
    from trainrec.tools import live_export as le

    rdir = rank_dir(tmp_path / "run", 0)
    _param_steps(rdir, "long", range(400))
    stop = threading.Event()
    fed = []
    feed = le.CsvProjector.feed

    def feed_then_stop(self, ev):
        fed.append(ev)
        if len(fed) == 200:
            stop.set()
        return feed(self, ev)

    monkeypatch.setattr(le.CsvProjector, "feed", feed_then_stop)
    out = tmp_path / "live"
    res = live_export(rdir, "csv", str(out), poll_interval=0.01, idle_timeout=10, stop=stop)
    assert res.reason == "stopped" and len(fed) == 200 and 0 < res.steps < 400
    files = sorted(out.iterdir())
    assert len(files) == res.steps
    for f in files:
        step = int(f.name.split("_")[1].split("-")[0])
        assert f.read_text() == f"vpp_stage,param_name,step,{','.join(OPS)}\n0,p,{step}," + ",".join(
            [repr(float(step))] * 6) + "\n"


def _resumed_param_log(rdir, run_id, resume_at, steps):
    """A later launch's log: RunResumed at ``resume_at``, then parameter "p" at ``steps`` with values 10 * s."""
    with LogWriter(rdir, rank=0, run_id=run_id, flush_interval=0.01) as w:
        w.write(RunResumed(rank=0, step=resume_at, wall=2.0, last_step=resume_at - 1))
        ids = w.intern(["p"], step=-1)
        for s in steps:
            w.write(stats_record(0, s, "param", ids, np.full((1, 6), 10 * s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=2.0))



@pytest.mark.parametrize(("per_record", "resume_at"), [(1, 3), (3, 4), (3, 3), (3, 9)])
def test_a_resumed_launchs_export_goes_on_from_its_own_log_file(tmp_path, per_record, resume_at):
    """An export that ended cleanly leaves a record of the log files it projected; the next launch's
    export (a resume) reads only the new file, goes on with the window files already there (trimming,
    removing, appending), and leaves what a full export of the whole run leaves, byte for byte."""
    rdir = rank_dir(tmp_path / "run", 0)
    out = tmp_path / "live"
    _param_steps(rdir, "res", range(8))
    first = live_export(rdir, "csv", str(out), step_count_per_record=per_record, poll_interval=0.01, idle_timeout=10)
    assert first.reason == "closed" and first.steps == 8
    assert os.path.exists(out / "live_export.done")
    untouched = {n: os.stat(out / n).st_mtime_ns for n in _csv_files(out)
                 if int(n.split("_")[1].split("-")[1][:-4]) < resume_at - resume_at % per_record}
    time.sleep(0.05)
    _resumed_param_log(rdir, "res", resume_at, range(resume_at, 12))
    second = live_export(rdir, "csv", str(out), step_count_per_record=per_record, poll_interval=0.01,
                         idle_timeout=10)
    assert second.reason == "closed"
    assert second.steps == 12 - resume_at  # the first launch's steps were not projected again
    assert {n: os.stat(out / n).st_mtime_ns for n in untouched} == untouched
    assert main(["export", "csv", str(tmp_path / "run"), "-o", str(tmp_path / "off"),
                 "--step-count-per-record", str(per_record)]) == 0
    offline = tmp_path / "off" / os.path.basename(rdir)
    files = _csv_files(offline)
    assert _csv_files(out) == files
    match, mismatch, errors = filecmp.cmpfiles(out, offline, files, shallow=False)
    assert not mismatch and not errors


def test_a_resumed_launchs_tensorboard_export_appends_to_the_earlier_file(tmp_path):
    rdir = rank_dir(tmp_path / "run", 0)
    _param_steps(rdir, "res", range(6))
    first = live_export(rdir, "tensorboard", poll_interval=0.01, idle_timeout=10)
    _resumed_param_log(rdir, "res", 3, range(3, 8))
    second = live_export(rdir, "tensorboard", poll_interval=0.01, idle_timeout=10)
    assert second.reason == "closed" and second.steps == 5 and second.files == first.files
    assert [n for n in os.listdir(rdir) if n.startswith("events.out.tfevents.")] == \
        [os.path.basename(first.files[0])]

    def values(d):
        return {t: [(s, v) for s, _, v in pts] for t, pts in _scalars(d).items()}

    live = values(rdir)
    assert live == values(_offline(tmp_path / "run", "tb", tmp_path / "offline")) and live
    (norm,) = [t for t in live if t.endswith("norm")]
    assert [v for _, v in live[norm]] == [0.0, 1.0, 2.0, 30.0, 40.0, 50.0, 60.0, 70.0]


@pytest.mark.parametrize("change", ["ndigits", "log size", "no record", "stopped"])
def test_without_a_fitting_record_the_whole_log_is_exported_again(tmp_path, change):
    """The record is trusted only as written by an export that ended cleanly, with the same options,
    for log files still as they were; it is removed when an export starts (its output is then work in
    progress). Otherwise the export reads every log file from the start, as before."""
    rdir = rank_dir(tmp_path / "run", 0)
    out = tmp_path / "live"
    _param_steps(rdir, "res", range(5))
    stop = threading.Event()
    if change == "stopped":
        stop.set()  # stopped before its first batch: not clean, no record
    first = live_export(rdir, "csv", str(out), poll_interval=0.01, idle_timeout=10, stop=stop)
    assert os.path.exists(out / "live_export.done") == (change != "stopped")
    if change == "no record":
        os.remove(out / "live_export.done")
    _resumed_param_log(rdir, "res", 3, range(3, 6))
    if change == "log size":
        with open(layout.list_logs(rdir)[0], "ab") as f:
            f.write(b"\0")
    second = live_export(rdir, "csv", str(out), ndigits=3 if change == "ndigits" else 6, poll_interval=0.01,
                         idle_timeout=10)
    assert second.reason == "closed" and second.steps == 6  # steps 0-2, and 3-5 again
    assert first.reason == ("stopped" if change == "stopped" else "closed")


def test_a_resumed_export_keeps_rows_of_names_with_line_breaks(tmp_path):
    """A quoted name may hold a line break: trimming an adopted window keeps such rows whole (they were
    cut at the line break and lost)."""
    rdir = rank_dir(tmp_path / "run", 0)
    out = tmp_path / "live"
    names = ["p", "a\nb", "c\u2028d"]
    with LogWriter(rdir, rank=0, run_id="nl", flush_interval=0.01) as w:
        ids = w.intern(names, step=-1)
        for s in range(8):
            w.write(stats_record(0, s, "param", ids, np.full((3, 6), s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=1.0))
    assert live_export(rdir, "csv", str(out), step_count_per_record=3, poll_interval=0.01,
                       idle_timeout=10).reason == "closed"
    with LogWriter(rdir, rank=0, run_id="nl", flush_interval=0.01) as w:
        w.write(RunResumed(rank=0, step=7, wall=2.0, last_step=6))
        ids = w.intern(names, step=-1)
        for s in (7, 8, 9):
            w.write(stats_record(0, s, "param", ids, np.full((3, 6), 10 * s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=2.0))
    res = live_export(rdir, "csv", str(out), step_count_per_record=3, poll_interval=0.01, idle_timeout=10)
    assert res.reason == "closed" and res.steps == 3
    assert main(["export", "csv", str(tmp_path / "run"), "-o", str(tmp_path / "off"), "--step-count-per-record", "3"]) == 0
    offline = tmp_path / "off" / os.path.basename(rdir)
    files = _csv_files(offline)
    assert _csv_files(out) == files
    match, mismatch, errors = filecmp.cmpfiles(out, offline, files, shallow=False)
    assert not mismatch and not errors
    assert (out / "param_6-8.csv").read_text().count('"a\nb"') == 3  # steps 6, 7 and 8


@pytest.mark.parametrize("resume_at", [6, 3])
@pytest.mark.parametrize("record", [True, False])
def test_a_resumed_launch_killed_in_its_first_step_has_that_step_dropped(tmp_path, resume_at, record):
    """The resumed launch dies in its first step (no StepEnded, no FileClosed): that torn step is not
    exported, and is reported, as the offline export does; with the earlier launch's log skipped (a
    record) or read again, and whether the resume goes back (3) or on (6)."""
    rdir = rank_dir(tmp_path / "run", 0)
    out = tmp_path / "live"
    _param_steps(rdir, "torn", range(6))
    assert live_export(rdir, "csv", str(out), poll_interval=0.01, idle_timeout=10).reason == "closed"
    if not record:
        os.remove(out / "live_export.done")
    w = LogWriter(rdir, rank=0, run_id="torn", flush_interval=0.01)
    try:
        w.write(RunResumed(rank=0, step=resume_at, wall=2.0, last_step=resume_at - 1))
        ids = w.intern(["p"], step=-1)
        w.write(StepBegan(rank=0, step=resume_at, wall=2.0))
        w.write(stats_record(0, resume_at, "param", ids, np.full((1, 6), 99, np.float32)))
        w.flush()
        res = live_export(rdir, "csv", str(out), poll_interval=0.01, idle_timeout=1)
    finally:
        w.close()
    assert res.reason == "idle" and res.dropped_steps == [resume_at]
    assert _csv_files(out) == [f"param_{s}-{s}.csv" for s in range(resume_at)]


def test_run_again_on_a_directory_exported_whole_it_ends_at_once_and_keeps_the_record(tmp_path):
    rdir = rank_dir(tmp_path / "run", 0)
    out = tmp_path / "live"
    _param_steps(rdir, "again", range(5))
    assert live_export(rdir, "csv", str(out), poll_interval=0.01).reason == "closed"
    again = live_export(rdir, "csv", str(out), poll_interval=0.01)  # no idle timeout, no parent: must end
    assert again.reason == "closed" and again.steps == 0
    assert os.path.exists(out / "live_export.done")
    _resumed_param_log(rdir, "again", 5, range(5, 7))
    res = live_export(rdir, "csv", str(out), poll_interval=0.01, idle_timeout=10)
    assert res.reason == "closed" and res.steps == 2  # the first log still skipped


def test_an_export_whose_training_died_does_not_take_up_the_next_launchs_log(tmp_path, monkeypatch):
    """Training killed (-9), then resumed at once, and the killed launch's export has taken up the
    resumed launch's new file: once it sees its parent gone it ends (dropping that file, written by
    another process: ``RunFollower.stop_discovering``, tested in tests/replay/test_follow.py) while the
    resumed launch goes on writing, and leaves that launch's own export alone with the file."""
    from trainrec.tools import live_export as le

    rdir = rank_dir(tmp_path / "run", 0)
    out = tmp_path / "live"
    alive = threading.Event()
    alive.set()
    monkeypatch.setattr(le, "pid_alive", lambda pid: alive.is_set())
    w1 = LogWriter(rdir, rank=0, run_id="kill", flush_interval=0.01)  # this process plays the training
    ids = w1.intern(["p"], step=-1)
    for s in range(3):
        w1.write(stats_record(0, s, "param", ids, np.full((1, 6), s, np.float32)))
        w1.write(StepEnded(rank=0, step=s, wall=1.0))
    w1.flush()
    here = os.path.dirname(os.path.abspath(__file__))
    resumed = subprocess.Popen([PY, "-c", f"""
import sys, time
sys.path.insert(0, {os.path.join(here, "..", "analyzers")!r})
import numpy as np
from export_logs import stats_record
from trainrec.recorder.writer import LogWriter
from trainrec.schema.events import RunResumed, StepEnded
with LogWriter({rdir!r}, rank=0, run_id="kill", flush_interval=0.01) as w:
    w.write(RunResumed(rank=0, step=3, wall=2.0, last_step=2))
    ids = w.intern(["p"], step=-1)
    for s in range(3, 100000):
        w.write(stats_record(0, s, "param", ids, np.full((1, 6), 10 * s, np.float32)))
        w.write(StepEnded(rank=0, step=s, wall=2.0))
        w.flush()
        time.sleep(0.002)  # a step every few ms: every poll of the export finds data
"""])
    result = []
    t = threading.Thread(target=lambda: result.append(
        live_export(rdir, "csv", str(out), parent_pid=os.getpid(), poll_interval=0.05)))
    t.start()
    try:
        assert _wait_for(lambda: os.path.exists(out / "param_5-5.csv"))  # it took up the new file
        alive.clear()  # the training process is gone
        t.join(timeout=10)
        assert not t.is_alive(), "the killed launch's export went on following the next launch's log"
        assert resumed.poll() is None  # still writing
    finally:
        alive.clear()
        resumed.kill()
        resumed.wait(timeout=10)
        t.join(timeout=30)
        w1.close()
    assert result and result[0].reason == "parent gone"


def test_a_backlog_is_exported_in_bounded_polls_with_the_same_result(tmp_path, monkeypatch):
    """Without a record (an export killed with its training, an older trainrec), a resumed launch's export
    reads the earlier launch's whole log again: POLL_BYTES of log at a time, as the events of one poll are
    held at once (6-9x the bytes), not all of it in its first poll; what it leaves is what the offline
    export leaves."""
    import importlib

    from trainrec.replay.follow import RunFollower

    follow_mod = importlib.import_module("trainrec.replay.follow")  # (the package's `follow` is the function)

    rdir = rank_dir(tmp_path / "run", 0)
    _param_steps(rdir, "res", range(1000))
    _resumed_param_log(rdir, "res", 990, range(990, 1010))
    sizes = []
    real_poll = RunFollower.poll

    def counted(self, max_bytes=None):
        got = real_poll(self, max_bytes)
        sizes.append(len(got))
        return got

    monkeypatch.setattr(follow_mod, "POLL_BYTES", 8192)
    monkeypatch.setattr(RunFollower, "poll", counted)
    out = tmp_path / "live"
    res = live_export(rdir, "csv", str(out), poll_interval=0.01, idle_timeout=10)
    assert res.reason == "closed" and res.steps == 1010
    total = sum(sizes)
    assert total > 2000 and max(sizes) < total / 5  # in pieces: no poll held the whole backlog
    assert main(["export", "csv", str(tmp_path / "run"), "-o", str(tmp_path / "off")]) == 0
    offline = tmp_path / "off" / os.path.basename(rdir)
    files = _csv_files(offline)
    assert _csv_files(out) == files
    match, mismatch, errors = filecmp.cmpfiles(out, offline, files, shallow=False)
    assert not mismatch and not errors
