"""Reading only some steps of a log file, through its step index (FileClosed's ``index_*``), or by a scan.

Per file, a step selection (``--steps``) yields the events of a full read that :func:`keep` keeps:
the preamble, FileOpened, FileClosed, the name tables and the records of the selected steps. A valid
index lets only the bytes that can hold those be read; without one the index is rebuilt by a scan,
or the file read whole, and the same rule gives the same events. The index is untrusted input: it is
checked before use and ignored, with a note among the reader's problems, on any mismatch. The rules:
``docs/scale.md``, "Reading only some steps: the step index".
"""

from __future__ import annotations

import bisect
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from trainrec.schema import codec, framing
from trainrec.schema.events import (
    MAX_STEP,
    Event,
    FileClosed,
    FileOpened,
    NamesInterned,
    NamesRepeated,
)

from .index_scan import FrameWalkError, scan_index, walk_frames
from .reader import LogReader

__all__ = ["BadIndex", "FileIndex", "StepRanges", "check_segments", "first_record", "in_ranges", "keep_selected",
           "load_index", "read_steps"]

StepRanges = Sequence[tuple[int, "int | None"]]
_ALWAYS = (FileOpened, FileClosed, NamesInterned, NamesRepeated)
_TAIL = 64 << 10  # bytes read from the end first to find the FileClosed frame (then 16 times more)
_HDR = struct.Struct("<IIII")


class BadIndex(Exception):
    """A step index that does not fit its file (the message says how)."""


def in_ranges(ranges: StepRanges, step: int) -> bool:
    return any(lo <= step and (hi is None or step <= hi) for lo, hi in ranges)


def keep_selected(events: Iterable[Event], ranges: StepRanges, span: list[int] | None = None) -> Iterator[Event]:
    """The events of one file's stream that a selection of ``ranges`` keeps (see the module docstring).
    ``span``: ``[lowest, highest]`` step >= 0 of every event (kept or not), updated as they pass."""
    preamble = True
    for ev in events:
        step = ev.step
        if step >= 0:
            preamble = False
            if span is not None:
                if span[0] < 0 or step < span[0]:
                    span[0] = step
                if step > span[1]:
                    span[1] = step
        if preamble or isinstance(ev, _ALWAYS) or in_ranges(ranges, step):
            yield ev


@dataclass(frozen=True)
class FileIndex:
    """A file's step index, checked against the file (arrays as int64)."""

    steps: np.ndarray
    offsets: np.ndarray
    seqs: np.ndarray
    low_steps: np.ndarray
    names_offsets: np.ndarray
    index_offset: int  # where the FileClosed frame starts (the end of the last segment)
    index_seq: int  # its sequence number
    size: int  # the file's size when the index was read
    version: int  # the file's format version
    close_reason: str = ""
    closed: bool = True  # a FileClosed ends its frames (False: a scan's index of a file not closed)
    end: int = -1  # where its last complete frame ends (-1: the end of the file)

    @property
    def step_span(self) -> tuple[int, int] | None:
        """The lowest and highest step >= 0 of the file's records, or None when it has none."""
        if not len(self.steps):
            return None
        return int(self.low_steps.min()), int(self.steps[-1])

    def spans(self, ranges: StepRanges) -> list[tuple[int, int]]:
        """Segment indices ``(first, last)`` that can hold records of ``ranges``, merged, in order."""
        n = len(self.steps)
        out: list[tuple[int, int]] = []
        for lo, hi in sorted(ranges, key=lambda r: r[0]):
            k0 = int(np.searchsorted(self.steps, lo, side="left"))
            below = np.flatnonzero(self.low_steps <= hi) if hi is not None else None
            k1 = n - 1 if below is None else int(below[-1]) if len(below) else -1
            if k1 < k0:
                continue
            if out and k0 <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], k1))
            else:
                out.append((k0, k1))
        return out

    def segment_end(self, k: int) -> int:
        return int(self.offsets[k + 1]) if k + 1 < len(self.offsets) else self.index_offset


def _frame_at(f, offset: int, size: int, version: int) -> tuple[Event, int]:
    """The event of the frame at ``offset`` and where it ends; BadIndex when no valid frame is there."""
    if not framing.FILE_HEADER_SIZE <= offset <= size - framing.FRAME_HEADER_SIZE:
        raise BadIndex(f"offset {offset} is outside the file's frames")
    f.seek(offset)
    head = f.read(framing.FRAME_HEADER_SIZE)
    magic, length, pcrc, hcrc = _HDR.unpack(head)
    if magic != framing.FRAME_MAGIC or zlib.crc32(head[:12]) != hcrc or length > framing.MAX_FRAME:
        raise BadIndex(f"no frame starts at byte {offset}")
    end = offset + framing.FRAME_HEADER_SIZE + length
    if end > size:
        raise BadIndex(f"the frame at byte {offset} runs past the end of the file")
    payload = f.read(length)
    if zlib.crc32(payload) != pcrc:
        raise BadIndex(f"the frame at byte {offset} fails its CRC")
    try:
        return codec.decode(payload, version), end
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any failure means a bad index
        raise BadIndex(f"the record at byte {offset} does not decode ({exc})") from None


def _last_frame(f, size: int) -> tuple[int, bytes] | None:
    """``(offset, payload)`` of the frame that ends the file: the frame header nearest the end that
    checks out must begin it, its payload checking out too; None otherwise (a torn tail, stray bytes)."""
    lo = framing.FILE_HEADER_SIZE
    want = _TAIL
    while True:
        base = max(lo, size - want)
        f.seek(base)
        tail = f.read(size - base)
        j = tail.rfind(framing.FRAME_MAGIC_BYTES, 0, len(tail) - framing.FRAME_HEADER_SIZE + 1)
        while j >= 0:
            magic, length, pcrc, hcrc = _HDR.unpack_from(tail, j)
            if zlib.crc32(tail[j : j + 12]) == hcrc:
                if j + framing.FRAME_HEADER_SIZE + length != len(tail):
                    return None
                payload = tail[j + framing.FRAME_HEADER_SIZE :]
                return (base + j, payload) if zlib.crc32(payload) == pcrc else None
            j = tail.rfind(framing.FRAME_MAGIC_BYTES, 0, j)
        if base == lo or want > framing.MAX_FRAME:
            return None
        want *= 16


def _sorted_in(a: np.ndarray, lo: int, hi: int, label: str) -> None:
    if len(a) and (a[0] < lo or a[-1] >= hi or (len(a) > 1 and not (np.diff(a) > 0).all())):
        raise BadIndex(f"{label} are not increasing within {lo}..{hi - 1}")


def load_index(path: str) -> tuple[FileIndex | None, str | None]:
    """``(index, None)``; ``(None, None)`` where the file has none (not closed, an older writer, bytes
    after its close); ``(None, why)`` where it has one that does not fit the file."""
    try:
        with open(path, "rb") as f:
            return _load(f, os.fstat(f.fileno()).st_size)
    except BadIndex as exc:
        return None, str(exc)
    except OSError:
        return None, None  # (the full read says what is wrong with the file)


def _load(f, size: int) -> tuple[FileIndex | None, str | None]:
    parsed = framing.decode_file_header(f.read(framing.FILE_HEADER_SIZE))
    if parsed is None or parsed[0] not in framing.SUPPORTED_VERSIONS:
        return None, None
    found = _last_frame(f, size)
    if found is None:
        return None, None
    closed_at, payload = found
    try:
        closed = codec.decode(payload, parsed[0])
    except Exception:  # noqa: BLE001 - not a FileClosed: the full read says what it is
        return None, None
    if type(closed) is not FileClosed or not (closed.index_steps or closed.index_names):
        return None, None  # (not closed, or by a writer from before the index)
    fields = (closed.index_steps, closed.index_low_steps, closed.index_offsets, closed.index_seqs, closed.index_names)
    if any(len(a) % 8 for a in fields) or len({len(a) for a in fields[:4]}) != 1:
        raise BadIndex("its arrays are not whole 8-byte entries of one length")
    steps, low = (np.frombuffer(a, "<i8") for a in fields[:2])
    uarrays = [np.frombuffer(a, "<u8") for a in fields[2:]]
    if any(len(u) and int(u.max()) >= 1 << 62 for u in uarrays):
        raise BadIndex("an offset or sequence number is beyond any file")
    offsets, seqs, names = (u.astype(np.int64) for u in uarrays)
    start = framing.FILE_HEADER_SIZE + framing.FRAME_HEADER_SIZE  # (FileOpened comes first)
    _sorted_in(steps, 0, MAX_STEP, "steps")
    _sorted_in(offsets, start, closed_at, "segment offsets")
    _sorted_in(seqs, 1, closed.seq, "segment sequence numbers")
    _sorted_in(names, start, closed_at, "name-table offsets")
    if len(low) and ((low < 0) | (low > steps)).any():
        raise BadIndex("a segment's lowest step is negative or above its step")
    if len(seqs) > 1 and (np.diff(offsets) < framing.FRAME_HEADER_SIZE * np.diff(seqs)).any():
        raise BadIndex("a segment holds more frames than bytes for them")
    return FileIndex(steps, offsets, seqs, low, names, closed_at, closed.seq, size, parsed[0], closed.reason), None


# ---------------------------------------------------------------------------------------- reading
def check_segments(f, ix: FileIndex, segments: Iterable[int]) -> None:
    """Raise BadIndex unless a frame of the step and seq the index gives starts where each of
    ``segments`` does (indices past the last segment are skipped)."""
    for k in sorted(set(segments)):
        if not 0 <= k < len(ix.steps):
            continue
        ev, _ = _frame_at(f, int(ix.offsets[k]), ix.index_offset, ix.version)
        if ev.seq != ix.seqs[k] or ev.step != ix.steps[k]:
            raise BadIndex(f"segment {k} of the index says step {ix.steps[k]}, seq {ix.seqs[k]} at byte "
                           f"{ix.offsets[k]}; the record there is of step {ev.step}, seq {ev.seq}")


def _plan(f, ix: FileIndex, ranges: StepRanges, version: int) -> list[tuple[int, int, int]]:
    """``(start, stop, first seq)`` of the byte spans to read, in file order, every boundary checked."""
    n = len(ix.steps)
    first = int(ix.offsets[0]) if n else ix.index_offset
    plan = [(framing.FILE_HEADER_SIZE, first, 0)]
    data = []
    ends = [0]
    for k0, k1 in ix.spans(ranges):
        ends += [k0, k1 + 1]
        data.append((int(ix.offsets[k0]), ix.segment_end(k1), int(ix.seqs[k0])))
    check_segments(f, ix, ends)
    starts = [d[0] for d in data]
    for off in map(int, ix.names_offsets):
        if off < first:
            continue  # read with the preamble
        i = bisect.bisect_right(starts, off) - 1
        if i >= 0 and off < data[i][1]:
            continue  # read with its segment
        ev, end = _frame_at(f, off, ix.index_offset, version)
        if type(ev) not in (NamesInterned, NamesRepeated):
            raise BadIndex(f"the index lists a name table at byte {off}, where a {type(ev).__name__} is")
        plan.append((off, end, ev.seq))
    plan.extend(data)
    plan.append((ix.index_offset, ix.size, ix.index_seq))
    plan.sort()
    for (_, stop, _), (start, _, _) in zip(plan, plan[1:], strict=False):
        if stop > start:
            raise BadIndex(f"the frames it points at overlap (at byte {start})")
    return plan


def read_steps(path: str, ranges: StepRanges, chunk_size: int = 4 << 20,
               columnar: bool = False) -> tuple[LogReader, Iterator[Event], list[int]]:
    """The reader of ``path``, the events a selection of ``ranges`` keeps (see the module docstring),
    read through the file's index where it has a valid one, and ``[lowest, highest]`` step >= 0 of the
    file's records (``[-1, -1]``: none), complete once the events are read. ``columnar``: see LogReader."""
    reader = LogReader(path, chunk_size=chunk_size, columnar=columnar)
    ix, why = load_index(path)
    plan = _checked_plan(path, ix, ranges) if ix is not None else None
    if ix is not None and isinstance(plan, str):
        why, plan = plan, None
    if plan is None:  # no index, or a bad one: rebuilt by a scan of the frames
        if why:
            reader.note(f"step index ignored ({why}); rebuilt by a scan of the file")
        ix = scan_index(path)
        plan = _checked_plan(path, ix, ranges) if ix is not None else None
        if not isinstance(plan, list):
            span = [-1, -1]
            return reader, keep_selected(reader, ranges, span), span
    return reader, keep_selected(_spans(reader, plan), ranges), list(ix.step_span or (-1, -1))


def _checked_plan(path: str, ix: FileIndex, ranges: StepRanges) -> list | str | None:
    """The plan, what is wrong with the index (str), or None where the file cannot be read now."""
    try:
        with open(path, "rb") as f:
            return _plan(f, ix, ranges, ix.version)
    except BadIndex as exc:
        return str(exc)
    except OSError:
        return None


def _spans(reader: LogReader, plan: list[tuple[int, int, int]]) -> Iterator[Event]:
    for start, stop, seq in plan:
        yield from reader.read_span(start, stop, seq)


def first_record(path: str, tag: str, max_records: int) -> Event | None | bool:
    """The first record of type ``tag`` among the first ``max_records`` of a log, found by the frames'
    tags alone (no other record is decoded: a config at the start of a long log, without a read of
    its statistics); None where there is none; False where the frames do not all check out (damage,
    a torn tail: read it with a LogReader, which says what is wrong)."""
    try:
        with open(path, "rb") as f:
            parsed = framing.decode_file_header(f.read(framing.FILE_HEADER_SIZE))
            if parsed is None or parsed[0] not in framing.SUPPORTED_VERSIONS:
                return False
            for i, (_, payload) in enumerate(walk_frames(f)):
                peeked = codec.peek_tag(payload)
                if peeked == "fc" and tag != "fc":
                    return None  # (nothing of the file follows its close)
                if peeked == tag:
                    try:
                        return codec.decode(payload, parsed[0])
                    except Exception:  # noqa: BLE001 - undecodable: the reader reports it
                        return False
                if i >= max_records:
                    return None
            return None
    except (OSError, FrameWalkError):
        return False
