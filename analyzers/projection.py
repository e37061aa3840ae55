"""From a rank's event stream to complete per-(kind, step) frames: the shared half of every export.

:class:`StepAssembler` takes the events of ONE rank's log files in order and yields
:class:`KindFrame` (every row of one kind at one step, names resolved, a row recorded twice keeping
its last values), :class:`Note` (an anomaly or config switch as text) and :class:`Rewind` (a resume
superseded everything from ``step`` on; live consumers only). A frame is emitted once its step is
known complete; :meth:`finish` with ``clean=False`` drops the steps that never ended and lists them
in :attr:`dropped_steps`. Row layouts repeat step after step, so they are cached, and consumers
cache their derived products on them (:attr:`RowLayout.cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from trainrec.replay.names import NameResolver
from trainrec.schema.events import (
    KINDS,
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

from .frames import Item, KindFrame, Note, Rewind, RowLayout, merge_layouts, unique_last
from .selection import StepSet

log = logging.getLogger(__name__)

__all__ = ["Projector", "StepAssembler"]

_LAYOUT_CACHE_MAX = 256


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
            uniq = unique_last(lay)
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
            merged = merge_layouts(kind, [lay for lay, _ in parts])
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
