"""The columnar reader's fast paths against its slow ones: stats records decoded from a layout read before
(:mod:`trainrec.replay.stats_templates`) against their full decode, and the frames taken in order in bulk
(``Sequence.took``) against ``Sequence.check`` frame by frame: the same events, problems, gaps and
counts, on long logs, damaged, torn and growing ones, and records changed after their layout was learnt."""

from __future__ import annotations

import array
import os
import random
import struct

import msgpack
import pytest
from hostile_logs import F, damaged_copies, frames, good_log, mutated
from trainrec.replay.reader import LogReader
from trainrec.replay.sequence import REMEMBERED_FRAMES, Sequence
from trainrec.replay.stats_columns import StatsColumns
from trainrec.replay.stats_templates import StatsTemplates
from trainrec.schema import framing
from trainrec.schema.errors import FormatError

STEPS = 300  # (sequence numbers and steps cross the msgpack widths at 128 and 256)


def _read(path: str, columnar: bool, chunk_size: int = 4 << 20):
    """Everything a reader makes of a file (events by repr, columns as events), or the error it raises."""
    reader = LogReader(path, chunk_size=chunk_size, columnar=columnar)
    try:
        events = reader.poll()
    except FormatError as exc:
        return ("error", type(exc).__name__, str(exc))
    return ([repr(ev.event() if type(ev) is StatsColumns else ev) for ev in events], reader.problems, reader.gaps,
            reader.pending_bytes, reader.closed_event, reader.frames, reader.duplicates, reader.events_read,
            reader.lost_frames, reader.unlisted_problems)


@pytest.fixture
def slow(monkeypatch):
    """Reads a file as the reader does with no template ever matching (every stats record in full)."""
    def read(path: str, chunk_size: int = 4 << 20):
        with monkeypatch.context() as m:
            m.setattr(StatsTemplates, "match", lambda self, buf, start, stop, version: None)
            return _read(path, True, chunk_size)
    return read


@pytest.fixture(scope="module")
def long_log(tmp_path_factory) -> str:
    return good_log(str(tmp_path_factory.mktemp("long")), steps=STEPS)


def _same_three_ways(path: str, slow, chunk_size: int = 4 << 20):
    fast = _read(path, True, chunk_size)
    assert fast == slow(path, chunk_size)
    assert fast == _read(path, False, chunk_size)
    return fast


def test_a_long_log_reads_the_same_and_through_templates(long_log, slow, monkeypatch):
    hits = []
    match = StatsTemplates.match

    def counted(self, buf, start, stop, version):
        got = match(self, buf, start, stop, version)
        hits.append(got is not None)
        return got

    monkeypatch.setattr(StatsTemplates, "match", counted)
    fast = _read(long_log, True)
    monkeypatch.undo()
    assert fast == slow(long_log) == _read(long_log, False)
    stats = 2 * STEPS
    assert stats - 24 <= sum(hits) <= stats, "nearly every stats record comes from a template"
    assert fast[1] == [] and fast[2] == []


def test_damaged_and_torn_long_logs_read_the_same(long_log, slow, tmp_path):
    for bad in damaged_copies(long_log, str(tmp_path), random.Random(3434), trials=30):
        for chunk in (4096, 4 << 20):  # (frames split across reads, and whole)
            _same_three_ways(bad, slow, chunk)


def test_a_growing_long_log_reads_the_same(long_log, tmp_path):
    with open(long_log, "rb") as f:
        data = f.read()
    grown = os.path.join(str(tmp_path), "grown.trl")
    readers = {True: LogReader(grown, columnar=True), False: LogReader(grown)}
    got: dict[bool, list] = {True: [], False: []}
    for end in [*range(1, len(data), 4999), len(data)]:
        with open(grown, "wb") as f:
            f.write(data[:end])
        for columnar, reader in readers.items():
            got[columnar].extend(ev.event() if type(ev) is StatsColumns else ev for ev in reader.poll())
        assert readers[True].pending_bytes == readers[False].pending_bytes
    assert got[True] == got[False] and len(got[True]) > 5 * STEPS
    assert readers[True].problems == readers[False].problems == []
    assert readers[True].gaps == readers[False].gaps == []


def _rewritten(path: str, out: str, change, rng) -> str:
    """A copy of ``path`` whose stats records after the first steps went through ``change(payload, wire,
    rng)`` (returning the new payload or None), each frame with valid CRCs."""
    head, wires = frames(path)
    body = []
    for i, w in enumerate(wires):
        payload = msgpack.packb(w, use_bin_type=True)
        if w[0] == "ts" and i > 40 and rng.random() < 0.3:
            payload = change(payload, list(w), rng) or payload
        body.append(framing.encode_frame(payload))
    with open(out, "wb") as f:
        f.write(head + b"".join(body))
    return out


def _byte_damage(payload, wire, rng):
    return mutated(payload, rng)


POOL = [None, True, False, 0, 1, -1, -2, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, 1 << 53, 1 << 63,
        (1 << 64) - 1, -(1 << 63), 2.5, float("nan"), "", "f", "d", "actv", b"", b"\x00" * 8, [], ["min"], {}]


def _field_values(payload, wire, rng):
    for _ in range(rng.randint(1, 2)):
        wire[rng.randrange(1, len(wire))] = rng.choice(POOL)
    return msgpack.packb(wire, use_bin_type=True)


def _wider_ints(payload, wire, rng):
    """The same record with its seq, rank or step in a wider msgpack int than the writer's (uint64 or
    int64: still the same number) or as a float, its wall as a float32: same values, other bytes."""
    i = rng.choice((1, 2, 3, 4))
    value = wire[i]
    packed = msgpack.packb(value, use_bin_type=True)
    if i == 4:
        other = b"\xca" + struct.pack(">f", value)
    elif rng.random() < 0.5:
        other = (b"\xcf" if value >= 0 else b"\xd3") + int(value).to_bytes(8, "big", signed=value < 0)
    else:
        other = msgpack.packb(float(value))
    at = payload.index(packed, 4)  # (the first field with those bytes: seq, rank or step)
    return payload[:at] + other + payload[at + len(packed) :]


@pytest.mark.parametrize("change", [_byte_damage, _field_values, _wider_ints], ids=lambda c: c.__name__)
def test_records_changed_after_their_layout_was_learnt_read_the_same(long_log, slow, tmp_path, change):
    rng = random.Random(34)
    outcomes = set()
    for trial in range(6):
        path = _rewritten(long_log, os.path.join(str(tmp_path), f"changed{trial}.trl"), change, rng)
        got = _same_three_ways(path, slow)
        outcomes.add(bool(got[1]))
    if change is not _wider_ints:
        assert outcomes == {True} or outcomes == {True, False}  # (records found damaged, as the codec finds them)


def test_templates_stay_bounded_on_a_log_of_ever_new_layouts(tmp_path, slow):
    path = good_log(str(tmp_path), steps=2)
    head, wires = frames(path)
    stats = next(w for w in wires if w[0] == "ts")
    at = wires.index(stats) + 1
    for k in range(300):  # 300 stats records, each of a layout of its own
        w = list(stats)
        w[F] = f"kind{k}"
        wires.insert(at + k, w)
    for i, w in enumerate(wires):
        w[1] = i
    body = b"".join(framing.encode_frame(msgpack.packb(w, use_bin_type=True)) for w in wires)
    with open(path, "wb") as f:
        f.write(head + body)
    reader = LogReader(path, columnar=True)
    reader.poll()
    assert reader._records._templates._count <= 64
    assert _read(path, True) == slow(path) == _read(path, False)


@pytest.mark.parametrize("start", [0, 5, REMEMBERED_FRAMES - 3, 3 * REMEMBERED_FRAMES + 7])
def test_frames_taken_in_bulk_leave_what_check_leaves(start):
    rng = random.Random(start)
    one, bulk = Sequence("x", 10), Sequence("x", 10)
    for s in (one, bulk):
        s.restart(start)
    seq = start
    for run in (1, 2, 700, REMEMBERED_FRAMES - 1, 3, REMEMBERED_FRAMES + 5, 2 * REMEMBERED_FRAMES + 1):
        crcs = [rng.getrandbits(32) for _ in range(run)]
        for k, c in enumerate(crcs):
            assert one.check(seq + k, c, 0) is None
        assert bulk.due() == seq
        bulk.took(seq, crcs)
        seq += run
        assert (one._next, one._ring_seq, one._ring_crc) == (bulk._next, bulk._ring_seq, bulk._ring_crc)
        # a frame again (a duplicate) is told the same way by both
        again = rng.randrange(max(start, seq - REMEMBERED_FRAMES), seq)
        i = again % REMEMBERED_FRAMES
        assert one._ring_seq[i] == bulk._ring_seq[i] and isinstance(bulk._ring_seq, array.array)
    bulk.took(seq, [])
    assert bulk._next == seq
