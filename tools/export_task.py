"""One export task per rank (or some data types of it): :func:`run_task` reads the rank's log files
in order (:class:`RankStream`), drops what a resume superseded, projects into CSV window files
(:mod:`.csv_dir_sink`) or a TensorBoard event file (:mod:`.tb_event_file`), and reports what it found
(files not closed, torn tails, damage, incomplete last steps) in a :class:`TaskResult`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trainrec.analyzers.export_csv import CsvProjector
from trainrec.analyzers.export_tb import TbProjector
from trainrec.analyzers.selection import StepSet
from trainrec.replay.discover import RunInfo
from trainrec.replay.follow import writer_running
from trainrec.replay.reader import LogReader
from trainrec.replay.run import Run
from trainrec.replay.stepindex import read_steps
from trainrec.schema.errors import FormatError
from trainrec.schema.events import (
    KINDS,
    FileClosed,
    FileOpened,
    NamesInterned,
    StepEnded,
    TensorStatsRecorded,
)

from .csv_dir_sink import CsvDirSink
from .tb_event_file import TbEventFile, tb_file_name

__all__ = ["ExportTask", "RankStream", "TaskResult", "run_task"]


_KEEP = (FileOpened, FileClosed, NamesInterned)
_KNOWN_KINDS = frozenset(KINDS)


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
