from __future__ import annotations

import pytest
from trainrec.schema import EVENT_TYPES, CorruptRecordError, UnknownEvent, decode, encode
from trainrec.schema.events import TensorStatsRecorded, pack_array


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


def test_unknown_tag_is_skippable_and_known_tag_with_bad_field_is_corrupt():
    import msgpack

    unknown = decode(msgpack.packb(["zz", 1, 0, 5, 0.0, "x"]))
    assert isinstance(unknown, UnknownEvent) and unknown.tag == "zz" and unknown.step == 5
    with pytest.raises(CorruptRecordError, match="field 'kind'"):
        decode(msgpack.packb(["ts", 1, 0, 5, 0.0, 123]))
    with pytest.raises(CorruptRecordError, match="rows"):
        decode(msgpack.packb(["ts", 1, 0, 5, 0.0, "actv", ["min"], "f", b"\0\0\0\0", b""]))


def test_newer_writer_extra_fields_are_ignored():
    import msgpack

    ev = decode(msgpack.packb(["sb", 1, 0, 5, 0.0, "future-field"]))
    assert ev.step == 5
