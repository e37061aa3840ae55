"""Every config option and API behaviour of TrainerMon, on a tiny CPU model, read back from the log."""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import threading
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from trainmon_util import (
    ALL_OPS,
    Pair,
    events_of,
    loss_of,
    make,
    new_threads,
    rank_dirs,
    stats_table,
    write_config,
)
from trainrec.recorder import TrainerMon
from trainrec.recorder.monitor import PRINT_STRUCT_EXIT
from trainrec.recorder.names import squash_all
from trainrec.recorder.runinfo import LIVE_EXPORT_NICE
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import (
    ConfigApplied,
    ConfigRejected,
    HookFailed,
    HooksFired,
    ModuleStructureRecorded,
    MonitoringStopped,
    RunResumed,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
)


def train(tmp_path, cfg: dict, steps: int = 3, grad_acc: int = 1, close: bool = True, **kw):
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=grad_acc, optimizer=opt, **kw)
    for s in range(steps):
        for m in range(grad_acc):
            loss_of(model, s * 7 + m).backward()
        opt.step()
        opt.zero_grad()
    if close:
        mon.close()
    return mon, model, opt


def steps_with(events, kind: str) -> list[int]:
    return sorted({e.step for e in events if isinstance(e, TensorStatsRecorded) and e.kind == kind})


def test_start_step_step_interval_collect_times(tmp_path, out):
    cfg = {"wg_distribution": True, "start_step": 1, "step_interval": 2, "collect_times": 2}
    train(tmp_path, cfg, steps=8)
    ev = events_of(out)
    assert steps_with(ev, "grad_reduced") == [1, 3]
    stops = [e for e in ev if isinstance(e, MonitoringStopped)]
    assert len(stops) == 1 and stops[0].reason == "collect_times" and stops[0].collections == 2
    ended = {e.step: e.collected for e in ev if isinstance(e, StepEnded)}
    assert ended == {0: False, 1: True, 2: False, 3: True, 4: False, 5: False, 6: False, 7: False}
    assert [e.step for e in ev if isinstance(e, HooksFired)] == [1, 3]
    assert sorted({e.step for e in ev if isinstance(e, StepBegan)}) == list(range(8))


def test_layer_frozen_and_unfrozen_mid_run_with_step_interval(tmp_path, out):
    """A layer frozen mid-run (torch refuses a gradient hook on a tensor that needs no gradient) costs
    the other rows nothing when the hooks are attached again at the next collected step, and its
    gradients are recorded again once it is unfrozen."""
    cfg = {"wg_distribution": True, "xy_distribution": True, "step_interval": 2}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for s in range(8):
        if s == 1:
            model.head.requires_grad_(False)
        if s == 5:
            model.head.requires_grad_(True)
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    assert [e for e in ev if isinstance(e, HookFailed)] == []
    assert steps_with(ev, "actv") == [0, 2, 4, 6]
    un = stats_table(ev, "grad_unreduced")
    assert sorted({k[0] for k in un if k[1] == "head.weight"}) == [0, 6]
    assert sorted({k[0] for k in un if not k[1].startswith("head.")}) == [0, 2, 4, 6]


def test_parameters_frozen_at_install_are_recorded_once_unfrozen(tmp_path, out, caplog):
    """Fine-tuning that unfreezes layers as it goes: parameters frozen when monitoring starts (the head,
    already in the optimizer; layers.1, added as a param group when unfrozen) are recorded from the
    first collected step after they are unfrozen, with the values torch gives; a target that matches
    only frozen parameters is no error, and a warning says when it is recorded."""
    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True, "ops": ["norm"],
           "targets": {"head": {}, "layers.1": {}, "embed": {}}}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, _ = make()
    model.head.requires_grad_(False)
    model.layers[1].requires_grad_(False)
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("layers.1")], lr=1e-2)
    with caplog.at_level("WARNING", logger="trainrec"):
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    assert any("targets.head matches only parameters that do not require grad" in r.getMessage()
               for r in caplog.records)
    grads, params, exp_avg = {}, {}, {}
    for s in range(4):
        if s == 2:
            model.head.requires_grad_(True)
            model.layers[1].requires_grad_(True)
            opt.add_param_group({"params": list(model.layers[1].parameters())})
        loss_of(model, s).backward()
        grads[s] = {n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None}
        params[s] = {n: float(p.detach().norm()) for n, p in model.named_parameters()}
        opt.step()
        exp_avg[s] = {n: float(opt.state[p]["exp_avg"].norm()) for n, p in model.named_parameters()
                      if p in opt.state}
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    assert [e for e in ev if isinstance(e, HookFailed)] == []
    late = ("head.weight", "head.bias", "layers.1.weight", "layers.1.bias")
    names = [n for n, _ in model.named_parameters()]
    for kind, want in (("grad_unreduced", grads), ("grad_reduced", grads), ("param", params), ("exp_avg", exp_avg)):
        got = {(k[0], k[1]): v["norm"] for k, v in stats_table(ev, kind).items()}
        for name in late:
            assert sorted(s for s, n in got if n == squash_all(names, True)[name]) == [2, 3], (kind, name)
        assert sorted(s for s, n in got if n == "embed.weight") == [0, 1, 2, 3], kind
        full = {short: n for n, short in squash_all(names, True).items()}
        for (s, n), v in got.items():
            assert v == pytest.approx(want[s][full[n]], rel=1e-5), (kind, s, n)


class LoraLinear(nn.Module):
    """A frozen Linear with a low-rank adapter beside it, named as peft's LoRA layers name theirs."""

    def __init__(self, d: int = 8, r: int = 2) -> None:
        super().__init__()
        self.base_layer = nn.Linear(d, d).requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, d, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


@pytest.mark.parametrize("xy", [False, True])
def test_parameters_frozen_mid_run_are_no_longer_recorded(tmp_path, out, xy):
    """A parameter frozen mid-run (LoRA-FA's frozen lora_A, an adapter switched off) gets no gradient,
    parameter or optimizer-state rows from the first collected step after: its parameter and Adam
    state rows went on (stale, with an update the optimizer never made), except where another
    parameter was unfrozen at the same time."""
    from trainrec.recorder import record

    torch.manual_seed(0)
    model = nn.Sequential(LoraLinear(), nn.ReLU(), LoraLinear())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True,
           "ur_distribution": True, "xy_distribution": xy, "ops": ["norm"]}
    with record(model, opt, config=cfg) as rec:
        for s in range(4):
            if s == 2:
                model[0].lora_A["default"].requires_grad_(False)
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    ev = events_of(rec.log_path)
    assert [e for e in ev if isinstance(e, HookFailed)] == []
    for kind in ("grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio"):
        got = stats_table(ev, kind)
        assert sorted({k[0] for k in got if k[1] == "0.lora_A.default.weight"}) == [0, 1], kind
        assert sorted({k[0] for k in got if k[1] == "0.lora_B.default.weight"}) == [0, 1, 2, 3], kind
        assert not any("base_layer" in k[1] for k in got), kind


def test_start_iteration_offsets_the_step_counter(tmp_path, out):
    train(tmp_path, {"wg_distribution": True, "start_step": 11}, steps=3, start_iteration=10)
    assert steps_with(events_of(out), "grad_reduced") == [11, 12]


@pytest.mark.parametrize("bad", [-1, 2**53, 1.5, "10", True])
def test_a_start_iteration_no_log_can_hold_is_a_config_error(tmp_path, out, bad):
    """Step numbers are 0..2**53-1 in the log (a reader takes a record beyond them for corruption)."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    model, opt = make()
    with pytest.raises(ConfigError) as err:
        mon.monitor_gnorm_with_ad(model, optimizer=opt, start_iteration=bad)
    assert err.value.key == "start_iteration"
    assert str(err.value).startswith("argument 'start_iteration': expected an integer of 0..")  # not a config key
    mon.monitor_gnorm_with_ad(model, optimizer=opt, start_iteration=np.int64(7))  # nothing was installed
    loss_of(model, 0).backward()
    opt.step()
    mon.close()
    assert steps_with(events_of(out), "grad_reduced") == [7]


@pytest.mark.parametrize("bad", [0, -2, 2.5, "2", "abc", True, None])
def test_a_grad_acc_steps_that_is_no_count_of_micro_steps_is_a_config_error(tmp_path, out, bad):
    """0 and -2 were taken for 1, 2.5 for 2 and "2" for 2, silently; "abc" was a ValueError from int()."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    model, opt = make()
    with pytest.raises(ConfigError, match="expected an integer >= 1") as err:
        mon.monitor_gnorm_with_ad(model, optimizer=opt, grad_acc_steps=bad)
    assert err.value.key == "grad_acc_steps"
    assert str(err.value).startswith("argument 'grad_acc_steps': expected an integer >= 1")  # not a config key
    mon.monitor_gnorm_with_ad(model, optimizer=opt, grad_acc_steps=8 / 4)  # nothing was installed; 2.0 is 2
    for m in range(2):
        loss_of(model, m).backward()
    opt.step()
    mon.close()
    assert {k[3] for k in stats_table(events_of(out), "grad_unreduced")} == {0, 1}


def test_ops_eps_and_full_precision(tmp_path, out):
    cfg = {"param_distribution": True, "ops": ["zeros", "max"], "eps": 0.5, "ndigits": 2}
    _, model, _ = train(tmp_path, cfg, steps=1)
    ev = events_of(out)
    recs = [e for e in ev if isinstance(e, TensorStatsRecorded)]
    assert {e.ops for e in recs} == {("zeros", "max")}
    par = stats_table(ev, "param")
    torch.manual_seed(0)
    fresh, _ = make()
    w = fresh.head.weight.detach().double()
    got = par[(0, "head.weight", "", 0)]
    assert got["zeros"] == pytest.approx((w.abs() < 0.5).double().mean().item(), abs=1e-6)
    # ndigits only affects exports: the log keeps float32 precision
    assert got["max"] == pytest.approx(w.max().item(), rel=1e-6) and round(got["max"], 2) != got["max"]


def test_ops_setter_validates(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    mon.ops = ["max", "min"]
    assert mon.ops == ["max", "min"]
    with pytest.raises(ConfigError, match="unknown op"):
        mon.ops = ["nope"]
    for value in ("norm", None):  # a str was taken letter by letter ("unknown op 'n'"), None was a TypeError
        with pytest.raises(ConfigError, match="expected a list of ops"):
            mon.ops = value
    assert mon.ops == ["max", "min"]
    mon.close()


def test_ops_set_during_training_take_effect_at_a_step_boundary(tmp_path, out):
    """ops set after install apply at once (nothing recorded yet); set in the middle of a step they apply
    from the next one, so each step's rows share one list of ops and the log reads cleanly."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}),
                     params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    mon.ops = ["max", "norm"]
    for s in range(3):
        loss_of(model, s).backward()
        if s == 1:
            mon.ops = ["norm", "min"]  # between backward and the optimizer step
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)  # asserts the reader found no problem
    ops = {e.step: e.ops for e in ev if isinstance(e, TensorStatsRecorded)}
    assert ops == {0: ("max", "norm"), 1: ("max", "norm"), 2: ("norm", "min")}
    red = stats_table(ev, "grad_reduced")
    assert set(red[(1, "head.weight", "", 0)]) == {"max", "norm"} and set(red[(2, "head.weight", "", 0)]) == {"norm", "min"}


def test_targets_select_params_on_segment_boundaries(tmp_path, out):
    model, _ = make()
    model.layers.append(torch.nn.Identity())  # layers.2 has no params; layers.1 must not match layers.1x
    cfg = {"wg_distribution": True, "targets": {"layers.1": {}}}
    mon = TrainerMon(write_config(tmp_path, cfg), live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert sorted(p.full for p in mon.context.params) == ["layers.1.bias", "layers.1.weight"]
    mon.close()


def test_target_that_matches_nothing_fails_before_training(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "targets": {"layer.0": {}}}),
                     live_export=False)
    model, opt = make()
    with pytest.raises(ConfigError, match="matches no module") as ei:
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    assert ei.value.key == "targets.layer.0"
    assert str(ei.value).startswith(f"{ei.value.source}: config key 'targets.layer.0'")
    assert ei.value.source.endswith(".json")  # the file to fix, as for errors found when it is read
    assert rank_dirs(out) == []  # its empty log and directory went: a fixed relaunch leaves no empty run beside
    # called again with a model the config fits, it records, in a new directory
    fitting = nn.Sequential()
    fitting.add_module("layer", nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    opt = torch.optim.SGD(fitting.parameters(), lr=0.1)
    mon.monitor_gnorm_with_ad(fitting, optimizer=opt)
    fitting(torch.randn(2, 4)).sum().backward()
    opt.step()
    mon.close()
    assert len(rank_dirs(out)) == 1
    assert steps_with(events_of(out), "grad_reduced") == [0]
    # its names went to the new log (they were interned while it had none: rows without names)
    assert sorted({k[1] for k in stats_table(events_of(out), "grad_reduced")}) == ["0.bias", "0.weight"]


def test_a_target_that_matches_nothing_says_what_names_there_are(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "targets": {"fc": {}}}), live_export=False)
    lin = nn.Linear(4, 4)
    with pytest.raises(ConfigError) as ei:
        mon.monitor_gnorm_with_ad(lin, optimizer=torch.optim.SGD(lin.parameters(), lr=0.1))
    assert ("the model has no submodules (a target names a submodule or a parameter), parameter names like "
            "'weight', 'bias'") in str(ei.value)
    model, opt = make()
    with pytest.raises(ConfigError) as ei:
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    assert "module names look like 'embed', 'layers', " in str(ei.value)
    assert "parameter names like 'embed.weight', 'layers.0.0.weight', " in str(ei.value)
    mon.close()


@pytest.mark.parametrize(("cfg", "expect"), [
    ({"xy_distribution": True, "targets": {"head.weight": {}}}, "is recorded by none of the options on"),
    ({"xy_distribution": True, "wg_distribution": True, "targets": {"head.weight": {"input": "tensor"}}},
     "has selectors for a module's inputs and outputs"),
])
def test_an_xy_target_that_names_only_a_parameter_fails_before_training(tmp_path, out, cfg, expect):
    """A parameter's name under xy_distribution alone matched something (a parameter), so it passed,
    and the run recorded nothing at all; selectors on it fitted no module and were dropped silently."""
    mon = TrainerMon(write_config(tmp_path, cfg), live_export=False)
    model, opt = make()
    with pytest.raises(ConfigError, match="matches no module, only parameters") as ei:
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    assert ei.value.key == "targets.head.weight" and expect in str(ei.value)
    assert "module names look like 'embed', 'layers', " in str(ei.value)
    mon.close()
    # what such a name is for: with a parameter option on, it selects that parameter
    train(tmp_path, {"xy_distribution": True, "wg_distribution": True, "targets": {"head.weight": {}, "pair": {}}},
          steps=1)
    ev = events_of(out)
    assert {k[1] for k in stats_table(ev, "grad_reduced")} == {"head.weight", "pair.proj.weight", "pair.proj.bias"}
    assert {k[1] for k in stats_table(ev, "actv")} == {"pair"}


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


def test_squash_name_switch(tmp_path, out):
    train(tmp_path, {"wg_distribution": True, "squash_name": False}, steps=1)
    names = {k[1] for k in stats_table(events_of(out), "grad_reduced")}
    assert "layers.1.weight" in names and "1.weight" not in names


def test_selectors_tuple_and_tensor_on_one_tuple(tmp_path, out):
    cfg = {"xy_distribution": True,
           "targets": {"pair": {"input": "tuple[2]:1", "output": "tuple[2]:1", "output_grad": "tuple[2]:0"},
                       "head": {"input": "tensor", "output": "tensor", "input_grad": "tensor"}}}
    train(tmp_path, cfg, steps=1)
    ev = events_of(out)
    actv = stats_table(ev, "actv")
    assert {k[1] for k in actv} == {"pair", "head"}
    assert actv[(0, "pair", "output", 0)]["norm"] == 0.0  # element 1 of the output is zeros
    assert actv[(0, "head", "input", 0)]["norm"] > 0  # "tensor" accepted for the 1-tuple of inputs
    assert not [e for e in ev if isinstance(e, HookFailed)]


@pytest.mark.parametrize("all_xy", [False, True])
def test_a_targets_entry_records_the_slots_it_names(tmp_path, out, all_xy):
    """The reference's documentation: a module in targets is monitored as its entry says (input,
    output, input_grad, output_grad to choose from), the others of all_xy in all four. Unnamed slots
    were recorded all the same; now they have no row (their CSV columns are nan) and cost nothing."""
    cfg = {"xy_distribution": True, "all_xy": all_xy, "squash_name": False,
           "targets": {"layers.1": {"output": "tensor"}, "head": {"input_grad": "tensor"}, "embed": {}}}
    train(tmp_path, cfg, steps=1)
    ev = events_of(out)
    actv, grads = stats_table(ev, "actv"), stats_table(ev, "actv_grad")

    def slots(table, name):
        return {k[2]: not math.isnan(v["norm"]) for k, v in table.items() if k[1] == name}

    assert slots(actv, "layers.1") == {"output": True}
    assert slots(grads, "layers.1") == {}
    assert slots(actv, "head") == {}
    assert slots(grads, "head") == {"input_grad": True}
    assert slots(actv, "embed") == {"input": True, "output": True}  # {}: every slot
    assert slots(grads, "embed") == {"output_grad": True, "input_grad": False}  # token ids have no gradient
    others = {k[1] for k in actv} - {"layers.1", "head", "embed"}
    assert bool(others) == all_xy
    for name in others:  # all_xy's other modules: all four
        assert slots(actv, name) == {"input": True, "output": True}, name
    assert not [e for e in ev if isinstance(e, HookFailed)]
    from trainrec.tools.cli import main as cli

    assert cli(["export", "csv", str(out), "-o", str(tmp_path / "csv")]) == 0
    (actv_csv,) = glob.glob(str(tmp_path / "csv" / "*" / "actv_0-0.csv"))
    with open(actv_csv) as f:
        head, *lines = f.read().splitlines()
    row = dict(zip(head.split(","), next(ln for ln in lines if ln.split(",")[1] == "layers.1_0").split(","),
                   strict=True))
    assert row["input.norm"] == "nan" and row["output.norm"] != "nan"


def test_selectors_as_module_struct_prints_them_for_a_linear(tmp_path, out):
    """module_struct.json (the reference's and ours) gives "tuple[1]" for a Linear's input, input_grad
    and output_grad, as the reference's hooks see them; "tuple[1]:0" picks the tensor output's gradient
    as it does in the reference's config example, with the values the defaults give."""
    sels = {"input": "tuple[1]:0", "output": "tensor", "input_grad": "tuple[1]:0", "output_grad": "tuple[1]:0"}
    rows = []
    for cfg in ({"xy_distribution": True, "targets": {"head": sels}}, {"xy_distribution": True, "targets": {"head": {}}}):
        before = set(rank_dirs(out))
        train(tmp_path, cfg, steps=1)
        (new_dir,) = set(rank_dirs(out)) - before
        rows.append({k: v for kind in ("actv", "actv_grad") for k, v in stats_table(events_of(new_dir), kind).items()})
    got, want = rows
    assert set(got) == {(0, "head", slot, 0) for slot in sels} == set(want)
    assert got == want


def test_selector_mismatch_fails_the_first_forward_with_a_config_error(tmp_path, out):
    """pair takes (x, y): "tensor" cannot fit its inputs, which only its first call shows. That call is
    in the run's first step: a ConfigError out of the forward, before training time is spent, also
    where that step is not collected."""
    for extra in ({}, {"start_step": 5}):
        mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"pair": {"input": "tensor"}},
                                                 **extra}), live_export=False)
        model, opt = make()
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        with pytest.raises(ConfigError) as err:
            loss_of(model, 0)
        assert "targets.pair.input" in str(err.value) and "gives tuple[2]" in str(err.value)
        assert err.value.source and str(err.value).startswith(err.value.source)
        mon.close()
    # the key as written, not the squashed name ("layers.1" is recorded as "1")
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"layers.1": {"output": "tuple[2]"}}}),
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    with pytest.raises(ConfigError) as err:
        loss_of(model, 0)
    assert err.value.key == "targets.layers.1.output"
    mon.close()


@pytest.mark.parametrize("slot", ["input", "input_grad"])
def test_an_input_selector_mismatch_is_one_config_error_not_a_failed_hook_first(tmp_path, out, caplog, slot):
    """An input_grad selector is applied by the monitor's forward pre-hook: a mismatch there was
    reported as a failed hook ("training goes on", a HookFailed in the log) just before the
    ConfigError that ends the run. One message now: the ConfigError, naming the key."""
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"pair": {slot: "tensor"}}}),
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    with caplog.at_level("WARNING", logger="trainrec"), pytest.raises(ConfigError) as err:
        loss_of(model, 0)
    assert err.value.key == f"targets.pair.{slot}" and "gives tuple[2]" in str(err.value)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    ev = events_of(out)
    assert not [e for e in ev if isinstance(e, HookFailed)]
    assert [e.keys for e in ev if isinstance(e, ConfigRejected)] == [(f"targets.pair.{slot}",)]


class _KeywordCall(nn.Module):
    """Calls its child with keyword arguments only, as HF's decoder layers call their attention
    (``self.self_attn(hidden_states=h, ...)``): a forward pre-hook sees no positional input."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)

    def forward(self, x):
        return self.attn(input=x)


@pytest.mark.parametrize("slot", ["input", "input_grad"])
def test_an_input_selector_on_a_module_called_with_keywords_says_so(tmp_path, out, slot):
    """The ConfigError said only "the module gives tuple[0]" of a module that does get a tensor, as a
    keyword argument: misleading where HF's models call their attention so. It names the keywords."""
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"attn": {slot: "tensor"}}}),
                     live_export=False)
    model = _KeywordCall()
    mon.monitor_gnorm_with_ad(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError) as err:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert err.value.key == f"targets.attn.{slot}" and "gives tuple[0]" in str(err.value)
    assert "keyword arguments only (input=a tensor)" in str(err.value)
    mon.close()


def test_a_selector_mismatch_at_the_first_forward_closes_the_monitor(tmp_path, out):
    """The ConfigError out of the first forward leaves no hook of the rejected monitor on the model (a
    notebook that fixes the config and makes a new monitor records with that one alone), and its log
    is closed."""
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "wg_distribution": True,
                                             "targets": {"pair": {"input": "tensor"}}}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    with pytest.raises(ConfigError):
        loss_of(model, 0)
    assert mon._closed and mon.output.writer.closed
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    mon2 = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"pair": {"input": "tuple[2]:0"}}}),
                      live_export=False)
    mon2.monitor_gnorm_with_ad(model, optimizer=opt)
    loss_of(model, 0).backward()
    opt.step()
    mon2.close()
    assert stats_table(events_of(mon2.log_path), "actv")


class _Recurrent(nn.Module):
    """An LSTM-like output: (y, (h, c))."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y, (y[:, -1], y[:, 0])


def test_a_selector_that_picks_a_non_tensor_fails_the_first_forward(tmp_path, out):
    """"tuple[2]:1" on an LSTM's (y, (h, c)) picks a tuple: every row would be NaN. A ConfigError at
    the first forward says so; "tuple[2]:0" records."""
    model = nn.Sequential(nn.Embedding(32, 8), _Recurrent())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"1": {"output": "tuple[2]:1"}}}),
                     live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    with pytest.raises(ConfigError) as err:
        model(torch.zeros(2, 3, dtype=torch.long))
    assert err.value.key == "targets.1.output" and "selects tuple[2], not a tensor" in str(err.value)


def test_a_run_that_a_selector_mismatch_ends_says_why_in_its_log(tmp_path, out, capsys):
    """The ConfigError out of the first forward usually ends the process: its log holds a
    ConfigRejected with the key and the reason, written before the exception left the hook, and is
    closed cleanly at exit (not a log of no steps that says nothing)."""
    import subprocess
    import sys

    cfg = write_config(tmp_path, {"xy_distribution": True, "targets": {"pair": {"input": "tensor"}}})
    script = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from trainmon_util import loss_of, make
from trainrec.recorder import TrainerMon
mon = TrainerMon({cfg!r})
model, opt = make()
mon.monitor_gnorm_with_ad(model, optimizer=opt)
loss_of(model, 0)
"""
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ConfigError" in proc.stderr and "targets.pair.input" in proc.stderr
    events = events_of(out)
    rejected = [e for e in events if isinstance(e, ConfigRejected)]
    assert len(rejected) == 1
    assert rejected[0].keys == ("targets.pair.input",) and "gives tuple[2]" in rejected[0].reason
    assert rejected[0].path == cfg and rejected[0].step == 0
    assert type(events[-1]).__name__ == "FileClosed"
    assert events[-1].reason == "config rejected: targets.pair.input"  # closed there, and why
    from trainrec.tools.cli import main

    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["per_rank"][0]
    assert rank["notes"] and rank["notes"][0].startswith("step 0: config rejected: ")


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


def test_selector_mismatch_after_the_first_step_is_reported_once_and_training_goes_on(tmp_path, out, caplog):
    """A module first called after the first step (here: from step 1 on) is checked by its hooks:
    a HookFailed naming the key, one warning, and training goes on."""

    class Late(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.Linear(4, 4)
            self.pair = Pair(4)
            self.late = False

        def forward(self, x):
            h = self.base(x)
            return self.pair(h, h)[0] if self.late else h

    cfg = {"xy_distribution": True, "targets": {"pair": {"input": "tensor"}, "base": {}}}
    mon = TrainerMon(write_config(tmp_path, cfg), live_export=False)
    model = Late()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for step in range(3):
        model.late = step >= 1
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    fails = [e for e in events_of(out) if isinstance(e, HookFailed)]
    assert fails and "targets.pair.input" in fails[0].error and "tuple[2]" in fails[0].error
    assert sum("forward hook of 'pair'" in r.getMessage() for r in caplog.records) == 1


def test_exception_in_a_hook_is_recorded_and_training_continues(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "xy_distribution": True}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)

    def boom(tensors):
        raise RuntimeError("injected failure")

    mon.context.engine.compute = mon.context.engine.rows = boom  # rows: the module hooks' entry
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

    mon.collection.optimizer.optimizer_rows = boom
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


@pytest.mark.parametrize("where", ["cycle.begin", "cycle.on_micro_step", "cycle.mark_began", "binding.part_of_step"])
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
    setattr(functools.reduce(getattr, parts, mon), name, boom)
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


def test_forward_only_and_backward_only(tmp_path, out):
    train(tmp_path, {"xy_distribution": True, "forward_only": True}, steps=1)
    ev = events_of(out)
    assert steps_with(ev, "actv") == [0] and steps_with(ev, "actv_grad") == []


def test_backward_only(tmp_path, out):
    train(tmp_path, {"xy_distribution": True, "backward_only": True}, steps=1)
    ev = events_of(out)
    assert steps_with(ev, "actv") == [] and steps_with(ev, "actv_grad") == [0]


def test_module_ranks_excludes_this_rank(tmp_path, out):
    train(tmp_path, {"xy_distribution": True, "wg_distribution": True, "module_ranks": [1]}, steps=1)
    ev = events_of(out)
    assert steps_with(ev, "actv") == [] and steps_with(ev, "grad_reduced") == [0]


def test_module_ranks_that_names_this_rank_records_its_activations(tmp_path, out):
    train(tmp_path, {"xy_distribution": True, "module_ranks": [1, 0]}, steps=1)
    ev = events_of(out)
    assert steps_with(ev, "actv") == [0] and steps_with(ev, "actv_grad") == [0]


def test_mv_and_ur_on_plain_adam_without_opt_ty(tmp_path, out):
    mon, model, opt = train(tmp_path, {"mv_distribution": True, "ur_distribution": True, "format": "csv"}, steps=2,
                            close=False)
    mon.close()
    ev = events_of(out)
    for kind in ("exp_avg", "exp_avg_sq", "update", "ratio"):
        assert steps_with(ev, kind) == [0, 1], kind
    assert len(stats_table(ev, "exp_avg")) == 2 * len(list(model.parameters()))


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
    assert mon.step_hooks.handles == [] and mon._struct_handles == []


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


def test_hooks_removed_on_close(tmp_path, out):
    cfg = {"xy_distribution": True, "wg_distribution": True}
    mon, model, opt = train(tmp_path, cfg, steps=1, close=False)
    assert any(m._forward_hooks for m in model.modules())
    mon.close()
    for m in model.modules():
        assert not m._forward_hooks and not m._backward_hooks and not m._forward_pre_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    mon.close()  # idempotent


def test_second_optimizer_instance_does_not_disturb(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    model, opt = make()
    other_model, other_opt = make(seed=1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for s in range(3):
        loss_of(other_model, s).backward()
        other_opt.step()
    loss_of(model, 0).backward()
    opt.step()
    mon.close()
    ev = events_of(out)
    assert steps_with(ev, "grad_reduced") == [0]
    assert [e.step for e in ev if isinstance(e, StepEnded)] == [0]


def test_optimizer_none_binds_the_optimizer_of_the_model(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    model, opt = make()
    other_model, other_opt = make(seed=1)
    mon.monitor_gnorm_with_ad(model, optimizer=None)
    loss_of(other_model, 0).backward()
    other_opt.step()  # not ours: ignored
    for s in range(2):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    assert mon.binding.opt is opt and not mon.binding.waiting
    mon.close()
    assert steps_with(events_of(out), "grad_reduced") == [0, 1]


def test_set_wrapped_optimizer_follows_dot_optimizer(tmp_path, out):
    class Wrapper:  # like DeepSpeed / Megatron mixed-precision wrappers
        def __init__(self, inner):
            self.optimizer = inner

        def step(self):
            self.optimizer.step()

    model, opt = make()
    wrapper = Wrapper(opt)
    TrainerMon.set_wrapped_optimizer(wrapper)
    try:
        mon = TrainerMon(write_config(tmp_path, {"mv_distribution": True}), live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=None)
        loss_of(model, 0).backward()
        wrapper.step()
        mon.close()
    finally:
        TrainerMon.set_wrapped_optimizer(None)
    assert steps_with(events_of(out), "exp_avg") == [0]


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
    import json

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


def test_collect_times_zero_collects_nothing(tmp_path, out):
    train(tmp_path, {"wg_distribution": True, "collect_times": 0}, steps=2)
    assert steps_with(events_of(out), "grad_reduced") == []


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
    (hf,) = [e for e in events_of(out) if isinstance(e, HooksFired)]
    rows = list(hf.rows())
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


def test_native_record_with_chunks_and_manual_steps(tmp_path, out):
    from trainrec.recorder import record

    model, _ = make()
    chunks = [model.layers[0], model.layers[1]]
    with record(chunks, config={"param_distribution": True, "xy_distribution": True, "ops": ["norm"]},
                output_dir=str(tmp_path / "native")) as rec:
        for s in range(2):
            loss_of(model, s).backward()
            rec.step()
        assert rec.step_count == 2
    ev = events_of(tmp_path / "native")
    par = stats_table(ev, "param")
    assert {(k[0], k[1]) for k in par} >= {(0, "0.weight"), (1, "weight")}
    ms = [e.vpp_stage for e in ev if isinstance(e, ModuleStructureRecorded)]
    assert ms == [0, 1]
    vpps = {v for e in ev if isinstance(e, TensorStatsRecorded) for v in e.column("vpp_stages")}
    assert vpps == {0, 1}


def test_adam_options_without_an_optimizer_say_so_once(tmp_path, out, caplog):
    """Manual steps and no optimizer: mv/ur/mg_direction have no state to read. One warning says so,
    the rest of the config is recorded, and nothing fails."""
    from trainrec.recorder import record

    model, _ = make()
    cfg = {"mv_distribution": True, "ur_distribution": True, "mg_direction": True, "wg_distribution": True,
           "ops": ["norm"]}
    with caplog.at_level("WARNING", logger="trainrec"), record(model, config=cfg,
                                                               output_dir=str(tmp_path / "native")) as rec:
        for s in range(3):
            loss_of(model, s).backward()
            rec.step()
            model.zero_grad()
    said = [r.getMessage() for r in caplog.records if "no torch optimizer is known" in r.getMessage()]
    assert len(said) == 1
    ev = events_of(tmp_path / "native")
    assert steps_with(ev, "grad_reduced") == [0, 1, 2] and steps_with(ev, "exp_avg") == []
    assert not [e for e in ev if isinstance(e, HookFailed)]


def test_native_record_detects_steps_through_the_optimizer(tmp_path, out):
    from trainrec.recorder import record

    model, opt = make()
    with record(model, opt, output_dir=str(tmp_path / "native")) as rec:
        loss_of(model, 0).backward()
        opt.step()
        with pytest.raises(RuntimeError):
            rec.step()
        assert set(rec.metrics("grad_reduced")) == {f"0:{n}/rank0/post_grad" for n in squash_all(
            [n for n, _ in model.named_parameters()]).values()}
        with pytest.raises(ValueError, match="unknown kind 'wg'; expected one of actv, actv_grad"):
            rec.metrics("wg")  # a typo is not an empty result
    ev = events_of(tmp_path / "native")
    assert steps_with(ev, "grad_reduced") == [0] and steps_with(ev, "param") == [0]


def test_native_record_without_steps_warns_and_start_iteration_numbers_steps(tmp_path, out, caplog, monkeypatch):
    """No optimizer and no rec.step(): every backward pass goes into step 0, and a warning says what to
    call (nothing did); start_iteration numbers the steps (the keyword was start_step, which is also a
    config key of another meaning, and a TypeError now says so)."""
    from trainrec.recorder import record, session

    monkeypatch.setattr(session, "_warned", set())
    model, _ = make()
    with pytest.raises(TypeError, match="start_step is a config key"):
        record(model, start_step=3, output_dir=str(tmp_path / "bad"))
    with caplog.at_level("WARNING", logger="trainrec"), record(
            model, config={"wg_distribution": True, "ops": ["norm"]}, output_dir=str(tmp_path / "native")):
        for s in range(3):
            loss_of(model, s).backward()
            model.zero_grad()
    assert [r for r in caplog.records if "step() was not called" in r.getMessage()]
    with record(model, config={"wg_distribution": True, "ops": ["norm"]}, start_iteration=5,
                output_dir=str(tmp_path / "numbered")) as rec:
        loss_of(model, 0).backward()
        rec.step()
    assert steps_with(events_of(tmp_path / "numbered"), "grad_reduced") == [5]


def test_native_record_with_a_bad_config_leaves_no_log_open(tmp_path, out):
    """A target that matches nothing: the ConfigError comes out of record(), and the monitor it made is
    closed (its log closed cleanly, its threads gone), not left running until the process exits."""
    from trainrec.recorder import record

    model, _ = make()
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match="matches no module") as ei:
        record(model, config={"xy_distribution": True, "targets": {"nope": {}}}, output_dir=str(tmp_path / "bad"))
    assert str(ei.value).startswith("config key 'targets.nope': matches no module")  # no file to name
    with pytest.raises(ConfigError) as ei:
        record(model, config={"bogus": 1}, output_dir=str(tmp_path / "bad"))
    assert str(ei.value).startswith("config dict: config key 'bogus': unknown key; expected one of ")
    assert glob.glob(str(tmp_path / "bad" / "*")) == []  # nothing recorded: its empty log and directory went
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and new_threads(before):
        time.sleep(0.02)
    assert new_threads(before) == []  # close() ran: the writer and spill threads stopped


class _PlainSGD:
    """An optimizer that is no torch Optimizer (no step hooks to find steps by)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        self.params = list(params)
        self.lr = lr

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            p -= self.lr * p.grad


@pytest.mark.parametrize("case", ["model None", "model a str", "model and optimizer swapped", "model []",
                                  "model [module, 3]", "optimizer a str", "optimizer the model", "optimizer []",
                                  "optimizer [opt, 3]", "optimizer no torch Optimizer", "grad_acc_steps 0"])
def test_native_record_with_a_wrong_model_or_optimizer_says_what_is_wrong_and_leaves_nothing(tmp_path, out, case):
    """A model or optimizer of the wrong type is one error out of record() that names the argument (an
    optimizer whose steps cannot be hooked was a warning, then steps never counted and rec.step()
    refused; a model that is no module an AttributeError from inside), and no empty log is left."""
    from trainrec.recorder import record

    model, opt = make()
    args, kwargs, what = {
        "model None": ((None, opt), {}, "model"),
        "model a str": (("model", opt), {}, "model"),
        "model and optimizer swapped": ((opt, model), {}, "model"),
        "model []": (([], opt), {}, "model"),
        "model [module, 3]": (([model, 3], opt), {}, "model"),
        "optimizer a str": ((model, "adam"), {}, "optimizer"),
        "optimizer the model": ((model, model), {}, "optimizer"),
        "optimizer []": ((model, []), {}, "optimizer"),
        "optimizer [opt, 3]": ((model, [opt, 3]), {}, "optimizer"),
        "optimizer no torch Optimizer": ((model, _PlainSGD(model.parameters())), {}, "optimizer"),
        "grad_acc_steps 0": ((model, opt), {"grad_acc_steps": 0}, "grad_acc_steps"),
    }[case]
    with pytest.raises((TypeError, ConfigError), match=what) as ei:
        record(*args, config={"wg_distribution": True}, output_dir=str(tmp_path / "bad"), **kwargs)
    if case == "optimizer no torch Optimizer":
        assert "rec.step()" in str(ei.value)  # what to do instead
    assert glob.glob(str(tmp_path / "bad" / "*")) == []


@pytest.mark.parametrize("output_dir", [5, ["out"]])
def test_an_output_dir_that_is_no_path_is_named(tmp_path, out, output_dir):
    """output_dir of the wrong type says so, naming it (it was os.path's bare 'expected str, bytes or
    os.PathLike object, not int', from wherever the path was first joined)."""
    from trainrec.recorder import record

    model, opt = make()
    with pytest.raises(TypeError, match="output_dir: expected a directory path"):
        record(model, opt, config={"wg_distribution": True}, output_dir=output_dir)
    with pytest.raises(TypeError, match="output_dir: expected a directory path"):
        TrainerMon({"wg_distribution": True}, output_dir=output_dir)


@pytest.mark.parametrize("config", [5, ["config.json"], ""])
def test_native_record_with_a_config_that_is_neither_dict_nor_path_says_so(tmp_path, out, config):
    from trainrec.recorder import record

    model, _ = make()
    with pytest.raises(ConfigError, match="expected the path of a config JSON file"):
        record(model, config=config, output_dir=str(tmp_path / "bad"))


def test_apply_config_with_a_target_matching_nothing_is_rejected_and_the_old_config_goes_on(tmp_path, out):
    from trainrec.recorder.config import parse_config
    from trainrec.schema.events import ConfigRejected

    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    loss_of(model, 0).backward()
    opt.step()
    mon._apply_config(parse_config({"wg_distribution": True, "targets": {"nothing.here": {}}}), 0, "abc")
    loss_of(model, 1).backward()
    opt.step()
    mon.close()
    ev = events_of(out)
    rej = [e for e in ev if isinstance(e, ConfigRejected)]
    assert rej and rej[0].keys == ("targets.nothing.here",) and rej[0].content_hash == "abc"
    assert steps_with(ev, "grad_reduced") == [0, 1]


@pytest.mark.parametrize("first", ["api", "tensorboard"])
def test_a_dynamic_change_of_format_says_it_applies_at_the_next_launch(tmp_path, out, caplog, monkeypatch, first):
    """The output (log, live export) is set up when the monitor is made: a config switched on later with
    another format says so, and what this run gives instead, rather than writing nothing silently."""
    from trainrec.recorder import session
    from trainrec.recorder.config import parse_config

    monkeypatch.setattr(session, "_warned", set())
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "format": first}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        mon._apply_config(parse_config({"wg_distribution": True, "format": "csv"}), 0, "abc")
    mon.close()
    (msg,) = [r.getMessage() for r in caplog.records if "format changed" in r.getMessage()]
    assert "next launch" in msg
    assert ("writes no log" in msg) == (first == "api") and ("trainrec export" in msg) == (first != "api")


def test_reload_xy_switches_activation_hooks_without_stacking(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "wg_distribution": True}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    n_hooks = sum(len(m._forward_hooks) for m in model.modules())
    mon.reload_xy(True)
    mon.reload_xy(True)
    assert sum(len(m._forward_hooks) for m in model.modules()) == n_hooks
    loss_of(model, 0).backward()
    opt.step()
    mon.reload_xy()  # the reference's default: xy_distribution=False
    # left: the run's own hook on each model chunk (micro steps of weight gradients), no activation hook
    assert sum(len(m._forward_hooks) for m in model.modules()) == len(mon.monitored.chunks)
    loss_of(model, 1).backward()
    opt.step()
    mon.reload_xy(True)
    loss_of(model, 2).backward()
    opt.step()
    mon.close()
    ev = events_of(out)
    assert steps_with(ev, "actv") == [0, 2] and steps_with(ev, "grad_reduced") == [0, 1, 2]


def test_autocast_bf16_and_grad_scaler(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "wg_distribution": True, "ops": ALL_OPS}),
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for s in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, s)
        scaler.scale(loss).backward()
        scaler.step(opt)  # unscales the grads in place, then steps
        scaler.update()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    actv = stats_table(ev, "actv")
    assert actv[(1, "head", "output", 0)]["norm"] > 0
    un, red = stats_table(ev, "grad_unreduced"), stats_table(ev, "grad_reduced")
    key = (1, "head.weight", "", 0)
    # unreduced grads are the scaled ones; the optimizer saw them unscaled (in place: measured again)
    assert un[key]["norm"] == pytest.approx(red[key]["norm"] * 1024.0, rel=1e-3)


def test_recomputation_under_activation_checkpointing_is_not_recorded_twice(tmp_path, out):
    from torch.utils.checkpoint import checkpoint

    class Ckpt(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "forward_only": True}), live_export=False)
    model, opt = make()
    model.layers[1] = Ckpt(model.layers[1])
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    loss_of(model, 0).backward()
    opt.step()
    mon.close()
    ev = events_of(out)
    from trainrec.replay.names import NameResolver

    res = NameResolver()
    for e in ev:
        res.feed(e)
    (hf,) = [e for e in ev if isinstance(e, HooksFired)]
    fired = res.ids_names(hf.rank, hf.module_ids)
    assert fired.count("1.inner") == 1 and fired.count("1") == 1


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_gradients_under_checkpointing_equal_those_without_it(tmp_path, out, reentrant):
    """Checkpointed or not, each call's activation gradients are recorded once, with the same values:
    non-reentrant checkpointing recomputes its segment on the segment's own inputs (whose gradient
    belongs to the training forward's call), reentrant checkpointing gets its gradients from the
    recomputation alone."""
    from torch.utils.checkpoint import checkpoint
    from trainrec.replay.names import NameResolver

    class Wrap(torch.nn.Module):
        def __init__(self, inner, ckpt: bool):
            super().__init__()
            self.inner = inner
            self.ckpt = ckpt

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=reentrant) if self.ckpt else self.inner(x)

    def run(where, wrap):
        mon = TrainerMon(write_config(where, {"xy_distribution": True, "all_xy": True}),
                         params_have_main_grad=False, live_export=False, output_dir=str(where / "out"))
        model, opt = make()
        model.layers[1] = Wrap(model.layers[1], wrap)
        mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
        for m in range(2):
            loss_of(model, m).backward()
        opt.step()
        mon.close()
        ev = events_of(where / "out")
        res = NameResolver()
        for e in ev:
            res.feed(e)
        (hf,) = [e for e in ev if isinstance(e, HooksFired)]
        names = res.ids_names(hf.rank, hf.module_ids)
        backward = sorted(n for n, d in zip(names, hf.directions, strict=True) if d == 1)
        return stats_table(ev, "actv_grad"), backward

    for p in (tmp_path / "a", tmp_path / "b"):
        p.mkdir()
    plain, plain_fired = run(tmp_path / "a", False)
    ckpt, ckpt_fired = run(tmp_path / "b", True)
    assert ckpt_fired == plain_fired
    assert set(ckpt) == set(plain)
    for key, want in plain.items():
        for op, v in want.items():
            got = ckpt[key][op]
            assert (math.isnan(v) and math.isnan(got)) or abs(got - v) <= 1e-5 + 1e-4 * abs(v), (key, op, got, v)


@pytest.mark.parametrize("reentrant", [False, True])
def test_input_gradient_of_a_checkpointed_segment_whose_input_feeds_a_residual(tmp_path, reentrant):
    """``h + checkpoint(block, h)``: non-reentrant checkpointing records the gradient of ``h`` over all
    its uses, as without checkpointing; reentrant checkpointing gets its gradients from the
    recomputation, on a detached copy of ``h``: the gradient through the block only (README)."""
    from torch.utils.checkpoint import checkpoint

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(3, 4)
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

        def forward(self, x):
            h = self.emb(x)
            return h + checkpoint(self.block, h, use_reentrant=reentrant)

    torch.manual_seed(0)
    model = Res()
    seen = {}
    model.block.register_full_backward_hook(lambda m, gin, gout: seen.__setitem__("block", gin[0].clone()))

    def on_h(module, args, h):
        h.register_hook(lambda g: seen.__setitem__("all", g.clone()))

    model.emb.register_forward_hook(on_h)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "targets": {"block": {"input_grad": "tuple[1]:0"}}},
                     params_have_main_grad=False, live_export=False, output_dir=str(tmp_path / "out"))
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    model(torch.randn(2, 3)).pow(2).sum().backward()
    opt.step()
    mon.close()
    (got,) = [v for k, v in stats_table(events_of(tmp_path / "out"), "actv_grad").items() if k[2] == "input_grad"]
    want = seen["block" if reentrant else "all"].double().norm().item()
    assert not math.isclose(seen["block"].norm().item(), seen["all"].norm().item(), rel_tol=1e-2)
    assert math.isclose(got["norm"], want, rel_tol=1e-5)


def test_parameter_passed_as_a_module_input_gets_one_gradient_row_per_micro_step(tmp_path, out):
    """A leaf tensor keeps its gradient hooks across backward passes (a learned prefix passed to a
    module): each micro step's call gets that micro step's gradient once, and no hook outlives the step."""

    class Prefix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.prefix = torch.nn.Parameter(torch.randn(3, 4))
            self.mlp = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.head(x + self.mlp(self.prefix).mean(0))

    torch.manual_seed(0)
    model = Prefix()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"mlp": {}}, "ops": ["norm"]}),
                     params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    want = {}
    for step in range(2):
        before = torch.zeros(3, 4)
        for micro in range(2):
            model(torch.randn(5, 4) * (micro + 1)).pow(2).sum().backward()
            want[(step, "mlp", "input_grad", micro)] = (model.prefix.grad - before).norm().item()
            before = model.prefix.grad.clone()
        opt.step()
        opt.zero_grad()
    mon.close()
    got = {k: v["norm"] for k, v in stats_table(events_of(out), "actv_grad").items() if k[2] == "input_grad"}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-5 * (1 + v), (k, got[k], v)
    assert not model.prefix._backward_hooks


@pytest.mark.parametrize("inplace", [True, False])
def test_gradient_of_a_view_output_modified_in_place_is_recorded(tmp_path, out, inplace):
    """A Linear's output on 3-D input is a view (of its 2-D matmul), and torch drops the gradient hooks
    of a view that is then modified in place (ReLU(inplace=True)): its gradient comes from the node
    that made the view's base, once, the same as without the in-place op."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=inplace), torch.nn.Linear(16, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    twin.load_state_dict(model.state_dict())
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "all_xy": True, "ops": ["norm", "max"]}),
                     params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 6, 16)
    model(x).sum().backward()
    mon.binding.opt.step()
    mon.close()
    h = twin[0](x)
    h.retain_grad()
    r = twin[1](h)
    r.retain_grad()
    twin[2](r).sum().backward()
    got = stats_table(events_of(out), "actv_grad")
    want = {("0", "output_grad"): h.grad, ("1", "input_grad"): h.grad, ("1", "output_grad"): r.grad,
            ("2", "input_grad"): r.grad}
    for (name, slot), g in want.items():
        row = got[(0, name, slot, 0)]
        assert abs(row["norm"] - g.norm().item()) <= 1e-5 and abs(row["max"] - g.max().item()) <= 1e-6, (name, slot)
    assert sum(1 for k in got if k[1] in ("0", "1", "2")) == 6  # one row per module and slot, no duplicates


class _Routed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.expert = torch.nn.Linear(4, 4)

    def forward(self, x, route: bool):
        h = self.a(x)
        return h + self.expert(h) if route else h  # the expert gets tokens in some micro steps only


@pytest.mark.parametrize("schedule", ["routed", "forwards first"])
def test_weight_gradients_carry_the_micro_step_of_their_backward_pass(tmp_path, out, schedule):
    """A parameter used in some micro steps only (a routed expert) gets its gradients under those micro
    steps; a stage that runs every forward before the backward passes (1F1B pipelines) gets each
    backward's own micro step, not the forwards' count."""
    torch.manual_seed(0)
    model = _Routed()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}),
                     params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=4, optimizer=opt)
    xs = [torch.randn(2, 4) for _ in range(4)]
    want = {}
    if schedule == "routed":
        for m in range(4):
            model(xs[m], route=m in (1, 3)).pow(2).sum().backward()
            if m in (1, 3):
                want[m] = model.expert.bias.grad.norm().item()
    else:
        losses = [model(xs[m], route=True).pow(2).sum() for m in range(4)]
        for m in range(4):
            losses[m].backward()
            want[m] = model.expert.bias.grad.norm().item()
    opt.step()
    mon.close()
    un = stats_table(events_of(out), "grad_unreduced")
    got = {k[3]: v["norm"] for k, v in un.items() if k[1] == "expert.bias"}
    assert got.keys() == want.keys()
    assert all(abs(got[m] - want[m]) <= 1e-5 * (1 + want[m]) for m in want), (got, want)
    assert sorted(k[3] for k in un if k[1] == "a.weight") == [0, 1, 2, 3]


class _InPlace(torch.nn.Module):
    """A Linear whose output a ReLU(inplace=True) modifies, and a module with mixed arguments."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU(inplace=True)
        self.mix = _Mixed()

    def forward(self, x, mask):
        h = self.act(self.lin(x))
        y, (s, k) = self.mix(h, mask, 3)
        return y + s + k


class _Mixed(torch.nn.Module):
    def forward(self, a, mask, n):
        return a * mask, (a.sum(), mask.sum())


def test_print_struct_grads_match_full_backward_hooks_and_allow_in_place_ops(tmp_path, out):
    """module_struct.json's input_grad/output_grad equal what torch's full backward hooks receive (taken
    on a twin model without in-place ops), and an in-place ReLU on a hooked Linear's output still runs
    (full backward hooks make it raise)."""
    def describe(grads):
        return {"config": f"tuple[{len(grads)}]", **{
            str(i): "<class 'NoneType'>" if g is None else f"size={tuple(g.shape)}, dtype={g.dtype}"
            for i, g in enumerate(grads)}}

    torch.manual_seed(0)
    twin = _InPlace()
    twin.act = torch.nn.ReLU()
    seen = {}
    def capture(name):
        def hook(module, grad_input, grad_output):
            seen.setdefault(name, (describe(grad_input), describe(grad_output)))
        return hook

    for name in ("lin", "mix"):
        getattr(twin, name).register_full_backward_hook(capture(name))
    x, mask = torch.randn(4, 8), torch.ones(4, 8)
    with warnings.catch_warnings():  # torch warns that lin's hook fires for outputs only (x needs no grad)
        warnings.simplefilter("ignore", UserWarning)
        twin(x, mask).sum().backward()

    mon = TrainerMon(write_config(tmp_path, {"print_struct": True}), live_export=False)
    model = _InPlace()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    model(x, mask).sum().backward()  # would raise with a full backward hook on lin
    with pytest.raises(Exception, match=PRINT_STRUCT_EXIT):
        opt.step()
    with open(out / "module_struct.json") as f:
        struct = json.load(f)
    for name in ("lin", "mix"):
        gi, go = seen[name]
        assert struct[f"0:{name}"]["input_grad"] == gi, name
        assert struct[f"0:{name}"]["output_grad"] == go, name
    assert struct["0:mix"]["input_grad"]["2"] == "<class 'NoneType'>"  # the int argument


def test_live_export_runs_at_lower_priority(tmp_path, out):
    """format csv starts the live projection process at the lowest priority (background work)."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "format": "csv"}), params_have_main_grad=False)
    try:
        proc = mon.output.live.proc
        assert proc is not None
        want = min(os.getpriority(os.PRIO_PROCESS, 0) + LIVE_EXPORT_NICE, 19)
        deadline = time.monotonic() + 20
        while os.getpriority(os.PRIO_PROCESS, proc.pid) != want and time.monotonic() < deadline:
            assert proc.poll() is None, "the live export exited early"
            time.sleep(0.05)  # it renices itself right after start-up
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == want
    finally:
        mon.close()


def test_unrecorded_options_are_said_once(tmp_path, out, caplog, monkeypatch):
    from trainrec.recorder import session

    monkeypatch.setattr(session, "_warned", set())
    cfg = {"wg_distribution": True, "mg_direction": True, "cc_distribution": {"enable": True}}
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        for _ in range(2):
            TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False).close()
    said = [r.getMessage() for r in caplog.records]
    assert not any("cc_distribution" in m or "mg_direction" in m for m in said)  # recorded: nothing to say
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        TrainerMon(write_config(tmp_path, {"xy_distribution": True, "module_ranks": [1, 2]}), live_export=False).close()
        TrainerMon(write_config(tmp_path, {"xy_distribution": True, "module_ranks": [0]}), live_export=False).close()
    assert [r.getMessage() for r in caplog.records] == [
        "trainrec: module_ranks [1, 2] names no rank of this run's world size 1: no rank records activations "
        "(xy_distribution)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        for cfg in ({"ops": ["norm", "max"], "format": "csv"}, {"wg_distribution": True, "collect_times": 0},
                    {"print_struct": True}):
            TrainerMon(write_config(tmp_path, cfg), live_export=False).close()
    assert [r.getMessage() for r in caplog.records] == [
        "trainrec: the config turns on none of xy_distribution, wg_distribution, param_distribution, "
        "mv_distribution, ur_distribution, mg_direction: no statistics are recorded (the log holds the steps and "
        "the module structure only)",
        "trainrec: collect_times is 0: no step is collected (as in msprobe 1.2.1)"]
    caplog.clear()
    monkeypatch.setattr(session, "_warned", set())
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")  # a config that the switch has not turned on yet: nothing to say
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        TrainerMon(write_config(tmp_path, {"switch": False}), live_export=False).close()
    assert not [r for r in caplog.records if "no statistics" in r.getMessage()]


def test_mg_direction_equals_sign_agreement_of_grad_and_momentum_before_the_update(tmp_path, out):
    """Per parameter and step: ((sign(g) . sign(exp_avg)).sum() / numel + 1) / 2 with the gradient being
    applied and the momentum before this update; 1.0 at the first step (no state yet). Exported to the
    reference's other_{start}-{end}.csv and as .../mg_direction_{op} TensorBoard tags."""
    ops = ["min", "max", "norm", "mean", "zeros", "nans"]
    mon = TrainerMon(write_config(tmp_path, {"mg_direction": True, "ops": ops, "format": "csv"}),
                     params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    pn = squash_all([n for n, _ in model.named_parameters()])
    want = {}
    for step in range(3):
        loss_of(model, step).backward()
        for n, p in model.named_parameters():
            m = opt.state[p].get("exp_avg") if p in opt.state else None
            if m is None:
                want[(step, pn[n])] = 1.0
            else:
                agree = (torch.sign(p.grad.double()) * torch.sign(m.double())).sum().item()
                want[(step, pn[n])] = (agree / p.numel() + 1) / 2
        opt.step()
        opt.zero_grad()
    mon.close()
    got = stats_table(events_of(out), "mg_direction")
    assert len(got) == len(want)
    for (step, name), value in want.items():
        row = got[(step, name, "", 0)]
        assert row["min"] == row["max"] == row["mean"] == pytest.approx(value, abs=1e-6), (step, name)
        assert row["norm"] == pytest.approx(abs(value), abs=1e-6) and row["nans"] == 0 and row["zeros"] == 0
    assert 0.0 < min(v for (s, _), v in want.items() if s > 0) < 1.0  # a non-trivial case was checked

    from trainrec.tools.cli import main as cli

    assert cli(["export", "csv", str(out), "--out", str(tmp_path / "csv")]) == 0
    files = glob.glob(str(tmp_path / "csv" / "**" / "other_*.csv"), recursive=True)
    assert files and not glob.glob(str(tmp_path / "csv" / "**" / "mg_direction_*.csv"), recursive=True)
    rows = {}
    for path in files:
        with open(path) as f:
            lines = f.read().splitlines()
        assert lines[0] == "vpp_stage,param_name,step," + ",".join(ops)
        rows.update({(int(c[2]), c[1]): float(c[3]) for c in (ln.split(",") for ln in lines[1:])})
    assert rows.keys() == want.keys()
    assert all(abs(v - want[k]) < 1e-5 for k, v in rows.items())


@pytest.mark.parametrize(("opt_cls", "kw"), [(torch.optim.SGD, {"momentum": 0.9}), (torch.optim.SGD, {}),
                                             (torch.optim.Adagrad, {}), (torch.optim.RMSprop, {"momentum": 0.9})])
def test_mg_direction_outside_adams_family_records_nothing(tmp_path, out, caplog, opt_cls, kw):
    """SGD (with or without momentum), Adagrad and RMSprop keep no exp_avg: the first step's 1.0 (no
    state yet, as the reference) was recorded at every step, a constant that looked like a measurement.
    Now nothing is, and one warning says why."""
    mon = TrainerMon(write_config(tmp_path, {"mg_direction": True, "ops": ["mean"]}), params_have_main_grad=False,
                     live_export=False)
    model, _ = make()
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    with caplog.at_level("WARNING", logger="trainrec"):
        for step in range(3):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
    mon.close()
    assert steps_with(events_of(out), "mg_direction") == []
    said = [r.getMessage() for r in caplog.records if "mg_direction compares" in r.getMessage()]
    assert len(said) == 1 and f"{opt_cls.__name__} is not of Adam's family" in said[0]


@pytest.mark.parametrize("key", ["input", "input_grad"])
def test_input_selector_that_cannot_fit_the_forward_signature_fails_at_start_up(tmp_path, out, key):
    """head is a Linear (forward(input)): tuple[2] can never fit its inputs, known before any step."""
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"head": {key: "tuple[2]:1"}}}),
                     live_export=False)
    model, opt = make()
    with pytest.raises(ConfigError) as err:
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    assert f"targets.head.{key}" in str(err.value) and "at most 1 positional input" in str(err.value)
    mon.close()
    # what the signature allows (pair takes x, y) passes here; a real mismatch is only seen when it runs
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "targets": {"pair": {key: "tuple[2]:1"}}}),
                     live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
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
    assert mon.output.writer.error is not None and "removed" in str(mon.output.writer.error)
    t0 = time.monotonic()
    mon.close()
    assert time.monotonic() - t0 < 10
    assert mon.output.live is None or mon.output.live.proc is None
