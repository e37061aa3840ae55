"""The items a projection (:mod:`.projection`) yields: :class:`KindFrame` (every row of one kind at one
step, over a :class:`RowLayout` of the rows' identity columns), :class:`Note` and :class:`Rewind`; with
the row bookkeeping of frames: duplicate rows settled (the last values kept), the layouts of one step's
records merged, and the rows the reference's files hold (:func:`reference_rows`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from trainrec.schema.events import SLOTS

__all__ = ["KindFrame", "Note", "Rewind", "RowLayout", "merge_layouts", "reference_rows", "unique_last"]


@dataclass(eq=False)
class RowLayout:
    """The identity columns of a frame's rows, shared by every frame with the same layout."""

    kind: str
    ops: tuple[str, ...]
    names: list[str]
    vpps: np.ndarray  # int64 per row
    micros: np.ndarray  # int64 per row
    slots: np.ndarray  # int64 per row (index into SLOTS)
    cache: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.names)

    def slot_name(self, i: int) -> str:
        s = int(self.slots[i])
        return SLOTS[s] if 0 <= s < len(SLOTS) else f"slot{s}"


@dataclass(eq=False)
class KindFrame:
    """Every row of one kind at one step: ``values`` is ``len(layout) x len(layout.ops)``."""

    rank: int
    kind: str
    step: int
    wall: float
    layout: RowLayout
    values: np.ndarray  # float32 or float64, C-contiguous

    @property
    def ops(self) -> tuple[str, ...]:
        return self.layout.ops


@dataclass(frozen=True)
class Note:
    """A text worth showing next to the scalars: an anomaly (``topic="anomalies"``) or a config switch."""

    rank: int
    step: int
    wall: float
    topic: str
    text: str
    kind: str = ""


@dataclass(frozen=True)
class Rewind:
    """Training resumed at ``step``: anything exported for steps >= ``step`` is superseded."""

    rank: int
    step: int
    wall: float


Item = KindFrame | Note | Rewind


def last_of_each(keys: list) -> np.ndarray | None:
    """Indices keeping the last occurrence of each key, in the order keys first appear; None if all unique."""
    if len(set(keys)) == len(keys):
        return None
    last: dict = {}
    for i, k in enumerate(keys):
        last[k] = i  # (a key keeps the place of its first insertion: the first-appearance order)
    return np.fromiter(last.values(), dtype=np.int64, count=len(last))


def unique_last(lay: RowLayout) -> np.ndarray | None:
    """Row indices keeping the last occurrence of each row key, in first-appearance order; None if all unique."""
    return last_of_each(list(zip(lay.vpps.tolist(), lay.names, lay.micros.tolist(), lay.slots.tolist(), strict=True)))


def reference_rows(lay: RowLayout) -> np.ndarray | None:
    """Rows of a frame that the reference's files hold, where fewer than the log's: for ``grad_unreduced``
    the row of each (vpp stage, name) at its highest micro step (the reference's ``acc_grad``; its file
    has no micro-step column), in the order parameters first got a gradient in the step, as the
    reference orders them. None where every row is kept. Cached on the layout."""
    if lay.kind != "grad_unreduced" or not len(lay) or not lay.micros.any():
        return None
    got = lay.cache.get("reference_rows", False)
    if got is not False:
        return got
    best: dict = {}
    for i, (v, n, m) in enumerate(zip(lay.vpps.tolist(), lay.names, lay.micros.tolist(), strict=True)):
        j = best.get((v, n))
        if j is None or m >= int(lay.micros[j]):
            best[(v, n)] = i
    rows = np.array(list(best.values()), dtype=np.int64)  # in first-appearance order of (vpp, name)
    lay.cache["reference_rows"] = rows if len(rows) < len(lay) else None
    return lay.cache["reference_rows"]


def merge_layouts(kind: str, lays: list[RowLayout]) -> tuple[RowLayout, list[list[int]], np.ndarray | None]:
    ops: list[str] = []
    for lay in lays:
        for o in lay.ops:
            if o not in ops:
                ops.append(o)
    col_maps = [[ops.index(o) for o in lay.ops] for lay in lays]
    merged = RowLayout(
        kind=kind,
        ops=tuple(ops),
        names=[n for lay in lays for n in lay.names],
        vpps=np.concatenate([lay.vpps for lay in lays]),
        micros=np.concatenate([lay.micros for lay in lays]),
        slots=np.concatenate([lay.slots for lay in lays]),
    )
    take = unique_last(merged)
    if take is not None:
        merged = RowLayout(
            kind=kind,
            ops=merged.ops,
            names=[merged.names[i] for i in take.tolist()],
            vpps=merged.vpps[take],
            micros=merged.micros[take],
            slots=merged.slots[take],
        )
    return merged, col_maps, take
