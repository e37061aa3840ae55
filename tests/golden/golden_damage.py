"""The golden scenarios of damaged and cut files: torn tails, flipped bits, a damaged name table
restored from its copy and a duplicated block of frames, a file of only its header, a newer format
version, and bytes that are not a log."""

from __future__ import annotations

import dataclasses
import struct

from golden_builder import Builder, Built, env, header_event, stats_actv
from trainrec.schema import codec, framing
from trainrec.schema.events import (
    FileClosed,
    NamesInterned,
    NamesRepeated,
    StepBegan,
    StepEnded,
    WriterFailed,
)


def _body(g: Builder, steps: int = 4) -> None:
    g.add(header_event())
    g.add(NamesInterned(**env(1, 0), first_id=0, names=("a", "b", "c")))
    seq = 2
    for step in range(steps):
        g.add(stats_actv(seq, step))
        g.add(StepEnded(**env(seq + 1, step, 1.0 + step), duration=0.1, collected=True))
        seq += 2


def torn_tail() -> Built:
    """The writer was killed in the middle of a frame: its first half is on disk."""
    g = Builder()
    _body(g)
    frame = framing.encode_frame(codec.encode(stats_actv(10, 4)))
    cut = frame[: len(frame) // 2]
    g.b.data += cut
    g.b.pending_bytes = len(cut)
    return g.b


def torn_header() -> Built:
    """The writer was killed after 7 bytes of a frame header."""
    g = Builder()
    _body(g, steps=2)
    cut = framing.encode_frame(codec.encode(StepBegan(**env(6, 2))))[:7]
    g.b.data += cut
    g.b.pending_bytes = len(cut)
    return g.b


def _flip(g: Builder, index: int, byte_in_frame: int, bit: int) -> None:
    start, _length = g.b.frames[index]
    data = bytearray(g.b.data)
    data[start + byte_in_frame] ^= 1 << bit
    g.b.data = bytes(data)


def flipped_payload_bit() -> Built:
    """One bit flipped inside a stats record's payload: that frame, and only that one, is lost."""
    g = Builder()
    _body(g)
    g.add(FileClosed(**env(10, 3, 9.0), records=10, reason="close"))
    k = 4  # the second stats record (seq 4)
    start, length = g.b.frames[k]
    _flip(g, k, framing.FRAME_HEADER_SIZE + 40, 3)
    lost = g.b.events.pop(k)
    g.b.problems.append({"offset": start, "skipped": length})
    g.b.gaps.append({"offset": start + length, "expected": lost.seq, "got": lost.seq + 1})
    return g.b


def flipped_header_bit() -> Built:
    """One bit flipped in a frame header's length: the reader resynchronises at the next frame."""
    g = Builder()
    _body(g)
    g.add(FileClosed(**env(10, 3, 9.0), records=10, reason="close"))
    k = 3  # StepEnded of step 0 (seq 3)
    start, length = g.b.frames[k]
    _flip(g, k, 5, 1)  # the length field
    lost = g.b.events.pop(k)
    g.b.problems.append({"offset": start, "skipped": length})
    g.b.gaps.append({"offset": start + length, "expected": lost.seq, "got": lost.seq + 1})
    return g.b


def reliability() -> Built:
    """A writer of this version: its identity in the header, a damaged name table restored from its copy, a
    duplicated block of frames dropped, and the writer's own note of a failure to write before its close."""
    g = Builder()
    g.add(dataclasses.replace(header_event(), writer_id="0123456789abcdef0123456789abcdef", proc_start=123456,
                              boot_id="6b0c5e4e-0d1f-4a3b-9c2d-1e2f3a4b5c6d"))
    names = ("model.layer1", "model.layer2", "model.head")
    g.add(NamesInterned(**env(1, 0), first_id=0, names=names))
    g.add(NamesRepeated(**env(2, 0), first_id=0, names=names))
    g.add(stats_actv(3, 0))
    g.add(StepEnded(**env(4, 0, 1.0), duration=0.5, collected=True))
    dup_start = len(g.b.data)
    dup = g.b.data[g.b.frames[3][0] :]  # the last two frames again (a copy tool that retried a block)
    g.b.data += dup
    g.add(WriterFailed(**env(5, 0, 2.0), error="OSError(28, 'No space left on device')", first_lost_seq=5,
                       discarded=12, last_step=3))
    g.add(FileClosed(**env(6, 0, 3.0), records=6, reason="close; the writer failed before"))
    start, length = g.b.frames[1]
    _flip(g, 1, framing.FRAME_HEADER_SIZE + 6, 2)  # inside a name: the table's frame is lost, not its copy
    lost = g.b.events.pop(1)
    g.b.events.insert(1, dataclasses.replace(lost, seq=2))  # restored from the copy, under the copy's number
    g.b.problems += [{"offset": start, "skipped": length}, {"offset": dup_start, "skipped": len(dup)}]
    g.b.gaps.append({"offset": start + length, "expected": 1, "got": 2})
    return g.b


def header_only() -> Built:
    """A file whose writer died right after creating it: the file header, no record."""
    return Builder().b


def future_version() -> Built:
    """A file of format version 2: refused with UnsupportedVersionError."""
    g = Builder(version=2)
    g.add(header_event())
    g.b.events = []
    g.b.error = "UnsupportedVersionError"
    return g.b


def not_a_log() -> Built:
    """Bytes that are not a trainrec log (a TensorBoard event file's start): refused with NotALogError."""
    b = Built(data=struct.pack("<Q", 24) + b"\x00" * 20)
    b.error = "NotALogError"
    return b
