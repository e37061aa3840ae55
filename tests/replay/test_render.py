"""JSON rendering of events: the fast line builder equals the dict form; non-finite floats as strings."""

from __future__ import annotations

import math

import orjson
from trainrec.replay.render import event_dict, jsonable, stat_lines, stat_rows
from trainrec.schema.events import OPS, TensorStatsRecorded, UnknownEvent, pack_array


def _rec(values, **kw):
    return TensorStatsRecorded(rank=3, step=9, seq=4, wall=1.5, kind="actv_grad", ops=OPS, dtype="d",
                               name_ids=pack_array("I", [0, 1]), values=pack_array("d", values), **kw)


def test_stat_lines_equal_stat_rows():
    vals = [1e16, -0.0, 1e-7, math.nan, math.inf, -math.inf, 2.5, 3.0, 123456.789, 0.1, 7.0, 1.0]
    for extra in ({}, {"slots": bytes([4, 9]), "micro_steps": pack_array("H", [1, 2]),
                       "call_ids": pack_array("I", [10, 11]), "vpp_stages": bytes([0, 1])}):
        ev = _rec(vals, **extra)
        names = ['a"quoted"\\name', "ünï"]
        rows = list(stat_rows(ev, names))
        assert [orjson.loads(line) for line in stat_lines(ev, names)] == rows
        assert len(rows) == 12 and rows[3]["value"] == "nan" and rows[4]["value"] == "inf"
        assert rows[5]["value"] == "-inf" and rows[0]["value"] == 1e16
    assert rows[6]["slot"] == "9" and rows[0]["slot"] == "output_grad" and rows[6]["call_id"] == 11
    assert not any("placeholder" in r for r in rows)


def test_placeholder_rows_are_marked_in_stat_lines_and_event_dicts():
    vals = [1.0] * 6 + [math.nan] * 6
    ev = _rec(vals, placeholders=bytes([0, 1]))
    rows = list(stat_rows(ev, ["a", "b"]))
    assert [orjson.loads(line) for line in stat_lines(ev, ["a", "b"])] == rows
    assert [r.get("placeholder", False) for r in rows] == [False] * 6 + [True] * 6
    assert list(rows[6])[-3:] == ["placeholder", "op", "value"]
    assert event_dict(ev)["placeholders"] == [0, 1]
    assert event_dict(_rec(vals))["placeholders"] == []


def test_event_dict_of_odd_content():
    ev = UnknownEvent(rank=0, step=1, tag="zz", fields=(b"\x01\x02", {1: math.nan}, [math.inf]))
    d = event_dict(ev)
    assert d["type"] == "UnknownEvent" and d["tag"] == "zz"
    assert d["fields"] == [[1, 2], {"1": "nan"}, ["inf"]]
    orjson.dumps(d)
    assert jsonable({"k": (1.0, -math.inf)}) == {"k": [1.0, "-inf"]}
