"""Failures inside the monitor (hooks, step bookkeeping, optimizer statistics, the output directory) never reach training and are said in the log."""

from __future__ import annotations

import functools
import json
import os
import time

import pytest
import torch
from trainmon_util import events_of, loss_of, make, steps_with, write_config
from trainrec.recorder import TrainerMon
from trainrec.schema.events import HookFailed


def test_an_exception_mid_step_leaves_a_log_that_says_how_the_process_ended(tmp_path, out, capsys):
    """An uncaught exception after a backward pass of step 3: the log is closed at exit with the
    exception's type as the reason, and inspect lists step 3 as begun and not ended."""
    import subprocess
    import sys

    script = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from trainmon_util import loss_of, make
from trainrec.recorder import TrainerMon
mon = TrainerMon({{"wg_distribution": True}}, live_export=False)
model, opt = make()
mon.monitor_gnorm_with_ad(model, optimizer=opt)
for s in range(3):
    loss_of(model, s).backward()
    opt.step()
    opt.zero_grad()
loss_of(model, 3).backward()
raise RuntimeError("the loss went away")
"""
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the loss went away" in proc.stderr
    events = events_of(out)
    assert type(events[-1]).__name__ == "FileClosed" and events[-1].reason == "exit after an uncaught RuntimeError"
    from trainrec.tools.cli import main

    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_rank"][0]["steps_not_ended"] == [3]
    assert main(["inspect", str(out)]) == 0
    # the log says why the step was cut short: not "the process stopped" (it closed the log on its way out)
    assert ("step(s) 3 began and did not end (its log was closed in the middle of it: exit after an uncaught "
            "RuntimeError)") in capsys.readouterr().out


def test_exception_in_a_hook_is_recorded_and_training_continues(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "xy_distribution": True}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)

    def boom(tensors):
        raise RuntimeError("injected failure")

    mon.session.context.engine.compute = mon.session.context.engine.rows = boom  # rows: the module hooks' entry
    before = model.head.weight.detach().clone()
    for s in range(2):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert not torch.equal(before, model.head.weight)
    fails = [e for e in events_of(out) if isinstance(e, HookFailed)]
    assert fails and all("injected failure" in e.error for e in fails)
    assert {e.where.split(" of ")[0] for e in fails} >= {"forward hook", "backward hook"}


def test_a_failure_in_the_optimizer_state_statistics_keeps_the_steps_other_rows(tmp_path, out):
    """mv/ur statistics that fail (an optimizer state torch cannot reduce) lose those rows only: the
    failure ended the step's writing, and its gradient, parameter and activation rows were lost too."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "xy_distribution": True,
                                             "mv_distribution": True, "ur_distribution": True}),
                     params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure in the Adam state")

    mon.session.collection.optimizer.optimizer_rows = boom
    for s in range(2):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    fails = [e for e in ev if isinstance(e, HookFailed)]
    assert [(e.step, e.where) for e in fails] == [(0, "optimizer state statistics"), (1, "optimizer state statistics")]
    for kind in ("grad_reduced", "grad_unreduced", "actv", "actv_grad"):
        assert steps_with(ev, kind) == [0, 1], kind
    assert steps_with(ev, "exp_avg") == []


@pytest.mark.parametrize("where", ["cycle.begin", "hooks.on_micro_step", "cycle.mark_began", "binding.part_of_step"])
def test_exception_in_the_step_bookkeeping_never_reaches_training(tmp_path, out, where):
    """The monitor's own per-step work around the hooks (step start and end, micro-step counting, the
    StepBegan mark, DeepSpeed's group split) runs inside the optimizer's step hooks and the model's
    forward pre-hook: a failure there is a HookFailed and a warning, and training goes on."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), params_have_main_grad=False,
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected failure in {where}")

    *parts, name = where.split(".")
    setattr(functools.reduce(getattr, parts, mon.session), name, boom)
    before = model.head.weight.detach().clone()
    for s in range(3):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    mon.step()  # the manual step goes through the same hooks
    mon.close()
    assert not torch.equal(before, model.head.weight)
    fails = [e for e in events_of(out) if isinstance(e, HookFailed)]
    assert fails and all(f"injected failure in {where}" in e.error for e in fails)


def test_an_output_directory_removed_mid_run_neither_stops_training_nor_holds_close(tmp_path, out, caplog):
    """A cleanup script removes the run directory: the writer fails (one error), training goes on, and
    close() stops the live export at once instead of waiting 30 s for a FileClosed that never comes."""
    import shutil

    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "format": "csv"}), params_have_main_grad=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for step in range(6):
        if step == 2:
            time.sleep(1.0)  # the live export has started and follows the log
            shutil.rmtree(mon.rank_dir)
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.3)  # a flush interval: the writer finds its file gone
    assert mon.session.output.writer.error is not None and "removed" in str(mon.session.output.writer.error)
    t0 = time.monotonic()
    mon.close()
    assert time.monotonic() - t0 < 10
    assert mon.session.output.live is None or mon.session.output.live.proc is None
