"""A log's step index rebuilt by a scan of its frames, for a file that has none (a crash, a file still
being written, an older trainrec) or whose index does not fit it.

The scan reads every byte and checks every frame, but decodes no record: the tag, sequence number
and step come from the first bytes of each payload (:func:`peek_envelope`). It builds what the
writer builds (see ``recorder/step_index.py``) and gives up (None: the file is read whole by the
reader, which says what is wrong) on anything a plain read would have to judge: a damaged frame, a
sequence number out of turn, a record after the close, a payload whose start is not an envelope.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator

import numpy as np
from trainrec.schema import codec, framing
from trainrec.schema.events import Event, FileClosed

__all__ = ["FrameWalkError", "peek_envelope", "scan_index", "walk_frames"]

_HDR = struct.Struct("<IIII")
_INTS = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_READ = 4 << 20


class FrameWalkError(Exception):
    """The frames stop checking out at ``offset``; ``torn``: only because the last one is incomplete."""

    def __init__(self, offset: int, torn: bool) -> None:
        super().__init__(f"at byte {offset}: {'an incomplete last frame' if torn else 'a damaged frame'}")
        self.offset = offset
        self.torn = torn


def walk_frames(f, start: int = framing.FILE_HEADER_SIZE) -> Iterator[tuple[int, bytes]]:
    """``(offset, payload)`` of every frame from ``start`` to a clean end of the file ``f``, each header
    and payload checked; FrameWalkError where they stop checking out."""
    f.seek(start)
    buf, pos, base = b"", 0, start  # (base: the file offset of buf[0])
    while True:
        if len(buf) - pos < framing.FRAME_HEADER_SIZE:
            more = f.read(_READ)
            if not more:
                if pos == len(buf):
                    return
                raise FrameWalkError(base + pos, framing.FRAME_MAGIC_BYTES.startswith(buf[pos : pos + 4]))
            buf, base, pos = buf[pos:] + more, base + pos, 0
            continue
        magic, length, _, hcrc = _HDR.unpack_from(buf, pos)
        if magic != framing.FRAME_MAGIC or zlib.crc32(buf[pos : pos + 12]) != hcrc or length > framing.MAX_FRAME:
            raise FrameWalkError(base + pos, False)
        while len(buf) - pos < framing.FRAME_HEADER_SIZE + length:
            more = f.read(max(_READ, framing.FRAME_HEADER_SIZE + length - (len(buf) - pos)))
            if not more:
                raise FrameWalkError(base + pos, True)
            buf, base, pos = buf[pos:] + more, base + pos, 0
        status, payload, nxt = framing.read_frame(buf, pos)
        if status is not framing.Frame.OK:
            raise FrameWalkError(base + pos, False)
        yield base + pos, payload
        pos = nxt


def _int(p: bytes, i: int) -> tuple[int, int]:
    b = p[i]
    if b <= 0x7F:
        return b, i + 1
    if b >= 0xE0:
        return b - 0x100, i + 1
    fmt = _INTS[b]  # (KeyError: not an int)
    return struct.unpack_from(fmt, p, i + 1)[0], i + 1 + struct.calcsize(fmt)


def peek_envelope(payload: bytes) -> tuple[str, int, int] | None:
    """``(tag, seq, step)`` from the start of a record's payload, without decoding it; None where it
    does not start as ``[tag, seq, rank, step, wall, ...]``."""
    try:
        h = payload[0]
        if 0x95 <= h <= 0x9F:
            i = 1
        elif h in (0xDC, 0xDD):
            i = 3 if h == 0xDC else 5
        else:
            return None
        tag = codec.peek_tag(payload)
        if not tag:
            return None
        i += 1 + len(tag)
        seq, i = _int(payload, i)
        _, i = _int(payload, i)
        step, i = _int(payload, i)
    except (IndexError, KeyError, struct.error):
        return None
    return tag, seq, step


def scan_index(path: str):
    """The :class:`~trainrec.replay.stepindex.FileIndex` of ``path`` rebuilt from its frames (its
    ``closed`` says whether a FileClosed ends them), or None (see the module docstring)."""
    from .stepindex import FileIndex  # (stepindex uses this module)

    steps: list[int] = []
    offsets: list[int] = []
    seqs: list[int] = []
    low: list[int] = []
    names: list[int] = []
    last, seq_due, end, closed_at, reason = -1, 0, framing.FILE_HEADER_SIZE, None, ""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            parsed = framing.decode_file_header(f.read(framing.FILE_HEADER_SIZE))
            if parsed is None or parsed[0] not in framing.SUPPORTED_VERSIONS:
                return None
            try:
                for off, payload in walk_frames(f):
                    env = peek_envelope(payload)
                    if env is None or env[1] != seq_due or closed_at is not None:
                        return None
                    tag, _, step = env
                    seq_due += 1
                    end = off + framing.FRAME_HEADER_SIZE + len(payload)
                    if tag == "fc":
                        closed_at, reason = off, _reason(payload, parsed[0])
                        if reason is None:
                            return None
                    elif step > last:
                        last = step
                        steps.append(step)
                        offsets.append(off)
                        seqs.append(seq_due - 1)
                        low.append(step)
                    elif low and 0 <= step < low[-1]:
                        low[-1] = step
                    if tag in ("nm", "nr"):
                        names.append(off)
            except FrameWalkError as exc:
                if not exc.torn:
                    return None
    except OSError:
        return None
    arrays = [np.asarray(a, dtype=np.int64) for a in (steps, offsets, seqs, low, names)]
    at = end if closed_at is None else closed_at
    return FileIndex(*arrays, index_offset=at, index_seq=seq_due - (closed_at is not None), size=size,
                     version=parsed[0], close_reason=reason, closed=closed_at is not None, end=end)


def _reason(payload: bytes, version: int) -> str | None:
    """The close reason of a FileClosed payload; None where it does not decode as one."""
    try:
        ev: Event = codec.decode(payload, version)
    except Exception:  # noqa: BLE001 - undecodable: the scan gives up, the reader says what it is
        return None
    return ev.reason if isinstance(ev, FileClosed) else None
