"""The name ids one log file has interned so far, and what a record says about them that contradicts
the file (see :mod:`trainrec.replay.reader`, which reports it as an ``inconsistent record``).

A file interns names in dense id ranges (NamesInterned); stats records and HooksFired use those ids.
A NamesRepeated (the writer's copy of a name table) stands in for a table whose frame was lost.
"""

from __future__ import annotations

import numpy as np
from trainrec.schema.events import Event, HooksFired, NamesInterned, NamesRepeated, unpack_array

__all__ = ["NameRanges"]


class NameRanges:
    """Interned id ranges ``[lo, hi)`` of one file (sorted, disjoint), and the id columns known to use
    only interned ids (tables only grow, so a column known stays known)."""

    def __init__(self) -> None:
        self.ranges: list[list[int]] = [[0, 0]]  # id ranges [lo, hi) interned so far, sorted, disjoint
        self.known_ids: set[bytes] = set()  # id columns whose ids were all interned (tables only grow)
        self._unknown_ids_reported = False

    def repeated_names(self, ev: NamesRepeated) -> list[Event]:
        """A copy of a name table: itself where its ids are known (the original was read), else first
        the names of the ids not known yet, as the NamesInterned records the original would have given
        (consumers resolve names from those), then itself."""
        lo, hi = ev.first_id, ev.first_id + len(ev.names)
        missing: list[tuple[int, int]] = []
        at = lo
        for a, b in self.ranges:
            if b <= at or a >= hi:
                continue
            if a > at:
                missing.append((at, a))
            at = max(at, b)
        if at < hi:
            missing.append((at, hi))
        if not missing:
            return [ev]
        out: list[Event] = []
        for a, b in missing:
            _add_range(self.ranges, a, b)
            out.append(NamesInterned(seq=ev.seq, rank=ev.rank, step=ev.step, wall=ev.wall, first_id=a,
                                     names=ev.names[a - lo : b - lo]))
        out.append(ev)
        return out

    def names_problem(self, ev: Event, lost: bool) -> str | None:
        """What a record says about name ids that contradicts the file so far, or None. ``lost``: a frame
        of the file could not be read (later unknown ids follow from it)."""
        ranges = self.ranges
        if isinstance(ev, NamesInterned):
            lo, hi = ev.first_id, ev.first_id + len(ev.names)
            expected = ranges[-1][1]
            what = None
            if lo < expected:
                what = f"names interned from id {lo}, but ids up to {expected - 1} are taken (ids are dense per file)"
            elif lo > expected and not lost:
                what = (f"names interned from id {lo}, but the next free id is {expected} and no record "
                        "was lost (ids are dense per file)")
            _add_range(ranges, lo, hi)
            return what
        ids = ev.module_ids if type(ev) is HooksFired else ev.name_ids  # type: ignore[attr-defined]
        if not ids or (len(ids) <= 1 << 16 and ids in self.known_ids):  # (a column known stays known)
            return None
        # (numpy's max: a Python max over the ids boxed each one, and took half the reading time)
        top = int(np.frombuffer(ids, dtype="<u4").max())
        if top < ranges[0][1] or lost or self._unknown_ids_reported:
            if top < ranges[0][1] and len(ids) <= 1 << 16 and len(self.known_ids) < 64:  # (4 MiB at most)
                self.known_ids.add(ids)
            return None
        col = unpack_array("I", ids)
        unknown = next((i for i in col if not _in_ranges(ranges, i)), None)
        if unknown is None:
            return None
        self._unknown_ids_reported = True
        return (f"name id {unknown} was never interned in this file (shown as <unknown name {unknown}>; "
                "later unknown ids of this file are not reported)")


def _add_range(ranges: list[list[int]], lo: int, hi: int) -> None:
    """Add ``[lo, hi)`` to sorted disjoint ranges, merging what touches."""
    if hi <= lo:
        return
    ranges.append([lo, hi])
    ranges.sort()
    merged = [ranges[0]]
    for r in ranges[1:]:
        if r[0] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], r[1])
        else:
            merged.append(r)
    ranges[:] = merged


def _in_ranges(ranges: list[list[int]], i: int) -> bool:
    return any(lo <= i < hi for lo, hi in ranges)
