"""The writer's step index of one log file: where each step's records start (see StepIndexed).

The writer worker feeds it only frames whose step differs from the highest so far (a new step, or a
late or step-less record) and the name tables it frames, never every record; at close it becomes the
StepIndexed record written just before FileClosed, which replay uses to read only some steps.
"""

from __future__ import annotations

import array
import sys
import time

from trainrec.schema import framing
from trainrec.schema.events import StepIndexed


class StepIndexBuilder:
    """Segments (step, first frame's offset and seq, lowest step >= 0 in it) and name-table offsets."""

    __slots__ = ("steps", "offsets", "seqs", "low_steps", "names_offsets")

    def __init__(self) -> None:
        self.steps = array.array("q")
        self.offsets = array.array("Q")
        self.seqs = array.array("Q")
        self.low_steps = array.array("q")
        self.names_offsets = array.array("Q")

    def moved(self, step: int, seq: int, offset: int, last_step: int) -> int:
        """A frame of ``step`` (not ``last_step``, the highest so far) at ``offset``; returns the new highest."""
        if step > last_step:
            self.steps.append(step)
            self.offsets.append(offset)
            self.seqs.append(seq)
            self.low_steps.append(step)
            return step
        if step >= 0 and step < self.low_steps[-1]:
            self.low_steps[-1] = step
        return last_step

    def record(self, rank: int, step: int) -> StepIndexed | None:
        """The StepIndexed record, or None when it would not fit in a frame (millions of steps)."""
        if 32 * len(self.steps) + 8 * len(self.names_offsets) > framing.MAX_FRAME - 4096:
            return None
        packed = [_le_bytes(a) for a in (self.steps, self.offsets, self.seqs, self.low_steps, self.names_offsets)]
        return StepIndexed(rank=rank, step=step, wall=time.time(), steps=packed[0], offsets=packed[1], seqs=packed[2],
                           low_steps=packed[3], names_offsets=packed[4])


def _le_bytes(a: array.array) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        a = array.array(a.typecode, a)
        a.byteswap()
    return a.tobytes()
