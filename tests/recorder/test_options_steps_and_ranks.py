"""Which steps, micro-steps, ranks and directions TrainerMon records, read back from the log."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from trainmon_util import events_of, loss_of, make, stats_table, steps_with, train, write_config
from trainrec.recorder import TrainerMon
from trainrec.recorder.names import squash_all
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import HookFailed, HooksFired, MonitoringStopped, StepBegan, StepEnded


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


def test_collect_times_zero_collects_nothing(tmp_path, out):
    train(tmp_path, {"wg_distribution": True, "collect_times": 0}, steps=2)
    assert steps_with(events_of(out), "grad_reduced") == []
