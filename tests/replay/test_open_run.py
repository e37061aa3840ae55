"""open_run on output directories, rank directories and files; selection; merge order; resume."""

from __future__ import annotations

import os

import pandas as pd
import pytest
from logbuild import rank_dir, same, stats, value, write_rank
from trainrec.recorder.writer import LogWriter
from trainrec.replay import list_runs, open_run
from trainrec.schema import framing
from trainrec.schema.errors import FormatError, NotALogError, NotARunError, UnsupportedVersionError
from trainrec.schema.events import (
    FileClosed,
    FileOpened,
    ModuleStructureRecorded,
    NamesInterned,
    RunResumed,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
)


def _launch(out, run_id, stamp, ranks=(0, 1), steps=range(4)):
    paths = {}
    for r in ranks:
        paths[r], _ = write_rank(
            rank_dir(out, r, stamp, suffix=f"{abs(hash(run_id)) % 0xFFFFFF:06x}{r:02x}"),
            rank=r, run_id=run_id, steps=steps, world_size=len(ranks),
        )
    return paths


@pytest.fixture()
def two_launches(tmp_path):
    a = _launch(tmp_path, "abc-1111", "Nov30_10-00-00")
    b = _launch(tmp_path, "abc-2222", "Nov30_12-00-00", steps=range(6))
    os.makedirs(tmp_path / "anomaly_detected")  # other content of an output directory is ignored
    return tmp_path, a, b


def test_output_dir_defaults_to_the_latest_launch(two_launches):
    out, _a, b = two_launches
    runs = list_runs(str(out))
    assert [r.run_id for r in runs] == ["abc-1111", "abc-2222"]
    run = open_run(str(out))
    assert run.run_id == "abc-2222" and run.ranks == [0, 1]
    assert run.files(1) == [b[1]]
    assert run.rank_dirs[0] == (os.path.dirname(b[0]),)
    assert isinstance(run.headers[b[0]], FileOpened) and run.world_size == 2
    assert run.format_versions == [framing.FORMAT_VERSION]


def test_selection_by_run_id_prefix_and_time_range(two_launches):
    out, a, _b = two_launches
    assert open_run(str(out), run_id="abc-1").files(0) == [a[0]]
    assert open_run(str(out), time_end="Nov30_11-00-00").run_id == "abc-1111"
    assert open_run(str(out), time_start="Nov30_12-00-00", time_end="Nov30_12-00-00").run_id == "abc-2222"
    with pytest.raises(NotARunError) as exc:
        open_run(str(out), run_id="abc")
    msg = str(exc.value)
    assert "2 runs match" in msg and "abc-1111" in msg and "abc-2222" in msg and "Nov30_10-00-00" in msg
    assert "ranks 0-1" in msg
    with pytest.raises(NotARunError, match="2 runs match time range"):
        open_run(str(out), time_start="Nov30_09-00-00", time_end="Nov30_13-00-00")
    with pytest.raises(NotARunError, match="no run matches run id 'zzz'"):
        open_run(str(out), run_id="zzz")
    with pytest.raises(NotARunError, match="not a time stamp"):
        open_run(str(out), time_start="yesterday")
    with pytest.raises(NotARunError, match="no run matches time range from Dec31_00-00-00 on; runs found"):
        open_run(str(out), time_start="Dec31_00-00-00")
    with pytest.raises(NotARunError, match="no run matches time range up to Nov01_00-00-00; runs found"):
        open_run(str(out), time_end="Nov01_00-00-00")


def test_rank_directory_and_single_file(two_launches):
    _out, a, _b = two_launches
    run = open_run(os.path.dirname(a[1]))
    assert run.ranks == [1] and run.run_id == "abc-1111"
    run = open_run(a[0])
    assert run.ranks == [0] and run.files(0) == [a[0]]
    events = list(run.events())
    assert isinstance(events[0], FileOpened) and isinstance(events[-1], FileClosed)
    with pytest.raises(NotARunError, match="belongs to run"):
        open_run(a[0], run_id="abc-2")


def test_not_a_run(tmp_path):
    with pytest.raises(NotARunError, match="no such file"):
        open_run(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotARunError, match="no trainrec logs"):
        open_run(str(tmp_path / "empty"))
    (tmp_path / "noise.trl").write_bytes(b"PK\x03\x04 a zip file, say")
    with pytest.raises(NotALogError, match="noise.trl.*bad magic"):
        open_run(str(tmp_path / "noise.trl"))
    (tmp_path / "future.trl").write_bytes(framing.encode_file_header(7) + b"\0" * 40)
    with pytest.raises(UnsupportedVersionError, match="future.trl.*format version 7"):
        open_run(str(tmp_path / "future.trl"))
    d = tmp_path / "Nov30_11-13-33-rank0-0000abcd"
    d.mkdir()
    (d / "trainrec-00000.trl").mkdir()  # a log name that cannot be read as a file
    with pytest.raises(FormatError, match="trainrec-00000.trl.*cannot read"):
        open_run(str(d))


def test_unsupported_version_inside_an_output_dir_is_an_error(tmp_path):
    _launch(tmp_path, "r1", "Nov30_10-00-00", ranks=(0,))
    d = rank_dir(tmp_path, 0, "Nov30_10-00-00", suffix="newer000")
    os.makedirs(d)
    with open(os.path.join(d, "trainrec-00000.trl"), "wb") as f:
        f.write(framing.encode_file_header(3))
    with pytest.raises(UnsupportedVersionError, match="upgrade trainrec"):
        open_run(d)


def test_merged_order_across_two_ranks(tmp_path):
    _launch(tmp_path, "m", "Nov30_10-00-00", ranks=(0, 1), steps=range(5))
    run = open_run(str(tmp_path))
    merged = list(run.events())
    per_rank = {r: list(run.events(rank=r)) for r in run.ranks}
    assert len(merged) == sum(len(v) for v in per_rank.values())
    for r in run.ranks:
        assert [e for e in merged if e.rank == r] == per_rank[r]
    # Key: (step reached so far, rank, position): within a step, rank 0 comes before rank 1.
    reached = {0: -1, 1: -1}
    keys = []
    for e in merged:
        reached[e.rank] = max(reached[e.rank], e.step)
        keys.append((reached[e.rank], e.rank))
    assert keys == sorted(keys)
    steps = [(e.step, e.rank) for e in merged if isinstance(e, StepBegan)]
    assert steps == [(s, r) for s in range(5) for r in (0, 1)]
    only = list(run.events(types=["ts", "StepBegan"]))
    assert {type(e) for e in only} == {TensorStatsRecorded, StepBegan} and len(only) == 20
    with pytest.raises(ValueError, match="unknown event type 'nope'"):
        list(run.events(types=["nope"]))


def test_resume_supersedes_later_steps_of_earlier_files(tmp_path):
    d = rank_dir(tmp_path, 0)
    p0, _ = write_rank(d, run_id="res", steps=range(10))
    p1, _ = write_rank(d, run_id="res-other-id", steps=range(6, 13), resume_step=6,
                       names=["layer1.weight", "layer0.weight"])
    run = open_run(str(tmp_path))
    assert run.files(0) == [p0, p1] and run.run_id == "res"
    began = [e.step for e in run.events() if isinstance(e, StepBegan)]
    assert began == list(range(13))
    assert run.superseded == {p0: 12, p1: 0}
    # The resumed file's own name table is used for its records.
    by_step = {ev.step: names for ev, names in run.stats()}
    assert by_step[5] == ["layer0.weight", "layer1.weight", "layer2.weight", "layer3.weight"]
    assert by_step[6] == ["layer1.weight", "layer0.weight"]
    df = pd.DataFrame(run.to_rows())
    assert not df.duplicated(["step", "name", "op"]).any()
    assert sorted(df.step.unique()) == list(range(13))
    # Every name table record is kept, superseded or not.
    assert sum(isinstance(e, NamesInterned) for e in run.events()) == 2


def test_several_resumes_compose(tmp_path):
    d = rank_dir(tmp_path, 0)
    p0, _ = write_rank(d, run_id="res", steps=range(10))
    p1, _ = write_rank(d, run_id="res", steps=range(6, 9), resume_step=6)
    p2, _ = write_rank(d, run_id="res", steps=range(3, 5), resume_step=3)
    run = open_run(d)
    assert run.cutoffs == {p0: 3, p1: 3}
    began = [(e.step, e.seq) for e in run.events() if isinstance(e, StepBegan)]
    assert [s for s, _ in began] == [0, 1, 2, 3, 4]
    assert run.superseded[p1] == 3 * 3 + 1  # its steps 6..8 and its own RunResumed(step=6)


def test_stats_and_rows_match_what_was_written(tmp_path):
    d = rank_dir(tmp_path, 0)
    _p, written = write_rank(d, run_id="v", steps=range(3))
    run = open_run(d)
    recs = list(run.stats(kinds=["grad_reduced"]))
    exp = [e for e in written if isinstance(e, TensorStatsRecorded)]
    assert len(recs) == 3 and all(same(a, b) for (a, _), b in zip(recs, exp, strict=True))
    assert recs[0][1] == [f"layer{i}.weight" for i in range(4)]
    assert list(run.stats(kinds=["actv"])) == []
    rows = run.to_rows()
    df = pd.DataFrame(rows)
    assert list(df.columns) == ["rank", "step", "kind", "name", "slot", "micro_step", "call_id", "vpp_stage",
                                "op", "value"]
    assert len(df) == 3 * 4 * 6
    got = df.set_index(["step", "name", "op"]).value
    assert got[(2, "layer3.weight", "norm")] == value(2, 3, 2)
    assert (df.call_id == -1).all() and (df.slot == "").all() and (df.kind == "grad_reduced").all()
    empty = run.to_rows(kinds=["param"])
    assert all(len(v) == 0 for v in empty.values())


def test_damaged_file_in_a_run(tmp_path):
    paths = _launch(tmp_path, "dmg", "Nov30_10-00-00", ranks=(0, 1), steps=range(5))
    with open(paths[1], "r+b") as f:
        f.seek(400)
        b = f.read(1)
        f.seek(400)
        f.write(bytes([b[0] ^ 0xFF]))
    run = open_run(str(tmp_path))
    n = sum(1 for _ in run.events())
    readers = run.readers
    assert readers[paths[0]].problems == [] and readers[paths[1]].problems
    assert readers[paths[1]].problems[0].path == paths[1]
    assert n == sum(r.events_read for r in readers.values())
    assert all(r.closed_cleanly for r in readers.values())


def test_readers_without_reading_events_first(tmp_path):
    d = rank_dir(tmp_path, 0)
    p, written = write_rank(d, run_id="v", steps=range(2), close=False)
    run = open_run(d)
    r = run.readers[p]
    assert not r.closed_cleanly and r.events_read == len(written) and r.pending_bytes == 0


def test_rows_in_execution_order_across_ranks(tmp_path):
    from logbuild import stats as stats_record
    from trainrec.recorder.writer import LogWriter
    from trainrec.replay import execution_order

    for r in (0, 1):
        w = LogWriter(rank_dir(tmp_path, r), rank=r, world_size=2, run_id="x", flush_interval=0.01)
        ids = w.intern(["m0", "m1"])
        for micro in (1, 0):  # written out of order on purpose
            w.write(stats_record(r, 0, ids, kind="actv", micro=micro, call_base=10 * micro + (5 - r)))
        w.write(stats_record(r, 0, ids, kind="grad_reduced"))  # no call ids: after the rest
        w.close()
    rows = open_run(str(tmp_path)).to_rows()
    order = execution_order(rows)
    keys = list(zip(rows["micro_step"][order], rows["call_id"][order], rows["rank"][order], strict=True))
    firsts = [k for i, k in enumerate(keys) if i % 6 == 0]  # one per (tensor row)
    assert firsts[:4] == [(0, 4, 1), (0, 5, 0), (0, 5, 1), (0, 6, 0)]
    assert [k[1] for k in firsts[-4:]] == [-1, -1, -1, -1]


def test_a_resume_after_many_structure_records_is_still_recognised(tmp_path):
    # One ModuleStructureRecorded per virtual-pipeline chunk can precede RunResumed in a resumed file.
    d = rank_dir(tmp_path, 0)
    p0, _ = write_rank(d, run_id="vpp", steps=range(6))
    w = LogWriter(d, rank=0, run_id="vpp", flush_interval=0.05)
    for chunk in range(12):
        w.write(ModuleStructureRecorded(rank=0, vpp_stage=chunk, names=("", "layer"), classes=("M", "L"),
                                        parents=(-1, 0)))
    w.write(RunResumed(rank=0, step=4, last_step=3, reason="test"))
    ids = w.intern(["layer0.weight"])
    for s in (4, 5, 6):
        w.write(StepBegan(rank=0, step=s))
        w.write(stats(0, s, ids))
        w.write(StepEnded(rank=0, step=s, collected=True))
    w.close()
    run = open_run(d)
    assert run.cutoffs == {p0: 4}
    assert [e.step for e in run.events() if isinstance(e, StepBegan)] == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("given", ["output", "rankdir"])
def test_the_references_output_without_logs_is_named_as_such(tmp_path, given):
    """msprobe's own output directory (its CSV or TensorBoard files, no trainrec log) got the bare
    'no trainrec logs here', which does not say that these are files trainrec reads elsewhere."""
    rank_dir = tmp_path / "out" / "Dec03_21-34-40-rank0-4700973a"
    rank_dir.mkdir(parents=True)
    (rank_dir / "actv_0-0.csv").write_text("vpp_stage,module_name,step\n")
    path = tmp_path / "out" if given == "output" else rank_dir
    with pytest.raises(NotARunError) as exc:
        open_run(str(path))
    assert "no trainrec logs here" in str(exc.value)
    assert "holds the reference's CSV or TensorBoard files and no trainrec log (msprobe's output?)" in str(exc.value)
    assert "trainrec.tools.csv2tb" in str(exc.value)
    (rank_dir / "actv_0-0.csv").unlink()
    with pytest.raises(NotARunError) as exc:
        open_run(str(path))
    assert "msprobe" not in str(exc.value)


def test_a_trainrec_export_given_as_run_is_named_as_such(tmp_path):
    out = tmp_path / "csv_out"
    (out / "Dec03_21-34-40-rank0-4700973a").mkdir(parents=True)
    (out / "Dec03_21-34-40-rank0-4700973a" / "actv_0-0.csv").write_text("vpp_stage,module_name,step\n")
    (out / ".trainrec-export.json").write_text("{}")
    with pytest.raises(NotARunError) as exc:
        open_run(str(out))
    assert "it is the output of trainrec export, not a run: give the directory the training wrote to" in str(exc.value)


def test_a_directory_of_anomaly_json_files_given_as_run_points_to_anomaly_analyse(tmp_path):
    out = tmp_path / "out" / "anomaly_detected"
    (out / "rank0").mkdir(parents=True)
    (out / "rank0" / "anomaly.json").write_text("{}")
    with pytest.raises(NotARunError) as exc:
        open_run(str(out))
    assert ("it holds anomaly.json files: python -m trainrec.tools.anomaly_analyse -d DIR ranks those; the trainrec "
            "commands take the directory the training wrote to") in str(exc.value)
