"""LogWriter against crashes: SIGKILL after flushes and between them, SIGTERM with and without the
program's own handler, and interpreter exit without close(). Each child is a small script run with
this interpreter, bounded by a timeout; the tests wait by reading the log, never by sleeping."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from trainrec.recorder.writer import LogWriter
from trainrec.replay.reader import LogReader, read_log
from trainrec.schema.errors import WriterError
from trainrec.schema.events import (
    Event,
    FileClosed,
    FileOpened,
    NamesInterned,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
)
from writer_util import TIMEOUT, rank_dir, read, run_script, script, spawn, stall, stats_event, wait_for

# ---------------------------------------------------------------------------------------------- crashes
_KILLED = """
import sys
from trainrec.recorder.writer import LogWriter
from trainrec.schema.events import StepBegan, StepEnded, TensorStatsRecorded, OPS, pack_array
mode = sys.argv[2]
w = LogWriter(sys.argv[1], rank=0, flush_interval=0.05 if mode == "interval" else 3600.0)
ids = w.intern([f"layer.{i}" for i in range(20)])
step = 0
while True:
    w.write(StepBegan(rank=0, step=step))
    w.write(TensorStatsRecorded(rank=0, step=step, kind="actv", ops=OPS, name_ids=pack_array("I", ids),
                                values=pack_array("f", [step + i for i in range(120)])))
    w.write(StepEnded(rank=0, step=step, duration=0.001))
    if mode == "flush":
        w.flush()  # everything up to this step's end is on the OS now
    step += 1
    if mode == "interval" and step == 30:
        import time
        while True:  # stop producing: only the periodic flush can bring the steps out
            time.sleep(1)
"""


def _steps_complete(events) -> list[int]:
    return [e.step for e in events if isinstance(e, StepEnded)]


def _check_prefix(events, last_step_seen: int) -> None:
    assert [e.seq for e in events] == list(range(len(events)))
    assert isinstance(events[0], FileOpened) and isinstance(events[1], NamesInterned)
    for ev in events:
        if isinstance(ev, TensorStatsRecorded):
            assert list(ev.value_array()) == [ev.step + i for i in range(120)]
    ended = _steps_complete(events)
    assert ended == list(range(len(ended))) and ended[-1] >= last_step_seen


def _log_appearing(rdir: str) -> str:
    """The path of the first log file the child creates in ``rdir``, once it is there."""
    name = wait_for(lambda: next(iter(os.listdir(rdir)), None) if os.path.isdir(rdir) else None, "the log")
    return os.path.join(rdir, name)


def _killed_once(tmp_path, mode: str, enough, what: str) -> tuple[str, list, subprocess.Popen]:
    """Run the child in ``mode``, follow its log until ``enough(ended steps)``, then SIGKILL it; returns
    the log's path, the events read before the kill and the child."""
    rdir = rank_dir(tmp_path)
    proc = spawn(script(_KILLED), rdir, mode)
    try:
        path = _log_appearing(rdir)
        reader = LogReader(path)
        seen: list[Event] = []

        def ready():
            seen.extend(reader.poll())
            return enough(_steps_complete(seen))

        wait_for(ready, what)
        proc.send_signal(signal.SIGKILL)
        proc.wait(TIMEOUT)
    finally:
        proc.kill()
        proc.communicate(timeout=TIMEOUT)
    return path, seen, proc


def test_sigkill_after_flushes_loses_nothing_that_was_flushed(tmp_path):
    path, seen, proc = _killed_once(tmp_path, "flush", lambda ended: ended and ended[-1] >= 40,
                                    "step 40 to be flushed")
    last_seen = _steps_complete(seen)[-1]
    assert proc.returncode == -signal.SIGKILL
    after, events = read(path)
    _check_prefix(events, last_seen)
    assert events[: len(seen)] == seen
    assert after.problems == [] and after.gaps == [] and not after.closed_cleanly
    assert after.pending_bytes < 16 + 600  # at most one torn frame (a stats frame is ~560 bytes)


def test_sigkill_loses_nothing_older_than_the_flush_interval(tmp_path):
    path, _, _ = _killed_once(tmp_path, "interval", lambda ended: len(ended) == 30,
                              "the periodic flush of 30 steps (no flush() called)")
    after, events = read(path)
    _check_prefix(events, 29)
    assert after.problems == [] and after.pending_bytes == 0 and not after.closed_cleanly


_TERMINATED = """
import signal, sys
from trainrec.recorder.writer import LogWriter
from trainrec.recorder.writer_exit import install_sigterm_handler
from trainrec.schema.events import StepBegan
mode = sys.argv[2]
if mode == "chained":
    def mine(signum, frame):
        print("previous handler ran", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, mine)
assert install_sigterm_handler() and install_sigterm_handler()
w = LogWriter(sys.argv[1], rank=0, flush_interval=3600.0, queue_size=16)
step = 0
while True:  # busy in write(): SIGTERM lands anywhere inside it, full queue waits included
    w.write(StepBegan(rank=0, step=step))
    if step == 100:
        w.flush()
        print("ready", flush=True)
    step += 1
"""


@pytest.mark.parametrize("mode", ["default", "chained"])
def test_sigterm_closes_the_log_cleanly_and_keeps_the_previous_disposition(tmp_path, mode):
    rdir = rank_dir(tmp_path)
    proc = spawn(script(_TERMINATED), rdir, mode)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    if mode == "default":
        assert proc.returncode == -signal.SIGTERM, err
    else:
        assert proc.returncode == 3 and "previous handler ran" in out, err
    (name,) = os.listdir(rdir)
    reader, events = read(os.path.join(rdir, name))
    assert reader.problems == [] and reader.pending_bytes == 0
    assert reader.closed_cleanly and reader.closed_event.reason == "sigterm"
    steps = [e.step for e in events if isinstance(e, StepBegan)]
    assert steps == list(range(len(steps))) and len(steps) > 100
    assert [e.seq for e in events] == list(range(len(events)))
    assert reader.closed_event.records == len(events) - 1


_GRACEFUL = """
import signal, sys
from trainrec.recorder.writer import LogWriter
from trainrec.recorder.writer_exit import install_sigterm_handler
from trainrec.schema.events import StepBegan
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # a preemption handler: finish up
assert install_sigterm_handler()
w = LogWriter(sys.argv[1], rank=0, flush_interval=3600.0, queue_size=16)
step = 0
while not stop:
    w.write(StepBegan(rank=0, step=step))
    if step == 100:
        w.flush()
        print("ready", flush=True)
    step += 1
for _ in range(50):  # the steps after the signal: the run saves its checkpoint and ends on its own
    w.write(StepBegan(rank=0, step=step))
    step += 1
print(step, flush=True)
w.close()
"""


def test_sigterm_with_a_handler_that_lets_training_finish_keeps_recording(tmp_path):
    """A preemption handler installed before the recorder's sets a flag and returns: the process goes
    on, and so does the log (it was closed at the signal, and the steps after it were lost)."""
    rdir = rank_dir(tmp_path)
    proc = spawn(script(_GRACEFUL), rdir)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    (name,) = os.listdir(rdir)
    reader, events = read(os.path.join(rdir, name))
    assert reader.problems == [] and reader.closed_cleanly and reader.closed_event.reason == "close"
    assert [e.step for e in events if isinstance(e, StepBegan)] == list(range(int(out.split()[-1])))


_EXITING = """
import os, sys
from trainrec.recorder.writer import LogWriter
from trainrec.schema.errors import WriterError
from trainrec.schema.events import StepBegan
w = LogWriter(sys.argv[1], rank=0, flush_interval=3600.0)
for s in range(10):
    w.write(StepBegan(rank=0, step=s))
w.flush()
pid = os.fork()
if pid == 0:  # a forked child (e.g. a data loader worker) must never touch the parent's log
    try:
        w.write(StepBegan(rank=0, step=99))
        code = 1
    except WriterError:
        code = 0
    w.close()
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
for s in range(10, 20):
    w.write(StepBegan(rank=0, step=s))
# no close(): interpreter exit closes the log
"""


def test_interpreter_exit_closes_the_log_and_a_forked_child_cannot_write_into_it(tmp_path):
    rdir = rank_dir(tmp_path)
    proc = run_script(script(_EXITING), rdir)
    assert proc.returncode == 0, proc.stderr
    (name,) = os.listdir(rdir)
    reader, events = read(os.path.join(rdir, name))
    assert reader.problems == [] and reader.pending_bytes == 0
    assert [e.step for e in events if isinstance(e, StepBegan)] == list(range(20))
    assert reader.closed_event.reason == "exit"
    assert sum(isinstance(e, FileClosed) for e in events) == 1


def test_constructor_rejects_bad_arguments_and_unwritable_places(tmp_path):
    with pytest.raises(ValueError, match="on_full"):
        LogWriter(rank_dir(tmp_path), on_full="spill")
    with pytest.raises(ValueError, match="flush_interval"):
        LogWriter(rank_dir(tmp_path), flush_interval=0)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(WriterError, match="a-file"):
        LogWriter(str(blocker / "rank0"))


def test_fsync_mode_writes_the_same_log(tmp_path):
    with LogWriter(rank_dir(tmp_path), fsync=True) as w:
        ids = w.intern(["a", "b"])
        for s in range(5):
            w.write(stats_event(s, ids))
        w.flush()
    reader, events = read(w.path)
    assert reader.problems == [] and reader.closed_cleanly
    assert [e.step for e in events if isinstance(e, TensorStatsRecorded)] == list(range(5))


def test_flush_with_a_timeout_reports_a_stalled_worker(tmp_path):
    w = LogWriter(rank_dir(tmp_path))
    release = stall(w)
    try:
        with pytest.raises(WriterError, match="did not finish within"):
            w.flush(timeout=0.05)
    finally:
        release.set()
    w.flush()
    w.close()
    assert read_log(w.path)[0].closed_cleanly


def test_sigterm_handler_is_not_installed_over_an_ignored_sigterm():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from trainrec.recorder.writer_exit import install_sigterm_handler

        assert install_sigterm_handler() is False
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
