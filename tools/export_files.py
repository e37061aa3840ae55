"""Files of the exports: CSV window files, TensorBoard event files, and one export task per rank.

* :class:`CsvDirSink` writes the CSV projection of one rank into one directory
  (``{kind}_{start}-{end}.csv``); a window file is created (truncated) the first time this export
  touches it and appended to afterwards, so an export never mixes with an older one.
* :class:`TbEventFile` writes TFRecord-framed TensorBoard events (little-endian length, masked
  CRC32C) into ``events.out.tfevents.{time}.{host}[.{suffix}]``, starting with the file version
  event, as tensorboardX does; CRC32C comes from the ``crc32c`` package (tensorboardX's own
  accelerator) with a pure-Python fallback.
* :func:`run_task` exports one rank (or some data types of it) of a run: it reads the rank's log
  files in order, drops what a resume superseded, projects and writes, and reports what it found
  (files not closed, torn tails, damage, incomplete last steps).
"""

from __future__ import annotations

import bisect
import io
import logging
import multiprocessing
import os
import re
import socket
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from trainrec.analyzers.export_csv import CsvProjector, ops_from_header
from trainrec.analyzers.export_tb import TbProjector
from trainrec.analyzers.selection import StepSet
from trainrec.analyzers.tb_encode import FILE_VERSION, event_bytes
from trainrec.replay.discover import RunInfo
from trainrec.replay.follow import writer_running
from trainrec.replay.reader import LogReader
from trainrec.replay.run import Run
from trainrec.replay.stepindex import read_steps
from trainrec.schema import layout
from trainrec.schema.errors import FormatError
from trainrec.schema.events import (
    KINDS,
    FileClosed,
    FileOpened,
    NamesInterned,
    StepEnded,
    TensorStatsRecorded,
)

log = logging.getLogger(__name__)

__all__ = ["CsvDirSink", "ExportTask", "TaskResult", "RankStream", "TbEventFile", "masked_crc32c", "pool_context", "run_task", "tb_file_name"]

try:  # the C implementation tensorboardX itself uses when present
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - crc32c is a declared dependency
    _crc32c = None

_KEEP = (FileOpened, FileClosed, NamesInterned)
_KNOWN_KINDS = frozenset(KINDS)


def pool_context():
    """Worker start method: fork (fast, nothing to re-import) when this process has no other thread."""
    if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


# ---------------------------------------------------------------------------------------- CRC32C
def _make_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE: list[int] | None = None


def crc32c(data: bytes) -> int:
    if _crc32c is not None:
        return _crc32c(data)
    global _TABLE
    if _TABLE is None:
        log.warning("trainrec: the crc32c package is missing; TensorBoard files are written slowly")
        _TABLE = _make_table()
    table = _TABLE
    c = 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    x = crc32c(data)
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------- TensorBoard
def tb_file_name(start_time: float, host: str, suffix: str = "") -> str:
    name = f"events.out.tfevents.{int(start_time)}.{host or socket.gethostname()}"
    return f"{name}.{suffix}" if suffix else name


class TbEventFile:
    """A TensorBoard event file: ``write(event_bytes)`` appends one TFRecord."""

    def __init__(self, path: str, wall: float | None = None, *, append: bool = False) -> None:
        """``append``: add to the file where it exists (it has its file version event already)."""
        layout.make_dirs(os.path.dirname(path) or ".")
        self.path = path
        if append and os.path.isfile(path) and os.path.getsize(path) > 0:
            self._f = open(path, "ab", buffering=1 << 20)  # noqa: SIM115 - closed in close()
            return
        self._f = open(path, "wb", buffering=1 << 20, opener=layout.private_opener)  # noqa: SIM115 - closed in close()
        self.write(event_bytes(time.time() if wall is None else wall, file_version=FILE_VERSION))

    def write(self, data: bytes) -> None:
        header = len(data).to_bytes(8, "little")
        self._f.write(header)
        self._f.write(masked_crc32c(header).to_bytes(4, "little"))
        self._f.write(data)
        self._f.write(masked_crc32c(data).to_bytes(4, "little"))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> TbEventFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------- CSV
class CsvDirSink:
    """CSV window files of one rank in ``directory`` (see the module docstring).

    What it wrote is kept as three integers per window file, per data type (window start and end, the
    last step written there), ordered by start: a live export runs as long as training does, so its
    bookkeeping must not grow by more than that per file. Paths are made from them when asked."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        layout.make_dirs(directory)
        # kind -> (starts, ends, last step written), ordered by start
        self._written: dict[str, tuple[array, array, array]] = {}
        self._open: dict[str, tuple[int, io.BufferedWriter, int]] = {}  # kind -> (start, file, window index)

    def path(self, kind: str, start: int, end: int) -> str:
        return os.path.join(self.directory, f"{kind}_{start}-{end}.csv")

    @property
    def kinds(self) -> list[str]:
        """The file prefixes this sink has window files of."""
        return sorted(k for k, (starts, _, _) in self._written.items() if starts)

    def adopt(self, step_count_per_record: int, kinds: Iterable[str]) -> None:
        """Take the window files of ``step_count_per_record`` steps with these prefixes already in the
        directory as this sink's own, before it writes anything (a live export going on where an earlier
        one ended): rows go on being appended to them, and a rewind trims or removes them. Their last
        steps are read when a rewind needs them."""
        spcr = step_count_per_record
        kinds = set(kinds)
        found: dict[str, list[tuple[int, int]]] = {}
        with os.scandir(self.directory) as it:
            for e in it:
                m = _WINDOW_FILE.match(e.name)
                if m is not None and m.group(1) in kinds:
                    start, end = int(m.group(2)), int(m.group(3))
                    if start % spcr == 0 and end == start + spcr - 1:
                        found.setdefault(m.group(1), []).append((start, end))
        for kind, windows in found.items():
            windows.sort()
            self._written[kind] = (array("q", [s for s, _ in windows]), array("q", [e for _, e in windows]),
                                   array("q", [_UNREAD]) * len(windows))

    def existing_ops(self, kind: str, start: int) -> tuple[str, ...] | None:
        """The ops in the header of window file ``(kind, start)`` where this sink has it (adopted, or
        written by it), else None."""
        written = self._written.get(kind)
        if written is None:
            return None
        starts, ends, _ = written
        i = bisect.bisect_left(starts, start)
        if i == len(starts) or starts[i] != start:
            return None
        try:
            with open(self.path(kind, start, ends[i]), encoding="utf-8", newline="") as f:
                return ops_from_header(f.readline())
        except (OSError, ValueError):
            return None

    def append(self, kind: str, start: int, end: int, header: str, text: bytes, step: int) -> None:
        cur = self._open.get(kind)
        if cur is not None and cur[0] != start:
            cur[1].close()
            del self._open[kind]
            cur = None
        if cur is None:
            if kind not in self._written:
                self._written[kind] = (array("q"), array("q"), array("q"))
            starts, ends, lasts = self._written[kind]
            i = bisect.bisect_left(starts, start)
            if i < len(starts) and starts[i] == start:
                f = open(self.path(kind, start, ends[i]), "ab", buffering=1 << 20)  # noqa: SIM115
            else:
                f = open(self.path(kind, start, end), "wb", buffering=1 << 20,  # noqa: SIM115 - kept open across steps
                         opener=layout.private_opener)
                f.write(header.encode("utf-8") + b"\n")
                starts.insert(i, start)
                ends.insert(i, end)
                lasts.insert(i, step)
            self._open[kind] = cur = (start, f, i)
        cur[1].write(text)
        lasts = self._written[kind][2]
        if step > lasts[cur[2]]:
            lasts[cur[2]] = step

    def rewind(self, step: int) -> list[tuple[str, int]]:
        """Drop the rows of steps >= ``step`` from the files this sink wrote; ``(kind, start)`` of the
        window files removed (a window left without rows goes too: its header may name other ops than
        the rows the resumed run writes there, and the offline export has no such file)."""
        self.flush_close()
        removed: list[tuple[str, int]] = []
        for kind, (starts, ends, lasts) in self._written.items():
            # windows do not overlap: those that begin at step or later go, the one before may hold it
            i = bisect.bisect_left(starts, step)
            if i and ends[i - 1] >= step and (lasts[i - 1] >= step or lasts[i - 1] == _UNREAD):
                lasts[i - 1] = _trim_csv(self.path(kind, starts[i - 1], ends[i - 1]), step)
            if i and lasts[i - 1] == -1:
                i -= 1
            for j in range(i, len(starts)):
                removed.append((kind, starts[j]))
                try:
                    os.remove(self.path(kind, starts[j], ends[j]))
                except FileNotFoundError:
                    pass  # removed by hand, or by an export of another launch following this directory
            del starts[i:], ends[i:], lasts[i:]
        return removed

    def flush(self) -> None:
        for _, f, _ in self._open.values():
            f.flush()

    def flush_close(self) -> None:
        for _, f, _ in self._open.values():
            f.close()
        self._open.clear()

    close = flush_close

    @property
    def files(self) -> list[str]:
        return sorted(self.path(kind, s, e) for kind, (starts, ends, _) in self._written.items()
                      for s, e in zip(starts, ends, strict=True))


_WINDOW_FILE = re.compile(r"^(.+)_(\d+)-(\d+)\.csv$")
_UNREAD = -2  # the last step of an adopted window file, not read yet


def _trim_csv(path: str, step: int) -> int:
    """Keep the header and the rows of steps < ``step`` in a window file; the last step kept (-1: none).
    The file is rewritten only where a row goes."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except FileNotFoundError:
        return -1
    rows = _csv_rows(text)
    kept = [r for r, s in rows if s is None or s < step]
    last = max((s for _, s in rows if s is not None and s < step), default=-1)
    if len(kept) < len(rows):
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.writelines(kept)
    return last


# a window file's row: vpp_stage, the name (quoted, as pandas quotes, where it holds a comma, a quote or a
# line break), the step, the values
_CSV_ROW = re.compile(r'[^,\n]*,(?:"(?:[^"]|"")*"|[^,"\n]*),([^,\n]*)[^\n]*\n?')


def _csv_rows(text: str) -> list[tuple[str, int | None]]:
    """The lines of a window file with their steps (None: the header, or a line without one); a row
    whose quoted name holds a line break is one line (``str.splitlines`` would cut it there)."""
    n = len(text)
    nl = text.find("\n")
    i = n if nl < 0 else nl + 1
    out: list[tuple[str, int | None]] = [(text[:i], None)]
    while i < n:
        m = _CSV_ROW.match(text, i)
        if m is None:  # not a row: the line as it is
            end = text.find("\n", i)
            end = n if end < 0 else end + 1
            out.append((text[i:end], None))
            i = end
            continue
        try:
            step: int | None = int(m.group(1))
        except ValueError:
            step = None
        out.append((m.group(0), step))
        i = m.end()
    return out


# ---------------------------------------------------------------------------------------- tasks
@dataclass
class ExportTask:
    """One unit of export work: some data types of one rank of a run."""

    fmt: str  # "csv" or "tb"
    info: RunInfo  # restricted to this rank
    rank: int
    out_dir: str
    kinds: tuple[str, ...]
    steps: StepSet | None = None
    notes: bool = True
    ndigits: int | None = 6
    step_count_per_record: int = 1
    tb_suffix: str = ""
    task_id: int = 0
    note_kinds: tuple[str, ...] | None = None  # anomalies of these kinds become notes (default: kinds)

    @property
    def log_bytes(self) -> int:
        total = 0
        for lf in self.info.files.get(self.rank, []):
            try:
                total += os.path.getsize(lf.path)
            except OSError:
                pass
        return total


@dataclass
class TaskResult:
    task_id: int
    rank: int
    out_dir: str
    kinds: tuple[str, ...]
    files: list[str] = field(default_factory=list)
    rows: int = 0
    values: int = 0
    steps: list[int] = field(default_factory=list)
    recorded_steps: tuple[int, int] | None = None  # first and last step that ended in the log, selected or not
    dropped_steps: list[int] = field(default_factory=list)
    superseded: int = 0
    bad_records: int = 0
    messages: list[str] = field(default_factory=list)  # what the user should know (unclosed, torn, damage)
    still_running: bool = False
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def _writer_alive(header) -> bool:
    """Whether the process that wrote a log is still running (only knowable on its own host; its start
    time tells it from a later process that got its pid)."""
    return bool(header.pid) and header.host == socket.gethostname() and writer_running(header)


class RankStream:
    """The rank's events in writing order, minus what a resume superseded; notes what it finds."""

    def __init__(self, task: ExportTask, result: TaskResult, progress: Callable[[int], None] | None) -> None:
        self.task = task
        self.result = result
        self.progress = progress
        self.last_reader: LogReader | None = None
        self._spans: list[tuple[int, int]] = []

    def __iter__(self):
        task, result, progress = self.task, self.result, self.progress
        run = Run(task.info)
        unknown: dict[str, int] = {}  # records of data types this version does not know: kind -> count
        for lf in run.log_files(task.rank):
            if lf.error is not None:
                result.messages.append(f"skipped {lf.path}: {lf.error}")
                continue
            cut = run.cutoffs.get(lf.path)
            file_span = None
            if task.steps is None:
                reader = LogReader(lf.path)
                stream = iter(reader)
            else:  # only the selected steps' bytes where the file has a step index
                reader, stream, file_span = read_steps(lf.path, task.steps.ranges)
            done = 0
            try:
                for ev in stream:
                    if cut is not None and ev.step >= cut and not isinstance(ev, _KEEP):
                        result.superseded += 1
                        continue
                    t = type(ev)
                    if t is StepEnded:
                        span = result.recorded_steps
                        result.recorded_steps = (ev.step, ev.step) if span is None else (
                            min(span[0], ev.step), max(span[1], ev.step))
                    elif t is TensorStatsRecorded and ev.kind not in _KNOWN_KINDS:
                        unknown[ev.kind] = unknown.get(ev.kind, 0) + 1
                    yield ev
                    if progress is not None and reader.bytes_read - done >= (4 << 20):
                        progress(reader.bytes_read - done)
                        done = reader.bytes_read
            except FormatError as exc:
                result.messages.append(f"stopped reading {lf.path}: {exc}")
            if progress is not None:
                try:
                    size = os.path.getsize(lf.path)
                except OSError:
                    size = reader.offset
                progress(max(0, size - done))
            for p in reader.problems:
                result.messages.append(f"damaged record skipped: {p}" if p.skipped else f"damage: {p}")
            self.last_reader = reader
            if file_span is not None:  # a step selection: the recorded span is the file's, not what was read
                self._spans.append((file_span[0], file_span[1] if cut is None else min(file_span[1], cut - 1)))
        spans = [s for s in self._spans if 0 <= s[0] <= s[1]]
        if task.steps is not None:
            result.recorded_steps = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None
        if unknown:
            kinds = ", ".join(f"{k!r} ({n})" for k, n in sorted(unknown.items()))
            result.messages.append(f"records of data types this trainrec does not know are not exported: {kinds} "
                                   "(a newer trainrec wrote them: export with that version)")

    def ended_cleanly(self) -> bool:
        """Whether the stream ended with FileClosed; adds messages about how it ended."""
        reader, result = self.last_reader, self.result
        if reader is None:
            return True
        clean = reader.closed_cleanly
        if reader.pending_bytes:
            result.messages.append(
                f"{reader.path} ends with {reader.pending_bytes} bytes of an incomplete record (torn tail), not exported"
            )
        if not clean:
            h = reader.header
            if h is not None and _writer_alive(h):
                result.still_running = True
                result.messages.append(f"{reader.path} is still being written (pid {h.pid}); exported what is complete")
            else:
                result.messages.append(
                    f"{reader.path} was not closed (its writer stopped without FileClosed); exported what is complete"
                )
        return clean


def run_task(task: ExportTask, progress: Callable[[int], None] | None = None) -> TaskResult:
    """Export one task; safe to call in a worker process."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    result = TaskResult(task.task_id, task.rank, task.out_dir, task.kinds)
    stream = RankStream(task, result, progress)
    if task.fmt == "csv":
        sink = CsvDirSink(task.out_dir)
        proj = CsvProjector(
            sink, kinds=task.kinds, steps=task.steps, ndigits=task.ndigits,
            step_count_per_record=task.step_count_per_record,
        )
        try:
            proj.feed_all(stream)
            s = proj.finish(stream.ended_cleanly())
        finally:
            sink.close()
        result.files = sink.files
        result.rows, result.values = s.rows, s.values
    elif task.fmt == "tb":
        headers = [lf.header for lf in task.info.files.get(task.rank, []) if lf.header is not None]
        start = headers[0].start_time if headers else time.time()
        host = headers[0].host if headers else socket.gethostname()
        path = os.path.join(task.out_dir, tb_file_name(start, host, task.tb_suffix))
        with TbEventFile(path, wall=start) as sink:
            proj = TbProjector(sink, kinds=task.kinds, steps=task.steps, notes=task.notes, note_kinds=task.note_kinds)
            proj.feed_all(stream)
            s = proj.finish(stream.ended_cleanly())
        result.files = [path]
        result.rows, result.values = s.events, s.scalars
    else:
        raise ValueError(f"unknown export format {task.fmt!r}")
    result.steps = sorted(s.steps)
    result.dropped_steps = list(s.dropped_steps)
    result.bad_records = s.bad_records
    result.seconds = time.perf_counter() - t0
    result.cpu_seconds = time.process_time() - c0
    return result
