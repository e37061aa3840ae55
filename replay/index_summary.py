"""What a run holds, from its files' headers and closing records (``trainrec inspect --quick``).

For a file closed with a step index (FileClosed's ``index_*``) the steps recorded and the number of
records come from that last record alone, checked like any index (see :mod:`.stepindex`: its arrays,
and the frames where its first and last segments start); any other file (not closed, an older
writer, an index that does not fit) is scanned (:mod:`.index_scan`: every frame checked, no record
decoded), and read whole where the scan gives up (damage). Supersession by
a resume applies to the steps of a rank (a file's steps from its successor's resume step on are not
counted), not to the files' record counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from trainrec.schema.errors import FormatError

from .index_scan import scan_index
from .reader import LogReader
from .run import Run
from .stepindex import BadIndex, check_segments, load_index

__all__ = ["QuickFile", "QuickRank", "quick_rank"]


@dataclass
class QuickFile:
    path: str
    size: int
    records: int = 0
    steps: list[int] = field(default_factory=list)  # distinct steps >= 0 of its records, sorted
    closed_cleanly: bool = False
    close_reason: str = ""
    torn_bytes: int = 0
    damage: int = 0  # regions of damage found (a file read whole only)
    source: str = "index"  # "index", "scan" or "read whole" (and why the index was not used)
    error: str | None = None

    def to_json(self) -> dict:
        return {"path": self.path, "bytes": self.size, "records": self.records, "steps": len(self.steps),
                "first_step": self.steps[0] if self.steps else None, "last_step": self.steps[-1] if self.steps else None,
                "closed_cleanly": self.closed_cleanly, "close_reason": self.close_reason, "torn_bytes": self.torn_bytes,
                "damage": self.damage, "source": self.source, "error": self.error}


@dataclass
class QuickRank:
    rank: int
    files: list[QuickFile]
    steps: list[int]  # the rank's steps after supersession

    @property
    def records(self) -> int:
        return sum(f.records for f in self.files)

    def to_json(self) -> dict:
        return {"rank": self.rank, "steps": len(self.steps), "first_step": self.steps[0] if self.steps else None,
                "last_step": self.steps[-1] if self.steps else None, "records": self.records,
                "files": [f.to_json() for f in self.files]}


def quick_file(path: str) -> QuickFile:
    """One file from its index, else read whole."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    qf = QuickFile(path, size)
    ix, why = load_index(path)
    if ix is not None:
        try:
            with open(path, "rb") as f:
                check_segments(f, ix, (0, len(ix.steps) - 1))
        except BadIndex as exc:
            ix, why = None, str(exc)
        except OSError:
            ix = None
    ignored = f" (step index ignored: {why})" if why else ""
    if ix is None:
        ix = scan_index(path)
        qf.source = "scan" + ignored
    if ix is not None:
        qf.records, qf.steps = ix.index_seq + ix.closed, ix.steps.tolist()
        qf.closed_cleanly, qf.close_reason = ix.closed, ix.close_reason
        qf.torn_bytes = 0 if ix.end < 0 else ix.size - ix.end
        return qf
    qf.source = "read whole" + ignored
    reader = LogReader(path)
    steps: set[int] = set()
    try:
        for ev in reader:
            if ev.step >= 0:
                steps.add(ev.step)
    except FormatError as exc:
        qf.error = str(exc)
    qf.records = reader.events_read
    qf.steps = sorted(steps)
    qf.closed_cleanly = reader.closed_cleanly
    qf.close_reason = reader.closed_event.reason if reader.closed_event else ""
    qf.torn_bytes = reader.pending_bytes
    qf.damage = len(reader.problems) + reader.unlisted_problems
    return qf


def quick_rank(run: Run, rank: int) -> QuickRank:
    """The files of ``rank`` and its steps after supersession."""
    files = [quick_file(p) for p in run.files(rank)]
    steps: set[int] = set()
    for qf in files:
        cut = run.cutoffs.get(qf.path)
        a = np.asarray(qf.steps, dtype=np.int64)
        steps.update((a if cut is None else a[a < cut]).tolist())
    return QuickRank(rank, files, sorted(steps))
