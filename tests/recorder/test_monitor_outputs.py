"""What TrainerMon writes besides statistics: structure, config, hooks fired, alerts, the api format and the live export, and what a config error leaves behind."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from trainmon_util import ALL_OPS, events_of, loss_of, make, rank_dirs, steps_with, train, write_config
from trainrec.recorder import TrainerMon
from trainrec.recorder.monitor import PRINT_STRUCT_EXIT
from trainrec.recorder.runinfo import LIVE_EXPORT_NICE
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import ConfigApplied, HookFailed, HooksFired, ModuleStructureRecorded


@pytest.mark.parametrize("fmt", ["csv", "tensorboard"])
def test_a_config_error_leaves_no_directory_with_the_live_export_on(tmp_path, out, fmt):
    """The live TensorBoard export has written its file's header into the directory by then: it goes
    too (a directory left with it alone was then the one append_output resumed into)."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "format": fmt, "targets": {"nope": {}}}))
    model, opt = make()
    time.sleep(1.0)  # the export process has started and seen the log
    with pytest.raises(ConfigError, match="matches no module"):
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    mon.close()
    assert rank_dirs(out) == []


def test_print_struct_writes_module_struct_and_stops(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"print_struct": True}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    loss_of(model, 0).backward()
    with pytest.raises(Exception, match=PRINT_STRUCT_EXIT):
        opt.step()
    before = model.head.weight.detach().clone()
    assert torch.equal(before, model.head.weight)  # raised before the update
    with open(out / "module_struct.json") as f:
        struct = json.load(f)
    assert struct["0:pair"]["input"] == {"config": "tuple[2]", "0": "size=(4, 5, 8), dtype=torch.float32",
                                         "1": "size=(4, 5, 8), dtype=torch.float32"}
    assert struct["0:head"]["output"]["config"] == "tensor"
    assert struct["0:pair"]["output_grad"]["config"] == "tuple[2]"
    ev = events_of(out)
    ms = [e for e in ev if isinstance(e, ModuleStructureRecorded)]
    assert ms[-1].io_specs["pair"]["input"]["config"] == "tuple[2]"
    assert "layers.0.0" in ms[0].names and ms[0].classes[ms[0].names.index("layers.0.0")] == "Linear"
    assert mon.session.step_hooks.handles == [] and len(mon.session.handles) == 0


def test_format_api_writes_nothing_and_returns_metrics(tmp_path, out):
    cfg = {"format": "api", "wg_distribution": True, "xy_distribution": True, "ops": ALL_OPS}
    mon, model, _ = train(tmp_path, cfg, steps=2, close=False)
    reduced, unreduced = mon.generate_wgrad_metrics()
    actv, actv_grad = mon.generate_xy_metrics()
    mon.close()
    assert not out.exists()
    assert "0:head.weight/rank0/post_grad" in reduced and "0:head.weight/rank0/acc_grad" in unreduced
    assert "0:pair_0/rank0/input" in actv and "0:head_0/rank0/output_grad" in actv_grad
    m = reduced["0:head.weight/rank0/post_grad"]
    assert set(m) == set(ALL_OPS) and all(torch.is_tensor(v) and v.dim() == 0 for v in m.values())
    # the reference's dtypes (msprobe-monitor.md): norm and mean float64, nans int64, the rest float32
    assert {op: v.dtype for op, v in m.items()} == {
        "min": torch.float32, "max": torch.float32, "norm": torch.float64, "mean": torch.float64,
        "zeros": torch.float32, "nans": torch.int64}
    # a gradient that never came (the input of the first module here) is float32 NaN throughout, as there
    missing = [v for tag, v in actv_grad.items() if tag.endswith("/input_grad") and torch.isnan(v["norm"])]
    assert missing and all(t.dtype == torch.float32 and torch.isnan(t) for v in missing for t in v.values())
    g = model.head.weight.grad  # zero_grad(set_to_none) ran; compare norms via a fresh computation instead
    assert g is None and float(m["norm"]) > 0


def test_config_applied_and_structure_at_start(tmp_path, out):
    cfg = {"wg_distribution": True, "step_count_per_record": 5, "mg_direction": False,
           "cc_distribution": {"enable": False}, "switch": False}
    train(tmp_path, cfg, steps=1)
    ev = events_of(out)
    ca = [e for e in ev if isinstance(e, ConfigApplied)]
    assert len(ca) == 1 and ca[0].config == cfg and ca[0].start_step == 0 and ca[0].content_hash
    assert [e.vpp_stage for e in ev if isinstance(e, ModuleStructureRecorded)] == [0]


def test_hooks_fired_lists_every_firing_with_call_ids_and_micro_steps(tmp_path, out):
    train(tmp_path, {"xy_distribution": True, "wg_distribution": True}, steps=1, grad_acc=2)
    # (a step a loaded machine keeps open past SPILL_AFTER_S is written in parts, in order)
    rows = [r for e in events_of(out) if isinstance(e, HooksFired) for r in e.rows()]
    calls = [r[2] for r in rows]
    assert calls == list(range(len(rows)))
    assert {r[3] for r in rows} == {0, 1}
    assert {r[1] for r in rows} == {0, 1}


def test_alert_engine_runs_on_the_writer_thread(tmp_path, out):
    cfg = {"wg_distribution": True, "ops": ["norm"],
           "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False}}
    train(tmp_path, cfg, steps=4)
    ev = events_of(out)
    assert steps_with(ev, "grad_reduced") == [0, 1, 2, 3]
    assert not [e for e in ev if isinstance(e, HookFailed)]


def test_alert_with_format_api_says_that_nothing_is_detected(tmp_path, out, caplog):
    """format api writes no log, and detection runs as the log is written: the alert config was
    silently ignored."""
    cfg = {"wg_distribution": True, "ops": ["norm"], "format": "api",
           "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}}
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        train(tmp_path, cfg, steps=1)
    assert 'alert is configured with format "api"' in caplog.text
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        caplog.clear()
        train(tmp_path, {k: v for k, v in cfg.items() if k != "alert"}, steps=1)
    assert "alert is configured" not in caplog.text


def test_live_export_runs_at_lower_priority(tmp_path, out):
    """format csv starts the live projection process at the lowest priority (background work)."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "format": "csv"}), params_have_main_grad=False)
    try:
        proc = mon.session.output.live.proc
        assert proc is not None
        want = min(os.getpriority(os.PRIO_PROCESS, 0) + LIVE_EXPORT_NICE, 19)
        deadline = time.monotonic() + 20
        while os.getpriority(os.PRIO_PROCESS, proc.pid) != want and time.monotonic() < deadline:
            assert proc.poll() is None, "the live export exited early"
            time.sleep(0.05)  # it renices itself right after start-up
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == want
    finally:
        mon.close()


def test_a_config_error_leaves_no_empty_anomaly_json(tmp_path, out):
    """With alert.dump, the monitor had made rank0/anomaly.json (and moved an earlier run's aside): a
    config error at start-up undoes both, as it removes the empty rank directory."""
    cfg = {"wg_distribution": True, "targets": {"nope": {}},
           "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}}
    mon = TrainerMon(write_config(tmp_path, cfg), live_export=False)
    model, opt = make()
    with pytest.raises(ConfigError, match="matches no module"):
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    mon.close()
    assert not (out / "anomaly_detected").exists() and rank_dirs(out) == []
    earlier = out / "anomaly_detected" / "rank0" / "anomaly.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{\n "k": {"step": 3}\n}\n')
    mon = TrainerMon(write_config(tmp_path, cfg), live_export=False)
    model, opt = make()
    with pytest.raises(ConfigError, match="matches no module"):
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    mon.close()
    assert sorted(p.name for p in earlier.parent.iterdir()) == ["anomaly.json"]
    assert earlier.read_text() == '{\n "k": {"step": 3}\n}\n'
