"""The step index: written by the LogWriter in FileClosed, used to read only some steps, never trusted blindly.

Whatever a file's index says (none, a valid one, a hostile one), a step selection yields the events
that the rule of :func:`keep_selected` keeps from a full read of the same file.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import sys

import numpy as np
import pytest
from index_logs import NO_INDEX, closed_record, copy_run, rewrite_index
from logbuild import rank_dir, stats
from trainrec.recorder.writer import LogWriter
from trainrec.replay import load_index, open_run, read_log, read_steps
from trainrec.replay.stepindex import keep_selected
from trainrec.schema import codec, framing
from trainrec.schema.events import (
    AnomalyDetected,
    FileClosed,
    NamesInterned,
    NamesRepeated,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    pack_array,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "analyzers"))
from varied_logs import write_varied_run  # noqa: E402

STEPS = 200
LATE = 37  # a late record of step LATE - 1 is written in step LATE
NEW_NAMES_AT = 120  # names interned in the middle of the run


def write_log(rdir: str, steps: int = STEPS) -> str:
    names = [f"layer{i}.weight" for i in range(20)]
    with LogWriter(rdir, rank=0, run_id="ix", flush_interval=0.05) as w:
        ids = w.intern(names, step=-1)
        for s in range(steps):
            w.write(StepBegan(rank=0, step=s, wall=1.0 + s))
            if s == NEW_NAMES_AT:
                ids = ids + w.intern(["late.bias"], step=s)
            w.write(stats(0, s, ids))
            if s == LATE:
                w.write(AnomalyDetected(rank=0, step=s - 1, wall=1.0 + s, rule="r", op="norm", value=1.0))
            w.write(StepEnded(rank=0, step=s, wall=1.5 + s, duration=0.5, collected=True))
        return w.path


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> str:
    return write_log(rank_dir(tmp_path_factory.mktemp("ix"), 0))


def _normal(events):
    """Events with FileClosed's index fields cleared (what differs between a file and its copy without them)."""
    return [dataclasses.replace(e, **NO_INDEX) if isinstance(e, FileClosed) else e for e in events]


def _selected(path: str, ranges) -> tuple[list, object]:
    reader, stream, _ = read_steps(path, ranges)
    return list(stream), reader


def _full(path: str, ranges) -> list:
    return list(keep_selected(read_log(path)[1], ranges))


def _wire(events) -> list[str]:
    """Events as text (compared so, NaN equals NaN)."""
    return [repr(e) for e in events]


def test_the_writer_indexes_every_step(log_path):
    ix, why = load_index(log_path)
    assert why is None and ix is not None
    assert ix.steps.tolist() == list(range(STEPS))
    with open(log_path, "rb") as f:
        data = f.read()

    def at(offset: int):
        _, length, _, _ = framing.FRAME_HEADER.unpack_from(data, offset)
        return codec.decode(data[offset + 16 : offset + 16 + length])

    for k in range(STEPS):
        ev = at(int(ix.offsets[k]))
        assert (ev.step, ev.seq) == (k, int(ix.seqs[k]))
    assert ix.low_steps[LATE] == LATE - 1 and (np.delete(ix.low_steps, LATE) == np.delete(ix.steps, LATE)).all()
    tables = [at(int(o)) for o in ix.names_offsets]
    assert {type(t) for t in tables} == {NamesInterned, NamesRepeated}
    assert [t.names for t in tables if isinstance(t, NamesInterned)] == [
        tuple(f"layer{i}.weight" for i in range(20)), ("late.bias",)]
    start, closed = closed_record(log_path)
    assert ix.index_offset == start and ix.step_span == (0, STEPS - 1)
    assert closed.records == closed.seq  # (the index takes no record of its own)


@pytest.mark.parametrize("ranges", [((100, 102),), ((0, 0),), ((LATE - 1, LATE - 1),), ((NEW_NAMES_AT + 5, None),),
                                    ((10, 12), (190, 195)), ((500, 600),), ((STEPS - 1, STEPS - 1),)])
def test_a_selection_reads_its_steps_only_and_equals_a_full_read(log_path, ranges):
    got, reader = _selected(log_path, ranges)
    assert got == _full(log_path, ranges)
    assert reader.problems == [] and reader.pending_bytes == 0 and reader.closed_cleanly
    size = os.path.getsize(log_path)
    wanted = sum((STEPS if hi is None else min(hi, STEPS - 1) + 1) - lo for lo, hi in ranges if lo < STEPS)
    if wanted <= 10:
        assert reader.bytes_read < size / 10, (reader.bytes_read, size)
    steps = {e.step for e in got if isinstance(e, TensorStatsRecorded)}
    assert steps == {s for s in range(STEPS) if any(lo <= s and (hi is None or s <= hi) for lo, hi in ranges)}
    # every name table is kept, those interned in the middle of the run too (read on their own)
    assert [e.names for e in got if isinstance(e, NamesInterned)] == [
        tuple(f"layer{i}.weight" for i in range(20)), ("late.bias",)]


def test_the_late_record_is_found(log_path):
    got, _ = _selected(log_path, ((LATE - 1, LATE - 1),))
    assert [type(e) for e in got if e.step == LATE - 1].count(AnomalyDetected) == 1


def test_a_file_without_index_is_scanned_to_the_same_events(log_path, tmp_path):
    old = str(tmp_path / "old.trl")
    shutil.copyfile(log_path, old)
    rewrite_index(old, **NO_INDEX)
    assert load_index(old) == (None, None)
    for ranges in (((100, 102),), ((0, 5), (150, None))):
        got, reader = _selected(old, ranges)
        assert _normal(got) == _normal(_selected(log_path, ranges)[0])
        assert reader.problems == []
    # (the scan reads every frame, but the reader decodes only the selection's)
    assert _selected(old, ((100, 102),))[1].bytes_read < os.path.getsize(old) / 10


def test_a_crash_truncated_file_falls_back_to_a_scan(log_path, tmp_path):
    torn = str(tmp_path / "torn.trl")
    with open(log_path, "rb") as f:
        data = f.read()
    with open(torn, "wb") as f:
        f.write(data[: len(data) * 3 // 5])
    assert load_index(torn) == (None, None)
    got, reader = _selected(torn, ((100, 102),))
    assert got == _full(torn, ((100, 102),)) and reader.pending_bytes > 0 and not reader.closed_cleanly
    assert reader.bytes_read < len(data) / 10  # (rebuilt by a scan)
    indexed, _ = _selected(log_path, ((100, 102),))
    assert [e for e in got if e.step >= 0] == [e for e in indexed if e.step >= 0 and not isinstance(e, FileClosed)]


def _hostile(ix, size: int) -> dict[str, dict]:
    steps, offsets, seqs, low = ix.steps.copy(), ix.offsets.copy(), ix.seqs.copy(), ix.low_steps.copy()

    def packed(steps=steps, offsets=offsets, seqs=seqs, low=low, names=ix.names_offsets):
        return {"index_steps": pack_array("q", steps.tolist()), "index_offsets": pack_array("Q", offsets.tolist()),
                "index_seqs": pack_array("Q", seqs.tolist()), "index_low_steps": pack_array("q", low.tolist()),
                "index_names": pack_array("Q", names.tolist())}

    past = offsets.copy()
    past[-1] = size + 1000
    mid = offsets.copy()
    mid[100] += 3
    negative = steps.copy()
    negative[0] = -5
    return {
        "offsets past the end": packed(offsets=past),
        "an offset in the middle of a frame": packed(offsets=mid),
        "a negative step": packed(steps=negative),
        "huge values": {**packed(), "index_offsets": pack_array("Q", [1 << 63] * len(offsets))},
        "more steps than offsets": {**packed(), "index_steps": pack_array("q", list(range(len(steps) + 5)))},
        "steps shifted": packed(steps=steps + 1, low=low + 1),
        "seqs shifted": packed(seqs=seqs + 1),
        "unsorted offsets": packed(offsets=offsets[::-1].copy()),
        "a name table where a step is": packed(names=np.array([offsets[150]])),
        "a lowest step above its step": packed(low=low + 1),
        "more frames than bytes": packed(seqs=seqs * 1000),
        "odd lengths": {**packed(), "index_seqs": b"\x01\x02\x03"},
    }


@pytest.mark.parametrize("case", [
    "offsets past the end", "an offset in the middle of a frame", "a negative step", "huge values",
    "more steps than offsets", "steps shifted", "seqs shifted", "unsorted offsets", "a name table where a step is",
    "a lowest step above its step", "more frames than bytes", "odd lengths"])
def test_a_hostile_index_is_ignored_with_a_note_and_rebuilt(log_path, tmp_path, case):
    ix, _ = load_index(log_path)
    bad = str(tmp_path / "bad.trl")
    shutil.copyfile(log_path, bad)
    rewrite_index(bad, **_hostile(ix, os.path.getsize(log_path))[case])
    ranges = ((100, 102),)
    got, reader = _selected(bad, ranges)
    assert got == _full(bad, ranges)
    assert _normal(got) == _normal(_selected(log_path, ranges)[0])
    notes = [p.what for p in reader.problems]
    assert len(notes) == 1 and notes[0].startswith("step index ignored ("), notes
    assert notes[0].endswith("rebuilt by a scan of the file")
    assert reader.bytes_read < os.path.getsize(bad) / 10


def test_a_damaged_close_record_means_no_index(log_path, tmp_path):
    bad = str(tmp_path / "flip.trl")
    with open(log_path, "rb") as f:
        data = bytearray(f.read())
    start, _ = closed_record(log_path)
    data[start + 40] ^= 0x10  # (inside the FileClosed payload: its CRC fails)
    with open(bad, "wb") as f:
        f.write(data)
    assert load_index(bad) == (None, None)
    got, reader = _selected(bad, ((100, 102),))
    assert got == _full(bad, ((100, 102),)) and "payload CRC mismatch" in reader.problems[0].what


def test_a_resumed_rank_spanning_the_resume(tmp_path):
    run_dir = write_varied_run(str(tmp_path / "run"), ranks=3, steps=40)
    old = copy_run(run_dir, str(tmp_path / "old"))
    ranges = ((18, 26),)  # rank 1 resumes at step 22 in a second file
    indexed, plain = open_run(run_dir), open_run(old)
    got = list(indexed.events(rank=1, steps=ranges))
    assert _normal(got) == _normal(list(plain.events(rank=1, steps=ranges)))
    actv = [e.step for e in got if isinstance(e, TensorStatsRecorded) and e.kind == "actv"]
    assert actv == list(range(18, 27))  # the superseded steps 22..26 of the first file are left out
    files = indexed.files(1)
    assert indexed.superseded[files[0]] == plain.superseded[plain.files(1)[0]] > 0
    read = sum(indexed.readers_of([1])[p].bytes_read for p in files)
    assert read < sum(os.path.getsize(p) for p in files) / 2
    assert indexed.step_span([1]) == plain.step_span([1]) == (0, 44)
    # every rank merged: the same stream, rank 2's torn tail included
    assert _normal(open_run(run_dir).events(steps=ranges)) == _normal(open_run(old).events(steps=ranges))


def _replayable(expected: str) -> bool:
    with open(expected, encoding="utf-8") as f:
        return "error" not in json.load(f)


GOLDEN = sorted(p for p in glob.glob(os.path.join(os.path.dirname(__file__), os.pardir, "golden", "v*", "*.json"))
                if _replayable(p))


@pytest.mark.parametrize("expected", GOLDEN, ids=os.path.basename)
def test_golden_logs_select_as_a_full_read(expected):
    log = expected[: -len(".json")] + ".trl"
    for ranges in (((1, 1),), ((0, None),), ((2, 3),)):
        got, reader = _selected(log, ranges)
        assert _wire(got) == _wire(_full(log, ranges))
        assert not any("step index ignored" in p.what for p in reader.problems)


@pytest.mark.parametrize("expected", GOLDEN, ids=os.path.basename)
def test_first_record_by_tag_is_the_readers_first(expected):
    from trainrec.replay.stepindex import first_record

    log = expected[: -len(".json")] + ".trl"
    for tag in ("ca", "rr", "ts", "fc"):
        got = first_record(log, tag, 10000)
        if got is False:  # (damage or a torn tail: the caller reads the file with a LogReader)
            assert read_log(log)[0].problems or read_log(log)[0].pending_bytes
            continue
        want = next((e for e in read_log(log)[1] if codec.TAGS.get(tag) is type(e)), None)
        assert repr(got) == repr(want)


def test_the_scan_rebuilds_the_writers_index(log_path, tmp_path):
    from trainrec.replay.index_scan import scan_index

    ix, _ = load_index(log_path)
    sc = scan_index(log_path)
    for name in ("steps", "offsets", "seqs", "low_steps", "names_offsets"):
        assert getattr(sc, name).tolist() == getattr(ix, name).tolist(), name
    assert (sc.index_offset, sc.index_seq, sc.closed, sc.close_reason) == (ix.index_offset, ix.index_seq, True, "close")
    torn = str(tmp_path / "torn.trl")
    with open(log_path, "rb") as f:
        data = f.read()
    with open(torn, "wb") as f:
        f.write(data[: int(ix.offsets[150]) + 7])  # (the writer killed in step 150's first frame)
    sc = scan_index(torn)
    assert sc.steps.tolist() == list(range(150)) and not sc.closed and sc.end == int(ix.offsets[150])


def test_a_damaged_file_without_index_is_read_whole(log_path, tmp_path):
    from trainrec.replay.index_scan import scan_index

    bad = str(tmp_path / "bad.trl")
    with open(log_path, "rb") as f:
        data = bytearray(f.read())
    ix, _ = load_index(log_path)
    data[int(ix.offsets[50]) + 30] ^= 0x01  # a payload bit in step 50
    with open(bad, "wb") as f:
        f.write(data)
    rewrite_index(bad, **NO_INDEX)
    assert scan_index(bad) is None
    got, reader = _selected(bad, ((100, 102),))
    assert got == _full(bad, ((100, 102),)) and reader.bytes_read >= os.path.getsize(bad) - 16
    assert "payload CRC mismatch" in reader.problems[0].what


@pytest.mark.parametrize("expected", GOLDEN, ids=os.path.basename)
def test_peek_envelope_agrees_with_the_codec(expected):
    from trainrec.replay.index_scan import peek_envelope

    log = expected[: -len(".json")] + ".trl"
    with open(log, "rb") as f:
        data = f.read()
    pos, seen = framing.FILE_HEADER_SIZE, 0
    while pos + framing.FRAME_HEADER_SIZE <= len(data):
        status, payload, nxt = framing.read_frame(data, pos)
        if status is not framing.Frame.OK:
            pos = framing.resync(data, pos) if nxt == pos else nxt
            continue
        try:
            ev = codec.decode(payload)
        except Exception:  # noqa: BLE001 - (an undecodable record: nothing to compare)
            pos = nxt
            continue
        tag = ev.tag if type(ev).__name__ == "UnknownEvent" else ev.TAG
        assert peek_envelope(payload) == (tag, ev.seq, ev.step)
        pos, seen = nxt, seen + 1
    assert seen or len(data) <= framing.FILE_HEADER_SIZE
