"""The anomaly scan of ``trainrec anomalies`` by rank partition (see :mod:`trainrec.tools.partition`).

Each part reads its ranks one at a time into a :class:`~trainrec.analyzers.columnar.ColumnarScan`
and hands back a :class:`~trainrec.analyzers.columnar.ScanPart` with its files' damage notes. A
record naming another rank than its file's ties ranks together; then the whole run is scanned again
in one merged stream, so the answer never depends on the parts.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainrec.analyzers.anomalies import AnomalyScan
from trainrec.analyzers.columnar import ColumnarScan, ScanPart, merge_parts
from trainrec.replay.discover import RunInfo
from trainrec.replay.run import Run
from trainrec.schema.rules import Rule

from .partition import partition_ranks, rank_bytes, run_parts, sub_info

__all__ = ["damage_notes", "scan_parts", "scan_ranks"]


def damage_notes(run: Run, ranks: Sequence[int]) -> list[tuple[str, str]]:
    """``(path, note)`` for files of ``ranks`` that could not be read, were damaged or end torn, in
    rank and file order (the files must have been read)."""
    notes: list[tuple[str, str]] = []
    readers = run.readers_of(ranks)
    for r in ranks:
        for path in run.files(r):
            err = run.file_errors.get(path)
            if err is not None:
                notes.append((path, f"skipped {path}: {err}"))
                continue
            reader = readers.get(path)
            if reader is None:
                continue
            notes.extend((path, str(p)) for p in reader.problems[:5])
            if reader.pending_bytes:
                notes.append((path, f"{path} ends in an incomplete record ({reader.pending_bytes} bytes: still being "
                                    "written, or the run crashed); everything before it is used"))
    return notes


def scan_ranks(info: RunInfo, ranks: Sequence[int], rules: Sequence[Rule], kinds: Sequence[str] | None,
               steps=None) -> ScanPart:
    """The scan of some ranks of a launch (a part's work; runs in any process that sees the files).
    ``steps``: read only these step ranges (see :meth:`Run.events`); the part's first and last step
    are then the files' recorded span, not only the steps read."""
    run = Run(info)
    parts = []
    foreign = False
    for r in ranks:
        scan = ColumnarScan([type(rule)(**rule.args) for rule in rules], kinds)
        for ev in run.events(rank=r, steps=steps, columnar=True):
            if ev.rank != r:
                foreign = True
            scan.feed(ev)
        parts.append(scan.finish().part())
    out = merge_parts(parts)
    out.notes = damage_notes(run, ranks)
    out.foreign = foreign
    _recorded_span(out, run, ranks, steps)
    return out


def _recorded_span(part: ScanPart, run: Run, ranks: Sequence[int], steps) -> None:
    if steps is not None:
        span = run.step_span(ranks)
        part.first_step, part.last_step = span if span is not None else (None, None)


def _serial(run: Run, rules: Sequence[Rule], kinds: Sequence[str] | None, steps=None) -> ScanPart:
    scan = AnomalyScan([type(rule)(**rule.args) for rule in rules], kinds).feed_all(run.events(steps=steps, columnar=True))
    out = ScanPart(
        detected=scan.detected, recorded=scan.recorded, first_step=scan.first_step, last_step=scan.last_step,
        ranks=scan.ranks, stats_records=scan.stats_records, bad_records=scan.bad_records,
        skipped_steps=scan.skipped_steps, notes=damage_notes(run, run.ranks),
    )
    _recorded_span(out, run, run.ranks, steps)
    return out


def scan_parts(run: Run, rules: Sequence[Rule], kinds: Sequence[str] | None, jobs: int = 1,
               engine: str = "local", cluster: str | None = None, progress: bool | None = None,
               steps=None) -> ScanPart:
    """Recorded and (with ``rules``) re-detected anomalies of every rank of ``run``; ``steps``: only
    the records of these step ranges are read (through the logs' step indexes where they have one)."""
    ranks = run.ranks
    groups = partition_ranks(run, ranks, len(ranks) if jobs <= 1 else jobs * 4)
    weights = [sum(rank_bytes(run, r) for r in g) for g in groups]
    args = [(sub_info(run, g), g, list(rules), kinds, steps) for g in groups]
    what = "re-detect" if rules else "anomalies"
    parts = run_parts(scan_ranks, args, weights, jobs, what, engine=engine, cluster=cluster, progress=progress)
    merged = merge_parts(parts)
    if merged.foreign:
        return _serial(run, rules, kinds, steps)
    return merged
