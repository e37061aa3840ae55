"""follow(): a live tail sees what a concurrently writing LogWriter appends, new ranks and resumes."""

from __future__ import annotations

import os
import threading
import time

from logbuild import rank_dir, stats
from trainrec.recorder.writer import LogWriter
from trainrec.replay import RunFollower, follow, open_run, read_log
from trainrec.schema import framing
from trainrec.schema.events import FileClosed, NamesInterned, RunResumed, StepBegan, TensorStatsRecorded


def _steps(w: LogWriter, rank: int, steps, ids, pause: float = 0.01) -> None:
    for s in steps:
        w.write(StepBegan(rank=rank, step=s))
        w.write(stats(rank, s, ids))
        w.flush(timeout=10)
        time.sleep(pause)


def _training(out: str, errors: list) -> None:
    """Rank 0 starts, rank 1 joins later, rank 0 'crashes' and resumes into a new file; rank 1 ends last."""
    try:
        w0 = LogWriter(rank_dir(out, 0), rank=0, world_size=2, run_id="live-1", flush_interval=0.01)
        ids0 = w0.intern(["a", "b"])
        _steps(w0, 0, range(0, 4), ids0)
        w1 = LogWriter(rank_dir(out, 1), rank=1, world_size=2, run_id="live-1", flush_interval=0.01)
        ids1 = w1.intern(["a", "b", "c"])
        _steps(w1, 1, range(0, 6), ids1)
        _steps(w0, 0, range(4, 6), ids0)
        w0.close()
        w0b = LogWriter(rank_dir(out, 0), rank=0, world_size=2, run_id="live-1", flush_interval=0.01)
        w0b.write(RunResumed(rank=0, step=5, last_step=5))
        ids0b = w0b.intern(["b", "a"])
        _steps(w0b, 0, range(5, 8), ids0b)
        w0b.close()
        _steps(w1, 1, range(6, 8), ids1)
        w1.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        errors.append(exc)


def test_follow_sees_a_concurrent_writer_new_ranks_and_a_resume(tmp_path):
    out = str(tmp_path / "monitor_output")  # does not exist yet: follow waits for it
    errors: list = []
    t = threading.Thread(target=_training, args=(out, errors))
    got = []
    gen = follow(out, poll_interval=0.01, until_closed=True, idle_timeout=30)
    t.start()
    for ev in gen:
        got.append(ev)
    t.join(timeout=60)
    assert not errors and not t.is_alive()
    run = open_run(out)
    assert run.ranks == [0, 1] and len(run.files(0)) == 2
    for r in run.ranks:
        expected = [ev for p in run.files(r) for ev in read_log(p)[1]]
        assert [ev for ev in got if ev.rank == r] == expected
    assert sum(isinstance(e, FileClosed) for e in got) == 3
    assert any(isinstance(e, RunResumed) for e in got)


def test_follow_a_single_growing_file_with_from_start_false_and_stop(tmp_path):
    d = rank_dir(tmp_path, 0)
    w = LogWriter(d, rank=0, run_id="f", flush_interval=0.01)
    ids = w.intern(["x"])
    _steps(w, 0, range(3), ids, pause=0)
    stop = threading.Event()
    got = []

    def consume():
        for ev in follow(w.path, poll_interval=0.01, stop=stop, from_start=False, idle_timeout=30):
            got.append(ev)
            if isinstance(ev, TensorStatsRecorded) and ev.step == 5:
                stop.set()

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.1)
    _steps(w, 0, range(3, 6), ids, pause=0)
    t.join(timeout=30)
    w.close()
    assert not t.is_alive()
    # Earlier content skipped except what names need; everything after the start seen, in order.
    assert [type(e).__name__ for e in got[:2]] == ["FileOpened", "NamesInterned"]
    assert [e.step for e in got if isinstance(e, StepBegan)] == [3, 4, 5]


def test_idle_timeout_ends_follow_and_poll_is_incremental(tmp_path):
    d = rank_dir(tmp_path, 0)
    w = LogWriter(d, rank=0, run_id="idle", flush_interval=0.01)
    ids = w.intern(["x"])
    _steps(w, 0, range(2), ids, pause=0)
    t0 = time.monotonic()
    got = list(follow(str(tmp_path), poll_interval=0.01, idle_timeout=0.2))
    assert time.monotonic() - t0 < 10
    assert [e.step for e in got if isinstance(e, StepBegan)] == [0, 1]
    f = RunFollower(d)
    first = f.poll()
    assert any(isinstance(e, NamesInterned) for e in first)
    assert f.poll() == []
    _steps(w, 0, [2], ids, pause=0)
    assert [type(e).__name__ for e in f.poll()] == ["StepBegan", "TensorStatsRecorded"]
    w.close()
    assert [type(e).__name__ for e in f.poll()] == ["FileClosed"] and f.closed


def test_follow_ignores_other_launches(tmp_path):
    old = LogWriter(rank_dir(tmp_path, 0, "Nov30_09-00-00"), rank=0, run_id="old", flush_interval=0.01)
    old.close()
    new = LogWriter(rank_dir(tmp_path, 0, "Nov30_10-00-00"), rank=0, run_id="new", flush_interval=0.01)
    f = RunFollower(str(tmp_path))
    evs = f.poll()
    assert f.run_id == "new" and {e.rank for e in evs} == {0}
    other = LogWriter(rank_dir(tmp_path, 1, "Nov30_10-00-01"), rank=1, run_id="old", flush_interval=0.01)
    other.close()
    new.close()
    later = f.poll()
    assert [type(e).__name__ for e in later] == ["FileClosed"]
    assert len(f.readers) == 1


def test_a_file_created_in_the_same_mtime_tick_as_the_last_listing_is_found(tmp_path):
    """A directory's mtime is as coarse as the kernel's clock tick: a log created right after the
    follower listed the directory may leave its mtime as it was (made so here with os.utime). The
    follower lists a recently changed directory again instead of trusting the unchanged mtime."""
    import os

    out = tmp_path / "monitor_output"
    d = rank_dir(str(out), 0)
    os.makedirs(d)
    w0 = LogWriter(rank_dir(str(out), 1), rank=1, world_size=2, run_id="tick", flush_interval=0.01)
    w0.close()
    f = RunFollower(str(out))
    f.poll()
    before = os.stat(d)
    w = LogWriter(d, rank=0, world_size=2, run_id="tick", flush_interval=0.01)
    w.close()
    os.utime(d, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same tick: mtime unchanged
    f.poll()
    assert f.ranks == [0, 1] and f.closed


def test_until_closed_ends_on_a_resumed_rank_whose_crashed_file_never_closed(tmp_path):
    """A rank's first file was cut off by kill -9 (never closed); the resumed launch's file after it
    closes cleanly: the run is closed (it waited for the crashed file's close, i.e. forever, which kept
    the live CSV export of every resumed run alive until close() killed it 30 s later)."""
    out = str(tmp_path / "out")
    d = rank_dir(out, 0)
    w = LogWriter(d, rank=0, world_size=1, run_id="crashed-1", flush_interval=0.01)
    ids = w.intern(["a"])
    _steps(w, 0, range(0, 3), ids, pause=0)
    w.flush(timeout=10)
    with open(w.path, "rb") as f:
        cut = f.read()  # what a kill -9 leaves: everything flushed, no FileClosed
    w.close()
    with open(w.path, "wb") as f:
        f.write(cut)
    w2 = LogWriter(d, rank=0, world_size=1, run_id="crashed-1", flush_interval=0.01)
    w2.write(RunResumed(rank=0, step=3, last_step=2))
    _steps(w2, 0, range(3, 5), w2.intern(["a"]), pause=0)
    w2.close()
    t0 = time.monotonic()
    got = list(follow(out, poll_interval=0.01, until_closed=True, idle_timeout=20))
    assert time.monotonic() - t0 < 10
    assert sorted({e.step for e in got if isinstance(e, StepBegan)}) == [0, 1, 2, 3, 4]
    assert sum(isinstance(e, FileClosed) for e in got) == 1


def test_a_directory_a_live_export_writes_into_is_not_listed_at_every_poll(tmp_path, monkeypatch):
    """The live CSV export writes its files into the rank directory it follows, which changes the
    directory's mtime at every step: each poll listed it (70 ms at 100k files). Between full listings
    (at most every few seconds) the next log file, a resume's, is found by its name."""
    import importlib
    import os

    follow_mod = importlib.import_module("trainrec.replay.follow")  # the package exports a function of that name

    rdir = rank_dir(tmp_path, 0)
    with LogWriter(rdir, rank=0, run_id="r", flush_interval=0.01) as w:
        w.write(StepBegan(rank=0, step=0, wall=1.0))
    listed = []
    real = follow_mod.layout.list_logs
    monkeypatch.setattr(follow_mod.layout, "list_logs", lambda d: listed.append(d) or real(d))
    f = RunFollower(rdir)
    f.poll()
    n0 = len(listed)
    for i in range(20):
        with open(os.path.join(rdir, f"param_{i}-{i}.csv"), "w"):
            pass
        f.poll()
    assert len(listed) - n0 <= 1
    with LogWriter(rdir, rank=0, run_id="r", flush_interval=0.01) as w:  # a resume: trainrec-00001.trl
        w.write(RunResumed(rank=0, step=1, wall=2.0, last_step=0))
    got = []
    for _ in range(50):
        got += f.poll()
        if any(isinstance(e, RunResumed) for e in got):
            break
        time.sleep(0.01)
    assert any(isinstance(e, RunResumed) for e in got)
    assert len(listed) - n0 <= 1


def test_stop_discovering_keeps_the_files_followed_that_keep_accepts(tmp_path):
    """A live export whose training process is gone follows only that process's files: files made
    since are not taken up, and a file of another writer followed already is dropped."""
    d = rank_dir(tmp_path, 0)
    w0 = LogWriter(d, rank=0, run_id="r", flush_interval=0.01)
    w0.write(StepBegan(rank=0, step=0, wall=1.0))
    w0.flush()
    f = RunFollower(d)
    assert any(isinstance(e, StepBegan) for e in f.poll())
    w1 = LogWriter(d, rank=0, run_id="r", flush_interval=0.01)  # another file, another "process"
    w1.write(StepBegan(rank=0, step=1, wall=2.0))
    w1.flush()
    f.poll()
    assert len(f.readers) == 2
    first = min(f.readers)
    f.stop_discovering(lambda h: h is not None and h.file_index == 0)
    assert list(f.readers) == [first]
    w2 = LogWriter(d, rank=0, run_id="r", flush_interval=0.01)  # made after: never taken up
    w2.write(StepBegan(rank=0, step=2, wall=3.0))
    w1.write(StepBegan(rank=0, step=3, wall=3.0))
    w0.write(StepBegan(rank=0, step=4, wall=3.0))
    for w in (w0, w1, w2):
        w.close()
    steps = [e.step for e in f.poll() if isinstance(e, StepBegan)]
    assert steps == [4] and list(f.readers) == [first]


def _big_log(d: str, steps: int, names: int) -> LogWriter:
    w = LogWriter(d, rank=0, run_id="big", flush_interval=0.01)
    ids = w.intern([f"layers.{i}.weight" for i in range(names)])
    _steps(w, 0, range(steps), ids, pause=0)
    return w


def _polls(f: RunFollower, max_bytes: int) -> list[list]:
    """Every poll's events until the first empty one (which means every file was read to its end)."""
    polls = []
    while events := f.poll(max_bytes=max_bytes):
        polls.append(events)
    return polls


def test_poll_with_a_byte_budget_takes_a_backlog_in_pieces_and_loses_nothing(tmp_path):
    """A follower that starts on a long log (a resumed launch's export reading the earlier launch's) reads
    it POLL_BYTES at a time: bounded memory per poll, the same events in the same order, and an empty
    poll still means every file was read to its end."""
    d = rank_dir(tmp_path, 0)
    w = _big_log(d, steps=40, names=2000)  # ~40 x 49 KB of stats records
    w.close()
    _, whole = read_log(w.path)
    f = RunFollower(d)
    polls = _polls(f, 200_000)
    assert len(polls) >= 8  # in pieces...
    assert [ev for p in polls for ev in p] == whole  # ...of the same events, in order
    assert f.closed and f.poll(max_bytes=200_000) == []


def test_a_frame_longer_than_the_budget_is_read_whole_in_the_same_poll(tmp_path):
    d = rank_dir(tmp_path, 0)
    w = _big_log(d, steps=3, names=20000)  # each stats record ~490 KB, more than the budget below
    _, whole = read_log(w.path)
    # empty only once the file is read to its end, even where no frame fits the budget
    got = [ev for p in _polls(RunFollower(d), 65536) for ev in p]
    assert got == whole
    w.close()


def test_from_start_false_skips_a_backlog_longer_than_the_budget(tmp_path):
    d = rank_dir(tmp_path, 0)
    w = _big_log(d, steps=20, names=2000)
    f = RunFollower(d, from_start=False)
    first = f.poll(max_bytes=100_000)  # the content there now: skipped whole, but what names need
    assert [type(e).__name__ for e in first] == ["FileOpened", "NamesInterned"]
    _steps(w, 0, [20], w.intern([f"layers.{i}.weight" for i in range(2000)]), pause=0)
    later = [ev for p in _polls(f, 100_000) for ev in p]
    assert [(type(e).__name__, e.step) for e in later] == [("StepBegan", 20), ("TensorStatsRecorded", 20)]
    w.close()


def test_with_a_budget_a_ranks_later_file_comes_after_its_earlier_one(tmp_path):
    """A resumed rank's second file is read only once its first is read to its end: replay takes a rank's
    events in the order they were written, whatever the budget."""
    d = rank_dir(tmp_path, 0)
    _big_log(d, steps=20, names=2000).close()
    w2 = LogWriter(d, rank=0, run_id="big", flush_interval=0.01)
    w2.write(RunResumed(rank=0, step=15, last_step=14))
    _steps(w2, 0, range(15, 18), w2.intern([f"layers.{i}.weight" for i in range(2000)]), pause=0)
    w2.close()
    got = [ev for p in _polls(RunFollower(d), 100_000) for ev in p]
    assert got == [ev for p in open_run(str(tmp_path)).files(0) for ev in read_log(p)[1]]
    assert [e.step for e in got if isinstance(e, StepBegan)] == [*range(20), 15, 16, 17]


def test_until_closed_ends_when_the_writer_is_killed(tmp_path):
    """A training process killed with kill -9 mid-run leaves its log unclosed: follow(until_closed=True)
    with no idle timeout waited forever. It now ends once the writer (this host's, by its FileOpened's
    pid) is gone, after yielding everything it wrote."""
    import os
    import signal
    import subprocess
    import sys

    out = str(tmp_path / "out")
    script = f"""
import sys, time
sys.path.insert(0, {os.path.dirname(__file__)!r})
from logbuild import rank_dir, stats
from trainrec.recorder.writer import LogWriter
from trainrec.schema.events import StepBegan
w = LogWriter(rank_dir({out!r}, 0), rank=0, world_size=1, run_id="killed", flush_interval=0.01)
ids = w.intern(["a"])
for s in range(1000):
    w.write(StepBegan(rank=0, step=s))
    w.write(stats(0, s, ids))
    w.flush(timeout=10)
    if s == 3:
        print("ready", flush=True)
    time.sleep(0.02)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        got: list = []
        done = threading.Event()

        def tail():
            got.extend(follow(out, poll_interval=0.05, until_closed=True))
            done.set()

        threading.Thread(target=tail, daemon=True).start()
        time.sleep(0.5)
        assert not done.is_set()  # the writer is alive: following goes on
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert done.wait(timeout=10), "follow() did not end after its writer was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    written = list(open_run(out).events())
    assert [type(e) for e in got] == [type(e) for e in written] and len(got) > 8
    assert not any(isinstance(e, FileClosed) for e in got)


def test_a_resumed_file_seen_before_its_resume_record_is_still_followed(tmp_path):
    """A resumed launch's writer puts its header on disk before its RunResumed: a poll in between must
    not take the file for another launch of the same run id."""
    d = rank_dir(tmp_path, 0)
    w0 = LogWriter(d, rank=0, run_id="r", flush_interval=0.01)
    ids = w0.intern(["x"])
    _steps(w0, 0, range(2), ids, pause=0)
    w0.close()
    f = RunFollower(str(tmp_path))
    f.poll()
    w1 = LogWriter(d, rank=0, run_id="r", flush_interval=0.01)
    w1.flush(timeout=10)
    assert f.poll() == [] and len(f.readers) == 1  # only its header so far: undecided
    w1.write(RunResumed(rank=0, step=1, last_step=1))
    _steps(w1, 0, range(1, 3), w1.intern(["x"]), pause=0)
    w1.close()
    later = f.poll()
    assert len(f.readers) == 2 and any(isinstance(e, RunResumed) for e in later)
    assert [e.step for e in later if isinstance(e, StepBegan)] == [1, 2] and f.closed


def test_a_launch_first_seen_before_its_header_is_readable_still_gets_its_later_ranks(tmp_path):
    """At the first look rank 0's log holds no complete header yet: the follower must not settle on a
    launch without a run id, or the rank that starts later is never taken as its own."""
    d0 = rank_dir(tmp_path, 0)
    os.makedirs(d0)
    with open(os.path.join(d0, "trainrec-00000.trl"), "wb") as f:
        f.write(framing.FILE_MAGIC[:4])  # a file header being written
    f = RunFollower(str(tmp_path))
    assert f.poll() == [] and f.run_id is None
    os.remove(os.path.join(d0, "trainrec-00000.trl"))
    w0 = LogWriter(d0, rank=0, world_size=2, run_id="late", flush_interval=0.01)
    f.poll()
    w1 = LogWriter(rank_dir(tmp_path, 1), rank=1, world_size=2, run_id="late", flush_interval=0.01)
    w0.close()
    w1.close()
    f.poll()
    assert f.run_id == "late" and f.ranks == [0, 1] and f.closed
