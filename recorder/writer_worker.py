"""The worker thread of a :class:`~.writer.LogWriter`: takes what the training thread handed over from
the queue, encodes, frames and appends it to the log file, keeps the file's step index, and after a
write failure keeps draining the queue and leaves what note it can of the failure.

Woken by the first item handed over, it lets ``flush_interval`` pass (a flush, a close or a half-full
queue end the wait) and then takes everything queued in one go, so a training step's few items cost
it one wake-up, not one each. It owns the file once its header is written, and closes it.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable, Iterable

from trainrec.schema import codec, framing
from trainrec.schema.errors import WriterError
from trainrec.schema.events import (
    Event,
    FileClosed,
    HookFailed,
    RecordsDropped,
    WriterFailed,
)

from . import failnote
from .log_file import close_quietly, file_identity, writev_all
from .step_index import StepIndexBuilder

log = logging.getLogger("trainrec.recorder.writer")  # (the writer's messages, as they always were)

_BUFFER_BYTES = 1 << 20  # write out at once when this much is buffered
_MAX_ERROR_LOGS = 5  # per writer: encode/callable failures logged at error level
_FAILURE_RETRY_S = 2.0  # after a write failure: how often the worker tries again to leave its note


class Control:
    """A flush or stop marker travelling through the queue."""

    __slots__ = ("kind", "arg")

    def __init__(self, kind: str, arg: object) -> None:
        self.kind = kind
        self.arg = arg


class WriterWorker:
    """Encodes, frames and writes the items of ``items`` (the writer's queue) to ``file``, whose header
    (its first ``file_bytes`` bytes, record 0) is written, on the writer's thread (:meth:`run`). ``wake``
    ends its wait before the interval is over; ``on_failure`` is told of the first failure (on this
    thread); ``dropped_total`` counts the records the training thread dropped (raised under its lock)."""

    def __init__(self, file, path: str, identity: tuple, *, rank: int, file_bytes: int, items: queue.SimpleQueue,
                 wake: queue.SimpleQueue, flush_interval: float, fsync: bool,
                 on_failure: Callable[[BaseException], None]) -> None:
        self.rank = rank
        self.path = path
        self.file_identity = identity
        self._file = file
        self._queue = items
        self._wake = wake
        self._flush_interval = flush_interval
        self._fsync = fsync
        self._on_failure: Callable[[BaseException], None] | None = on_failure
        self._error: BaseException | None = None
        self.dropped_total = 0
        self._seq = 1
        self._last_step = -1
        self._reported_drops = 0
        self._error_logs = 0
        self._buffered = 0
        self._written_seq = 1  # records before this one are on the OS (as far as the writer knows)
        self._file_bytes = file_bytes  # bytes written out so far: a frame's offset is this plus _buffered
        self._index = StepIndexBuilder()
        self._discarded = 0  # records (or deferred batches) handed over and never written, after a failure
        self._note_seq = 0  # sequence number of the next failure record (0: none written yet)
        self._note_tried = 0.0

    def run(self) -> None:
        """The thread's body: the loop, and after a bug in it the failure reported and the queue drained."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, never raised here
            self._fail(exc)
            close_quietly(self._file)
            self._discard_forever()
        finally:
            self._on_failure = None  # (holds the writer: alive while its thread runs, and no cycle after)

    def _discard_forever(self) -> None:  # pragma: no cover - only after a bug in _loop
        while True:
            item = self._queue.get()
            if type(item) is Control:
                if item.kind == "flush":
                    item.arg.set()
                elif item.kind == "stop":
                    return

    def _loop(self) -> None:
        # The worker sleeps until something is handed over, then lets flush_interval pass (unless a
        # flush, a close or a filling queue wakes it) and takes everything queued by then in one go:
        # about one wake-up per interval instead of one per item, and the items' encoding back to back.
        q = self._queue
        wake = self._wake
        buf: list[bytes] = []
        interval = self._flush_interval
        while True:
            item = q.get()
            if type(item) is not Control or item.kind == "names":  # (a name table waits as records do)
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
                if type(item) is Control and item.kind != "names":
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
                    if self.dropped_total != self._reported_drops:
                        self._append_drops(buf)
                    if isinstance(item, Event):
                        self._frame(item, buf)
                    elif type(item) is Control:  # a name table
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
        total = self.dropped_total
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
                                     dropped=self.dropped_total, reason=closing))
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
                dropped=self.dropped_total,
                reason=reason,
                **self._index.fields(),
            )
            self._frame(closing, buf)
            self._write_out(buf)  # fsyncs too when asked to (fsync=True)
        if self._error is not None:  # (failed before, or in this last write-out)
            self._leave_note(closing=f"{reason}; the writer failed before")
        buf.clear()
        close_quietly(self._file)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
            self._on_failure(exc)
            log.error("trainrec: log writer for %s failed: %r; training goes on, and nothing more is recorded "
                      "in this log", self.path, exc)
