"""TensorBoard projection of a rank's log: scalars tagged as the reference tags them, plus text notes.

Each stats row becomes ``len(ops)`` float32 scalars, one ``Event`` per kind and step, built from a
cached :class:`~trainrec.analyzers.tb_encode.ScalarTemplate`; anomalies and config switches become
text summaries at their step (tags: docs/exports.md). Output goes to a sink with
``write(event: bytes)``; opening files is the caller's business (``trainrec.tools``). ``rewind=True``
(a live export) writes a ``SessionLog.START`` at a resume's step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from trainrec.analyzers.frames import KindFrame, Note, Rewind, reference_rows
from trainrec.analyzers.projection import Projector, StepAssembler
from trainrec.analyzers.selection import SeenSteps, StepSet
from trainrec.analyzers.tb_encode import ScalarTemplate, event_bytes, text_summary
from trainrec.schema.events import Event
from trainrec.schema.naming import reference_tag

__all__ = ["TbProjector", "TbSink", "TbSummary", "export_tb", "frame_tags"]

NOTE_TAG = "trainrec/{topic}"
ANOMALY_COUNT_TAG = "trainrec/anomaly_count"


class TbSink(Protocol):
    def write(self, event: bytes) -> None: ...


@dataclass
class TbSummary:
    """What a TensorBoard projection wrote."""

    events: int = 0
    scalars: int = 0
    notes: int = 0
    steps: SeenSteps = field(default_factory=SeenSteps)
    dropped_steps: list = field(default_factory=list)
    bad_records: int = 0


def frame_tags(frame: KindFrame) -> list[str]:
    """The scalar tags of a frame's values, row-major (row, op)."""
    lay = frame.layout
    rank = frame.rank
    tags: list[str] = []
    rows = reference_rows(lay)  # grad_unreduced: the last micro step's (its tags have no micro step)
    for i in range(len(lay)) if rows is None else rows.tolist():
        base = reference_tag(lay.kind, lay.names[i], int(lay.slots[i]), int(lay.micros[i]), rank, int(lay.vpps[i]))
        tags.extend(f"{base}_{op}" for op in lay.ops)
    return tags


class TbProjector(Projector):
    """Feeds events of one rank, writes TensorBoard events to ``sink`` as steps complete."""

    def __init__(
        self,
        sink: TbSink,
        *,
        kinds: Iterable[str] | None = None,
        steps: StepSet | None = None,
        notes: bool = True,
        rewind: bool = False,
        note_kinds: Iterable[str] | None = None,
    ) -> None:
        self.sink = sink
        self.rewind = rewind
        self.assembler = StepAssembler(kinds, steps, notes, note_kinds)
        self.summary = TbSummary()
        self._pending_notes: list[Note] = []

    def _finished(self) -> None:
        self._flush_notes()

    # ------------------------------------------------------------------ items
    def _item(self, item) -> None:
        if isinstance(item, KindFrame):
            self._flush_notes(before=item.step)
            self._frame(item)
        elif isinstance(item, Note):
            self._pending_notes.append(item)
        elif isinstance(item, Rewind):
            self._flush_notes()
            if self.rewind:
                self.sink.write(event_bytes(item.wall, item.step, session_start=True))
                self.summary.events += 1
                self.summary.steps.drop_from(item.step)

    def _frame(self, frame: KindFrame) -> None:
        lay = frame.layout
        key = ("tb", frame.rank)
        tmpl = lay.cache.get(key)
        if tmpl is None:
            tmpl = ScalarTemplate(frame_tags(frame))
            lay.cache[key] = tmpl
        rows = reference_rows(lay)
        values = frame.values if rows is None else frame.values[rows]
        self.sink.write(event_bytes(frame.wall, frame.step, summary=tmpl.summary(values)))
        self.summary.events += 1
        self.summary.scalars += len(tmpl)
        self.summary.steps.add(frame.step)

    def _flush_notes(self, before: int | None = None) -> None:
        notes = self._pending_notes
        if not notes:
            return
        if before is None:
            now, self._pending_notes = notes, []
        else:
            now = [n for n in notes if n.step <= before]
            self._pending_notes = [n for n in notes if n.step > before]
        by_step: dict[tuple[int, str], list[Note]] = {}
        for n in now:
            by_step.setdefault((n.step, n.topic), []).append(n)
        for (step, topic), group in sorted(by_step.items()):
            text = "\n".join(f"- rank {n.rank}: {n.text}" for n in group)
            wall = max(n.wall for n in group)
            summary = text_summary(NOTE_TAG.format(topic=topic), text)
            if topic == "anomalies":
                summary += ScalarTemplate([ANOMALY_COUNT_TAG]).summary(np.array([len(group)], np.float32))
            self.sink.write(event_bytes(wall, max(step, 0), summary=summary))
            self.summary.events += 1
            self.summary.notes += len(group)


def export_tb(
    events: Iterable[Event],
    sink: TbSink,
    *,
    kinds: Iterable[str] | None = None,
    steps: StepSet | None = None,
    notes: bool = True,
    clean: bool = True,
) -> TbSummary:
    """Project a whole stream of one rank's events to ``sink``."""
    p = TbProjector(sink, kinds=kinds, steps=steps, notes=notes)
    p.feed_all(events)
    return p.finish(clean)
