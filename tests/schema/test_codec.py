"""The codec: every event type round-trips, garbage is a CorruptRecordError, the wire layout is frozen."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trainrec.schema import EVENT_TYPES, CorruptRecordError, UnknownEvent, codec, decode, encode
from trainrec.schema.events import (
    MAX_STEP,
    MAX_WORLD_SIZE,
    OPS,
    SLOTS,
    AnomalyDetected,
    StepEnded,
    TensorStatsRecorded,
    pack_array,
)


def test_every_event_type_round_trips_with_defaults():
    for cls in EVENT_TYPES:
        ev = cls(seq=7, rank=3, step=11, wall=1.25)
        assert decode(encode(ev)) == ev


def test_stats_record_round_trips():
    ev = TensorStatsRecorded(
        rank=0, step=2, kind="actv", ops=("min", "max"), name_ids=pack_array("I", [4, 5]),
        values=pack_array("f", [1.0, 2.0, 3.0, 4.0]), slots=bytes([1, 2]),
    )
    back = decode(encode(ev))
    assert back == ev
    assert list(back.value_array()) == [1.0, 2.0, 3.0, 4.0]
    assert list(back.column("slots")) == [1, 2]
    assert list(back.column("call_ids")) == [-1, -1]


def _two_rows(**kw) -> TensorStatsRecorded:
    return TensorStatsRecorded(
        rank=0, step=2, kind="grad_unreduced", ops=("norm", "nans"), name_ids=pack_array("I", [4, 5]),
        values=pack_array("f", [1.0, 0.0, float("nan"), float("nan")]), **kw,
    )


def test_placeholder_column_round_trips_and_reads_as_zeros_when_absent():
    ev = _two_rows(placeholders=bytes([0, 1]))
    back = decode(encode(ev))
    assert back == ev
    assert list(back.column("placeholders")) == [0, 1]
    assert list(_two_rows().column("placeholders")) == [0, 0]


def test_placeholder_column_of_the_wrong_length_or_value_is_corrupt():
    for bad in (bytes([1]), bytes([0, 1, 0])):
        assert "placeholders has" in _two_rows(placeholders=bad).check()
        with pytest.raises(CorruptRecordError, match="placeholders has"):
            decode(encode(_two_rows(placeholders=bad)))
    assert "placeholder flag 2" in _two_rows(placeholders=bytes([0, 2])).check()
    with pytest.raises(CorruptRecordError, match="placeholder flag"):
        decode(encode(_two_rows(placeholders=bytes([0, 2]))))


def test_stats_record_of_an_older_writer_without_placeholders_decodes():
    """A writer from before ``placeholders`` was appended packs nine fields after the envelope: the
    record decodes with no row marked, and the wire places of the fields before it are unchanged."""
    ev = _two_rows(slots=bytes([0, 0]), call_ids=pack_array("I", [3, 4]))
    old = msgpack.packb(["ts", 1, 0, 2, 0.0, "grad_unreduced", ["norm", "nans"], "f", ev.name_ids, ev.values,
                         b"", ev.call_ids, ev.slots, b""], use_bin_type=True)
    back = decode(old)
    assert back == dataclasses.replace(ev, seq=1, wall=0.0)
    assert back.placeholders == b""
    assert list(back.column("placeholders")) == [0, 0]
    wire = msgpack.unpackb(encode(_two_rows(placeholders=bytes([1, 0]))))
    assert wire[:5] == ["ts", -1, 0, 2, 0.0] and wire[-1] == bytes([1, 0]) and len(wire) == 5 + 10


def test_unknown_tag_is_skippable_and_known_tag_with_bad_field_is_corrupt():
    unknown = decode(msgpack.packb(["zz", 1, 0, 5, 0.0, "x"]))
    assert isinstance(unknown, UnknownEvent) and unknown.tag == "zz" and unknown.step == 5
    with pytest.raises(CorruptRecordError, match="field 'kind'"):
        decode(msgpack.packb(["ts", 1, 0, 5, 0.0, 123]))
    with pytest.raises(CorruptRecordError, match="rows"):
        decode(msgpack.packb(["ts", 1, 0, 5, 0.0, "actv", ["min"], "f", b"\0\0\0\0", b""]))


def test_newer_writer_extra_fields_are_ignored():
    ev = decode(msgpack.packb(["sb", 1, 0, 5, 0.0, "future-field"]))
    assert ev.step == 5


_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_SCALAR = st.one_of(_INT, st.text(max_size=8), st.floats(allow_nan=False), st.booleans())
_BY_TYPE = {
    "int": _INT,
    "float": st.floats(allow_nan=False),
    "str": st.text(max_size=20),
    "bytes": st.binary(max_size=40),
    "bool": st.booleans(),
    "tuple": st.lists(_SCALAR, max_size=5).map(tuple),
    "dict": st.dictionaries(st.text(max_size=6), st.one_of(_SCALAR, st.lists(_SCALAR, max_size=3).map(tuple)),
                            max_size=4),
}


def _event_strategy(cls):
    if cls is TensorStatsRecorded:
        return _stats_strategy()
    fields = {f.name: _BY_TYPE[str(f.type)] for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


@st.composite
def _stats_strategy(draw):
    n = draw(st.integers(0, 6))
    ops = tuple(draw(st.lists(st.sampled_from(OPS), min_size=0, max_size=6)))
    dtype = draw(st.sampled_from("fd"))
    floats = st.floats(allow_nan=False, width=32 if dtype == "f" else 64)
    values = draw(st.lists(floats, min_size=n * len(ops), max_size=n * len(ops)))

    def column(typecode, size, bound):
        return draw(st.one_of(st.just(b""), st.lists(st.integers(0, bound), min_size=n, max_size=n).map(
            lambda v: pack_array(typecode, v))))

    return TensorStatsRecorded(
        seq=draw(st.integers(0, 2**32)), rank=draw(st.integers(0, 4096)), step=draw(st.integers(-1, 2**40)),
        wall=draw(st.floats(allow_nan=False)), kind=draw(st.text(max_size=12)), ops=ops, dtype=dtype,
        name_ids=pack_array("I", draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))),
        values=pack_array(dtype, values), micro_steps=column("H", 2, 2**16 - 1),
        call_ids=column("I", 4, 2**32 - 1), slots=column("B", 1, len(SLOTS) - 1), vpp_stages=column("B", 1, 255),
        placeholders=column("B", 1, 1),
    )


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_every_event_type_round_trips_with_arbitrary_values(data):
    # Values that contradict each other or size an allocation beyond its bound (logs are untrusted)
    # are a CorruptRecordError naming what is wrong; everything else round-trips.
    for cls in EVENT_TYPES:
        ev = data.draw(_event_strategy(cls), label=cls.__name__)
        if _envelope_ok(ev) and ev.check() is None:
            assert decode(encode(ev)) == ev
        else:
            with pytest.raises(CorruptRecordError):
                decode(encode(ev))


def _envelope_ok(ev) -> bool:
    return -1 <= ev.seq < 2**63 and -1 <= ev.rank < MAX_WORLD_SIZE and -1 <= ev.step < MAX_STEP


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_payloads_raise_only_corrupt_record_errors(payload):
    try:
        ev = decode(payload)
    except CorruptRecordError:
        return
    assert ev.TAG in {cls.TAG for cls in EVENT_TYPES} | {"?"}


def test_every_truncation_of_a_payload_is_a_corrupt_record():
    payload = encode(TensorStatsRecorded(kind="actv", ops=("min",), name_ids=pack_array("I", [1, 2]),
                                         values=pack_array("f", [1.0, 2.0])))
    for cut in range(len(payload)):
        with pytest.raises(CorruptRecordError):
            decode(payload[:cut])


def test_huge_declared_lengths_are_refused_without_allocating():
    # [ "ts", bin32 of 4 GiB ] in a few bytes
    payload = b"\x92\xa2ts\xc6\xff\xff\xff\xff"
    with pytest.raises(CorruptRecordError):
        decode(payload)
    with pytest.raises(CorruptRecordError):
        decode(b"\xdd\xff\xff\xff\xff")  # array32 of 4G elements


def test_envelope_and_layout_checks_name_the_field():
    with pytest.raises(CorruptRecordError, match="envelope field 'step'"):
        decode(msgpack.packb(["sb", 1, 0, "five", 0.0]))
    with pytest.raises(CorruptRecordError, match=r"\[tag, seq"):
        decode(msgpack.packb({"tag": "sb"}))
    with pytest.raises(CorruptRecordError, match=r"\[tag, seq"):
        decode(msgpack.packb(["sb", 1, 0]))


def test_lenient_types_ints_for_floats_lists_for_tuples():
    ev = decode(msgpack.packb(["se", 1, 0, 5, 7, 2, 1, 3]))
    assert ev == StepEnded(seq=1, rank=0, step=5, wall=7.0, duration=2.0, collected=1, micro_steps=3)
    assert isinstance(ev.wall, float) and isinstance(ev.duration, float)


def test_encoder_accepts_numpy_scalars_and_sets_and_refuses_other_objects():
    ev = AnomalyDetected(value=np.float32(1.5), baseline=np.float64(0.25), call_id=np.int64(3),
                         group_mates=frozenset({3, 1}))
    back = decode(encode(ev))
    assert (back.value, back.baseline, back.call_id, back.group_mates) == (1.5, 0.25, 3, (1, 3))
    with pytest.raises(TypeError, match="cannot encode object"):
        encode(AnomalyDetected(message=object()))


def test_encode_seq_override_and_wire_layout_is_frozen():
    ev = StepEnded(seq=4, rank=2, step=9, wall=1.5, duration=0.5, collected=True, micro_steps=2)
    # optimizer_skipped, then foreign_passes were appended later (schema growth): the fields before
    # them keep their places, and records written before them decode with their defaults
    assert msgpack.unpackb(encode(ev, seq=11)) == ["se", 11, 2, 9, 1.5, 0.5, True, 2, False, False]
    assert encode(ev).hex() == "9aa27365040209cb3ff8000000000000cb3fe0000000000000c302c2c2"
    assert decode(bytes.fromhex("98a27365040209cb3ff8000000000000cb3fe0000000000000c302")) == ev
    assert decode(bytes.fromhex("99a27365040209cb3ff8000000000000cb3fe0000000000000c302c2")) == ev


def test_read_time_upgrade_of_an_older_format_version(monkeypatch):
    """A record written by a (hypothetical) format 0 that stored duration in milliseconds as an int."""

    def upgrade(wire: list) -> list:
        wire[5] = wire[5] / 1000.0
        return wire

    monkeypatch.setitem(codec.UPGRADES, (0, "se"), upgrade)
    old = msgpack.packb(["se", 1, 0, 5, 0.0, 1500])
    assert decode(old, version=0).duration == 1.5
    assert decode(old, version=1).duration == 1500.0  # current version: no upgrade


def test_values_per_record_are_capped_by_type():
    """A record may hold only so many values for its type (issue 35: a valid-CRC frame built to expand
    into gigabytes of objects); real records of every size in use stay within."""
    import msgpack
    from trainrec.schema.events import AnomalyDetected, NamesInterned

    mates = tuple(range(10_000))  # a 10k-rank job's group
    assert decode(encode(AnomalyDetected(group_mates=mates))).group_mates == mates
    names = tuple(f"layer{i}" for i in range(300_000))
    assert decode(encode(NamesInterned(names=names))).names == names
    too_many_ops = msgpack.packb(["ts", 1, 0, 0, 0.0, "actv", [f"op{i}" for i in range(5000)]])
    with pytest.raises(CorruptRecordError, match=r"'ts': a length beyond what it may hold \(5000 exceeds .*4096"):
        decode(too_many_ops)
    nested = msgpack.packb(["nm", 1, 0, 0, 0.0, 0, [[0] * 600_000, [0] * 600_000]])
    with pytest.raises(CorruptRecordError, match="'nm' holds more than"):
        decode(nested)
