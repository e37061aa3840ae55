"""Property tests: damage anywhere after the file header never crashes the reader, and exactly the
damaged frames are lost (counted against what was written)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logbuild import frame_spans, rank_dir, write_rank
from trainrec.replay.reader import LogReader
from trainrec.schema import framing

SETTINGS = settings(max_examples=int(os.environ.get("TRAINREC_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz")
    # (without the name table's copy: a frame lost is a frame lost here; tests/replay/test_reliability.py
    # has the copy restore the names of a lost table)
    path, _ = write_rank(rank_dir(out, 0), steps=range(12), repeat_names=False)
    with open(path, "rb") as f:
        data = f.read()
    events = LogReader(path).poll()
    spans = frame_spans(data)
    assert len(events) == len(spans)
    work = os.path.join(out, "work.trl")
    return data, events, spans, work


def _read(path: str, data: bytes, chunks: list[int] | None = None):
    """Read ``data`` from ``path`` at once, or growing by ``chunks`` with a poll after each piece."""
    with open(path, "wb") as f:
        f.write(data if chunks is None else b"")
    r = LogReader(path)
    if chunks is None:
        return r, r.poll()
    got = []
    pos = 0
    for c in [*chunks, len(data)]:
        with open(path, "ab") as f:
            f.write(data[pos : pos + c])
        pos = min(len(data), pos + c)
        got.extend(r.poll())
    return r, got


def _survivors(events, spans, damaged):
    return [ev for ev, (s, e) in zip(events, spans, strict=True) if not any(s <= d < e for d in damaged)]


@SETTINGS
@given(data=st.data())
def test_flipped_bits_lose_exactly_the_frames_they_hit(pristine, data):
    raw, events, spans, work = pristine
    positions = data.draw(
        st.lists(st.integers(framing.FILE_HEADER_SIZE, len(raw) - 1), min_size=1, max_size=4, unique=True)
    )
    damaged = bytearray(raw)
    for p in positions:
        damaged[p] ^= 1 << data.draw(st.integers(0, 7))
    chunks = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 400), max_size=12)))
    r, got = _read(work, bytes(damaged), chunks)
    expected = _survivors(events, spans, positions)
    assert got == expected
    hit = len(events) - len(expected)
    assert (len(r.problems) > 0) == (hit > 0)
    # Lost frames in the middle show up as sequence gaps; only trailing ones cannot.
    assert r.lost_frames <= hit


@SETTINGS
@given(cut=st.integers(0, 10**9), chunks=st.one_of(st.none(), st.lists(st.integers(1, 500), max_size=8)))
def test_truncation_keeps_every_complete_frame_and_reports_a_torn_tail(pristine, cut, chunks):
    raw, events, spans, work = pristine
    cut = framing.FILE_HEADER_SIZE + cut % (len(raw) - framing.FILE_HEADER_SIZE + 1)
    r, got = _read(work, raw[:cut], chunks)
    complete = [ev for ev, (_s, e) in zip(events, spans, strict=True) if e <= cut]
    assert got == complete
    last_end = max([e for _s, e in spans if e <= cut], default=framing.FILE_HEADER_SIZE)
    assert r.pending_bytes == cut - last_end
    assert r.problems == []


@SETTINGS
@given(data=st.data())
def test_bytes_cut_out_or_inserted_lose_only_the_frames_they_touch(pristine, data):
    raw, events, spans, work = pristine
    a = data.draw(st.integers(framing.FILE_HEADER_SIZE, len(raw) - 1))
    if data.draw(st.booleans()):
        b = data.draw(st.integers(a + 1, min(len(raw), a + 3000)))
        damaged = raw[:a] + raw[b:]
        keep = [ev for ev, (s, e) in zip(events, spans, strict=True) if e <= a or s >= b]
    else:
        junk = data.draw(st.binary(min_size=1, max_size=300))
        damaged = raw[:a] + junk + raw[a:]
        keep = [ev for ev, (s, e) in zip(events, spans, strict=True) if not s < a < e]
    chunks = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 700), max_size=8)))
    r, got = _read(work, damaged, chunks)
    # Every untouched frame survives, in order. A touched frame may survive too: a byte inserted
    # into (or cut from) a run of equal bytes can leave the frame's bytes unchanged.
    index = {id(ev): i for i, ev in enumerate(events)}
    got_idx = [index.get(id(ev), -1) for ev in _identify(got, events)]
    assert -1 not in got_idx and got_idx == sorted(got_idx)
    assert {index[id(ev)] for ev in keep} <= set(got_idx)


def _identify(got, events):
    """Map read events back to the written ones (equal values, matched in order)."""
    out = []
    j = 0
    for ev in got:
        while j < len(events) and events[j] != ev:
            j += 1
        out.append(events[j] if j < len(events) else object())
        j += 1
    return out


@SETTINGS
@given(noise=st.binary(max_size=4000), chunks=st.one_of(st.none(), st.lists(st.integers(1, 300), max_size=8)))
def test_arbitrary_bytes_after_a_valid_header_never_raise(pristine, noise, chunks):
    _raw, _events, _spans, work = pristine
    r, got = _read(work, framing.encode_file_header() + noise, chunks)
    assert r.pending_bytes + sum(p.skipped for p in r.problems) <= len(noise)
