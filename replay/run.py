"""A run: the per-rank logs of one training launch, replayed as one stream of events.

``open_run(path)`` accepts an output directory (the latest launch, or one chosen by ``run_id``
prefix or a ``time_start``/``time_end`` range), one rank directory, or one log file (grouping into
launches: :mod:`trainrec.replay.discover`). :meth:`Run.events` keeps each rank's own order and merges
the ranks by step; a file beginning with RunResumed from step ``S`` supersedes the records with
``step >= S`` in the rank's earlier files ("last writer wins", counted in :attr:`Run.superseded`).
Both rules in full: ``docs/python-api.md``, "Event order and resumes".
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from trainrec.schema.errors import FormatError
from trainrec.schema.events import (
    TAGS,
    Event,
    FileClosed,
    FileOpened,
    NamesInterned,
    TensorStatsRecorded,
    UnknownEvent,
)

from .discover import LogFile, RunInfo
from .names import NameResolver
from .reader import LogReader
from .rows import rows_from_events
from .run_select import find_run
from .stats_columns import StatsColumns
from .stepindex import StepRanges, read_steps

log = logging.getLogger(__name__)

_KEEP = (FileOpened, FileClosed, NamesInterned)

_TYPE_NAMES: dict[str, type[Event]] = {}
for _cls in (*TAGS.values(), UnknownEvent):
    _TYPE_NAMES[_cls.TAG.lower()] = _cls
    _TYPE_NAMES[_cls.__name__.lower()] = _cls


def resolve_types(types: Iterable[str | type[Event]] | str | type[Event]) -> frozenset[type[Event]]:
    """Event classes named by classes, tags (``ts``) or class names (``TensorStatsRecorded``, any case).

    Raises ValueError naming an unknown type and listing the known ones.
    """
    if isinstance(types, (str, type)):
        types = [types]
    out = set()
    for t in types:
        if isinstance(t, type):
            out.add(t)
            continue
        cls = _TYPE_NAMES.get(str(t).lower())
        if cls is None:
            known = ", ".join(f"{c.__name__} ({c.TAG})" for c in TAGS.values())
            raise ValueError(f"unknown event type {t!r}; known: {known}")
        out.add(cls)
    return frozenset(out)


class Run:
    """The ranks, files and events of one launch. Build it with :func:`open_run`."""

    def __init__(self, info: RunInfo, where: str = "") -> None:
        self.info = info
        self.where = where
        self.run_id = info.run_id
        self._files: dict[int, list[LogFile]] = {r: list(fs) for r, fs in info.files.items()}
        self.ranks: list[int] = sorted(self._files)
        self.rank_dirs: dict[int, tuple[str, ...]] = info.rank_dirs
        self.headers = {f.path: f.header for f in info.all_files if f.header is not None}
        # Errors found opening a file (not a log, unreadable); such files contribute no events.
        self.file_errors: dict[str, FormatError] = {f.path: f.error for f in info.all_files if f.error}
        self.superseded: dict[str, int] = {}
        self.cutoffs: dict[str, int] = {}
        for fs in self._files.values():
            cut: int | None = None
            for f in reversed(fs):
                if cut is not None:
                    self.cutoffs[f.path] = cut
                if f.resume_step is not None:
                    cut = f.resume_step if cut is None else min(cut, f.resume_step)
        self._readers: dict[str, LogReader] = {}
        # per file read with a step selection: its lowest and highest step >= 0 after supersession
        self.step_spans: dict[str, tuple[int, int] | None] = {}
        # Called with the bytes of log read since its last call, as files are read (progress bars).
        self.on_bytes: Callable[[int], None] | None = None
        # Merging holds one read chunk per rank: keep their sum bounded (4 MiB each up to 64 ranks).
        self._chunk = max(64 << 10, min(4 << 20, (256 << 20) // max(1, len(self.ranks))))

    @property
    def missing_ranks(self) -> list[int]:
        """RUN an output directory: the ranks of the world size with no log there (see find_run)."""
        return self.info.missing_ranks

    @property
    def unattributed(self) -> list[LogFile]:
        """RUN an output directory: the files there whose header cannot be read, in no run."""
        return list(self.info.unattributed)

    def __repr__(self) -> str:
        return f"<Run {self.run_id!r} ranks={self.ranks} files={sum(len(v) for v in self._files.values())}>"

    # ------------------------------------------------------------------ layout
    def files(self, rank: int) -> list[str]:
        """Log paths of ``rank`` in writing order."""
        return [f.path for f in self._files.get(rank, [])]

    def log_files(self, rank: int) -> list[LogFile]:
        return list(self._files.get(rank, []))

    @property
    def world_size(self) -> int:
        sizes = [h.world_size for h in self.headers.values()]
        return max(sizes) if sizes else len(self.ranks)

    @property
    def format_versions(self) -> list[int]:
        return sorted({f.version for fs in self._files.values() for f in fs if f.version is not None})

    @property
    def readers(self) -> dict[str, LogReader]:
        """One LogReader per file, after a full read (problems, gaps, torn bytes, closed cleanly).

        Files already read to their end by :meth:`events` are not read again.
        """
        return self.readers_of(self.ranks)

    def readers_of(self, ranks: Iterable[int]) -> dict[str, LogReader]:
        """:attr:`readers` of the files of ``ranks`` only."""
        ranks = list(ranks)
        for r in ranks:
            if any(p not in self._readers and p not in self.file_errors for p in self.files(r)):
                for _ in self._rank_events(r, only_unread=True):
                    pass
        return {p: self._readers[p] for r in ranks for p in self.files(r) if p in self._readers}

    # ------------------------------------------------------------------ events
    def events(
        self, rank: int | Iterable[int] | None = None, types: Iterable[str | type[Event]] | None = None,
        steps: StepRanges | None = None, columnar: bool = False,
    ) -> Iterator[Event]:
        """Events of ``rank`` (default: all ranks, merged; see the module docstring for the order),
        optionally only those of ``types`` (classes, tags or class names). ``steps``: ranges
        ``(first, last or None)``: only what a step selection keeps, read through the files' step
        indexes where they have valid ones (see :mod:`trainrec.replay.stepindex`). ``columnar``: stats
        records come as :class:`~trainrec.replay.stats_columns.StatsColumns` where they can."""
        ranks = self._select_ranks(rank)
        wanted = resolve_types(types) if types is not None else None
        if wanted is not None and columnar and TensorStatsRecorded in wanted:
            wanted |= {StatsColumns}
        if len(ranks) == 1:
            for ev in self._rank_events(ranks[0], steps=steps, columnar=columnar):
                if wanted is None or type(ev) in wanted:
                    yield ev
            return
        for item in heapq.merge(*(self._keyed(r, wanted, steps, columnar) for r in ranks)):
            yield item[3]

    def step_span(self, ranks: Iterable[int] | None = None) -> tuple[int, int] | None:
        """The lowest and highest step >= 0 recorded in the files of ``ranks`` read with a step
        selection (from their indexes, or their whole read), after supersession; None when none."""
        spans = [s for r in (self.ranks if ranks is None else ranks) for p in self.files(r)
                 if (s := self.step_spans.get(p)) is not None]
        return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None

    def stats(
        self, kinds: Iterable[str] | None = None, rank: int | Iterable[int] | None = None
    ) -> Iterator[tuple[TensorStatsRecorded, list[str]]]:
        """``(record, names of its rows)`` for every stats record, optionally of some ``kinds`` only."""
        wanted = None if kinds is None else set(kinds)
        resolver = NameResolver()
        # Steps usually repeat the same rows: resolve each (rank, table, id column) once.
        # A rank's generation changes whenever its name table may have changed.
        cache: dict[tuple, list[str]] = {}
        gen: dict[int, int] = {}
        for ev in self.events(rank):
            t = type(ev)
            if t is TensorStatsRecorded:
                if wanted is None or ev.kind in wanted:
                    key = (ev.rank, gen.get(ev.rank, 0), ev.name_ids)
                    names = cache.get(key)
                    if names is None:
                        if len(cache) > 4096:
                            cache.clear()
                        names = cache[key] = resolver.names(ev)
                    yield ev, list(names)
            else:
                if t is NamesInterned or t is FileOpened:
                    gen[ev.rank] = gen.get(ev.rank, 0) + 1
                resolver.feed(ev)

    def to_rows(
        self, kinds: Iterable[str] | None = None, rank: int | Iterable[int] | None = None
    ) -> dict[str, np.ndarray]:
        """Stats as flat columns, one row per (tensor, op); see :mod:`trainrec.replay.rows`."""
        return rows_from_events(self.events(rank), kinds)

    # ------------------------------------------------------------------ internals
    def _select_ranks(self, rank: int | Iterable[int] | None) -> list[int]:
        if rank is None:
            return list(self.ranks)
        wanted = [rank] if isinstance(rank, int) else list(rank)
        missing = [r for r in wanted if r not in self._files]
        if missing:
            raise ValueError(f"rank(s) {missing} not in run {self.run_id!r} (ranks: {self.ranks})")
        return sorted(set(wanted))

    def _keyed(self, rank: int, wanted: frozenset[type[Event]] | None, steps: StepRanges | None = None,
               columnar: bool = False) -> Iterator[tuple]:
        step = -1
        i = 0
        for ev in self._rank_events(rank, steps=steps, columnar=columnar):
            if ev.step > step:
                step = ev.step
            i += 1
            if wanted is None or type(ev) in wanted:
                yield (step, rank, i, ev)

    def _rank_events(self, rank: int, only_unread: bool = False, steps: StepRanges | None = None,
                     columnar: bool = False) -> Iterator[Event]:
        for lf in self._files[rank]:
            path = lf.path
            if path in self.file_errors or (only_unread and path in self._readers):
                continue
            cut = self.cutoffs.get(path)
            span = None
            if steps is None:
                reader = LogReader(path, chunk_size=self._chunk, columnar=columnar)
                stream: Iterable[Event] = reader
            else:
                reader, stream, span = read_steps(path, steps, self._chunk, columnar)
            dropped = 0
            report, done = self.on_bytes, 0
            try:
                for i, ev in enumerate(stream):
                    if report is not None and not i & 255:
                        report(reader.bytes_read - done)
                        done = reader.bytes_read
                    if cut is not None and ev.step >= cut and not isinstance(ev, _KEEP):
                        dropped += 1
                        continue
                    yield ev
            except FormatError as exc:
                log.warning("trainrec: skipping %s", exc)
                self.file_errors[path] = exc
                continue
            if report is not None:
                report(reader.bytes_read - done)
            self._readers[path] = reader
            self.superseded[path] = dropped
            if span is not None:
                hi = span[1] if cut is None else min(span[1], cut - 1)
                self.step_spans[path] = (span[0], hi) if 0 <= span[0] <= hi else None


def open_run(
    path: str, *, run_id: str | None = None, time_start: str | None = None, time_end: str | None = None
) -> Run:
    """Open RUN: an output directory, a rank directory or a log file (see the module docstring).

    Raises NotARunError (with a listing of the candidates when a selection is ambiguous or matches
    nothing), NotALogError or UnsupportedVersionError, naming the path.
    """
    return Run(find_run(path, run_id, time_start, time_end), where=path)
