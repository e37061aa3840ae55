"""Records whose CRC checks out but whose contents are absurd or contradict the file: bounded memory,
a problem naming file and offset, and nothing else of the log lost."""

from __future__ import annotations

import tracemalloc

import pytest
from hostile_logs import F, good_log, rewrite
from trainrec.replay.names import NameResolver
from trainrec.replay.reader import read_log
from trainrec.schema.events import FileOpened, NamesInterned, TensorStatsRecorded


def _set(i, value):
    return lambda w: w.__setitem__(i, value)


@pytest.mark.parametrize(
    ("tag", "change", "what"),
    [
        ("nm", _set(F, 2**40), "first name id 1099511627776 is outside"),
        ("nm", _set(F + 1, ["a", None]), "a name is NoneType"),
        ("fo", _set(F + 1, 2**40), "world size 1099511627776 is outside"),
        ("fo", _set(F + 1, 0), "world size 0 is outside"),
        ("fo", _set(F + 11, ["a", None]), "group_mates holds 'a'"),
        ("ts", lambda w: w.__setitem__(F + 7, bytes([250, 250])), "slot 250 is not a known slot"),
        ("ts", _set(F + 1, [1, 2, 3, 4, 5, 6]), "op 1 is not a name"),
        ("ts", _set(3, 2**62), "envelope field 'step'"),
        ("ts", _set(2, 2**40), "envelope field 'rank'"),
        ("hf", lambda w: w.__setitem__(F + 1, bytes([77, 77])), "direction 77"),
        ("hf", lambda w: w.__setitem__(F, w[F] + b"\x01"), "module_ids is not a whole number"),
        ("se", _set(F + 2, 2**40), "micro step count"),
        ("ca", lambda w: w.__setitem__(F + 2, {"x": _nested(100)}), "nests deeper"),
    ],
)
def test_an_absurd_field_is_an_undecodable_record_at_its_offset(tmp_path, tag, change, what):
    path = good_log(str(tmp_path))
    _, clean = read_log(path)
    offset = rewrite(path, tag, change)
    reader, events = read_log(path)
    assert [(p.offset, p.what.split(": ", 1)[0]) for p in reader.problems] == [(offset, "undecodable record")]
    assert what in reader.problems[0].what and str(reader.problems[0]).startswith(f"{path} at byte {offset}: ")
    assert len(events) == len(clean) - 1  # that record only


def _nested(depth: int):
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


def test_a_name_id_gap_with_no_record_lost_is_reported_and_the_record_kept(tmp_path):
    path = good_log(str(tmp_path))
    offset = rewrite(path, "nm", _set(F, 2**32 - 2))
    tracemalloc.start()
    try:
        reader, events = read_log(path)
        resolver = NameResolver()
        for ev in events:
            resolver.feed(ev)
        names = [resolver.names(ev) for ev in events if isinstance(ev, TensorStatsRecorded)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # the ids below the gap are not materialised
    assert any(isinstance(ev, NamesInterned) for ev in events)
    whats = [(p.offset, p.skipped, p.what) for p in reader.problems]
    assert whats[0][:2] == (offset, 0) and "names interned from id 4294967294" in whats[0][2]
    # the stats records name ids 0 and 1, which nobody interned: said once, shown as placeholders
    assert len(whats) == 2 and "name id 0 was never interned" in whats[1][2]
    assert names[0] == ["<unknown name 0>", "<unknown name 1>"]
    assert resolver.name(0, 2**32 - 1) == "head.bias"


def test_an_unknown_name_id_is_reported_once_per_file_and_its_values_kept(tmp_path):
    path = good_log(str(tmp_path))
    _, clean = read_log(path)
    offset = rewrite(path, "ts", lambda w: w.__setitem__(F + 3, b"\xff" * 8))
    reader, events = read_log(path)
    assert len(events) == len(clean)
    assert [(p.offset, p.skipped) for p in reader.problems] == [(offset, 0)]
    assert "name id 4294967295 was never interned" in reader.problems[0].what
    assert "(record kept)" in str(reader.problems[0])


def test_unknown_name_ids_after_a_lost_names_record_are_its_consequence(tmp_path):
    path = good_log(str(tmp_path))
    offset = rewrite(path, "nm", _set(F + 1, [None]))
    reader, events = read_log(path)
    assert [p.offset for p in reader.problems] == [offset]  # the names record only
    assert isinstance(events[0], FileOpened)


def test_records_appended_after_the_close_are_one_damaged_region_not_replayed(tmp_path):
    path = good_log(str(tmp_path))
    _, clean = read_log(path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "ab") as f:
        f.write(data[16:])  # the log's frames once more, after its FileClosed
    reader, events = read_log(path)
    assert events == clean and reader.closed_cleanly and reader.gaps == []
    assert [(p.offset, p.skipped) for p in reader.problems] == [(len(data), len(data) - 16)]
    assert "after the FileClosed record" in reader.problems[0].what


def test_a_record_of_another_rank_in_a_ranks_log_is_reported_once_and_kept(tmp_path):
    """A record naming a rank that is not its file's (the header's) would be merged under that rank:
    reported with its offset, once per file, and kept (nothing recorded is lost)."""
    path = good_log(str(tmp_path))
    _, clean = read_log(path)
    first = rewrite(path, "ts", _set(2, 1))
    rewrite(path, "ts", _set(2, 1), which=1)
    reader, events = read_log(path)
    assert len(events) == len(clean)
    assert [(p.offset, p.skipped) for p in reader.problems] == [(first, 0)]
    assert "rank 1 in the log of rank 0" in reader.problems[0].what
    assert sum(1 for e in events if isinstance(e, TensorStatsRecorded) and e.rank == 1) == 2
