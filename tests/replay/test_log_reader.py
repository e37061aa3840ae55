"""LogReader on real logs: clean ends, torn tails completed later, damage in the middle, garbage."""

from __future__ import annotations

import os
import random
import struct

import pytest
from logbuild import frame_spans, rank_dir, same, write_rank
from trainrec.replay.reader import LogReader, read_head, read_log
from trainrec.schema import codec, framing
from trainrec.schema.errors import NotALogError, UnsupportedVersionError
from trainrec.schema.events import FileClosed, FileOpened, StepBegan, TensorStatsRecorded


@pytest.fixture()
def log_bytes(tmp_path):
    path, written = write_rank(rank_dir(tmp_path, 0), steps=range(6))
    with open(path, "rb") as f:
        return f.read(), written


def _write(tmp_path, data: bytes, name: str = "x.trl") -> str:
    p = os.path.join(tmp_path, name)
    with open(p, "wb") as f:
        f.write(data)
    return p


def test_round_trip_through_the_writer(tmp_path):
    path, written = write_rank(rank_dir(tmp_path, 0), steps=range(3))
    reader, events = read_log(path)
    assert isinstance(events[-1], FileClosed) and reader.closed_cleanly
    assert len(events) == len(written) + 1
    assert all(same(a, b) for a, b in zip(events, written, strict=False))
    assert [e.seq for e in events] == list(range(len(events)))
    assert reader.problems == [] and reader.gaps == [] and reader.pending_bytes == 0
    assert reader.header == events[0] and reader.version == framing.FORMAT_VERSION


def test_record_missing_its_last_byte_is_completed_by_the_next_poll(tmp_path, log_bytes):
    data, _ = log_bytes
    p = _write(tmp_path, data[:-1])
    r = LogReader(p)
    first = r.poll()
    assert not any(isinstance(e, FileClosed) for e in first)
    last_frame = frame_spans(data)[-1]
    assert r.pending_bytes == last_frame[1] - last_frame[0] - 1
    assert r.problems == [] and not r.closed_cleanly
    assert r.poll() == []  # nothing new: still waiting, still no error
    with open(p, "ab") as f:
        f.write(data[-1:])
    second = r.poll()
    assert len(second) == 1 and isinstance(second[0], FileClosed)
    assert r.pending_bytes == 0 and r.problems == [] and r.closed_cleanly


def test_file_growing_in_random_pieces_reads_every_event_without_problems(tmp_path, log_bytes):
    data, _ = log_bytes
    _, whole = read_log(_write(tmp_path, data, "whole.trl"))
    p = _write(tmp_path, b"", "grow.trl")
    r = LogReader(p)
    rng = random.Random(7)
    got = []
    pos = 0
    while pos < len(data):
        step = rng.choice([1, 3, 7, 16, 40, 200])
        with open(p, "ab") as f:
            f.write(data[pos : pos + step])
        pos += step
        got.extend(r.poll())
    assert got == whole
    assert r.problems == [] and r.pending_bytes == 0


def test_poll_reads_only_new_bytes(tmp_path, log_bytes):
    """Overwrite what was already consumed with garbage: a poll must not see it, only the appended frames."""
    data, _ = log_bytes
    spans = frame_spans(data)
    cut = spans[5][1]
    p = _write(tmp_path, data[:cut])
    r = LogReader(p)
    assert len(r.poll()) == 6
    with open(p, "r+b") as f:
        f.seek(framing.FILE_HEADER_SIZE)
        f.write(b"\xff" * (cut - framing.FILE_HEADER_SIZE))
        f.seek(0, os.SEEK_END)
        f.write(data[cut:])
    rest = r.poll()
    assert len(rest) == len(spans) - 6 and r.problems == []


def test_flipped_bit_in_the_middle_loses_one_frame_and_is_reported(tmp_path, log_bytes):
    data, written = log_bytes
    spans = frame_spans(data)
    k = 4
    start, end = spans[k]
    damaged = bytearray(data)
    damaged[start + 20] ^= 0x10  # inside the payload
    r, events = read_log(_write(tmp_path, bytes(damaged)))
    assert len(events) == len(spans) - 1
    assert [p.offset for p in r.problems] == [start]
    assert r.problems[0].skipped == end - start and "CRC" in r.problems[0].what
    assert len(r.gaps) == 1 and r.gaps[0].lost == 1 and r.lost_frames == 1
    assert r.closed_cleanly


def test_flipped_bit_in_a_frame_header_resynchronises_at_the_next_frame(tmp_path, log_bytes):
    data, _ = log_bytes
    spans = frame_spans(data)
    start, end = spans[3]
    damaged = bytearray(data)
    damaged[start + 5] ^= 0x01  # the length field
    r, events = read_log(_write(tmp_path, bytes(damaged)))
    assert len(events) == len(spans) - 1
    assert r.problems[0].offset == start and r.problems[0].skipped == end - start
    assert "header" in r.problems[0].what


def test_bytes_cut_out_of_the_middle_lose_only_the_frames_they_touch(tmp_path, log_bytes):
    data, _ = log_bytes
    spans = frame_spans(data)
    a = spans[3][0] + 30
    b = spans[5][0] + 10  # frames 3, 4 and 5 are damaged
    r, events = read_log(_write(tmp_path, data[:a] + data[b:]))
    assert len(events) == len(spans) - 3
    assert r.lost_frames == 3 and r.problems and r.closed_cleanly


def test_frame_cut_short_at_the_end_of_a_finished_file_is_found(tmp_path, log_bytes):
    """The last-but-one frame loses bytes: its announced length runs past the end of the file, but the
    complete frame after it shows it is damage, not a frame still being written."""
    data, _ = log_bytes
    spans = frame_spans(data)
    s, e = spans[-2]
    r, events = read_log(_write(tmp_path, data[: s + 20] + data[e - 4 : e] + data[e:]))
    assert isinstance(events[-1], FileClosed)
    assert len(events) == len(spans) - 1
    assert "cut short" in r.problems[0].what and r.pending_bytes == 0


def test_valid_frame_with_an_undecodable_payload_is_skipped(tmp_path, log_bytes):
    data, _ = log_bytes
    spans = frame_spans(data)
    bad = framing.encode_frame(b"\xc1 not msgpack")
    cut = spans[2][1]
    r, events = read_log(_write(tmp_path, data[:cut] + bad + data[cut:]))
    assert len(events) == len(spans)
    assert "undecodable" in r.problems[0].what and r.problems[0].offset == cut


def test_frame_above_the_cap_is_skipped(tmp_path, log_bytes):
    data, _ = log_bytes
    spans = frame_spans(data)
    big_payload = codec.encode(StepBegan(rank=0, step=99)) + b"\0" * 400
    r0 = LogReader(_write(tmp_path, data[: spans[1][1]] + framing.encode_frame(big_payload) + data[spans[1][1] :]),
                   max_frame=300)
    events = r0.poll()
    assert len(events) == len(spans)
    assert "above the cap" in r0.problems[0].what


def test_garbage_files(tmp_path):
    rng = random.Random(3)
    with pytest.raises(NotALogError, match="bad magic"):
        read_log(_write(tmp_path, bytes(rng.getrandbits(8) for _ in range(500)), "noise.trl"))
    with pytest.raises(NotALogError, match="bad magic"):
        read_log(_write(tmp_path, b"hello", "short.trl"))
    with pytest.raises(NotALogError, match="no such"):
        read_log(os.path.join(tmp_path, "missing.trl"))
    r, events = read_log(_write(tmp_path, b"", "empty.trl"))
    assert events == [] and r.version is None
    r, events = read_log(_write(tmp_path, framing.FILE_MAGIC[:5], "partial.trl"))
    assert events == [] and r.pending_bytes == 5
    with pytest.raises(UnsupportedVersionError, match="format version 99"):
        read_log(_write(tmp_path, framing.encode_file_header(99), "future.trl"))
    # A valid header then noise: never raises, reports damage.
    noise = bytes(rng.getrandbits(8) for _ in range(5000))
    r, events = read_log(_write(tmp_path, framing.encode_file_header() + noise, "h_noise.trl"))
    assert events == [] and r.problems


def test_noise_between_frames_and_magic_lookalikes(tmp_path, log_bytes):
    data, _ = log_bytes
    spans = frame_spans(data)
    cut = spans[2][1]
    junk = framing.FRAME_MAGIC_BYTES + b"\x01\x02\x03" + framing.FRAME_MAGIC_BYTES * 3 + b"zz"
    r, events = read_log(_write(tmp_path, data[:cut] + junk + data[cut:]))
    assert len(events) == len(spans)
    assert len(r.problems) == 1 and r.problems[0].offset == cut and r.problems[0].skipped == len(junk)


def test_read_head_reads_only_the_beginning(tmp_path):
    path, _ = write_rank(rank_dir(tmp_path, 0), steps=range(2000))
    r, head = read_head(path, max_events=2)
    assert isinstance(head[0], FileOpened) and len(head) == 2
    assert r.offset < 200_000 < os.path.getsize(path)


def test_stats_values_survive(tmp_path):
    path, written = write_rank(rank_dir(tmp_path, 0), steps=[7])
    _, events = read_log(path)
    ts = [e for e in events if isinstance(e, TensorStatsRecorded)][0]
    exp = [e for e in written if isinstance(e, TensorStatsRecorded)][0]
    assert list(ts.value_array()) == list(exp.value_array())
    assert struct.unpack("<4I", ts.name_ids) == (0, 1, 2, 3)


def test_one_damaged_region_read_in_pieces_is_one_problem(tmp_path, log_bytes):
    data, _ = log_bytes
    spans = frame_spans(data)
    cut = spans[2][1]
    junk = bytes(range(256)) * 40  # no magic inside
    whole = data[:cut] + junk + data[cut:]
    p = _write(tmp_path, b"")
    r = LogReader(p)
    for i in range(0, len(whole), 1000):
        with open(p, "ab") as f:
            f.write(whole[i : i + 1000])
        r.poll()
    assert len(r.problems) == 1 and r.problems[0].offset == cut and r.problems[0].skipped == len(junk)
    assert r.events_read == len(spans)
