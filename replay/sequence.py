"""The writer's sequence numbers of one log file, checked frame by frame: gaps, duplicates, wrong numbers.

The writer numbers a file's frames 0, 1, 2, ... so that a reader can tell (see :class:`Sequence`):

* frames lost: a jump forward (:class:`SeqGap`, counted by ``trainrec check``);
* a duplicate frame: a number read before with the same payload CRC (a block written twice, as by a
  copy tool that retried it), dropped by the reader;
* a wrong number: a jump forward whose next record goes on from where the jump started (a forged or
  damaged number), reported as what is known, no frame lost;
* frames out of order: a number going back with other content.
"""

from __future__ import annotations

import array
import logging
from dataclasses import dataclass

log = logging.getLogger("trainrec.replay.reader")

# (seq, payload CRC) of the latest frames, to tell a duplicate: 12 bytes each, kept until the file's close
REMEMBERED_FRAMES = 4096


class _Duplicate:
    def __repr__(self) -> str:
        return "DUPLICATE"


DUPLICATE = _Duplicate()  # Sequence.check's verdict on a duplicate frame


@dataclass(frozen=True)
class SeqGap:
    """A jump in the writer's sequence numbers: frames ``expected .. got-1`` were not read.

    ``offset`` is where the first frame after the gap starts. ``got < expected`` means the sequence
    went backwards (frames out of order or duplicated), which the writer never does.
    """

    path: str
    offset: int
    expected: int
    got: int
    # 0: the records after it go on from ``expected``, so the number ``got`` of the record at ``offset``
    # is wrong and no frame was lost (a forged or damaged number); None: a plain gap
    most: int | None = None

    @property
    def lost(self) -> int:
        jump = max(0, self.got - self.expected)
        return jump if self.most is None else min(jump, self.most)

    def describe(self) -> str:
        """What the gap is, without where."""
        if self.got < self.expected:
            return f"sequence numbers go back from {self.expected - 1} to {self.got}"
        if self.most is not None:
            return (f"sequence number {self.got} where {self.expected} was due, and the next record goes on from "
                    f"{self.expected + 1}: the record's sequence number is wrong, no frame lost")
        return f"{self.lost} frame(s) lost (seq {self.expected}..{self.got - 1})"

    def __str__(self) -> str:
        return f"{self.path} at byte {self.offset}: {self.describe()}"


class Sequence:
    """Sequence numbers of one file as its frames are read, in order; ``max_listed`` gaps are kept, the
    rest counted (a hostile file of millions of tiny frames would fill memory with them)."""

    def __init__(self, path: str, max_listed: int) -> None:
        self.path = path
        self.max_listed = max_listed
        self.gaps: list[SeqGap] = []
        self.unlisted_gaps = 0
        self.unlisted_lost = 0
        self.duplicates = 0
        self._next = 0
        self._jumped: SeqGap | None = None  # the last gap, a jump forward, until the next record explains it
        self._ring_seq = array.array("q")  # at seq % REMEMBERED_FRAMES: that seq, and its payload CRC
        self._ring_crc = array.array("I")

    @property
    def lost(self) -> int:
        return sum(g.lost for g in self.gaps) + self.unlisted_lost

    def check(self, seq: int, pcrc: int, offset: int):
        """Check the number of the frame at ``offset``: None in sequence, DUPLICATE (to be dropped), or
        the SeqGap it opens (kept)."""
        expected = self._next
        if seq == expected and self._jumped is None:  # (in order, as nearly every frame is)
            seqs = self._ring_seq
            i = seq % REMEMBERED_FRAMES
            if i == len(seqs):
                seqs.append(seq)
                self._ring_crc.append(pcrc)
            elif i < len(seqs):  # (the ring is full: the oldest frame makes room)
                seqs[i] = seq
                self._ring_crc[i] = pcrc
            else:
                self._advance(seq, pcrc)
                return None
            self._next = seq + 1
            return None
        jumped, self._jumped = self._jumped, None
        if jumped is not None and seq == jumped.expected + 1 and seq != expected:
            fixed = SeqGap(jumped.path, jumped.offset, jumped.expected, jumped.got, 0)
            if self.gaps and self.gaps[-1] is jumped:
                self.gaps[-1] = fixed
                log.warning("trainrec: %s", fixed)
            else:  # (counted only)
                self.unlisted_lost -= jumped.lost
            self._advance(seq, pcrc)
            return None
        if jumped is not None:
            log.warning("trainrec: %s", jumped)
        if seq == expected:
            self._advance(seq, pcrc)
            return None
        if seq < expected and self._remembered(seq, pcrc):
            self.duplicates += 1
            return DUPLICATE
        gap = self._gap(offset, seq, logged=seq < expected)
        if seq > expected:
            self._jumped = gap  # logged once the next record tells lost frames from a wrong number
        self._advance(seq, pcrc)
        return gap

    def due(self) -> int | None:
        """The number due next while the sequence is in order (frames from it on can be taken in bulk
        by :meth:`took`), else None (each frame goes through :meth:`check`)."""
        return self._next if self._jumped is None else None

    def took(self, first: int, crcs: list[int]) -> None:
        """Frames numbered ``first``, ``first + 1``, ... in order, with these payload CRCs: what
        :meth:`check` of each in turn leaves (``first`` is what :meth:`due` said)."""
        n = len(crcs)
        if not n:
            return
        self._next = first + n
        size = REMEMBERED_FRAMES
        if n > size:  # (only the latest are remembered)
            first, crcs, n = first + n - size, crcs[n - size :], size
        seqs, ring_crcs = self._ring_seq, self._ring_crc
        i = first % size
        k = min(n, size - i)  # written at i .. i + k - 1, then from 0 on
        grown = i + k if k == n else size
        if len(seqs) < grown:
            seqs.extend([-1] * (grown - len(seqs)))
            ring_crcs.extend([0] * (grown - len(ring_crcs)))
        seqs[i : i + k] = array.array("q", range(first, first + k))
        ring_crcs[i : i + k] = array.array("I", crcs[:k])
        if k < n:
            seqs[: n - k] = array.array("q", range(first + k, first + n))
            ring_crcs[: n - k] = array.array("I", crcs[k:])

    def restart(self, seq: int) -> None:
        """The next frame read is number ``seq`` (reading goes on elsewhere in the file: a step selection)."""
        self._next = seq
        self._jumped = None

    def forget(self) -> None:
        """Drop the remembered CRCs (the file is closed: nothing follows)."""
        self._ring_seq, self._ring_crc = array.array("q"), array.array("I")

    def _advance(self, seq: int, pcrc: int) -> None:
        self._next = seq + 1
        seqs, crcs = self._ring_seq, self._ring_crc
        i = seq % REMEMBERED_FRAMES
        if i >= len(seqs):  # (grown as frames come, up to the ring's size)
            seqs.extend([-1] * (i + 1 - len(seqs)))
            crcs.extend([0] * (i + 1 - len(crcs)))
        seqs[i] = seq
        crcs[i] = pcrc

    def _remembered(self, seq: int, pcrc: int) -> bool:
        i = seq % REMEMBERED_FRAMES
        return i < len(self._ring_seq) and self._ring_seq[i] == seq and self._ring_crc[i] == pcrc

    def _gap(self, offset: int, seq: int, logged: bool) -> SeqGap:
        g = SeqGap(self.path, offset, self._next, seq)
        if len(self.gaps) >= self.max_listed:
            self.unlisted_gaps += 1
            self.unlisted_lost += g.lost
            return g
        self.gaps.append(g)
        if logged:
            log.warning("trainrec: %s", g)
        return g
