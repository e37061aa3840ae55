"""The writer's step index of one log file: where each step's records start (FileClosed's ``index_*``).

The writer worker feeds it only frames whose step differs from the highest so far (a new step, or a
late or step-less record) and the name tables it frames, never every record; at close it becomes the
index fields of the FileClosed record, which replay uses to read only some steps.
"""

from __future__ import annotations

import array
import sys

from trainrec.schema import framing


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

    def fields(self) -> dict[str, bytes]:
        """FileClosed's index fields; none where they would not fit in its frame (millions of steps)."""
        if 32 * len(self.steps) + 8 * len(self.names_offsets) > framing.MAX_FRAME - (1 << 20):
            return {}
        return {"index_steps": _le_bytes(self.steps), "index_offsets": _le_bytes(self.offsets),
                "index_seqs": _le_bytes(self.seqs), "index_low_steps": _le_bytes(self.low_steps),
                "index_names": _le_bytes(self.names_offsets)}


def _le_bytes(a: array.array) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        a = array.array(a.typecode, a)
        a.byteswap()
    return a.tobytes()
