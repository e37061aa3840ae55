"""The per-rank log writer: a background thread that encodes, frames and appends events.

Modelled on TensorBoard's ``EventFileWriter``. The training thread hands over immutable events (or a
zero-argument callable that builds them later, on the worker, e.g. after a device-to-host copy has
completed) and returns at once; handing over costs a queue put (well under a microsecond). One worker
thread encodes, frames and writes: woken by the first item handed over, it lets ``flush_interval``
pass (a flush, a close or a half-full queue end the wait) and then takes everything queued in one go,
so a training step's few items cost it one wake-up, not one each.

Guarantees:

* Everything handed over is on the OS (so it survives a ``kill -9`` of the training process) at most
  ``flush_interval`` seconds later (default 0.2 s), and at once after :meth:`LogWriter.flush`, which
  waits until everything handed over before it is written. That is what a crash of the process
  needs; ``fsync=True`` adds an fsync after every write-out (close included) for a crash of the
  machine, at a cost of milliseconds each (the default, like TensorBoard's writer, leaves it to the OS).
  ``durability="step"`` (or ``TRAINREC_DURABILITY=step``) flushes at every StepEnded handed over: each
  step's records are on the OS before the next step begins (see docs/reliability.md for the cost).
* :meth:`LogWriter.close` writes a :class:`FileClosed` record, drains and closes the file. It
  is idempotent, runs at interpreter exit for every writer still open, and on SIGTERM once
  :func:`install_sigterm_handler` was called.
* A worker failure (disk full, file too large, the log file removed or replaced) is raised as
  :class:`WriterError` on the caller's next call (``write``, ``intern``, ``flush``, ``close``); the
  worker keeps draining the queue and discards what it takes, so no producer is ever left blocked.
  A deferred callable that raises, or an event that cannot be encoded, does not stop the writer: it
  is logged and recorded in the file as a :class:`HookFailed` event. A failure is logged once, and
  the writer leaves what it can of it: a :class:`WriterFailed` record in the file (at the failure,
  retried while the process runs, and at close with the final count of what was never written),
  else a sidecar ``<log>.failed.json`` beside it.
* The queue is bounded (``queue_size`` items). When it is full, ``on_full="block"`` (default, no loss)
  waits for room; ``on_full="drop"`` drops the record, and the worker writes a
  :class:`RecordsDropped` event with the count; :attr:`FileClosed.dropped` has the total. Name tables
  (:meth:`LogWriter.intern`), flushes and the closing record are never dropped.

Signal and fork safety: the queue is a C ``SimpleQueue`` (reentrant: a SIGTERM handler may close a
writer while the interrupted main thread is inside ``write``), and closing takes no lock that the
training thread might hold. In a child forked from a process with live writers the writers are
disabled (``write`` raises WriterError, ``close`` does nothing), and the file is unbuffered, so the
child can never write into the parent's log.
"""

from __future__ import annotations

import _thread
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable

from trainrec.schema import codec, framing
from trainrec.schema.errors import WriterError
from trainrec.schema.events import (
    Event,
    FileClosed,
    HookFailed,
    RecordsDropped,
    StepEnded,
    WriterFailed,
)

from . import failnote, writer_exit
from .log_file import close_quietly, create_log_file, file_identity, write_all, writev_all
from .log_header import __version__, file_header  # noqa: F401 - __version__ re-exported
from .step_index import StepIndexBuilder
from .writer_exit import before_sigterm_close, install_sigterm_handler  # noqa: F401 - re-exported
from .writer_names import FileNameIds

log = logging.getLogger(__name__)

_BUFFER_BYTES = 1 << 20  # write out at once when this much is buffered
_MAX_ERROR_LOGS = 5  # per writer: encode/callable failures logged at error level
_FAILURE_RETRY_S = 2.0  # after a write failure: how often the worker tries again to leave its note
DURABILITY_ENV = "TRAINREC_DURABILITY"
DURABILITIES = ("interval", "step")

Item = Event | Callable[[], Iterable[Event]]


class _Control:
    """A flush or stop marker travelling through the queue."""

    __slots__ = ("kind", "arg")

    def __init__(self, kind: str, arg: object) -> None:
        self.kind = kind
        self.arg = arg


class LogWriter:
    """Append events to a new log file in ``rank_dir`` from a background thread.

    Parameters mirror the FileOpened header; header fields not given are filled in (host, pid,
    versions, start time). Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        rank_dir: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        run_id: str = "",
        pp_stage: int = 0,
        group_mates: tuple = (),
        flush_interval: float = 0.2,
        queue_size: int = 4096,
        on_full: str = "block",
        fsync: bool = False,
        durability: str | None = None,
        repeat_names: bool = True,
    ) -> None:
        if durability is None:
            durability = os.environ.get(DURABILITY_ENV, "").strip().lower() or "interval"
            if durability not in DURABILITIES:
                log.warning("trainrec: ignoring %s=%r (expected one of %s)", DURABILITY_ENV,
                            os.environ.get(DURABILITY_ENV), ", ".join(DURABILITIES))
                durability = "interval"
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITIES)}, not {durability!r}")
        self.durability = durability
        self._per_step = durability == "step"
        if on_full not in ("block", "drop"):
            raise ValueError(f"on_full must be 'block' or 'drop', not {on_full!r}")
        if not flush_interval > 0:
            raise ValueError(f"flush_interval must be a positive number of seconds, not {flush_interval!r}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, not {queue_size!r}")
        self.rank = rank
        self.rank_dir = rank_dir
        try:
            self.path, self._file, index = create_log_file(rank_dir)
        except OSError as exc:
            raise WriterError(f"{rank_dir}: cannot create a log file: {exc}") from exc
        self._flush_interval = float(flush_interval)
        self._fsync = fsync
        self._drop = on_full == "drop"
        self._maxsize = queue_size
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # wakes the worker before its interval is over (flush, close, a queue half full); a SimpleQueue,
        # not an Event: put takes no lock, so a SIGTERM handler's close cannot deadlock on one
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_at = queue_size // 2
        self._error: BaseException | None = None
        self._closed = False
        self._stop_sent = False
        self._close_once = _thread.allocate_lock()  # acquired once, never released: first close wins
        self._drop_lock = _thread.allocate_lock()
        self._dropped_total = 0
        # (name tables wrapped: the worker lists them in the step index without a look at every record;
        # the closure holds the queue, not the writer: no reference cycle)
        q = self._queue
        self._name_ids = FileNameIds(rank, repeat_names, lambda table: q.put(_Control("names", table)))
        self._pid = os.getpid()
        self.header = file_header(rank_dir, index, self._pid, rank=rank, world_size=world_size, run_id=run_id,
                                  pp_stage=pp_stage, group_mates=group_mates)
        try:
            head = framing.encode_file_header() + framing.encode_frame(codec.encode(self.header))
            write_all(self._file, head)
            self.file_identity = file_identity(os.fstat(self._file.fileno()))
        except OSError as exc:
            self._file.close()
            raise WriterError(f"{self.path}: cannot write the file header: {exc}") from exc
        # Worker-owned state.
        self._seq = 1
        self._last_step = -1
        self._reported_drops = 0
        self._error_logs = 0
        self._buffered = 0
        self._written_seq = 1  # records before this one are on the OS (as far as the writer knows)
        self._file_bytes = len(head)  # bytes written out so far: a frame's offset is this plus _buffered
        self._index = StepIndexBuilder()
        self._discarded = 0  # records (or deferred batches) handed over and never written, after a failure
        self._note_seq = 0  # sequence number of the next failure record (0: none written yet)
        self._note_tried = 0.0
        self._thread = threading.Thread(target=self._run, name=f"trainrec-writer-rank{rank}", daemon=True)
        self._thread.start()
        writer_exit.live_writers.add(self)

    # ------------------------------------------------------------------ training-thread side
    def write(self, item: Item) -> None:
        """Hand over one event, or a zero-argument callable returning events, built on the worker."""
        if self._error is not None or self._closed:
            self._check()
        q = self._queue
        n = q.qsize()
        if n >= self._wake_at:
            self._wake.put(None)  # half full: the worker takes the queue now, not at its interval's end
            if n >= self._maxsize:
                if self._drop:
                    with self._drop_lock:
                        self._dropped_total += 1
                    return
                self._wait_for_room()
        q.put(item)
        if self._per_step and type(item) is StepEnded:
            self.flush()

    def _wait_for_room(self) -> None:
        delay = 5e-5
        q = self._queue
        while q.qsize() >= self._maxsize:
            self._check()
            if not self._thread.is_alive():
                raise WriterError(f"{self.path}: the writer thread is gone")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def intern(self, names: Iterable, step: int = -1) -> list[int]:
        """Ids of ``names`` in this file; new names are announced by a NamesInterned event first.

        Ids are dense, per file, and stable: a name keeps its id for the life of the writer. The
        announcement is queued before the ids are returned and is never dropped.
        """
        return self._name_ids.ids(names, step, self._check)

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything handed over so far is written to the OS (a no-op once closed)."""
        if self._error is not None:
            self._check()
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(_Control("flush", done))
        self._wake.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
            if not self._thread.is_alive():
                raise WriterError(f"{self.path}: the writer thread is gone")
            if deadline is not None and time.monotonic() >= deadline:
                raise WriterError(f"{self.path}: flush did not finish within {timeout} s")
        self._check(allow_closed=True)

    def close(self, reason: str = "close", timeout: float | None = None) -> None:
        """Write FileClosed, drain and close the file (fsynced first when the writer was made with fsync=True).

        Idempotent: only the first call closes and re-raises a worker failure; a later call returns
        once the close is done (or ``timeout`` passed). A close interrupted by a signal whose handler
        closes again (SIGTERM) still completes: whichever call comes first hands the stop over.
        """
        first = self._close_once.acquire(False)
        if first:
            self._closed = True
            writer_exit.live_writers.discard(self)
        if os.getpid() != self._pid:
            return  # a forked child: the file belongs to the parent
        stop = _Control("stop", reason)
        if threading.current_thread() is self._thread:
            self._queue.put(stop)  # called from a deferred callable: cannot join itself
            return
        if self._thread.is_alive():
            if not self._stop_sent:
                self._stop_sent = True
                self._queue.put(stop)  # a second STOP, if two callers race here, is never read
                self._wake.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                if first:
                    raise WriterError(f"{self.path}: the writer did not finish closing within {timeout} s")
                return
        elif first:  # pragma: no cover - the worker never exits before a stop
            close_quietly(self._file)
        if first:
            self._check(allow_closed=True)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error(self) -> BaseException | None:
        """The worker failure, if any."""
        return self._error

    @property
    def dropped(self) -> int:
        """Records dropped so far because the queue was full (``on_full="drop"``)."""
        return self._dropped_total

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, allow_closed: bool = False) -> None:
        err = self._error
        if err is not None:
            if isinstance(err, WriterError):
                raise WriterError(str(err)) from err
            raise WriterError(f"{self.path}: log writer failed: {err!r}") from err
        if self._closed and not allow_closed:
            raise WriterError(f"{self.path}: log writer is closed")

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, never raised here
            self._fail(exc)
            close_quietly(self._file)
            self._discard_forever()

    def _discard_forever(self) -> None:  # pragma: no cover - only after a bug in _loop
        while True:
            item = self._queue.get()
            if type(item) is _Control:
                if item.kind == "flush":
                    item.arg.set()
                elif item.kind == "stop":
                    return

    def _loop(self) -> None:
        # The worker sleeps until something is handed over, then lets flush_interval pass (unless a
        # flush, a close or a filling queue wakes it) and takes everything queued by then in one go:
        # about one wake-up per interval instead of one per item, and the items' encoding back to back
        # (0.60 -> 0.33-0.43 ms of this thread's CPU per step of the benchmark's config a).
        q = self._queue
        wake = self._wake
        buf: list[bytes] = []
        interval = self._flush_interval
        while True:
            item = q.get()
            if type(item) is not _Control or item.kind == "names":  # (a name table waits as records do)
                try:
                    wake.get(timeout=interval)
                except queue.Empty:
                    pass
            while True:  # the wake-ups sent meanwhile: this round answers them all
                try:
                    wake.get_nowait()
                except queue.Empty:
                    break
            due = time.monotonic() + interval  # a drain that items keep feeding still writes out this often
            while True:
                if type(item) is _Control and item.kind != "names":
                    if item.kind == "flush":
                        self._append_drops(buf)
                        self._write_out(buf)
                        item.arg.set()
                    else:
                        self._finish(buf, str(item.arg))
                        return
                elif self._error is not None:  # failed: keep draining so that no producer stays blocked
                    self._discarded += 1
                    if isinstance(item, Event) and item.step > self._last_step:
                        self._last_step = item.step
                    self._leave_note(retry=True)
                else:
                    if self._dropped_total != self._reported_drops:
                        self._append_drops(buf)
                    if isinstance(item, Event):
                        self._frame(item, buf)
                    elif type(item) is _Control:  # a name table
                        self._index.names_offsets.append(self._file_bytes + self._buffered)
                        self._frame(item.arg, buf)
                    else:
                        self._run_callable(item, buf)
                    if self._buffered >= _BUFFER_BYTES or (buf and time.monotonic() >= due):
                        self._write_out(buf)
                        due = time.monotonic() + interval
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
            self._write_out(buf)

    def _frame(self, ev: Event, buf: list[bytes]) -> None:
        """Encode and frame one event onto ``buf`` with the next sequence number."""
        try:
            payload = codec.encode(ev, seq=self._seq)
            header = framing.frame_header(payload)
        except Exception as exc:  # noqa: BLE001 - a bad event must not stop the log
            self._record_failure(f"writer: encoding {type(ev).__name__}", exc, buf)
            return
        step = ev.step
        if step != self._last_step:  # (the one test per record: a new step, or a late or step-less record)
            self._last_step = self._index.moved(step, self._seq, self._file_bytes + self._buffered, self._last_step)
        self._seq += 1
        buf.append(header)  # header and payload go to os.writev separately: no copy of the payload
        buf.append(payload)
        self._buffered += len(payload) + framing.FRAME_HEADER_SIZE

    def _run_callable(self, fn: Callable[[], Iterable[Event]], buf: list[bytes]) -> None:
        try:
            if not callable(fn):
                raise TypeError(f"expected an Event or a callable, got {type(fn).__name__}")
            for ev in fn():
                if not isinstance(ev, Event):
                    raise TypeError(f"deferred callable yielded {type(ev).__name__}, not an Event")
                self._frame(ev, buf)
        except Exception as exc:  # noqa: BLE001 - a failing hook must not stop the log
            name = getattr(fn, "__qualname__", type(fn).__name__)
            self._record_failure(f"writer: deferred {name}", exc, buf)

    def _record_failure(self, where: str, exc: BaseException, buf: list[bytes]) -> None:
        """Log a bad event or failing callable and record it as HookFailed; the log goes on."""
        if self._error_logs < _MAX_ERROR_LOGS:
            self._error_logs += 1
            log.error("trainrec: %s: %s failed: %r; the log goes on", self.path, where, exc)
        ev = HookFailed(
            rank=self.rank, step=self._last_step, wall=time.time(), where=where, error=repr(exc)[:1000]
        )
        frame = framing.encode_frame(codec.encode(ev, seq=self._seq))
        self._seq += 1
        buf.append(frame)
        self._buffered += len(frame)

    def _append_drops(self, buf: list[bytes]) -> None:
        """Record the drops since the last RecordsDropped, if any."""
        total = self._dropped_total
        count = total - self._reported_drops
        if count and self._error is None:
            self._reported_drops = total
            self._frame(RecordsDropped(rank=self.rank, step=self._last_step, wall=time.time(), count=count), buf)

    def _write_out(self, buf: list[bytes]) -> None:
        """Append the buffered frames to the file (discarded once the writer has failed)."""
        if buf and self._error is None:
            try:
                self._check_file()
                writev_all(self._file.fileno(), buf)
                if self._fsync:
                    os.fsync(self._file.fileno())
                self._written_seq = self._seq
                self._file_bytes += self._buffered
            except BaseException as exc:  # noqa: BLE001 - reported to the caller, never raised here
                self._discarded += self._seq - self._written_seq
                self._fail(exc)
                self._leave_note()
        buf.clear()
        self._buffered = 0

    def _check_file(self) -> None:
        """Fail when the path no longer names our file (removed or replaced: writes would be lost)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise WriterError(f"{self.path}: the log file was removed while being written") from None
        if file_identity(st) != self.file_identity:
            raise WriterError(f"{self.path}: the log file was replaced by another file while being written")

    def _leave_note(self, closing: str | None = None, retry: bool = False) -> None:
        """After a write failure: append a WriterFailed record (and with ``closing``, the FileClosed) if
        the disk allows; at close, where it does not, the sidecar. ``retry``: only every few seconds."""
        now = time.monotonic()
        if retry and (self._note_seq or now - self._note_tried < _FAILURE_RETRY_S):
            return
        self._note_tried = now
        seq = self._note_seq or self._written_seq
        note = WriterFailed(rank=self.rank, step=self._last_step, wall=time.time(), error=repr(self._error)[:1000],
                            first_lost_seq=self._written_seq, discarded=self._discarded, last_step=self._last_step)
        events: list[Event] = [note]
        if closing is not None:
            events.append(FileClosed(rank=self.rank, step=self._last_step, wall=time.time(), records=seq + 1,
                                     dropped=self._dropped_total, reason=closing))
        # (the file removed or replaced, a WriterError: not ours to write)
        if failnote.append_or_leave(self._file, self.path, events, seq, isinstance(self._error, WriterError),
                                    closing is not None):
            self._note_seq = seq + 1

    def _finish(self, buf: list[bytes], reason: str) -> None:
        if self._error is None:
            self._append_drops(buf)
            closing = FileClosed(
                rank=self.rank,
                step=self._last_step,
                wall=time.time(),
                records=self._seq,  # records before this one, FileOpened included
                dropped=self._dropped_total,
                reason=reason,
                **self._index.fields(),
            )
            self._frame(closing, buf)
            self._write_out(buf)  # fsyncs too when asked to (fsync=True)
        if self._error is not None:  # (failed before, or in this last write-out)
            self._leave_note(closing=f"{reason}; the writer failed before")
        buf.clear()
        close_quietly(self._file)

    def disown_in_fork_child(self) -> None:
        """In a forked child: this writer is the parent's; refuse every later call, write nothing."""
        self._close_once.acquire(False)
        self._closed = True
        self._error = WriterError(f"{self.path}: this writer belongs to process {self._pid}, not to its forked child")

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
            log.error("trainrec: log writer for %s failed: %r; training goes on, and nothing more is recorded "
                      "in this log", self.path, exc)
