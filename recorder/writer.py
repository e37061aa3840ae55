"""The per-rank log writer: a background thread that encodes, frames and appends events.

The training thread hands over immutable events (or a callable that builds them later, on the worker,
e.g. after a device-to-host copy completed) and returns at once. One worker thread encodes, frames and
writes; it flushes to the OS at least every ``flush_interval`` seconds, so a ``kill -9`` of the
training process loses at most that much. ``flush()`` waits until everything queued is written.
``close()`` is idempotent and also runs at interpreter exit. A worker failure (disk full, file
removed) is raised as :class:`WriterError` on the caller's next call, and the queue keeps being drained
so no producer is left blocked.

When the bounded queue is full the ``on_full`` policy applies: ``"block"`` (default, no loss) waits
for room; ``"drop"`` drops the record and later writes a :class:`RecordsDropped` event with the count.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from trainrec.schema import codec, framing, layout
from trainrec.schema.errors import WriterError
from trainrec.schema.events import Event, FileClosed, FileOpened, NamesInterned, RecordsDropped

log = logging.getLogger(__name__)

__version__ = "0.1.0"

_FLUSH = object()
_STOP = object()
_BUFFER_BYTES = 1 << 20

Item = Event | Callable[[], Iterable[Event]]


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except Exception:  # pragma: no cover - torch is a dependency
        return ""


def create_log_file(rank_dir: str) -> tuple[str, object, int]:
    """Create the next log file of ``rank_dir`` exclusively; returns (path, binary file, index)."""
    os.makedirs(rank_dir, exist_ok=True)
    while True:
        existing = layout.list_logs(rank_dir)
        index = (layout.log_index(os.path.basename(existing[-1])) + 1) if existing else 0
        path = os.path.join(rank_dir, layout.log_file_name(index))
        try:
            return path, open(path, "xb"), index  # noqa: SIM115 - owned by the writer
        except FileExistsError:
            continue


class LogWriter:
    """Append events to a new log file in ``rank_dir`` from a background thread.

    Parameters mirror the FileOpened header; ``header`` fields not given are filled in (host, pid,
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
    ) -> None:
        if on_full not in ("block", "drop"):
            raise ValueError(f"on_full must be 'block' or 'drop', not {on_full!r}")
        self.rank = rank
        self.rank_dir = rank_dir
        self.path, self._file, index = create_log_file(rank_dir)
        self._flush_interval = flush_interval
        self._fsync = fsync
        self._on_full = on_full
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._dropped = 0
        self._dropped_total = 0
        self._records = 0
        self._names: dict[str, int] = {}
        self.header = FileOpened(
            seq=0,
            rank=rank,
            step=-1,
            wall=time.time(),
            run_id=run_id,
            world_size=world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            start_time=time.time(),
            trainrec_version=__version__,
            torch_version=_torch_version(),
            format_version=framing.FORMAT_VERSION,
            file_index=index,
            dir_name=os.path.basename(os.path.abspath(rank_dir)),
            pp_stage=pp_stage,
            group_mates=tuple(group_mates),
        )
        self._file.write(framing.encode_file_header())
        self._file.write(framing.encode_frame(codec.encode(self.header)))
        self._file.flush()
        self._seq = 1
        self._thread = threading.Thread(target=self._run, name=f"trainrec-writer-rank{rank}", daemon=True)
        self._thread.start()
        _live_writers.add(self)

    # ------------------------------------------------------------------ training-thread side
    def write(self, item: Item) -> None:
        """Hand over one event, or a callable returning events to be built on the worker."""
        self._check()
        if self._dropped and self._on_full == "drop":
            try:
                self._queue.put_nowait(RecordsDropped(rank=self.rank, wall=time.time(), count=self._dropped))
                self._dropped = 0
            except queue.Full:
                self._dropped += 1
                self._dropped_total += 1
                return
        if self._on_full == "block":
            self._put_blocking(item)
        else:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self._dropped += 1
                self._dropped_total += 1

    def _put_blocking(self, item: object) -> None:
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                self._check()
                if not self._thread.is_alive():
                    raise WriterError(f"{self.path}: the writer thread is gone") from None

    def intern(self, names: Iterable[str], step: int = -1) -> list[int]:
        """Ids of ``names`` in this file; new names are announced by a NamesInterned event first."""
        table = self._names
        out = []
        new = []
        for n in names:
            i = table.get(n)
            if i is None:
                i = len(table)
                table[n] = i
                new.append(n)
            out.append(i)
        if new:
            self.write(
                NamesInterned(
                    rank=self.rank, step=step, wall=time.time(), first_id=len(table) - len(new), names=tuple(new)
                )
            )
        return out

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything handed over so far is written to the OS."""
        self._check()
        if self._closed:
            return
        done = threading.Event()
        self._put_blocking((_FLUSH, done))
        if not done.wait(timeout):
            raise WriterError(f"{self.path}: flush did not finish within {timeout} s")
        self._check()

    def close(self, reason: str = "close") -> None:
        """Write FileClosed, drain, and close the file. Idempotent; re-raises a worker failure once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _live_writers.discard(self)
        if self._thread.is_alive():
            if self._error is None:
                self._put_blocking(
                    FileClosed(
                        rank=self.rank,
                        wall=time.time(),
                        records=self._records,
                        dropped=self._dropped_total,
                        reason=reason,
                    )
                )
            self._put_blocking(_STOP)
            self._thread.join()
        try:
            self._file.close()
        except OSError:
            pass
        self._check(allow_closed=True)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error(self) -> BaseException | None:
        return self._error

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, allow_closed: bool = False) -> None:
        err = self._error
        if err is not None:
            raise WriterError(f"{self.path}: log writer failed: {err!r}") from err
        if self._closed and not allow_closed:
            raise WriterError(f"{self.path}: log writer is closed")

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        buf: list[bytes] = []
        size = 0
        last_flush = time.monotonic()
        q = self._queue
        while True:
            timeout = max(0.0, self._flush_interval - (time.monotonic() - last_flush)) if buf else None
            try:
                item = q.get(timeout=timeout)
            except queue.Empty:
                item = None
            stop = item is _STOP
            flush_done = None
            if isinstance(item, tuple) and item and item[0] is _FLUSH:
                flush_done = item[1]
            elif item is not None and not stop and self._error is None:
                try:
                    events = (item,) if isinstance(item, Event) else item()
                    for ev in events:
                        frame = framing.encode_frame(codec.encode(ev, seq=self._seq))
                        self._seq += 1
                        self._records += 1
                        buf.append(frame)
                        size += len(frame)
                except BaseException as exc:  # noqa: BLE001 - reported to the caller, never raised here
                    self._fail(exc)
            due = time.monotonic() - last_flush >= self._flush_interval
            if (buf or flush_done or stop) and (size >= _BUFFER_BYTES or due or flush_done or stop):
                if self._error is None:
                    try:
                        self._file.write(b"".join(buf))
                        self._file.flush()
                        if self._fsync or stop:
                            os.fsync(self._file.fileno())
                    except BaseException as exc:  # noqa: BLE001
                        self._fail(exc)
                buf.clear()
                size = 0
                last_flush = time.monotonic()
            if flush_done is not None:
                flush_done.set()
            if stop:
                return

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
            log.error("trainrec: log writer for %s failed: %r; training goes on without it", self.path, exc)


_live_writers: weakref.WeakSet[LogWriter] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for w in list(_live_writers):
        try:
            w.close(reason="exit")
        except Exception:  # noqa: BLE001 - never fail interpreter exit
            pass


def install_sigterm_handler() -> bool:
    """Close every live writer on SIGTERM, then hand the signal to the previous handler.

    Only possible from the main thread; returns False elsewhere.
    """
    import signal

    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "_trainrec", False):
        return True

    def handler(signum, frame):
        _close_all()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    handler._trainrec = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, handler)
    return True
