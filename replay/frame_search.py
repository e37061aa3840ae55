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
