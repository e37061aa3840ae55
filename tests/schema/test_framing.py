"""Framing: the byte layout is frozen, and read_frame/resync tell the three outcomes apart on any bytes."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trainrec.schema import framing
from trainrec.schema.framing import Frame, encode_frame, read_frame, resync


def _frames(*payloads: bytes) -> tuple[bytes, list[int]]:
    data, starts = b"", []
    for p in payloads:
        starts.append(len(data))
        data += encode_frame(p)
    return data, starts


def test_byte_layout_is_frozen():
    assert framing.encode_file_header() == b"\x89TRREC\r\n" + struct.pack("<II", 1, 0)
    assert framing.FILE_HEADER_SIZE == framing.FRAME_HEADER_SIZE == 16
    frame = encode_frame(b"abc")
    prefix = struct.pack("<III", 0x7A4C52D7, 3, zlib.crc32(b"abc"))
    assert frame == prefix + struct.pack("<I", zlib.crc32(prefix)) + b"abc"
    assert frame.hex() == "d7524c7a03000000c24124359033e016616263"


def test_file_header_round_trip_and_refusals():
    assert framing.decode_file_header(framing.encode_file_header(7, 3)) == (7, 3)
    assert framing.decode_file_header(framing.encode_file_header()[:15]) is None
    assert framing.decode_file_header(b"\x89TRREC\r\x00" + bytes(8)) is None


def test_consecutive_frames_read_back_in_order():
    payloads = [b"", b"x", bytes(range(256)) * 40]
    data, starts = _frames(*payloads)
    pos = 0
    for p, start in zip(payloads, starts, strict=True):
        assert pos == start
        status, payload, pos = read_frame(data, pos)
        assert status is Frame.OK and payload == p
    assert pos == len(data)
    # bytearray and memoryview buffers read the same
    assert read_frame(bytearray(data), starts[2])[1] == payloads[2]
    assert read_frame(memoryview(data), starts[1])[1] == payloads[1]


def test_every_cut_of_a_frame_is_incomplete_not_damage():
    frame = encode_frame(b"payload of some length")
    for cut in range(1, len(frame)):
        status, payload, nxt = read_frame(frame[:cut], 0)
        assert (status, payload, nxt) == (Frame.INCOMPLETE, None, 0), cut


def test_every_flipped_header_bit_is_a_bad_header_and_payload_bit_a_bad_payload():
    frame = encode_frame(b"0123456789abcdef")
    for i in range(len(frame) * 8):
        damaged = bytearray(frame)
        damaged[i // 8] ^= 1 << (i % 8)
        status, payload, nxt = read_frame(bytes(damaged), 0)
        if i // 8 < framing.FRAME_HEADER_SIZE:
            assert (status, nxt) == (Frame.BAD_HEADER, 0), i
        else:
            assert (status, nxt) == (Frame.BAD_PAYLOAD, len(frame)), i  # its length is trusted: skip it
        assert payload is None


def test_length_above_the_cap_is_too_large_even_with_a_valid_header_crc():
    frame = encode_frame(b"z" * 100)
    assert read_frame(frame, 0, max_frame=99)[0] is Frame.TOO_LARGE
    assert read_frame(frame, 0, max_frame=100)[0] is Frame.OK


def test_encoding_a_payload_above_the_cap_is_refused(monkeypatch):
    monkeypatch.setattr(framing, "MAX_FRAME", 10)
    encode_frame(b"x" * 10)
    with pytest.raises(ValueError, match="exceeds the frame cap"):
        encode_frame(b"x" * 11)


def test_a_few_trailing_bytes_that_are_not_a_magic_prefix_are_a_bad_header():
    assert read_frame(b"\x00\x01", 0)[0] is Frame.BAD_HEADER
    assert read_frame(framing.FRAME_MAGIC_BYTES[:3], 0)[0] is Frame.INCOMPLETE


def test_resync_finds_the_next_valid_header_and_skips_false_magics():
    data, starts = _frames(b"one", b"two", b"three")
    fake = framing.FRAME_MAGIC_BYTES + b"\xff" * 12  # a magic whose header CRC does not check out
    buf = b"garbage" + fake + data
    assert resync(buf, 0) == len(b"garbage") + len(fake)
    assert resync(data, starts[1]) == starts[2]
    assert resync(data, starts[2]) == len(data)
    # trailing bytes that may be the start of a header still being written are kept
    assert resync(data + framing.FRAME_MAGIC_BYTES[:2], starts[2]) == len(data)
    assert resync(data + framing.FRAME_MAGIC_BYTES + b"\x01", starts[2]) == len(data)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=120), st.integers(0, 130), st.integers(1, 64))
def test_read_frame_and_resync_never_raise_on_arbitrary_bytes(noise, pos, cap):
    pos = min(pos, len(noise))
    status, payload, nxt = read_frame(noise, pos, max_frame=cap)
    assert isinstance(status, Frame)
    assert payload is None or (status is Frame.OK and len(payload) <= cap)
    assert pos <= nxt <= len(noise)
    if pos < len(noise):
        assert pos < resync(noise, pos, cap) <= len(noise)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=50), min_size=1, max_size=5), st.data())
def test_frames_after_garbage_are_found_again(payloads, data):
    frames, starts = _frames(*payloads)
    junk = data.draw(st.binary(max_size=40).filter(lambda b: framing.FRAME_MAGIC_BYTES not in b))
    buf = junk + frames
    pos = 0 if not junk else resync(buf, 0) if read_frame(buf, 0)[0] is not Frame.OK else 0
    got = []
    while pos < len(buf):
        status, payload, nxt = read_frame(buf, pos)
        if status is Frame.OK:
            got.append(payload)
            pos = nxt
        else:
            pos = resync(buf, pos)
    assert got[-len(payloads):] == payloads
