"""The spill thread writes what a long step has recorded while the step goes on: racing the training
thread's hooks, it loses nothing, duplicates nothing and changes no value (a numpy view of the step's
live firing arrays made the hooks' appends fail with BufferError)."""

from __future__ import annotations

import math
import sys
import time

from trainmon_util import events_of, loss_of, make, stats_table, write_config
from trainrec.recorder import TrainerMon, step_output
from trainrec.schema.events import HookFailed, HooksFired, TensorStatsRecorded

CFG = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
       "ops": ["norm", "max", "nans"]}


def _comparable(table: dict) -> dict:
    return {k: {op: "nan" if math.isnan(v) else v for op, v in row.items()} for k, row in table.items()}


def _train(tmp_path, name: str) -> list:
    out = tmp_path / name
    mon = TrainerMon(write_config(tmp_path, CFG, f"{name}.json"), params_have_main_grad=False, live_export=False,
                     output_dir=str(out))
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=24, optimizer=opt)
    for s in range(3):
        for m in range(24):
            loss_of(model, 100 * s + m).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    return events_of(out)


def test_spilling_all_the_time_records_exactly_what_one_write_per_step_does(tmp_path, monkeypatch):
    calm = _train(tmp_path, "calm")
    monkeypatch.setattr(step_output, "SPILL_AFTER_S", 0.0)
    monkeypatch.setattr(step_output, "SPILL_TICK_S", 0.0002)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns between almost any two bytecodes
    try:
        busy = _train(tmp_path, "busy")
    finally:
        sys.setswitchinterval(interval)
    assert not [e for e in busy if isinstance(e, HookFailed)]
    pieces = [e for e in busy if isinstance(e, HooksFired)]
    assert len(pieces) > 3  # it did spill, in the middle of steps
    for kind in ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param"):
        assert _comparable(stats_table(busy, kind)) == _comparable(stats_table(calm, kind)), kind
    n_rows = sum(len(e) for e in calm if isinstance(e, TensorStatsRecorded))
    assert sum(len(e) for e in busy if isinstance(e, TensorStatsRecorded)) == n_rows  # no duplicates

    def firings(events):
        return sorted((e.step, c) for e in events if isinstance(e, HooksFired)
                      for c in (r[2] for r in e.rows()))

    assert firings(busy) == firings(calm)


def test_the_spill_thread_sleeps_through_steps_that_are_not_collected(tmp_path, monkeypatch):
    """Between collected steps there is nothing to write: the spill thread waits for the next one
    instead of waking every tick (background wake-ups on every step a config skips)."""

    calls = []
    monkeypatch.setattr(step_output, "SPILL_TICK_S", 0.01)
    monkeypatch.setattr(step_output.StepOutput, "spill", lambda self, st, step_t0, current: calls.append(st is not None))
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"], "start_step": 1,
                                             "collect_times": 1}),
                     params_have_main_grad=False, live_export=False, output_dir=str(tmp_path / "out"))
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    loss_of(model, 0).backward()  # step 0: not collected
    time.sleep(0.3)
    assert calls == []
    opt.step()
    opt.zero_grad()
    loss_of(model, 1).backward()  # step 1: collected
    time.sleep(0.3)
    assert len(calls) >= 5 and all(calls)
    opt.step()
    opt.zero_grad()
    n = len(calls)
    loss_of(model, 2).backward()  # monitoring stopped after one collection
    time.sleep(0.3)
    assert len(calls) <= n + 1
    mon.close()


def test_api_metrics_of_a_spilled_step_hold_the_whole_step(tmp_path, monkeypatch):
    def metrics(name: str) -> dict:
        mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}, f"{name}.json"),
                         params_have_main_grad=False, live_export=False, output_dir=str(tmp_path / name))
        model, opt = make()
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        loss_of(model, 0).backward()
        time.sleep(0.05)
        opt.step()
        got = {which: {tag: float(v["norm"]) for tag, v in m.items()}
               for which, m in zip(("reduced", "unreduced"), mon.generate_wgrad_metrics(), strict=True)}
        mon.close()
        return got

    calm = metrics("calm")
    monkeypatch.setattr(step_output, "SPILL_AFTER_S", 0.0)
    monkeypatch.setattr(step_output, "SPILL_TICK_S", 0.001)
    assert metrics("busy") == calm and calm["reduced"] and calm["unreduced"]
