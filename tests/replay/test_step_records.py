"""Step records decoded without the codec's generic walk (:mod:`trainrec.replay.step_records`) against
the codec's full decode: the same events, the same errors word for word, the same damage handling, on
golden logs, hostile records, random mutations and torn, damaged or growing files; and the reader's
sequence bookkeeping past the ring of remembered frames."""

from __future__ import annotations

import dataclasses
import glob
import os
import random

import msgpack
import pytest
from hostile_logs import F, damaged_copies, frames, good_log, mutated, rewrite
from trainrec.replay import record_stream
from trainrec.replay.reader import LogReader
from trainrec.replay.sequence import DUPLICATE, REMEMBERED_FRAMES, Sequence
from trainrec.replay.stats_columns import StatsColumns, decode_columns
from trainrec.replay.step_records import ENDED_FIELDS, decode_record, decode_record_columnar
from trainrec.schema import codec, framing
from trainrec.schema.errors import CorruptRecordError, FormatError
from trainrec.schema.events import StepBegan, StepEnded

GOLDEN = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden",
                                       "v*", "*.trl")))
DURATION, COLLECTED, MICRO, SKIPPED, FOREIGN = range(F, F + 5)  # wire indexes of StepEnded's fields


def _plain(ev):
    return ev.event() if isinstance(ev, StatsColumns) else ev


def _read(path: str, columnar: bool, chunk_size: int = 4 << 20):
    """What a reader makes of a file: its events (by repr: NaN values compare equal), problems, gaps,
    torn bytes, close, frames; or the error it raises."""
    reader = LogReader(path, chunk_size=chunk_size, columnar=columnar)
    try:
        events = reader.poll()
    except FormatError as exc:
        return ("error", type(exc).__name__, str(exc))
    return ([repr(_plain(ev)) for ev in events], reader.problems, reader.gaps, reader.pending_bytes,
            reader.closed_event, reader.frames, reader.duplicates, reader.events_read)


@pytest.fixture
def codec_reader(monkeypatch):
    """The reader as it was: every record through the codec (stats ones through the columns path when
    columnar). Returns a function reading a file that way."""
    def read(path: str, columnar: bool, chunk_size: int = 4 << 20):
        with monkeypatch.context() as m:
            m.setattr(record_stream, "decode_record", codec.decode)
            m.setattr(record_stream, "decode_record_columnar", decode_columns)
            return _read(path, columnar, chunk_size)
    return read


def _outcome(decode, payload):
    try:
        return "ok", repr(_plain(decode(payload)))
    except CorruptRecordError as exc:
        return "error", str(exc)


def _same(payload) -> tuple:
    """Both fast decoders against the codec on one payload; returns the codec's outcome."""
    full = _outcome(codec.decode, payload)
    assert _outcome(decode_record, payload) == full
    assert _outcome(decode_record_columnar, payload) == _outcome(decode_columns, payload)
    return full


def test_the_fast_path_knows_the_events_fields():
    envelope = ("seq", "rank", "step", "wall")
    assert tuple(f.name for f in dataclasses.fields(StepBegan)) == envelope
    assert tuple(f.name for f in dataclasses.fields(StepEnded)) == (*envelope, *ENDED_FIELDS), (
        "a field was added to StepEnded: teach step_records its place on the wire")


def test_step_records_are_the_codecs_events():
    for ev in (StepBegan(seq=5, rank=3, step=7, wall=1.5), StepBegan(),
               StepEnded(seq=(1 << 63) - 1, rank=(1 << 20) - 1, step=12, wall=2.0, duration=0.25, collected=True,
                         micro_steps=1 << 16, optimizer_skipped=True, foreign_passes=True), StepEnded()):
        payload = memoryview(codec.encode(ev))
        got = decode_record(payload)
        assert got == codec.decode(payload) == ev and type(got) is type(ev) and repr(got) == repr(ev)
        assert decode_record_columnar(payload) == ev
        assert hash(got) == hash(ev) and dataclasses.asdict(got) == dataclasses.asdict(ev)
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.step = 1  # type: ignore[misc]


def test_the_writers_step_records_never_reach_the_codec(tmp_path, monkeypatch):
    path = good_log(str(tmp_path), steps=3)
    expected = [ev for ev in LogReader(path).poll() if type(ev) in (StepBegan, StepEnded)]

    def refuse(payload, version=framing.FORMAT_VERSION):
        if codec.peek_tag(payload) in ("sb", "se"):
            raise AssertionError("a step record of the writer's layout went to the codec")
        return decode(payload, version)

    decode = codec.decode
    monkeypatch.setattr(codec, "decode", refuse)
    for columnar in (False, True):
        got = [ev for ev in LogReader(path, columnar=columnar).poll() if type(ev) in (StepBegan, StepEnded)]
        assert got == expected and len(got) == 6


def test_a_step_record_the_codec_upgrades_is_the_codecs(monkeypatch):
    def upgrade(wire: list) -> list:
        wire[COLLECTED] = not wire[COLLECTED]
        return wire

    payload = codec.encode(StepEnded(seq=1, rank=0, step=2, wall=1.0, collected=True))
    assert decode_record(payload).collected is True
    monkeypatch.setitem(codec.UPGRADES, (framing.FORMAT_VERSION, "se"), upgrade)
    assert decode_record(payload) == codec.decode(payload) and decode_record(payload).collected is False
    assert decode_record_columnar(payload).collected is False


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: os.path.basename(p))
def test_golden_logs_read_the_same(path, codec_reader):
    for columnar in (False, True):
        assert _read(path, columnar) == codec_reader(path, columnar)


def _set(i, value):
    def change(w):
        w[i] = value
    return change


# (tag, what, change of the record's wire list, what the codec makes of it)
HOSTILE = [
    ("sb", "wall as an int", _set(4, 7), "ok"),
    ("se", "wall as an int", _set(4, 7), "ok"),
    ("sb", "a field appended by a newer writer", lambda w: w.append(b"new"), "ok"),
    ("se", "a field appended by a newer writer", lambda w: w.append(3), "ok"),
    ("se", "3 fields (an older writer)", lambda w: w.__delitem__(slice(F + 3, None)), "ok"),
    ("se", "no fields", lambda w: w.__delitem__(slice(F, None)), "ok"),
    ("sb", "a sequence number of True", _set(1, True), "ok"),
    ("se", "collected as the int 2", _set(COLLECTED, 2), "ok"),
    ("se", "duration as an int", _set(DURATION, 3), "ok"),
    ("se", "micro steps as a bool", _set(MICRO, True), "ok"),
    ("se", "micro steps at the cap", _set(MICRO, 1 << 16), "ok"),
    ("se", "micro steps past the cap", _set(MICRO, (1 << 16) + 1), "error"),
    ("se", "micro steps negative", _set(MICRO, -1), "error"),
    ("se", "duration as text", _set(DURATION, "0.1"), "error"),
    ("se", "optimizer_skipped as a map", _set(SKIPPED, {"a": 1}), "error"),
    ("se", "foreign_passes as None", _set(FOREIGN, None), "error"),
    ("sb", "wall as text", _set(4, "now"), "error"),
    ("sb", "a rank past the world size cap", _set(2, 1 << 21), "error"),
    ("se", "a step past the cap", _set(3, 1 << 60), "error"),
    ("sb", "a sequence number below -1", _set(1, -5), "error"),
    ("se", "a sequence number past 2**63", _set(1, 1 << 63), "error"),
    ("sb", "the envelope cut short", lambda w: w.__delitem__(slice(3, None)), "error"),
]


@pytest.mark.parametrize("tag,what,change,expect", HOSTILE, ids=[f"{h[0]}: {h[1]}" for h in HOSTILE])
def test_hostile_step_record(tmp_path, codec_reader, tag, what, change, expect):
    path = good_log(str(tmp_path))
    offset = rewrite(path, tag, change, which=1)
    with open(path, "rb") as f:
        status, payload, _ = framing.read_frame(f.read(), offset)
    assert status is framing.Frame.OK
    assert _same(memoryview(payload))[0] == expect, what
    for columnar in (False, True):
        got = _read(path, columnar)
        assert got == codec_reader(path, columnar)
        if expect == "error":
            assert any(p.offset == offset and p.what.startswith("undecodable record") for p in got[1])


def test_not_msgpack_after_a_step_head():
    for payload in (b"\x95\xa2sb\xc1", b"\x95\xa2sb", b"\x9a\xa2se" + b"\xff" * 40, b"\x95\xa2sb\x01\x02\x03\xc0",
                    b"\x95\xa2sb\x01\x02\x03\xcb" + b"\x00" * 8 + b"\x00", b"\x9a\xa2se\xdd\xff\xff\xff\xff",
                    b"\x95\xa2sb" + b"\x00" * 80):
        assert _same(payload)[0] == "error"


def test_random_mutations_decode_as_the_codec_decodes(tmp_path):
    """Payloads of step records with bytes flipped, dropped, repeated or cut: either both decoders
    fail with the same message, or both give the same record."""
    path = good_log(str(tmp_path), steps=2)
    _, wires = frames(path)
    payloads = [msgpack.packb(w, use_bin_type=True) for w in wires if w[0] in ("sb", "se")]
    rng = random.Random(3434)
    seen = {"ok": 0, "error": 0}
    for _ in range(4000):
        p = mutated(rng.choice(payloads), rng)
        seen[_same(memoryview(p))[0]] += 1  # (the reader hands a memoryview of its buffer)
    assert seen["error"] > 100 and seen["ok"] > 100  # (both sides of the fence were exercised)


def test_random_field_values_decode_as_the_codec_decodes(tmp_path):
    """Step records with fields replaced by values of every msgpack type: the same outcome."""
    path = good_log(str(tmp_path), steps=1)
    _, wires = frames(path)
    steps = [w for w in wires if w[0] in ("sb", "se")]
    pool = [None, True, False, 0, -1, 1 << 16, 1 << 40, -(1 << 63), (1 << 64) - 1, 2.5, float("nan"), "", "se",
            b"", b"\x00" * 8, [], [1], {}, {"a": 1}, msgpack.ExtType(1, b"x")]
    rng = random.Random(34)
    outcomes = set()
    for _ in range(3000):
        wire = list(rng.choice(steps))
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(1, len(wire) + 1)
            if i == len(wire):
                wire.append(rng.choice(pool))
            else:
                wire[i] = rng.choice(pool)
        outcomes.add(_same(msgpack.packb(wire, use_bin_type=True))[0])
    assert outcomes == {"ok", "error"}


def test_damaged_and_torn_files_read_the_same(tmp_path, codec_reader):
    path = good_log(str(tmp_path), steps=6)
    for bad in damaged_copies(path, str(tmp_path), random.Random(7)):
        for chunk in (4096, 4 << 20):  # (frames split across reads, and whole)
            for columnar in (False, True):
                assert _read(bad, columnar, chunk) == codec_reader(bad, columnar, chunk)


def test_a_growing_file_reads_the_same(tmp_path, monkeypatch):
    path = good_log(str(tmp_path), steps=5)
    with open(path, "rb") as f:
        data = f.read()
    grown = os.path.join(str(tmp_path), "grown.trl")
    fast = LogReader(grown)
    monkeypatch.setattr(record_stream, "decode_record", codec.decode)
    full = LogReader(grown)
    got: dict[bool, list] = {True: [], False: []}
    for end in [*range(0, len(data) + 1, 97), len(data)]:
        with open(grown, "wb") as f:
            f.write(data[: max(end, 1)])
        got[True].extend(fast.poll())
        got[False].extend(full.poll())
        assert fast.pending_bytes == full.pending_bytes and fast.frames == full.frames
    assert got[True] == got[False] and sum(type(ev) in (StepBegan, StepEnded) for ev in got[True]) == 10
    assert fast.problems == full.problems == [] and fast.closed_cleanly


def test_sequence_past_the_ring_of_remembered_frames():
    """In-order frames past REMEMBERED_FRAMES overwrite the oldest: a recent frame read again is a
    duplicate, one older than the ring is not remembered (a sequence going back)."""
    seq = Sequence("f", 10)
    total = 3 * REMEMBERED_FRAMES + 5
    assert all(seq.check(i, i * 7 % 1000, i) is None for i in range(total))
    assert seq.check(total - 3, (total - 3) * 7 % 1000, total) is DUPLICATE
    assert seq.check(total - 3, 1, total) is not DUPLICATE  # (same number, other content)
    old = seq.check(5, 35, total + 1)
    assert old is not DUPLICATE and old.got == 5 and old.got < old.expected
    assert seq.duplicates == 1 and seq.lost == 0
