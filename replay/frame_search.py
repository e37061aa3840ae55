"""Finding frames in damaged bytes: where the reader resynchronises after a bad header, and how it tells
a frame cut short from one still being written (see :mod:`trainrec.replay.reader`).

Pure functions over a buffer of frames (the layout is :mod:`trainrec.schema.framing`'s); they never
raise on arbitrary bytes.
"""

from __future__ import annotations

import struct
import zlib

from trainrec.schema import framing

_HDR = struct.Struct("<IIII")
_HDR_SIZE = framing.FRAME_HEADER_SIZE
_MAGIC_BYTES = framing.FRAME_MAGIC_BYTES
_crc32 = zlib.crc32


def header_ok(buf: bytes, i: int, max_frame: int) -> int | None:
    """Length of the frame at ``i`` when its header checks out, else None."""
    _, length, _, hcrc = _HDR.unpack_from(buf, i)
    if length <= max_frame and _crc32(buf[i : i + 12]) == hcrc:
        return length
    return None


def resync(buf: bytes, i: int, n: int, max_frame: int) -> int:
    """Offset of the next header that checks out at or after ``i``; a possible partial header at
    the end is kept (it may be completed by the writer); ``n`` when there is none."""
    while True:
        j = buf.find(_MAGIC_BYTES, i, n)
        if j < 0:
            for k in (3, 2, 1):
                if n - k >= i and _MAGIC_BYTES.startswith(buf[n - k : n]):
                    return n - k
            return n
        if n - j < _HDR_SIZE:
            return j
        if header_ok(buf, j, max_frame) is not None:
            return j
        i = j + 1


def find_frame(buf: bytes, lo: int, hi: int, need_complete: bool, max_frame: int) -> tuple[int | None, int]:
    """First valid frame starting in ``[lo, hi)``. With ``need_complete`` its payload must be in the
    buffer and check out; otherwise a header that checks out is enough. Also returns where a
    later search must start again (a candidate that could not be confirmed yet)."""
    n = len(buf)
    i = lo
    retry = max(lo, hi - _HDR_SIZE + 1)
    limit = min(n, hi + len(_MAGIC_BYTES) - 1)  # a magic starting before hi may end after it
    while True:
        j = buf.find(_MAGIC_BYTES, i, limit)
        if j < 0:
            return None, retry
        if n - j < _HDR_SIZE:
            return None, min(retry, j)
        length = header_ok(buf, j, max_frame)
        if length is not None:
            end = j + _HDR_SIZE + length
            if end > n:
                if not need_complete:
                    return j, retry
                retry = min(retry, j)
            else:
                _, _, pcrc, _ = _HDR.unpack_from(buf, j)
                with memoryview(buf) as mv:
                    ok = _crc32(mv[j + _HDR_SIZE : end]) == pcrc
                if ok:
                    return j, retry
        i = j + 1


def undecided(buf: bytes, lo: int, hi: int) -> bool:
    """Whether a frame header could start in ``[lo, hi)`` but runs past the end of ``buf``."""
    n = len(buf)
    for j in range(max(lo, n - _HDR_SIZE + 1), min(hi, n)):
        if _MAGIC_BYTES.startswith(buf[j : min(n, j + 4)]):
            return True
    return False


def damaged_frame(buf: bytes, pos: int, max_frame: int, scan_from: int) -> tuple[str | None, int, int | None, int]:
    """What is wrong with the frame at ``pos`` of ``buf``, which did not check out whole:
    ``(what, next_pos, None, 0)``: damage, reading goes on at ``next_pos``; or ``(None, pos, retry_from,
    need)``: nothing to decide yet, the frame may still be being written (``need`` bytes are missing;
    ``retry_from``, when not None: where the search for a later frame starts again; ``scan_from``:
    where it stopped before). At least a frame header's bytes must be there."""
    n = len(buf)
    magic, length, pcrc, hcrc = _HDR.unpack_from(buf, pos)
    if magic != framing.FRAME_MAGIC or _crc32(buf[pos : pos + 12]) != hcrc:
        return "bad frame header", resync(buf, pos + 1, n, max_frame), None, 0
    if length > max_frame:
        return f"frame length {length} above the cap of {max_frame}", resync(buf, pos + 1, n, max_frame), None, 0
    start = pos + _HDR_SIZE
    stop = start + length
    if stop > n:
        # Incomplete: normal while the writer writes, unless a complete valid frame
        # follows inside the bytes we have, which means this one was cut short.
        later, retry_from = find_frame(buf, max(start, scan_from), n, True, max_frame)
        if later is None:
            return None, pos, retry_from, stop - n
        return f"frame cut short (announced {length} bytes)", later, None, 0
    inner, _ = find_frame(buf, start, stop, False, max_frame)
    if inner is None and undecided(buf, start, stop):
        return None, pos, None, 0  # a header may start near the end of the data: decide with more bytes
    what = "payload CRC mismatch" if inner is None else "payload CRC mismatch (frame cut short)"
    return what, stop if inner is None else inner, None, 0
