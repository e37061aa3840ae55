"""`trainrec export csv|tb`: selection, parallel == serial, bad input, runs still being written."""

from __future__ import annotations

import filecmp
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from export_logs import PARAMS, rank_dir, stats_record, write_rank_log  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from trainrec.recorder.writer import LogWriter  # noqa: E402
from trainrec.schema.events import RunResumed, StepEnded  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    for r in range(2):
        write_rank_log(rank_dir(d, r), rank=r, steps=range(5), seed=r)
    return d


def _tree(d):
    out = []
    for root, _dirs, files in os.walk(d):
        out.extend(os.path.relpath(os.path.join(root, f), d) for f in files)
    return sorted(out)


def _tb_content(d):
    """Every scalar and text of every rank directory, as EventAccumulator reads it."""
    content = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if not os.path.isdir(p):
            continue
        ea = EventAccumulator(p, size_guidance={"scalars": 0, "tensors": 0})
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            content[(name, tag)] = [(e.step, e.wall_time, e.value if e.value == e.value else "nan") for e in ea.Scalars(tag)]
        for tag in ea.Tags()["tensors"]:
            content[(name, tag)] = [(e.step, e.tensor_proto.string_val[0]) for e in ea.Tensors(tag)]
    return content


def test_parallel_csv_is_byte_equal_to_serial(two_ranks, tmp_path, capsys):
    assert main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "a")]) == 0
    assert main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "b"), "-j", "3", "--step-count-per-record", "2"]) == 0
    assert main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "c"), "-j", "3"]) == 0
    files = [f for f in _tree(tmp_path / "a") if not f.startswith(".")]
    assert files == [f for f in _tree(tmp_path / "c") if not f.startswith(".")]
    assert len(files) == 2 * 7 * 5
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "c", files, shallow=False)
    assert not mismatch and not errors and len(match) == len(files)
    assert {os.path.dirname(f) for f in files} == {os.path.basename(rank_dir(two_ranks, r)) for r in range(2)}
    assert "param_4-5.csv" in os.listdir(tmp_path / "b" / os.path.basename(rank_dir(two_ranks, 0)))
    assert "exported run run-x: ranks 0-1, steps 0..4" in capsys.readouterr().out


def test_parallel_tb_equals_serial(two_ranks, tmp_path):
    assert main(["export", "tb", str(two_ranks), "-o", str(tmp_path / "a")]) == 0
    assert main(["export", "tb", str(two_ranks), "-o", str(tmp_path / "b"), "-j", "4"]) == 0
    a, b = _tb_content(tmp_path / "a"), _tb_content(tmp_path / "b")
    assert a == b
    assert len(a) > 500
    # serial: one event file per rank; parallel split the data types into parts in the same rank directory
    r0 = os.path.basename(rank_dir(two_ranks, 0))
    assert len(os.listdir(tmp_path / "a" / r0)) == 1 and len(os.listdir(tmp_path / "b" / r0)) == 2


def test_selection_types_steps_ranks(two_ranks, tmp_path):
    out = tmp_path / "sel"
    assert main(["export", "csv", str(two_ranks), "-o", str(out), "--types", "param,exp_avg", "--types", "actv",
                 "--steps", "1-2,4", "--ranks", "1"]) == 0
    files = [f for f in _tree(out) if not f.startswith(".")]
    r1 = os.path.basename(rank_dir(two_ranks, 1))
    assert files == sorted(f"{r1}/{k}_{s}-{s}.csv" for k in ("param", "exp_avg", "actv") for s in (1, 2, 4))


def test_time_range_selects_launches(tmp_path, capsys):
    out_dir = tmp_path / "mon"
    write_rank_log(rank_dir(out_dir, 0, stamp="Dec03_21-34-40", suffix="aaaaaaaa"), run_id="early", steps=range(2),
                   kinds=("param",))
    write_rank_log(rank_dir(out_dir, 0, stamp="Dec03_21-34-42", suffix="bbbbbbbb"), run_id="middle", steps=range(2),
                   kinds=("param",))
    write_rank_log(rank_dir(out_dir, 0, stamp="Dec03_22-00-00", suffix="cccccccc"), run_id="late", steps=range(2),
                   kinds=("param",))
    assert main(["export", "csv", str(out_dir), "-o", str(tmp_path / "e"), "--time-start", "Dec03_21-34-40",
                 "--time-end", "Dec03_21-34-42"]) == 0
    assert sorted(os.listdir(tmp_path / "e")) == [
        ".trainrec-export.json", "Dec03_21-34-40-rank0-aaaaaaaa", "Dec03_21-34-42-rank0-bbbbbbbb"]
    # the same rank from two launches stays apart
    assert sorted(os.listdir(tmp_path / "e" / "Dec03_21-34-40-rank0-aaaaaaaa")) == ["param_0-0.csv", "param_1-1.csv"]
    capsys.readouterr()
    assert main(["export", "csv", str(out_dir), "-o", str(tmp_path / "f"), "--time-start", "Jan01_00-00-00",
                 "--time-end", "Jan02_00-00-00"]) == 2
    err = capsys.readouterr().err
    assert "no run has a rank directory stamped in Jan01_00-00-00 .. Jan02_00-00-00" in err and "run late" in err
    assert main(["export", "csv", str(out_dir), "-o", str(tmp_path / "g"), "--time-start", "Dec3"]) == 2
    assert "is not a time stamp like" in capsys.readouterr().err
    # no selection: the latest launch
    assert main(["export", "csv", str(out_dir), "-o", str(tmp_path / "h")]) == 0
    assert "Dec03_22-00-00-rank0-cccccccc" in os.listdir(tmp_path / "h")


def test_output_directory_rules(two_ranks, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["export", "csv", str(two_ranks), "-o", str(out), "--types", "param"]) == 0
    capsys.readouterr()
    assert main(["export", "csv", str(two_ranks), "-o", str(out), "--types", "exp_avg"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["export", "csv", str(two_ranks), "-o", str(out), "--types", "exp_avg", "--force"]) == 0
    names = {os.path.basename(f).split("_")[0] for f in _tree(out) if not f.startswith(".")}
    assert names == {"exp"}  # the previous export was replaced, not mixed
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["export", "tb", str(two_ranks), "-o", str(foreign), "--force"]) == 2
    assert "holds no trainrec export" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine"


def test_bad_arguments(two_ranks, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "x"), "--types", "param,gradz"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown data type 'gradz'; valid types: actv, actv_grad, grad_unreduced, grad_reduced, param" in err
    with pytest.raises(SystemExit):
        main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "x"), "--steps", "3-1"])
    assert "end before start" in capsys.readouterr().err
    assert main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "y"), "--ranks", "7"]) == 2
    assert "no rank matches --ranks 7" in capsys.readouterr().err
    # steps outside the recorded ones: the same error as `trainrec anomalies -s`, and no output left
    assert main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "z"), "--steps", "50-60"]) == 2
    err = capsys.readouterr().err
    assert "steps 50-60 are outside the recorded range of run" in err and "the recorded steps are 0..4" in err
    assert not (tmp_path / "z").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", "tb", str(two_ranks), "-o", str(empty), "--steps", "50-60"]) == 2
    assert list(empty.iterdir()) == []  # an empty directory given is left empty
    # partly outside: exported, with a note on the part outside
    assert main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "part"), "--steps", "3-4,50-60"]) == 0
    assert "note: steps 50-60 are outside the recorded range (the recorded steps are 0..4)" in capsys.readouterr().err
    # selected steps recorded, but no data of the selected type there: nothing to export, exit 1, no output
    params_only = tmp_path / "params_only"
    write_rank_log(rank_dir(params_only, 0), rank=0, steps=range(3), kinds=("param",))
    assert main(["export", "csv", str(params_only), "-o", str(tmp_path / "t"), "--types", "exp_avg"]) == 1
    assert "nothing to export: no statistics for types exp_avg" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
    assert main(["export", "csv", str(tmp_path / "missing"), "-o", str(tmp_path / "w")]) == 2


def test_an_output_that_cannot_be_written_is_one_error_line(two_ranks, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["export", "csv", str(two_ranks), "-o", str(a_file / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainrec export: error: cannot prepare output directory ") and "a_file/sub" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_run_still_being_written_and_torn_tail(tmp_path, capsys):
    d = tmp_path / "live"
    rdir = rank_dir(d, 0)
    w = LogWriter(rdir, rank=0, run_id="live", flush_interval=0.02)
    write_rank_log(rdir, steps=range(3), kinds=("param",), close=False, writer=w)
    ids = list(range(5, 5 + len(PARAMS)))
    w.write(stats_record(0, 3, "param", ids, np.ones((len(ids), 6), np.float32)))  # step 3 still running
    w.flush()
    try:
        assert main(["export", "csv", str(d), "-o", str(tmp_path / "a")]) == 0
        err = capsys.readouterr().err
        assert "is still being written" in err and "step(s) 3 did not end" in err
        assert sorted(os.listdir(tmp_path / "a" / os.path.basename(rdir))) == [f"param_{s}-{s}.csv" for s in range(3)]
        with open(w.path, "ab") as f:  # half a record after the last complete one
            f.write(b"\x40\x00\x00\x00\x01\x02")
        assert main(["export", "tb", str(d), "-o", str(tmp_path / "b")]) == 0
        assert "6 bytes of an incomplete record (torn tail)" in capsys.readouterr().err
    finally:
        w.close()


def test_resume_supersedes_earlier_steps(tmp_path):
    rdir = rank_dir(tmp_path / "res", 0)
    with LogWriter(rdir, rank=0, run_id="res", flush_interval=0.02) as w:
        ids = w.intern(["p"], step=-1)
        for s in range(5):
            w.write(stats_record(0, s, "param", ids, np.full((1, 6), s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=1.0))
    with LogWriter(rdir, rank=0, run_id="res", flush_interval=0.02) as w:
        w.write(RunResumed(rank=0, step=3, wall=2.0, last_step=2))
        ids = w.intern(["p"], step=-1)
        for s in range(3, 6):
            w.write(stats_record(0, s, "param", ids, np.full((1, 6), 10 * s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=2.0))
    assert main(["export", "csv", str(tmp_path / "res"), "-o", str(tmp_path / "o")]) == 0
    base = tmp_path / "o" / os.path.basename(rdir)
    mins = {s: (base / f"param_{s}-{s}.csv").read_text().splitlines()[1].split(",")[3] for s in range(6)}
    assert mins == {0: "0.0", 1: "1.0", 2: "2.0", 3: "30.0", 4: "40.0", 5: "50.0"}


def test_progress_bar_only_on_a_terminal(two_ranks, tmp_path, capsys):
    from trainrec.tools.cmd_export import Progress

    assert main(["export", "csv", str(two_ranks), "-o", str(tmp_path / "q"), "-j", "2"]) == 0
    assert capsys.readouterr().err == ""  # not a terminal: quiet
    bar = Progress(total=4_000_000, tasks=2, label="export tb", enabled=True)
    bar.advance(2_000_000)
    bar.advance(2_000_000, task_done=True)
    bar.close()
    err = capsys.readouterr().err
    assert "\rexport tb [" in err and "100%" in err and "1/2 parts" in err and err.endswith("\n")
