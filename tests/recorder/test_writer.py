"""LogWriter with real files, real threads and real processes: round trips, close and flush,
interning, full-queue policies and failures (crashes: test_writer_crashes.py).

Subprocess tests run small scripts with this interpreter; each one is bounded by a timeout, and each
waits for what it needs by reading the log file (never by sleeping a fixed time).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import threading
import time

import pytest
from trainrec.recorder.writer import LogWriter
from trainrec.replay.names import NameResolver
from trainrec.replay.reader import LogReader
from trainrec.schema.errors import WriterError
from trainrec.schema.events import (
    DIR_BACKWARD,
    EVENT_TYPES,
    AnomalyDetected,
    ApiCallsRecorded,
    CollectiveCalled,
    CollectiveCompleted,
    ConfigApplied,
    ConfigChanged,
    ConfigRejected,
    Event,
    ExceptionRaised,
    FileClosed,
    FileOpened,
    HookFailed,
    HooksFired,
    ModuleStructureRecorded,
    MonitoringStopped,
    NamesInterned,
    NamesRepeated,
    RecordsDropped,
    RunResumed,
    StallDetected,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    WriterFailed,
    pack_array,
)
from writer_util import TIMEOUT, rank_dir, read, run_script, script, stall, stats_event, wait_for

# fields a sample may leave at their default: the envelope's, the only format version, name tables that
# begin at id 0, and FileClosed's step index (FileClosed is the writer's own, made at close)
_ENVELOPE = ("seq", "rank")
_DEFAULT_ONLY = {
    "FileOpened": (*_ENVELOPE, "format_version"),
    "NamesInterned": (*_ENVELOPE, "first_id"),
    "NamesRepeated": (*_ENVELOPE, "first_id"),
    "FileClosed": (*_ENVELOPE, "index_steps", "index_offsets", "index_seqs", "index_low_steps", "index_names"),
}


def every_event(rank: int = 0) -> list[Event]:
    """One instance of every event type the writer is handed, with no field left at its default."""
    env = {"rank": rank, "step": 3, "wall": 1234.5}
    return [
        NamesInterned(first_id=0, names=("layer.0", "layer.1"), **env),
        NamesRepeated(first_id=0, names=("layer.0", "layer.1"), **env),
        ModuleStructureRecorded(
            vpp_stage=1,
            names=("", "layer"),
            classes=("Net", "Linear"),
            parents=(-1, 0),
            param_counts=(12, 12),
            io_specs={"layer": ("tensor", "tuple[2]")},
            **env,
        ),
        HooksFired(
            module_ids=pack_array("I", [0, 1, 1, 0]),
            directions=bytes([0, 0, 1, 1]),
            call_ids=pack_array("I", [0, 1, 2, 3]),
            micro_steps=pack_array("H", [0, 0, 1, 1]),
            **env,
        ),
        StepBegan(**env),
        StepEnded(duration=0.25, collected=True, micro_steps=2, optimizer_skipped=True, foreign_passes=True, **env),
        dataclasses.replace(stats_event(3, [0, 1], rank), wall=1234.5, placeholders=bytes([0, 1])),
        TensorStatsRecorded(
            kind="param", ops=("norm",), dtype="d", name_ids=pack_array("I", [1]),
            values=pack_array("d", [2.5]), **env,
        ),
        AnomalyDetected(
            micro_step=1, pp_stage=2, vpp_stage=1, call_id=7, tag_name="0:layer.0/output_grad",
            op="norm", value=1e30, baseline=2.0, message="jumped", group_mates=(0, 1), rule="AnomalyTurbulence",
            kind="actv_grad", name="layer.0", slot="output_grad", **env,
        ),
        ConfigChanged(path="/cfg.json", content_hash="ab12", changed_keys=("ops", "xy_distribution"), **env),
        ConfigApplied(path="/cfg.json", content_hash="ab12", config={"ops": ("norm",), "xy": True},
                      start_step=4, reason="dynamic", **env),
        ConfigRejected(path="/cfg.json", content_hash="cd34", reason="bad key", keys=("opz",), **env),
        MonitoringStopped(reason="collect_times", collections=9, **env),
        RunResumed(previous_files=("a/trainrec-00000.trl",), last_step=2, reason="resume", **env),
        RecordsDropped(count=5, **env),
        HookFailed(where="forward hook", error="ValueError('x')", count=2, **env),
        CollectiveCalled(op="broadcast", group="3", group_ranks=(0, 2), group_seq=5, shapes=((2, 2),), dtypes=("float32",),
                         reduce_op="", codeline="t.py[4]", async_op=True, peer=2, **env),
        CollectiveCalled(op="all_gather", group="3", group_ranks=(0, 2), group_seq=4, shapes=((2, 2), (2, 2), (2, 2)),
                         dtypes=("float16",) * 3, reduce_op="sum", codeline="t.py[3]", ops=("norm",),
                         pre_values=pack_array("f", [1.0, 2.0, 3.0]), **env),
        CollectiveCompleted(op="all_gather", group="3", group_seq=4, duration=0.5, ops=("norm",),
                            values=pack_array("f", [1.0, 2.0, 3.0]), **env),
        StallDetected(elapsed=9.0, median_step=1.0, threshold=5.0, count=2, stacks="Thread 0x1:\n", modules=("m",),
                      hook_module="m", hook_direction=1, hook_micro_step=2, hook_call_id=3, collective_op="barrier",
                      collective_group_ranks=(0, 1), collective_seq=7, collective_elapsed=8.5, **env),
        ExceptionRaised(error="KeyError: 'x'", modules=("m",), traceback="Traceback...", **env),
        ApiCallsRecorded(micro_step=1, ops=("norm",), dtype="f", name_ids=pack_array("I", [1]),
                         module_ids=pack_array("I", [0]), positions=pack_array("I", [0]),
                         port_counts=pack_array("H", [2]), port_ids=pack_array("I", [2, 3]),
                         type_ids=pack_array("I", [4, 4]), dtype_ids=pack_array("I", [5, 5]), ndims=bytes([1, 1]),
                         dims=pack_array("q", [3, 3]), requires_grad=bytes([0, 1]),
                         values=pack_array("f", [1.0, 2.0]), stack_depths=pack_array("H", [1]),
                         stack_frames=pack_array("I", [6]), vpp_stage=1,
                         module_calls=pack_array("I", [0]), module_positions=pack_array("I", [1]),
                         module_dtype_ids=pack_array("I", [5, 5]), module_ndims=bytes([2, 255]),
                         module_dims=pack_array("q", [4, 3]), **env),
        ApiCallsRecorded(micro_step=1, ops=("norm",), dtype="d", name_ids=pack_array("I", [1]),
                         module_ids=pack_array("I", [0]), positions=pack_array("I", [3]),
                         port_counts=pack_array("H", [1]), port_ids=pack_array("I", [2]), type_ids=pack_array("I", [4]),
                         dtype_ids=pack_array("I", [5]), ndims=bytes([1]), dims=pack_array("q", [3]),
                         requires_grad=bytes([0]), values=pack_array("d", [0.5]), direction=DIR_BACKWARD, **env),
        WriterFailed(error="OSError(28, 'No space left on device')", first_lost_seq=3, discarded=7, last_step=2, **env),
        FileOpened(run_id="r", world_size=2, host="h", pid=9, start_time=1.5, trainrec_version="9",
                   torch_version="8", format_version=1, file_index=3, dir_name="d", pp_stage=1,
                   group_mates=(0, 1), writer_id="w-1", proc_start=42, boot_id="boot-1", **env),
        FileClosed(records=4, dropped=1, reason="test", **env),
    ]


# ---------------------------------------------------------------------------------------------- round trips
def test_every_event_type_round_trips_through_writer_and_reader(tmp_path):
    written = every_event()
    assert {type(e) for e in written} == set(EVENT_TYPES), "a new event type needs a sample here"
    for etype in EVENT_TYPES:  # a new field needs a sample value here too
        samples = [e for e in written if type(e) is etype]
        for f in dataclasses.fields(etype):
            if f.name not in _DEFAULT_ONLY.get(etype.__name__, _ENVELOPE) and f.default is not dataclasses.MISSING:
                assert any(getattr(e, f.name) != f.default for e in samples), f"{etype.__name__}.{f.name}"
    # (FileClosed ends a file: the reader ignores what follows one; the writer's own close makes it)
    written = [e for e in written if not isinstance(e, FileClosed)]
    with LogWriter(rank_dir(tmp_path), rank=0, world_size=2, run_id="rt") as w:
        for ev in written:
            w.write(ev)
    reader, events = read(w.path)
    assert reader.problems == [] and reader.pending_bytes == 0
    assert events[0] == w.header and isinstance(events[0], FileOpened)
    assert [e.seq for e in events] == list(range(len(events)))
    body = events[1:-1]
    assert body == [dataclasses.replace(ev, seq=i + 1) for i, ev in enumerate(written)]
    closed = events[-1]
    assert isinstance(closed, FileClosed) and closed.reason == "close" and reader.closed_event == closed
    assert closed.records == closed.seq == len(written) + 1 and closed.dropped == 0


def test_header_describes_the_writer(tmp_path):
    rdir = rank_dir(tmp_path, 3)
    with LogWriter(rdir, rank=3, world_size=8, run_id="run-x", pp_stage=1, group_mates=(2, 3)) as w:
        h = w.header
    assert (h.rank, h.world_size, h.run_id, h.pp_stage, h.group_mates) == (3, 8, "run-x", 1, (2, 3))
    assert h.pid == os.getpid() and h.file_index == 0 and h.dir_name == os.path.basename(rdir)
    assert h.format_version == 1 and h.trainrec_version and h.host
    assert os.path.basename(w.path) == "trainrec-00000.trl"
    reader, _ = read(w.path)
    assert reader.header == h


def test_deferred_callables_run_on_the_worker_and_failures_are_recorded_not_fatal(tmp_path):
    threads = []

    def deferred():
        threads.append(threading.current_thread())
        return [StepBegan(rank=0, step=1), StepEnded(rank=0, step=1, duration=0.5)]

    def broken():
        raise ValueError("stats went wrong")

    with LogWriter(rank_dir(tmp_path)) as w:
        w.write(deferred)
        w.write(broken)
        w.write(StepBegan(rank=0, step=2, wall=object()))  # cannot be encoded
        w.write(lambda: [StepBegan(rank=0, step=3)])
        w.flush()
        assert w.error is None
    assert threads == [w._thread]
    reader, events = read(w.path)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["FileOpened", "StepBegan", "StepEnded", "HookFailed", "HookFailed", "StepBegan", "FileClosed"]
    assert "stats went wrong" in events[3].error and "broken" in events[3].where
    assert "StepBegan" in events[4].where
    assert [e.seq for e in events] == list(range(len(events))) and reader.problems == []


# ---------------------------------------------------------------------------------------------- close / flush
def test_close_is_idempotent_and_later_calls_behave(tmp_path):
    w = LogWriter(rank_dir(tmp_path))
    w.write(StepBegan(rank=0, step=0))
    w.close()
    w.close()
    w.close(reason="again")
    w.flush()  # nothing left to flush: a no-op
    assert w.closed
    with pytest.raises(WriterError, match="closed"):
        w.write(StepBegan(rank=0, step=1))
    _, events = read(w.path)
    assert [type(e) for e in events] == [FileOpened, StepBegan, FileClosed]


def test_flush_makes_everything_visible_and_interval_flushes_without_asking(tmp_path):
    assert inspect.signature(LogWriter).parameters["flush_interval"].default == 0.2
    w = LogWriter(rank_dir(tmp_path), flush_interval=0.05)
    try:
        for s in range(50):
            w.write(stats_event(s, [0, 1, 2]))
        w.flush()
        reader = LogReader(w.path)
        assert len(reader.poll()) == 51 and reader.pending_bytes == 0
        w.write(StepEnded(rank=0, step=50))  # no flush(): the interval must bring it out
        got = wait_for(lambda: reader.poll(), "the periodic flush")
        assert [type(e) for e in got] == [StepEnded]
    finally:
        w.close()


def test_the_worker_takes_an_interval_of_items_in_one_go_and_wakes_early_when_asked(tmp_path):
    """The worker waits out flush_interval after the first item and then encodes everything queued in
    one go (one wake-up per interval, not one per item); a flush, a close or a half-full queue wake it
    at once, so none of them waits for a long interval."""
    ran = []

    def deferred(step):
        def build():
            ran.append(step)
            return [StepBegan(rank=0, step=step)]
        return build

    w = LogWriter(rank_dir(tmp_path), flush_interval=60.0, queue_size=8)
    try:
        t0 = time.monotonic()
        w.write(deferred(0))
        w.write(deferred(1))
        time.sleep(0.3)
        assert ran == []  # waiting out the interval: nothing encoded yet, nothing written
        reader = LogReader(w.path)
        assert [type(e) for e in reader.poll()] == [FileOpened]
        w.flush()  # wakes the worker: both items, in order
        assert ran == [0, 1]
        assert [e.step for e in reader.poll()] == [0, 1]
        for s in range(2, 7):  # the queue reaches half its size: the worker takes it without a flush
            w.write(deferred(s))
        wait_for(lambda: len(ran) >= 6, "the worker to wake at a half-full queue", timeout=20)
        w.write(deferred(7))
    finally:
        w.close()  # wakes it too: the close does not wait out the 60 s
    assert time.monotonic() - t0 < 30
    _, events = read(w.path)
    assert [e.step for e in events if isinstance(e, StepBegan)] == list(range(8))


def test_a_drain_that_items_keep_feeding_still_writes_out_every_interval(tmp_path):
    """Items arriving as fast as the worker takes them keep it in one drain: what it has encoded still
    reaches the OS every flush_interval, not only when the queue is found empty."""
    w = LogWriter(rank_dir(tmp_path), flush_interval=0.05)
    ran = []

    def link(step):  # each item hands over the next one while the worker is busy with it
        def build():
            ran.append(step)
            time.sleep(0.01)
            if step < 149:
                w.write(link(step + 1))
            return [StepBegan(rank=0, step=step)]
        return build

    try:
        reader = LogReader(w.path)
        reader.poll()
        w.write(link(0))
        got = wait_for(lambda: [e for e in reader.poll() if isinstance(e, StepBegan)], "a write-out mid-drain")
        assert len(ran) < 149  # written while the chain still ran
        assert got[0].step == 0
        wait_for(lambda: len(ran) == 150, "the chain to end")
    finally:
        w.close()
    _, events = read(w.path)
    assert [e.step for e in events if isinstance(e, StepBegan)] == list(range(150))


def test_second_writer_in_a_rank_dir_gets_the_next_file_and_fresh_ids(tmp_path):
    rdir = rank_dir(tmp_path)
    with LogWriter(rdir) as a:
        assert a.intern(["x", "y"]) == [0, 1]
    with LogWriter(rdir) as b:
        assert b.intern(["y"]) == [0]
    assert os.path.basename(b.path) == "trainrec-00001.trl" and b.header.file_index == 1


# ---------------------------------------------------------------------------------------------- intern
def test_intern_ids_are_stable_dense_and_announced_once(tmp_path):
    with LogWriter(rank_dir(tmp_path)) as w:
        assert w.intern(["a", "b", "a"], step=0) == [0, 1, 0]
        assert w.intern(("b", "a")) == [1, 0]
        assert w.intern(iter(["c", "a", "d", "c"]), step=2) == [2, 0, 3, 2]
        assert w.intern([]) == []
    _, events = read(w.path)
    interned = [e for e in events if isinstance(e, NamesInterned)]
    assert [(e.first_id, e.names, e.step) for e in interned] == [(0, ("a", "b"), 0), (2, ("c", "d"), 2)]


def test_concurrent_interning_never_uses_an_id_before_it_is_announced(tmp_path):
    """Several threads intern overlapping names and write stats with the ids: every id resolves."""
    w = LogWriter(rank_dir(tmp_path), queue_size=64)
    errors = []

    def producer(k: int) -> None:
        try:
            for step in range(40):
                names = [f"m{(k * 7 + step + j) % 90}" for j in range(5)]
                w.write(stats_event(step, w.intern(names, step)))
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    w.close()
    assert errors == []
    _, events = read(w.path)
    resolver = NameResolver()
    rows = 0
    for ev in events:
        resolver.feed(ev)
        if isinstance(ev, TensorStatsRecorded):
            names = resolver.names(ev)
            assert all(n.startswith("m") for n in names), names
            rows += len(names)
    assert rows == 4 * 40 * 5
    expected = {f"m{(k * 7 + step + j) % 90}" for k in range(4) for step in range(40) for j in range(5)}
    assert sorted(resolver.table(0)) == sorted(expected)  # each name interned exactly once


# ---------------------------------------------------------------------------------------------- full queue
def test_full_queue_with_drop_policy_records_how_many_were_dropped(tmp_path):
    w = LogWriter(rank_dir(tmp_path), queue_size=8, on_full="drop")
    release = stall(w)
    for s in range(8):
        w.write(StepBegan(rank=0, step=s))  # fills the queue
    for s in range(8, 13):
        w.write(StepBegan(rank=0, step=s))  # dropped, training goes on
    ids = w.intern(["never-dropped"], step=13)  # name tables bypass the bound
    assert w.dropped == 5
    release.set()
    w.flush()
    w.write(StepBegan(rank=0, step=20))
    w.close()
    reader, events = read(w.path)
    steps = [e.step for e in events if isinstance(e, StepBegan)]
    assert steps == [*range(8), 20]
    dropped = [e for e in events if isinstance(e, RecordsDropped)]
    assert [d.count for d in dropped] == [5]
    assert any(isinstance(e, NamesInterned) and e.names == ("never-dropped",) for e in events) and ids == [0]
    assert reader.closed_event.dropped == 5 and reader.problems == []
    assert [e.seq for e in events] == list(range(len(events)))


def test_full_queue_with_block_policy_waits_and_loses_nothing(tmp_path):
    w = LogWriter(rank_dir(tmp_path), queue_size=4)
    release = stall(w)
    done = threading.Event()

    def producer():
        for s in range(200):
            w.write(StepBegan(rank=0, step=s))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    wait_for(lambda: w._queue.qsize() >= 4, "the queue to fill")
    assert not done.is_set()  # the producer waits for room (it cannot have written 200 into 4 slots)
    release.set()
    t.join(TIMEOUT)
    assert done.is_set()
    w.close()
    reader, events = read(w.path)
    assert [e.step for e in events if isinstance(e, StepBegan)] == list(range(200))
    assert reader.closed_event.dropped == 0 and not any(isinstance(e, RecordsDropped) for e in events)


# ---------------------------------------------------------------------------------------------- failures
def test_log_file_removed_is_reported_on_the_next_call_and_never_blocks(tmp_path):
    w = LogWriter(rank_dir(tmp_path), queue_size=4)
    w.write(StepBegan(rank=0, step=0))
    w.flush()
    os.remove(w.path)
    w.write(StepBegan(rank=0, step=1))
    with pytest.raises(WriterError, match="removed"):
        w.flush()
    assert w.error is not None
    start = time.monotonic()
    raised = 0
    for s in range(1000):  # a training loop that catches the error goes on at full speed
        try:
            w.write(StepBegan(rank=0, step=s))
        except WriterError:
            raised += 1
    assert raised == 1000 and time.monotonic() - start < TIMEOUT
    with pytest.raises(WriterError, match="removed"):
        w.close()
    w.close()  # the second close is quiet


def test_log_file_replaced_is_reported(tmp_path):
    w = LogWriter(rank_dir(tmp_path))
    w.write(StepBegan(rank=0, step=0))
    w.flush()
    other = str(tmp_path / "other")
    with open(other, "wb") as f:
        f.write(b"someone else's file")
    os.replace(other, w.path)
    w.write(StepBegan(rank=0, step=1))
    with pytest.raises(WriterError, match="replaced"):
        w.flush()
    with pytest.raises(WriterError):
        w.intern(["new name"])
    with pytest.raises(WriterError):
        w.close()
    with open(w.path, "rb") as f:
        assert f.read() == b"someone else's file"  # we never wrote into the replacement


_EFBIG = """
import json, resource, signal, sys, time
from trainrec.recorder.writer import LogWriter
from trainrec.schema.errors import WriterError
from trainrec.schema.events import StepBegan, TensorStatsRecorded, OPS, pack_array
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
limit = 64 * 1024
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
w = LogWriter(sys.argv[1], rank=0, queue_size=4, flush_interval=0.01)
ids = w.intern([f"n{i}" for i in range(50)])
first_error = None
steps_after = 0
t0 = time.monotonic()
for step in range(2000):
    total = sum(i * i for i in range(200))  # the training keeps computing
    try:
        w.write(TensorStatsRecorded(rank=0, step=step, kind="param", ops=OPS, name_ids=pack_array("I", ids),
                                    values=pack_array("f", [float(step)] * 300)))
        if step % 10 == 9:
            w.flush()
    except WriterError as exc:
        if first_error is None:
            first_error = (step, str(exc))
        else:
            steps_after += 1
try:
    w.close()
except WriterError:
    pass
print(json.dumps({"first_error": first_error, "steps_after": steps_after, "seconds": time.monotonic() - t0,
                  "path": w.path, "limit": limit, "total": total}))
"""


def test_disk_full_like_failure_efbig_is_reported_and_training_goes_on(tmp_path):
    proc = run_script(script(_EFBIG), rank_dir(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    step, message = out["first_error"]
    assert "File too large" in message or "EFBIG" in message or "Errno 27" in message, message
    assert out["steps_after"] == 2000 - step - 1  # every later step ran (and was told, cheaply)
    size = os.path.getsize(out["path"])
    assert size <= out["limit"]
    reader, events = read(out["path"])
    # What reached the disk reads back cleanly: whole frames, at most one torn frame at the end.
    assert reader.problems == [] and reader.gaps == []
    assert [e.seq for e in events] == list(range(len(events)))
    assert reader.pending_bytes < 16 + 3000
    stats = [e for e in events if isinstance(e, TensorStatsRecorded)]
    assert stats and [e.step for e in stats] == list(range(len(stats)))
    assert stats[-1].step < step  # nothing after the reported failure claims to be on disk
