"""Byte layout of a trainrec log file: the file header and the record frames.

A log file is::

    file header   16 bytes   FILE_MAGIC (8) | format version u32 LE | flags u32 LE
    frame*        each       frame header (16) | payload (length bytes)

A frame header is ``FRAME_MAGIC u32 | length u32 | crc32(payload) u32 | crc32(first 12 bytes) u32``,
all little-endian. The header checks itself, so its length can be trusted, which gives three
outcomes when reading: a clean end of file; an incomplete last frame (not an error: the writer may
still be writing); a corrupt frame in the middle (bad header: resynchronise on the next valid one;
bad payload: skip that one frame). Payloads never exceed ``MAX_FRAME`` bytes.
This module is pure: bytes only, no files, no events."""

from __future__ import annotations

import enum
import struct
import zlib

FILE_MAGIC = b"\x89TRREC\r\n"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
FILE_HEADER = struct.Struct("<8sII")
FILE_HEADER_SIZE = FILE_HEADER.size  # 16
# Bits of the file header's flags field that this format defines (none yet): any other bit set is
# damage, reported by the reader, which reads on.
KNOWN_FLAGS = 0

FRAME_MAGIC = 0x7A4C_52D7
FRAME_MAGIC_BYTES = struct.pack("<I", FRAME_MAGIC)
FRAME_HEADER = struct.Struct("<IIII")
FRAME_HEADER_SIZE = FRAME_HEADER.size  # 16
_PREFIX = struct.Struct("<III")
MAX_FRAME = 64 * 1024 * 1024

_crc32 = zlib.crc32


def encode_file_header(version: int = FORMAT_VERSION, flags: int = 0) -> bytes:
    return FILE_HEADER.pack(FILE_MAGIC, version, flags)


def decode_file_header(data: bytes) -> tuple[int, int] | None:
    """Return ``(version, flags)``, or None when ``data`` does not start with the magic."""
    if len(data) < FILE_HEADER_SIZE:
        return None
    magic, version, flags = FILE_HEADER.unpack_from(data, 0)
    if magic != FILE_MAGIC:
        return None
    return version, flags


def frame_header(payload: bytes) -> bytes:
    """The 16-byte header of the frame of ``payload``: a frame is ``frame_header(p) + p``.

    Lets a writer hand header and payload to ``os.writev`` without copying the payload again.
    Raises ValueError for a payload larger than MAX_FRAME.
    """
    n = len(payload)
    if n > MAX_FRAME:
        raise ValueError(f"record of {n} bytes exceeds the frame cap of {MAX_FRAME} bytes")
    prefix = _PREFIX.pack(FRAME_MAGIC, n, _crc32(payload))
    return prefix + struct.pack("<I", _crc32(prefix))


def encode_frame(payload: bytes) -> bytes:
    """Frame one payload. Raises ValueError for a payload larger than MAX_FRAME."""
    return frame_header(payload) + payload


class Frame(enum.Enum):
    OK = "ok"
    INCOMPLETE = "incomplete"  # cut short at the end of the data: wait, the writer may finish it
    BAD_HEADER = "bad_header"  # header fails its CRC or its magic: resynchronise
    BAD_PAYLOAD = "bad_payload"  # header fine, payload CRC mismatch: skip this one frame
    TOO_LARGE = "too_large"  # header fine but length above the cap: treat as a bad header


def read_frame(buf: bytes | bytearray | memoryview, pos: int, max_frame: int = MAX_FRAME):
    """Decode the frame starting at ``pos`` of ``buf``.

    Returns ``(status, payload, next_pos)``. ``payload`` is a bytes object for OK, else None.
    ``next_pos`` is where the following frame starts for OK and BAD_PAYLOAD, ``pos`` otherwise.
    Never raises on arbitrary bytes and never allocates more than ``max_frame``.
    """
    end = len(buf)
    if end - pos < FRAME_HEADER_SIZE:
        # Fewer bytes than a header: a partial header if they could still become one.
        tail = bytes(buf[pos:end])
        if FRAME_MAGIC_BYTES.startswith(tail[:4]):
            return Frame.INCOMPLETE, None, pos
        return Frame.BAD_HEADER, None, pos
    magic, length, pcrc, hcrc = FRAME_HEADER.unpack_from(buf, pos)
    if magic != FRAME_MAGIC or _crc32(bytes(buf[pos : pos + 12])) != hcrc:
        return Frame.BAD_HEADER, None, pos
    if length > max_frame:
        return Frame.TOO_LARGE, None, pos
    start = pos + FRAME_HEADER_SIZE
    stop = start + length
    if stop > end:
        return Frame.INCOMPLETE, None, pos
    payload = bytes(buf[start:stop])
    if _crc32(payload) != pcrc:
        return Frame.BAD_PAYLOAD, None, stop
    return Frame.OK, payload, stop


def resync(buf: bytes | bytearray | memoryview, pos: int, max_frame: int = MAX_FRAME) -> int:
    """Offset of the next plausible frame after ``pos``: a magic whose header CRC checks out.

    Returns ``len(buf)`` minus a possible partial header when none is found, so that a header
    still being written at the end is found on the next call.
    """
    data = bytes(buf) if not isinstance(buf, bytes) else buf
    end = len(data)
    i = pos + 1
    while True:
        i = data.find(FRAME_MAGIC_BYTES, i)
        if i < 0:
            # Keep up to 3 trailing bytes that could be the start of a magic.
            for k in range(min(3, end - pos - 1), 0, -1):
                if FRAME_MAGIC_BYTES.startswith(data[end - k :]):
                    return end - k
            return end
        if end - i < FRAME_HEADER_SIZE:
            return i  # possibly a header still being written
        _, length, _, hcrc = FRAME_HEADER.unpack_from(data, i)
        if _crc32(data[i : i + 12]) == hcrc and length <= max_frame:
            return i
        i += 1
