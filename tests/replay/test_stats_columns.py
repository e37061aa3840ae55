"""Stats records decoded straight into columns (``LogReader(columnar=True)``, :mod:`trainrec.replay.stats_columns`)
against the codec's full decode: the same records, the same errors word for word, the same damage
handling, on golden logs, hostile records, random mutations and torn or damaged files."""

from __future__ import annotations

import dataclasses
import glob
import os
import random
from collections import Counter

import msgpack
import pytest
from hostile_logs import F, damaged_copies, frames, good_log, mutated, rewrite, write_frames
from trainrec.replay import stats_columns
from trainrec.replay.reader import LogReader
from trainrec.replay.run import open_run
from trainrec.replay.stats_columns import _FIELDS, StatsColumns, decode_columns
from trainrec.replay.summary import summarize
from trainrec.schema import codec, framing
from trainrec.schema.errors import CorruptRecordError, FormatError
from trainrec.schema.events import OPS, TensorStatsRecorded

GOLDEN = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden",
                                       "v*", "*.trl")))
# wire indexes of the stats record's fields
KIND, OPS_, DTYPE, IDS, VALUES, MICRO, CALLS, SLOTS, VPP, HOLES = range(F, F + 10)


def _plain(ev):
    return ev.event() if isinstance(ev, StatsColumns) else ev


def _read(path: str, columnar: bool, chunk_size: int = 4 << 20):
    """What a reader makes of a file: its events (columns as events, by repr: NaN values compare equal),
    problems, gaps, torn bytes, close; or the error it raises."""
    reader = LogReader(path, chunk_size=chunk_size, columnar=columnar)
    try:
        events = reader.poll()
    except FormatError as exc:
        return ("error", type(exc).__name__, str(exc)), 0
    columns = sum(isinstance(ev, StatsColumns) for ev in events)
    got = ([repr(_plain(ev)) for ev in events], reader.problems, reader.gaps, reader.pending_bytes, reader.closed_event,
           reader.frames, reader.duplicates)
    return got, columns


def _outcome(decode, payload):
    try:
        return "ok", repr(_plain(decode(payload)))  # (repr: NaN values compare equal)
    except CorruptRecordError as exc:
        return "error", str(exc)


def test_columns_hold_the_events_fields():
    names = tuple(f.name for f in dataclasses.fields(TensorStatsRecorded) if f.name not in ("seq", "rank", "step", "wall"))
    assert names == _FIELDS, "a field was added to TensorStatsRecorded: teach stats_columns its place on the wire"


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: os.path.basename(p))
def test_golden_logs_read_the_same(path):
    full, _ = _read(path, False)
    fast, columns = _read(path, True)
    assert fast == full
    if full[0] != "error" and any(type(ev) is TensorStatsRecorded for ev in full[0]):
        assert columns, "stats records of the writer's layout come as columns"


def test_every_stats_record_of_a_log_comes_as_columns(tmp_path):
    path = good_log(str(tmp_path), steps=4)
    reader = LogReader(path, columnar=True)
    events = reader.poll()
    stats = [ev for ev in events if isinstance(ev, (StatsColumns, TensorStatsRecorded))]
    assert len(stats) == 8 and all(type(ev) is StatsColumns for ev in stats)
    full = [ev for ev in LogReader(path).poll() if type(ev) is TensorStatsRecorded]
    assert [ev.event() for ev in stats] == full
    for cols, ev in zip(stats, full, strict=True):
        assert cols.matrix().shape == (len(ev), len(ev.ops))
        assert cols.matrix().ravel().tolist() == ev.value_array().tolist()
        assert cols.ids().tolist() == list(ev.column("name_ids"))
        assert len(cols) == len(ev) and cols.check() is None


def _set(i, value):
    def change(w):
        w[i] = value
    return change


def _resize_ops(ops):
    def change(w):
        w[OPS_] = ops
        w[VALUES] = bytes(4 * len(ops) * (len(w[IDS]) // 4))
    return change


def _nested(depth: int) -> list:
    out: list = ["x"]
    for _ in range(depth):
        out = [out]
    return out


# (what, change of a stats record's wire list, what both decoders must make of it)
HOSTILE = [
    ("wall as an int", _set(4, 7), "event"),  # the codec takes it (as 7.0): the columns path hands it over
    ("a field appended by a newer writer", lambda w: w.append(b"new"), "event"),
    ("13 fields (an older writer)", lambda w: w.__delitem__(slice(F + 8, None)), "event"),
    ("14 fields (no placeholders)", lambda w: w.__delitem__(HOLES), "columns"),
    ("a sequence number of True", _set(1, True), "event"),
    ("kind not a string", _set(KIND, 7), "error"),
    ("ops not a list", _set(OPS_, "min"), "error"),
    ("an op not a string", _resize_ops(["min", 3]), "error"),
    ("an empty op", _resize_ops(["min", ""]), "error"),
    ("an op twice", _resize_ops(["min", "min"]), "error"),
    ("an op list nested deep", _set(OPS_, [[[[["x"]]]]] * 2), "error"),
    ("an op that is a map", _resize_ops(["min", {"a": 1}]), "error"),
    ("ops nested past the codec's depth", _set(OPS_, ["min", _nested(40)]), "error"),
    ("kind as a map", _set(KIND, {"a": 1}), "error"),
    ("too many ops for a record", _set(OPS_, ["op"] * 5000), "error"),
    ("dtype unknown", _set(DTYPE, "h"), "error"),
    ("dtype not a string", _set(DTYPE, 1.5), "error"),
    ("name ids not whole u32", lambda w: w.__setitem__(IDS, w[IDS][:-1]), "error"),
    ("values one byte short", lambda w: w.__setitem__(VALUES, w[VALUES][:-1]), "error"),
    ("values as text", _set(VALUES, "abc"), "error"),
    ("micro steps of the wrong length", _set(MICRO, b"\x01"), "error"),
    ("call ids of the wrong length", _set(CALLS, b"\x01\x00\x00\x00"), "error"),
    ("vpp stages of the wrong length", _set(VPP, b"\x00\x00\x00"), "error"),
    ("a slot that is no slot", _set(SLOTS, b"\x01\x09"), "error"),
    ("a placeholder flag of 2", _set(HOLES, b"\x00\x02"), "error"),
    ("a rank past the world size cap", _set(2, 1 << 21), "error"),
    ("a step past the cap", _set(3, 1 << 60), "error"),
    ("a sequence number below -1", _set(1, -5), "error"),
    ("a name id never interned", lambda w: w.__setitem__(IDS, bytes([0, 0, 0, 0, 99, 0, 0, 0])), "columns"),
]


@pytest.mark.parametrize("what,change,expect", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_stats_record(tmp_path, what, change, expect):
    path = good_log(str(tmp_path))
    offset = rewrite(path, "ts", change, which=1)
    with open(path, "rb") as f:
        status, payload, _ = framing.read_frame(f.read(), offset)
    assert status is framing.Frame.OK
    full, fast = _outcome(codec.decode, payload), _outcome(decode_columns, payload)
    assert fast == full
    if expect == "error":
        assert full[0] == "error", f"{what}: {full}"
    else:
        assert type(decode_columns(payload)) is (StatsColumns if expect == "columns" else TensorStatsRecorded)
    # and the whole file, read both ways: the same events, the same problem at the same offset
    got_full, _ = _read(path, False)
    got_fast, _ = _read(path, True)
    assert got_fast == got_full
    if expect == "error":
        assert any(p.offset == offset and p.what.startswith("undecodable record") for p in got_fast[1])


def test_not_msgpack_after_a_stats_head():
    for payload in (b"\x9f\xa2ts\xc1", b"\x9f\xa2ts", b"\x9e\xa2ts" + b"\xff" * 40, b"\x9f\xa2ts\xdd\xff\xff\xff\xff"):
        assert _outcome(decode_columns, payload) == _outcome(codec.decode, payload)
        assert _outcome(decode_columns, payload)[0] == "error"


def test_random_mutations_decode_as_the_codec_decodes(tmp_path):
    """Payloads of stats records with bytes flipped, dropped, repeated or cut: either both decoders
    fail with the same message, or both give the same record."""
    path = good_log(str(tmp_path), steps=2)
    _, wires = frames(path)
    payloads = [msgpack.packb(w, use_bin_type=True) for w in wires if w[0] == "ts"]
    rng = random.Random(34)
    seen = {"ok": 0, "error": 0, "columns": 0}
    for _ in range(3000):
        p = mutated(rng.choice(payloads), rng)
        data = memoryview(p)  # (the reader hands a memoryview of its buffer)
        fast, full = _outcome(decode_columns, data), _outcome(codec.decode, data)
        assert fast == full, p.hex()
        seen[full[0]] += 1
        seen["columns"] += full[0] == "ok" and type(decode_columns(data)) is StatsColumns
    assert seen["error"] > 100 and seen["columns"] > 100  # (both sides of the fence were exercised)


def test_random_field_values_decode_as_the_codec_decodes(tmp_path):
    """Stats records with fields (or ops) replaced by values of every msgpack type: the same outcome."""
    path = good_log(str(tmp_path), steps=1)
    _, wires = frames(path)
    stats = [w for w in wires if w[0] == "ts"]
    pool = [None, True, 0, -1, 1 << 40, -(1 << 63), 2.5, float("nan"), "", "f", "min", "ts", b"", b"\x00" * 8,
            [], ["min"], [["min"]], {}, {"min": 1}, {1: [2]}, _nested(40), msgpack.ExtType(1, b"x")]
    rng = random.Random(3434)
    outcomes = set()
    for _ in range(2000):
        wire = list(rng.choice(stats))
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(1, len(wire) + 1)
            value = rng.choice(pool)
            if i == OPS_ and rng.random() < 0.5:  # an op of the list, not the list
                wire[OPS_] = [*wire[OPS_][:-1], value]
            elif i == len(wire):
                wire.append(value)
            else:
                wire[i] = value
        payload = msgpack.packb(wire, use_bin_type=True)
        fast, full = _outcome(decode_columns, payload), _outcome(codec.decode, payload)
        assert fast == full, wire
        outcomes.add(full[0])
    assert outcomes == {"ok", "error"}


def test_damaged_and_torn_files_read_the_same(tmp_path):
    path = good_log(str(tmp_path), steps=6)
    for bad in damaged_copies(path, str(tmp_path), random.Random(7)):
        for chunk in (4096, 4 << 20):  # (frames split across reads, and whole)
            assert _read(bad, True, chunk)[0] == _read(bad, False, chunk)[0]


def test_a_growing_file_reads_the_same(tmp_path):
    path = good_log(str(tmp_path), steps=5)
    with open(path, "rb") as f:
        data = f.read()
    grown = os.path.join(str(tmp_path), "grown.trl")
    readers = {True: LogReader(grown, columnar=True), False: LogReader(grown)}
    got: dict[bool, list] = {True: [], False: []}
    for end in range(0, len(data) + 1, 333):
        with open(grown, "wb") as f:
            f.write(data[: max(end, 1)])
        for columnar, reader in readers.items():
            got[columnar].extend(_plain(ev) for ev in reader.poll())
        assert readers[True].pending_bytes == readers[False].pending_bytes
    with open(grown, "wb") as f:
        f.write(data)
    for columnar, reader in readers.items():
        got[columnar].extend(_plain(ev) for ev in reader.poll())
    assert got[True] == got[False] and got[True]
    assert readers[True].problems == readers[False].problems == []


def test_run_events_with_columns(tmp_path):
    good_log(str(tmp_path), steps=3)
    run = open_run(str(tmp_path))
    full = list(run.events())
    fast = list(open_run(str(tmp_path)).events(columnar=True))
    assert [_plain(ev) for ev in fast] == full
    stats = list(open_run(str(tmp_path)).events(types="ts", columnar=True))
    assert stats and all(type(ev) is StatsColumns for ev in stats)
    selected = list(open_run(str(tmp_path)).events(steps=[(1, 1)], columnar=True))
    assert [_plain(ev) for ev in selected] == list(open_run(str(tmp_path)).events(steps=[(1, 1)]))


def test_summary_counts_columns_as_stats_records(tmp_path):
    path = good_log(str(tmp_path), steps=4)
    rewrite(path, "ts", _set(4, 3), which=2)  # (one stats record the codec decodes: wall as an int)
    rank = summarize(open_run(str(tmp_path))).ranks[0]
    full = list(open_run(str(tmp_path)).events())
    assert rank.counts == Counter(type(ev).__name__ for ev in full)
    stats = [ev for ev in full if type(ev) is TensorStatsRecorded]
    assert rank.stat_values == sum(len(ev) * len(ev.ops) for ev in stats) and len(stats) == 8
    assert rank.stats_steps == {ev.step for ev in stats}


def test_what_the_columns_path_remembers_is_bounded(tmp_path):
    """Logs are untrusted: long op names are checked every time, not remembered (a hostile log of
    megabyte-long op names would otherwise stay in memory); so are id columns past 64 KiB or 64 of them."""
    long_ops = ("x" * 4000, "y" * 4000)
    payload = codec.encode(TensorStatsRecorded(seq=1, rank=0, step=0, wall=1.0, kind="param", ops=long_ops))
    assert type(decode_columns(payload)) is StatsColumns
    assert long_ops not in stats_columns._GOOD_OPS
    path = good_log(str(tmp_path), steps=1)

    def many_columns(wires):
        stats = next(w for w in wires if w[0] == "ts")
        for k in range(100):  # 100 stats records of distinct id columns, every id interned (0 or 1)
            w = list(stats)
            w[IDS] = bytes([k & 1, 0, 0, 0]) * 2 + bytes(4 * (k + 1))
            w[VALUES] = bytes(4 * len(OPS) * (k + 3))
            w[SLOTS] = w[CALLS] = b""
            wires.insert(wires.index(stats) + 1, w)
        for i, w in enumerate(wires):
            w[1] = i  # (sequence numbers in order)

    head, wires = frames(path)
    many_columns(wires)
    write_frames(path, head, wires)
    reader = LogReader(path, columnar=True)
    events = reader.poll()
    assert sum(type(ev) is StatsColumns for ev in events) > 100 and reader.problems == []
    assert len(reader._records._names.known_ids) == 64
