"""The per-rank log writer: a background thread that encodes, frames and appends events.

Modelled on TensorBoard's ``EventFileWriter``. The training thread hands over immutable events (or
a callable that builds them later, on the worker, e.g. after a device-to-host copy) and returns at
once. One worker thread (:class:`~.writer_worker.WriterWorker`) wakes at the first item, lets
``flush_interval`` pass, and writes everything queued in one go.

Guarantees, in short (details: docs/recorder-internals.md, "The log writer"): everything handed over
is on the OS within ``flush_interval`` and at once after :meth:`LogWriter.flush`; :meth:`LogWriter.close`
writes :class:`FileClosed`, is idempotent and runs at exit; a worker failure is raised as
:class:`WriterError` on the caller's next call and the queue is still drained; the queue is bounded,
``on_full`` blocks or drops (and the drop is recorded). The queue is reentrant and closing takes no
lock, so a SIGTERM handler may close a writer; a forked child's writers are disabled."""

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
from trainrec.schema.events import Event, StepEnded

from . import writer_exit
from .log_file import close_quietly, create_log_file, file_identity, write_all
from .log_header import file_header
from .writer_names import FileNameIds
from .writer_worker import Control, WriterWorker

log = logging.getLogger(__name__)

DURABILITY_ENV = "TRAINREC_DURABILITY"
DURABILITIES = ("interval", "step")

Item = Event | Callable[[], Iterable[Event]]


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
        # (name tables wrapped: the worker lists them in the step index without a look at every record;
        # the closure holds the queue, not the writer: no reference cycle)
        q = self._queue
        self._name_ids = FileNameIds(rank, repeat_names, lambda table: q.put(Control("names", table)))
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
        self._worker = WriterWorker(self._file, self.path, self.file_identity, rank=rank, file_bytes=len(head),
                                    items=self._queue, wake=self._wake, flush_interval=float(flush_interval),
                                    fsync=fsync, on_failure=self._worker_failed)
        self._thread = threading.Thread(target=self._worker.run, name=f"trainrec-writer-rank{rank}", daemon=True)
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
                        self._worker.dropped_total += 1
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
        self._queue.put(Control("flush", done))
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
        stop = Control("stop", reason)
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
        return self._worker.dropped_total

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

    def _worker_failed(self, exc: BaseException) -> None:
        """The worker's first failure (told on its thread): raised on the caller's next call."""
        self._error = exc

    def disown_in_fork_child(self) -> None:
        """In a forked child: this writer is the parent's; refuse every later call, write nothing."""
        self._close_once.acquire(False)
        self._closed = True
        self._error = WriterError(f"{self.path}: this writer belongs to process {self._pid}, not to its forked child")
