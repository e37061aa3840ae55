"""Resumed training appending to the same run (append_output, start_iteration)."""

from __future__ import annotations

import json
import os
import time

import pytest
from trainmon_util import events_of, loss_of, make, rank_dirs, steps_with, train, write_config
from trainrec.recorder import TrainerMon
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import RunResumed, StepEnded


def test_append_output_resumes_into_the_matching_rank_dir(tmp_path, out):
    train(tmp_path, {"wg_distribution": True}, steps=2)
    (first,) = rank_dirs(out)
    stamp = os.path.basename(first).split("-rank")[0]
    train(tmp_path, {"wg_distribution": True, "append_output": [stamp, stamp]}, steps=2, start_iteration=2)
    assert rank_dirs(out) == [first]
    assert sorted(os.listdir(first)) == ["trainrec-00000.trl", "trainrec-00001.trl"]
    ev = events_of(os.path.join(first, "trainrec-00001.trl"))
    rr = [e for e in ev if isinstance(e, RunResumed)]
    assert rr and rr[0].previous_files == ("trainrec-00000.trl",) and rr[0].last_step == 1
    assert steps_with(ev, "grad_reduced") == [2, 3]


def test_a_resumed_launchs_live_csv_export_reads_only_its_own_log(tmp_path, out):
    """format csv, live export on: the first launch's export ends cleanly and records the log it
    exported; the resumed launch's export reads only the new log file, and the rank directory ends
    with the CSV files ``trainrec export`` writes for the whole run."""
    import filecmp

    from trainrec.tools.cli import main as cli

    def launch(cfg, steps, **kw):
        mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False)
        model, opt = make()
        mon.monitor_gnorm_with_ad(model, optimizer=opt, **kw)
        for s in range(steps):
            loss_of(model, s).backward()
            opt.step()
            opt.zero_grad()
        mon.close()

    cfg = {"wg_distribution": True, "format": "csv", "step_count_per_record": 2}
    launch(cfg, 5)
    (first,) = rank_dirs(out)
    with open(os.path.join(first, "live_export.done")) as f:
        assert [n for n, _ in json.load(f)["logs"]] == ["trainrec-00000.trl"]
    stamp = os.path.basename(first).split("-rank")[0]
    before = {n: os.stat(os.path.join(first, n)).st_mtime_ns for n in os.listdir(first) if n.endswith("_0-1.csv")}
    assert len(before) == 2  # grad_unreduced, grad_reduced
    time.sleep(0.05)
    launch({**cfg, "append_output": [stamp, stamp]}, 3, start_iteration=3)
    # not rewritten: the resumed launch's export did not read the first log again
    assert {n: os.stat(os.path.join(first, n)).st_mtime_ns for n in before} == before
    with open(os.path.join(first, "live_export.done")) as f:
        assert [n for n, _ in json.load(f)["logs"]] == ["trainrec-00000.trl", "trainrec-00001.trl"]
    with open(os.path.join(first, "live_export.out")) as f:
        assert "error" not in f.read().lower()
    assert cli(["export", "csv", str(out), "-o", str(tmp_path / "off"), "--step-count-per-record", "2"]) == 0
    offline = tmp_path / "off" / os.path.basename(first)
    files = sorted(os.listdir(offline))
    assert sorted(n for n in os.listdir(first) if n.endswith(".csv")) == files and len(files) == 2 * 3
    match, mismatch, errors = filecmp.cmpfiles(first, offline, files, shallow=False)
    assert not mismatch and not errors


def test_a_resume_that_fails_at_start_up_keeps_the_run_whole(tmp_path, out):
    """A resume whose config fails in monitor_gnorm_with_ad (a target that matches nothing) has already
    opened its log file: it carries the run's own id, so that file joins the run instead of starting
    one of its own that became the "latest" run, which the next, good resume then continued, hiding
    the steps before the crash from every replay."""
    from trainrec.replay import open_run

    train(tmp_path, {"wg_distribution": True}, steps=3)
    (first,) = rank_dirs(out)
    stamp = os.path.basename(first).split("-rank")[0]
    resume = {"wg_distribution": True, "append_output": [stamp, stamp]}
    mon = TrainerMon(write_config(tmp_path, {**resume, "xy_distribution": True, "targets": {"nope": {}}}),
                     params_have_main_grad=False, live_export=False)
    model, opt = make()
    with pytest.raises(ConfigError):
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    mon.close()
    train(tmp_path, resume, steps=2, start_iteration=3)
    assert len(os.listdir(first)) == 3
    for where in (str(out), first):
        run = open_run(where)
        assert sorted({e.step for e in run.events() if isinstance(e, StepEnded)}) == [0, 1, 2, 3, 4], where


def test_a_resume_without_start_iteration_warns_that_it_supersedes_the_run(tmp_path, out, caplog):
    train(tmp_path, {"wg_distribution": True}, steps=2)
    stamp = os.path.basename(rank_dirs(out)[0]).split("-rank")[0]
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        train(tmp_path, {"wg_distribution": True, "append_output": [stamp, stamp]}, steps=1, start_iteration=2)
    assert "start_iteration" not in caplog.text
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        train(tmp_path, {"wg_distribution": True, "append_output": [stamp, stamp]}, steps=1)
    assert "training starts at step 0 here (start_iteration not given, or 0)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):  # (it said 'not given' of a 0 given)
        train(tmp_path, {"wg_distribution": True, "append_output": [stamp, stamp]}, steps=1, start_iteration=0)
    assert "training starts at step 0 here (start_iteration not given, or 0)" in caplog.text


def test_append_output_without_a_match_is_a_clear_error(tmp_path, out):
    with pytest.raises(ConfigError, match="no rank directory of rank 0") as ei:
        TrainerMon(write_config(tmp_path, {"append_output": ["Jan01_00-00-00", "Jan01_00-00-01"]}))
    assert ei.value.key == "append_output"


def test_append_output_with_a_reversed_range_says_so(tmp_path, out):
    with pytest.raises(ConfigError, match=r"\[Jan02_00-00-00, Jan01_00-00-00\] is empty: its start is after") as ei:
        TrainerMon(write_config(tmp_path, {"append_output": ["Jan02_00-00-00", "Jan01_00-00-00"]}))
    assert ei.value.key == "append_output"
