"""What a run contains: the data behind ``trainrec inspect`` (and, through :mod:`.integrity`, ``check``).

:func:`summarize` reads every rank once (resume supersession applied) and returns a
:class:`RunSummary`, whose per-file reader state :func:`~trainrec.replay.integrity.findings` turns
into what is wrong with the run. Pure: nothing here prints. (It does look up whether the writer of a
file not closed still runs, by the pid in the file's header, where that host is this one.)
"""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from dataclasses import dataclass, field

from trainrec.schema.events import (
    AnomalyDetected,
    ConfigApplied,
    ConfigRejected,
    ExceptionRaised,
    FileOpened,
    HookFailed,
    HooksFired,
    MonitoringStopped,
    RecordsDropped,
    StallDetected,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
)

from .discover import LogFile
from .follow import writer_running
from .problems import Problem
from .run import Run
from .sequence import SeqGap
from .stats_columns import StatsColumns

_STEP_TYPES = (StepBegan, StepEnded, TensorStatsRecorded, HooksFired)


@dataclass
class FileSummary:
    path: str
    size: int
    format_version: int | None
    run_id: str | None
    resume_step: int | None
    events: int = 0
    closed_cleanly: bool = False
    close_reason: str = ""
    torn_bytes: int = 0
    end_offset: int = 0  # where the torn tail starts
    superseded: int = 0
    problems: list[Problem] = field(default_factory=list)
    gaps: list[SeqGap] = field(default_factory=list)
    error: str | None = None
    first_record_is_header: bool = True
    writer_pid: int = 0  # the writer's, from the file's header
    writer_host: str = ""
    writer_running: bool | None = None  # for a file not closed: whether its writer runs (None: another host)
    failure: str = ""  # what the writer said of its failure to write (WriterFailed, or the sidecar)
    # problems and gaps past the reader's MAX_LISTED: (problems, bytes skipped, gaps, frames lost)
    unlisted: tuple[int, int, int, int] = (0, 0, 0, 0)
    duplicates: int = 0  # frames dropped as duplicates

    @property
    def lost_frames(self) -> int:
        return sum(g.lost for g in self.gaps) + self.unlisted[3]

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "bytes": self.size,
            "format_version": self.format_version,
            "run_id": self.run_id,
            "resume_step": self.resume_step,
            "events": self.events,
            "closed_cleanly": self.closed_cleanly,
            "close_reason": self.close_reason,
            "torn_bytes": self.torn_bytes,
            "superseded": self.superseded,
            "problems": [
                {"offset": p.offset, "what": p.what, "bytes_skipped": p.skipped} for p in self.problems
            ],
            "lost_frames": self.lost_frames,
            "error": self.error,
            "writer_pid": self.writer_pid,
            "writer_host": self.writer_host,
            "writer_running": self.writer_running,
            "writer_failure": self.failure,
            "duplicate_frames": self.duplicates,
        }


@dataclass
class RankSummary:
    rank: int
    dirs: tuple[str, ...]
    files: list[FileSummary]
    counts: Counter = field(default_factory=Counter)
    steps: set[int] = field(default_factory=set)
    stats_steps: set[int] = field(default_factory=set)
    stat_values: int = 0
    anomalies: int = 0
    dropped_records: int = 0
    hook_failures: int = 0
    skipped_steps: list[int] = field(default_factory=list)  # optimizer steps that never ran (inf/NaN)
    # what the monitor said, in order: configs rejected, monitoring started (dynamic mode) and
    # stopped, the first failure of each hook (at most MAX_NOTES)
    notes: list[str] = field(default_factory=list)
    unended: list[int] = field(default_factory=list)  # steps that began and did not end
    # the run's end after the last step: passes of the model inside other optimizers' steps only (a GAN's
    # discriminator in the generator's), under the next step's number; not counted in ``steps``
    foreign_passes: list[int] = field(default_factory=list)

    @property
    def first_step(self) -> int | None:
        return min(self.steps) if self.steps else None

    @property
    def last_step(self) -> int | None:
        return max(self.steps) if self.steps else None

    @property
    def closed_cleanly(self) -> bool:
        return bool(self.files) and self.files[-1].closed_cleanly

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "dirs": list(self.dirs),
            "steps": len(self.steps),
            "steps_with_stats": len(self.stats_steps),
            "first_step": self.first_step,
            "last_step": self.last_step,
            "events": dict(sorted(self.counts.items())),
            "stat_values": self.stat_values,
            "anomalies": self.anomalies,
            "dropped_records": self.dropped_records,
            "hook_failures": self.hook_failures,
            "optimizer_skipped_steps": self.skipped_steps,
            "notes": self.notes,
            "steps_not_ended": self.unended,
            "foreign_passes_after_last_step": self.foreign_passes,
            "closed_cleanly": self.closed_cleanly,
            "torn_bytes": sum(f.torn_bytes for f in self.files),
            "damage": sum(len(f.problems) for f in self.files),
            "lost_frames": sum(f.lost_frames for f in self.files),
            "files": [f.to_json() for f in self.files],
        }


@dataclass
class RunSummary:
    path: str
    run_id: str
    world_size: int
    format_versions: list[int]
    ranks: list[RankSummary]
    missing_ranks: list[int] = field(default_factory=list)  # of the world size, no log found (output dir)
    unattributed: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of headerless files beside
    conflict: str = ""  # its run id is shared by launches that do not resume one another (discover)

    @property
    def anomalies(self) -> int:
        return sum(r.anomalies for r in self.ranks)

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "run_id": self.run_id,
            "format_versions": self.format_versions,
            "world_size": self.world_size,
            "ranks": [r.rank for r in self.ranks],
            "anomalies": self.anomalies,
            "per_rank": [r.to_json() for r in self.ranks],
            "missing_ranks": self.missing_ranks,
            "unattributed_files": [{"path": p, "what": w} for p, w in self.unattributed],
            "conflict": self.conflict,
        }


MAX_NOTES = 20


def _unreadable(f: LogFile) -> str:
    """Why a file's header cannot be read, without its path."""
    err = f.error
    if err is None:
        return "no file header (empty, or cut before the end of its header)"
    return err.message + (f" (at byte {err.offset})" if err.offset else "")


def _note(rs: RankSummary, text: str) -> None:
    if len(rs.notes) < MAX_NOTES:
        rs.notes.append(text)
    elif len(rs.notes) == MAX_NOTES:
        rs.notes.append("... (all of them: trainrec dump RUN --type cr,mx,hx,sl,xr)")


def summarize(run: Run, ranks: list[RankSummary] | None = None) -> RunSummary:
    """Read the whole run once and summarise it per rank and per file. ``ranks``: the summaries of
    every rank, made already (by :func:`summarize_rank`, in other processes)."""
    if ranks is None:
        ranks = [summarize_rank(run, r) for r in run.ranks]
    return RunSummary(
        path=run.where,
        run_id=run.run_id,
        world_size=run.world_size,
        format_versions=run.format_versions,
        ranks=ranks,
        missing_ranks=run.missing_ranks,
        unattributed=[(f.path, _unreadable(f)) for f in run.unattributed],
        conflict=run.info.conflict,
    )


def summarize_rank(run: Run, r: int) -> RankSummary:
    """Read one rank of the run and summarise it per file."""
    rs = RankSummary(rank=r, dirs=run.rank_dirs.get(r, ()), files=[])
    counts = rs.counts
    failed: set[str] = set()
    began: set[int] = set()
    ended: set[int] = set()
    foreign: set[int] = set()
    for ev in run.events(rank=r, columnar=True):  # (stats records as columns: the same, decoded faster)
        t = type(ev)
        if t is StatsColumns:
            t = TensorStatsRecorded
        counts[t.__name__] += 1
        if t in _STEP_TYPES and ev.step >= 0:
            rs.steps.add(ev.step)
            if t is TensorStatsRecorded:
                rs.stats_steps.add(ev.step)
                rs.stat_values += len(ev.name_ids) // 4 * len(ev.ops)
            elif t is StepEnded:
                ended.add(ev.step)
                if ev.optimizer_skipped:
                    rs.skipped_steps.append(ev.step)
                if ev.foreign_passes:
                    foreign.add(ev.step)
            elif t is StepBegan:
                began.add(ev.step)
        elif t is AnomalyDetected:
            rs.anomalies += 1
        elif t is RecordsDropped:
            rs.dropped_records += ev.count
        elif t is HookFailed:
            rs.hook_failures += ev.count
            if ev.where not in failed:
                failed.add(ev.where)
                _note(rs, f"step {ev.step}: {ev.where} failed: {ev.error}")
        elif t is ConfigRejected:
            _note(rs, f"step {ev.step}: config rejected: {ev.reason}")
        elif t is MonitoringStopped:
            _note(rs, f"step {ev.step}: monitoring stopped: {ev.reason}")
        elif t is StallDetected:  # (the stall watchdog: one note per report, as it is written)
            where = f" in {ev.collective_op} #{ev.collective_seq}" if ev.collective_op else ""
            mod = f", module {ev.modules[-1]}" if ev.modules else ""
            _note(rs, f"step {ev.step}: STALL: running for {ev.elapsed:.1f} s (threshold {ev.threshold:.1f} s)"
                      f"{where}{mod}")
        elif t is ExceptionRaised:
            mod = f" in module {ev.modules[-1]}" if ev.modules else ""
            _note(rs, f"step {ev.step}: ended by an exception{mod}: {ev.error[:300]}")
        elif t is ConfigApplied and ev.reason == "dynamic":
            _note(rs, f"step {ev.step}: monitoring started (dynamic config); first collected step {ev.start_step}")
    rs.unended = sorted(began - ended)
    rs.foreign_passes = sorted(foreign)
    rs.steps -= foreign
    rs.stats_steps -= foreign
    readers = run.readers_of([r])  # (this rank's only: the others are read in their turn)
    for lf in run.log_files(r):
        try:
            size = os.path.getsize(lf.path)
        except OSError:
            size = 0
        fs = FileSummary(
            path=lf.path,
            size=size,
            format_version=lf.version,
            run_id=lf.run_id,
            resume_step=lf.resume_step,
            superseded=run.superseded.get(lf.path, 0),
        )
        err = run.file_errors.get(lf.path)
        reader = readers.get(lf.path)
        if err is not None or reader is None:
            fs.error = str(err) if err is not None else "not read"
        else:
            fs.events = reader.events_read
            fs.closed_cleanly = reader.closed_cleanly
            fs.close_reason = reader.closed_event.reason if reader.closed_event else ""
            fs.torn_bytes = reader.pending_bytes
            fs.end_offset = reader.offset
            fs.problems = list(reader.problems)
            fs.gaps = list(reader.gaps)
            fs.first_record_is_header = reader.events_read == 0 or isinstance(reader.header, FileOpened)
            fs.duplicates = reader.duplicates
            fs.unlisted = (reader.unlisted_problems, reader.unlisted_skipped, reader.unlisted_gaps,
                           reader.unlisted_lost)
            fs.failure = _failure_text_of(reader.failure) if reader.failure is not None else _sidecar(lf.path)
            if isinstance(reader.header, FileOpened):
                fs.writer_pid, fs.writer_host = reader.header.pid, reader.header.host
                if not fs.closed_cleanly and fs.writer_pid and fs.writer_host == socket.gethostname():
                    fs.writer_running = writer_running(reader.header)
        rs.files.append(fs)
    return rs


SIDECAR_SUFFIX = ".failed.json"  # (the writer's FAILED_SUFFIX)


def _failure_text(first_lost_seq: int, discarded: int, last_step: int, error: str) -> str:
    upto = f", up to step {last_step}" if last_step >= 0 else ""
    return (f"the writer failed to write ({error[:300]}): from record {first_lost_seq} on, {discarded} record(s) "
            f"or batches handed over{upto} were never written")


def _failure_text_of(ev) -> str:
    return _failure_text(ev.first_lost_seq, ev.discarded, ev.last_step, ev.error)


def _sidecar(path: str) -> str:
    """What the sidecar of a log whose writer failed says (bounded and checked: untrusted), or ""."""
    try:
        with open(path + SIDECAR_SUFFIX, "rb") as f:
            doc = json.loads(f.read(1 << 16))
        return "(from its sidecar) " + _failure_text(int(doc.get("first_lost_seq", 0)), int(doc.get("discarded", 0)),
                                                     int(doc.get("last_step", -1)), str(doc.get("error", "")))
    except FileNotFoundError:
        return ""
    except (OSError, ValueError, TypeError, AttributeError):
        return f"its writer left a sidecar {path + SIDECAR_SUFFIX} that cannot be read: it failed to write"
