"""From a rank's event stream to complete per-(kind, step) frames: the shared half of every export.

The CSV and TensorBoard exports (offline or live) are projections of the log. Both need the same
thing first: the statistics of one kind at one step, with names resolved, duplicates settled and
only once the step is complete. :class:`StepAssembler` does that for the events of ONE rank's log
files, fed in order, and yields items:

* :class:`KindFrame`: every row of one kind at one step (all records of that kind and step merged;
  a row recorded twice keeps its last values, in the order rows first appeared);
* :class:`Note`: an anomaly or a config switch, as text, for the step it happened at;
* :class:`Rewind`: a resume superseded everything from ``step`` on (only useful to a live consumer;
  offline readers drop the superseded events before they get here).

A frame is emitted when its step is known to be complete: a ``StepEnded`` for it (or a later step),
data of a later step of the same kind, the end of its file (``FileClosed``) or :meth:`finish`. A log
that ends without ``FileClosed`` (still being written, or its writer died) may end in the middle of a
step: :meth:`finish` with ``clean=False`` then drops the frames of steps that never ended, when the
log has step markers at all, and reports them in :attr:`dropped_steps`.

Row layouts (resolved names, slots, micro steps, vpp stages) repeat step after step, so they are
built once and cached by the bytes of their columns; consumers cache their own derived products
(CSV row prefixes, TensorBoard templates) on the layout object (:attr:`RowLayout.cache`).
"""

from __future__ import annotations

import bisect
import logging
import re
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
from trainrec.replay.names import NameResolver
from trainrec.schema.events import (
    CSV_FILE_PREFIX,
    KINDS,
    SLOTS,
    AnomalyDetected,
    ConfigApplied,
    ConfigRejected,
    Event,
    FileClosed,
    FileOpened,
    MonitoringStopped,
    RunResumed,
    StepEnded,
    TensorStatsRecorded,
)

log = logging.getLogger(__name__)

__all__ = [
    "KindFrame",
    "Note",
    "Projector",
    "Rewind",
    "RowLayout",
    "SeenSteps",
    "StepAssembler",
    "StepSet",
    "parse_kinds",
    "parse_steps",
]

_LAYOUT_CACHE_MAX = 256


# ---------------------------------------------------------------------------------------- selection
class StepSet:
    """A set of steps given as ranges, e.g. ``"10-20,30"`` (both ends inclusive; ``"5-"`` open)."""

    def __init__(self, ranges: Iterable[tuple[int, int | None]]) -> None:
        self.ranges = tuple(ranges)

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        return any(lo <= step and (hi is None or step <= hi) for lo, hi in self.ranges)

    def __repr__(self) -> str:
        return f"StepSet({self.text()!r})"

    def text(self) -> str:
        return ",".join(f"{lo}" if lo == hi else f"{lo}-{'' if hi is None else hi}" for lo, hi in self.ranges)


class SeenSteps:
    """The steps an export wrote, in 8 bytes each (a live export runs as long as training does).

    Steps come in increasing order but for a resume's rewind (:meth:`drop_from`), which supersedes
    the steps from one on; an older step added again (an offline export of several files) is inserted
    in order. Iterates in step order."""

    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps = array("q")

    def add(self, step: int) -> None:
        a = self._steps
        if not a or step > a[-1]:
            a.append(step)
            return
        i = bisect.bisect_left(a, step)
        if a[i] != step:
            a.insert(i, step)

    def drop_from(self, step: int) -> None:
        """Forget the steps >= ``step``."""
        del self._steps[bisect.bisect_left(self._steps, step) :]

    def __iter__(self) -> Iterator[int]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        return f"SeenSteps({list(self._steps)!r})"


_RANGE_RE = re.compile(r"^\s*(\d+)\s*(?:([-:])\s*(\d*)\s*)?$")


def parse_steps(text: str, what: str = "step") -> StepSet:
    """Parse ``"10-20,30,40-"`` (``10:20`` is ``10-20``); raises ValueError saying which part is wrong."""
    ranges: list[tuple[int, int | None]] = []
    for part in str(text).split(","):
        m = _RANGE_RE.match(part)
        if not m:
            raise ValueError(f"bad {what} range {part.strip()!r} in {text!r} (expected e.g. '10-20,30')")
        lo = int(m.group(1))
        hi: int | None = lo if not m.group(2) else (int(m.group(3)) if m.group(3) else None)
        if hi is not None and hi < lo:
            raise ValueError(f"bad {what} range {part.strip()!r}: end before start")
        ranges.append((lo, hi))
    return StepSet(ranges)


def parse_kinds(values: Iterable[str] | str | None, valid: Iterable[str] = KINDS) -> tuple[str, ...]:
    """Data types from ``"actv,param"`` (or a list of such strings), in the order given; all when None.

    Raises ValueError naming the unknown type and listing the valid ones.
    """
    valid = tuple(valid)
    if values is None:
        return valid
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for v in values:
        for k in str(v).split(","):
            k = k.strip()
            if not k:
                continue
            if k not in valid:
                # the reference's CSV file prefix of a type ("other" is mg_direction) names it too
                k = next((kind for kind, prefix in CSV_FILE_PREFIX.items() if prefix == k and kind in valid), k)
            if k not in valid:
                aliases = "".join(f" ({p} for {kind})" for kind, p in CSV_FILE_PREFIX.items() if kind in valid)
                raise ValueError(f"unknown data type {k!r}; valid types: {', '.join(valid)}{aliases}")
            if k not in out:
                out.append(k)
    if not out:
        raise ValueError(f"no data type given; valid types: {', '.join(valid)}")
    return tuple(out)


# ---------------------------------------------------------------------------------------- items
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


# ---------------------------------------------------------------------------------------- assembler
@dataclass
class _Pending:
    rank: int
    step: int
    wall: float
    parts: list  # [(RowLayout, values ndarray)]


def _note_text(ev: Event) -> tuple[str, str] | None:
    if isinstance(ev, AnomalyDetected):
        where = ev.tag_name or f"{ev.kind}:{ev.name}"
        text = f"**{ev.rule or 'anomaly'}** `{where}` {ev.op}={ev.value!r} (baseline {ev.baseline!r})"
        if ev.message:
            text += f": {ev.message}"
        return "anomalies", text
    if isinstance(ev, ConfigApplied):
        return "config", f"config applied ({ev.reason or 'change'}), collecting from step {ev.start_step}: `{ev.path}` {ev.content_hash}"
    if isinstance(ev, ConfigRejected):
        keys = f" keys {', '.join(map(str, ev.keys))}" if ev.keys else ""
        return "config", f"config rejected{keys}: {ev.reason} (`{ev.path}`)"
    if isinstance(ev, MonitoringStopped):
        return "config", f"monitoring stopped after {ev.collections} collections: {ev.reason}"
    if isinstance(ev, RunResumed):
        return "config", f"run resumed at step {ev.step} (last step before: {ev.last_step}) {ev.reason}".rstrip()
    return None


class StepAssembler:
    """Turns one rank's events (fed in order) into complete :class:`KindFrame`s, notes and rewinds."""

    def __init__(
        self,
        kinds: Iterable[str] | None = None,
        steps: StepSet | None = None,
        notes: bool = True,
        note_kinds: Iterable[str] | None = None,
    ) -> None:
        self.kinds = frozenset(KINDS if kinds is None else kinds)
        # Anomalies of these kinds become notes (an export split by kinds keeps all notes in one part).
        self.note_kinds = self.kinds if note_kinds is None else frozenset(note_kinds)
        self.steps = steps
        self.notes = notes
        self.resolver = NameResolver()
        self._gen = 0
        self._layouts: dict = {}
        self._merged: dict = {}
        self._pending: dict[str, _Pending] = {}
        self._notes: list[Note] = []
        self._saw_step_end = False
        self.last_step_ended = -1
        self.dropped_steps: list[int] = []
        self.bad_records = 0

    # ------------------------------------------------------------------ feeding
    def feed(self, ev: Event) -> list[Item]:
        """Items completed by this event (usually none)."""
        self.resolver.feed(ev)
        if isinstance(ev, TensorStatsRecorded):
            return self._stats(ev)
        out: list[Item] = []
        if isinstance(ev, StepEnded):
            self._saw_step_end = True
            self.last_step_ended = max(self.last_step_ended, ev.step)
            self._flush_upto(ev.step, out)
        elif isinstance(ev, FileOpened):
            self._gen += 1
            if self._pending or self._notes:
                # The previous file ended without FileClosed (its writer died): its last step may be torn.
                self._end_unclean(out)
        elif isinstance(ev, FileClosed):
            self._flush_upto(None, out)
        elif isinstance(ev, RunResumed) and ev.step >= 0:
            self._drop_from(ev.step)
            out.append(Rewind(ev.rank, ev.step, ev.wall))
        if self.notes:
            nt = _note_text(ev)
            if nt is not None and self._wanted_note(ev):
                self._notes.append(Note(ev.rank, ev.step, ev.wall, nt[0], nt[1], getattr(ev, "kind", "")))
        return out

    @property
    def saw_step_end(self) -> bool:
        """Whether the stream had step markers (StepEnded): only then is a last step without its end
        known to be torn."""
        return self._saw_step_end

    def continue_after(self, saw_step_end: bool, last_step_ended: int) -> None:
        """Go on from a stream that was not fed here (an earlier export projected it): whether it had
        step markers, and the last step that ended in it (what tells a torn last step, see
        :meth:`finish`)."""
        self._saw_step_end = self._saw_step_end or saw_step_end
        self.last_step_ended = max(self.last_step_ended, last_step_ended)

    def finish(self, clean: bool = True) -> list[Item]:
        """Items still held at the end of the stream. ``clean=False``: the log did not end with FileClosed."""
        out: list[Item] = []
        if clean:
            self._flush_upto(None, out)
        else:
            self._end_unclean(out)
        return out

    def run(self, events: Iterable[Event], clean: bool = True) -> Iterator[Item]:
        """Feed a whole stream and yield every item."""
        for ev in events:
            yield from self.feed(ev)
        yield from self.finish(clean)

    # ------------------------------------------------------------------ internals
    def _wanted_note(self, ev: Event) -> bool:
        if self.steps is not None and ev.step >= 0 and ev.step not in self.steps:
            return False
        kind = getattr(ev, "kind", "")
        return not (isinstance(ev, AnomalyDetected) and kind and kind not in self.note_kinds)

    def _end_unclean(self, out: list[Item]) -> None:
        if self._saw_step_end:
            torn = sorted({p.step for p in self._pending.values() if p.step > self.last_step_ended})
            for kind in [k for k, p in self._pending.items() if p.step > self.last_step_ended]:
                del self._pending[kind]
            for s in torn:
                if s not in self.dropped_steps:
                    self.dropped_steps.append(s)
        self._flush_upto(None, out)

    def _drop_from(self, step: int) -> None:
        for kind in [k for k, p in self._pending.items() if p.step >= step]:
            del self._pending[kind]
        # the superseded steps' ends no longer count: a re-run step torn by a crash is dropped again
        self.last_step_ended = min(self.last_step_ended, step - 1)
        # a step cut short and then re-run by the resume is not missing from the export
        self.dropped_steps = [s for s in self.dropped_steps if s < step]
        self._notes = [n for n in self._notes if n.step < step]

    def _flush_upto(self, step: int | None, out: list[Item]) -> None:
        done = [k for k, p in self._pending.items() if step is None or p.step <= step]
        done.sort(key=lambda k: (self._pending[k].step, KINDS.index(k) if k in KINDS else len(KINDS)))
        for k in done:
            out.append(self._frame(k, self._pending.pop(k)))
        if self._notes:
            keep = []
            for n in self._notes:
                if step is None or n.step <= step:
                    out.append(n)
                else:
                    keep.append(n)
            self._notes = keep

    def _stats(self, ev: TensorStatsRecorded) -> list[Item]:
        kind = ev.kind
        if kind not in self.kinds:
            return []
        if self.steps is not None and ev.step not in self.steps:
            return []
        problem = ev.check()
        if problem is not None:
            self.bad_records += 1
            log.warning("trainrec export: skipping a %s record of rank %d step %d: %s", kind, ev.rank, ev.step, problem)
            return []
        n = len(ev)
        if n == 0 or not ev.ops:
            return []
        out: list[Item] = []
        pend = self._pending.get(kind)
        if pend is not None and pend.step != ev.step:
            out.append(self._frame(kind, self._pending.pop(kind)))
            pend = None
        layout = self._layout(ev)
        values = np.frombuffer(ev.values, dtype="<f4" if ev.dtype == "f" else "<f8").reshape(n, len(ev.ops))
        if pend is None:
            self._pending[kind] = _Pending(ev.rank, ev.step, ev.wall, [(layout, values)])
        else:
            pend.parts.append((layout, values))
            pend.wall = max(pend.wall, ev.wall)
        return out

    def _layout(self, ev: TensorStatsRecorded) -> RowLayout:
        key = (self._gen, self.resolver.generation, ev.kind, tuple(ev.ops), ev.name_ids, ev.micro_steps, ev.slots, ev.vpp_stages)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) >= _LAYOUT_CACHE_MAX:
                self._layouts.clear()
                self._merged.clear()
            n = len(ev)
            lay = RowLayout(
                kind=ev.kind,
                ops=tuple(str(o) for o in ev.ops),
                names=self.resolver.names(ev),
                vpps=np.frombuffer(ev.vpp_stages, dtype=np.uint8).astype(np.int64) if ev.vpp_stages else np.zeros(n, np.int64),
                micros=np.frombuffer(ev.micro_steps, dtype="<u2").astype(np.int64) if ev.micro_steps else np.zeros(n, np.int64),
                slots=np.frombuffer(ev.slots, dtype=np.uint8).astype(np.int64) if ev.slots else np.zeros(n, np.int64),
            )
            uniq = _unique_last(lay)
            lay.cache["_unique"] = uniq  # None when every row is distinct
            self._layouts[key] = lay
        return lay

    def _frame(self, kind: str, pend: _Pending) -> KindFrame:
        parts = pend.parts
        if len(parts) == 1:
            lay, vals = parts[0]
            if lay.cache.get("_unique") is None:
                return KindFrame(pend.rank, kind, pend.step, pend.wall, lay, vals)
        mkey = tuple((id(lay), lay.ops) for lay, _ in parts)
        merged = self._merged.get(mkey)
        if merged is None:
            merged = _merge_layouts(kind, [lay for lay, _ in parts])
            self._merged[mkey] = merged
        lay, col_maps, take = merged
        dtype = np.float32 if all(v.dtype == np.float32 for _, v in parts) else np.float64
        full = np.full((sum(len(v) for _, v in parts), len(lay.ops)), np.nan, dtype=dtype)
        r = 0
        for (_, v), cols in zip(parts, col_maps, strict=True):
            full[r : r + len(v), cols] = v
            r += len(v)
        values = full if take is None else np.ascontiguousarray(full[take])
        return KindFrame(pend.rank, kind, pend.step, pend.wall, lay, values)


def _unique_last(lay: RowLayout) -> np.ndarray | None:
    """Row indices keeping the last occurrence of each row key, in first-appearance order; None if all unique."""
    keys = list(zip(lay.vpps.tolist(), lay.names, lay.micros.tolist(), lay.slots.tolist(), strict=True))
    if len(set(keys)) == len(keys):
        return None
    last: dict = {}
    order: list = []
    for i, k in enumerate(keys):
        if k not in last:
            order.append(k)
        last[k] = i
    return np.array([last[k] for k in order], dtype=np.int64)


def reference_rows(lay: RowLayout) -> np.ndarray | None:
    """Rows of a frame the reference's files hold, where they are fewer than the log's: ``grad_unreduced``
    has one row per micro step in the log, and the reference one per step and parameter, the gradient
    accumulated at the last micro step (its ``acc_grad``: the file has no micro-step column). The indices
    of each (vpp stage, name)'s row of the highest micro step, in the log's order; None where every row
    is kept. They come in the order parameters first got a gradient in the step (the reference's: its
    table of them is filled as gradients first arrive), not in the last micro step's (a parameter used
    in a later micro step only comes after the others). Cached on the layout."""
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


def _merge_layouts(kind: str, lays: list[RowLayout]) -> tuple[RowLayout, list[list[int]], np.ndarray | None]:
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
    take = _unique_last(merged)
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


class Projector:
    """Base of the CSV and TensorBoard projectors: events go through a :class:`StepAssembler` and
    each item it completes goes to :meth:`_item`; :meth:`finish` drains it and fills ``summary``."""

    assembler: StepAssembler
    summary: object

    def feed(self, ev: Event) -> None:
        for item in self.assembler.feed(ev):
            self._item(item)

    def feed_all(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.feed(ev)

    def flush(self) -> None:
        """Hand what the projection holds back to its sink (a live export's poll is done)."""

    def finish(self, clean: bool = True):
        for item in self.assembler.finish(clean):
            self._item(item)
        self._finished()
        self.summary.dropped_steps = list(self.assembler.dropped_steps)
        self.summary.bad_records = self.assembler.bad_records
        return self.summary

    def _item(self, item) -> None:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def _finished(self) -> None:
        """Hook run after the last item, before the summary is filled."""
