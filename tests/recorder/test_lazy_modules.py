"""Lazy modules (``torch.nn.LazyLinear`` and the like): their parameters are ``UninitializedParameter``
until the module's first forward, with no size, no memory, and no hooks (torch refuses them). A monitor
installed before that forward hooks them at the end of the model chunk's forward that makes them, before
its backward, records them from then on, records the module structure again with their sizes, and a
target naming one says so."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from trainmon_util import ALL_OPS, assert_close, events_of, ref_stats, stats_table, write_config
from trainrec.recorder import TrainerMon
from trainrec.schema.events import HookFailed, ModuleStructureRecorded, StepEnded


class LazyNet(nn.Module):
    """Two lazy layers that run, and one that never does (a branch not taken)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.LazyLinear(8)
        self.out = nn.LazyLinear(3)
        self.unused = nn.LazyLinear(5)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


@pytest.mark.parametrize("xy", [False, True])  # (without xy: the weight-gradient hooks are list appends)
def test_a_lazy_model_is_recorded_once_its_parameters_are_made(tmp_path, out, xy):
    """The monitor installed before the first forward crashed (the structure record asked the size of an
    UninitializedParameter, and a gradient hook on one raises)."""
    torch.manual_seed(0)
    model = LazyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True, "xy_distribution": xy,
           "ops": ALL_OPS}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    seen = {}
    for step in range(3):
        for micro in range(2):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    seen[("unreduced", step, n, micro)] = p.grad.clone()
        for n, p in model.named_parameters():
            if p.grad is not None:
                seen[("param", step, n)] = p.detach().clone()
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    assert not [e for e in ev if isinstance(e, HookFailed)]
    assert [(e.step, e.optimizer_skipped) for e in ev if isinstance(e, StepEnded)] == [(s, False) for s in range(3)]
    unred, par = stats_table(ev, "grad_unreduced"), stats_table(ev, "param")
    for step in range(3):
        for n in ("inp.weight", "inp.bias", "out.weight", "out.bias"):
            for micro in range(2):
                assert_close(unred[(step, n, "", micro)], ref_stats(seen[("unreduced", step, n, micro)]),
                             what=f"unreduced {n} {step} {micro}")
            assert_close(par[(step, n, "", 0)], ref_stats(seen[("param", step, n)]), what=f"param {n} {step}")
    assert not [k for k in {**unred, **par, **stats_table(ev, "exp_avg")} if k[1].startswith("unused")]
    # the structure at install (sizes not known: 0), and again with them after the first forward
    st = [e for e in ev if isinstance(e, ModuleStructureRecorded)]
    assert [dict(zip(e.names, e.param_counts, strict=True)) for e in st] == [
        {"": 0, "inp": 0, "out": 0, "unused": 0}, {"": 0, "inp": 6 * 8 + 8, "out": 8 * 3 + 3, "unused": 0}]
    assert st[1].classes == ("LazyNet", "Linear", "Linear", "LazyLinear")
    if xy:
        assert (0, "inp", "output", 1) in stats_table(ev, "actv")


def test_a_target_naming_a_lazy_parameter_warns_and_is_recorded_once_made(tmp_path, out, caplog):
    torch.manual_seed(0)
    model = LazyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    cfg = {"targets": {"out": {}}, "wg_distribution": True, "ops": ["norm"]}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    with caplog.at_level(logging.WARNING, logger="trainrec.recorder.monitor"):
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
    warned = [r.getMessage() for r in caplog.records if "lazy module" in r.getMessage()]
    assert len(warned) == 1 and "targets.out" in warned[0] and "out.weight" in warned[0]
    model(torch.randn(4, 6)).sum().backward()
    want = model.out.weight.grad.norm().item()
    opt.step()
    mon.close()
    red = stats_table(events_of(out), "grad_reduced")
    assert sorted(k[1] for k in red) == ["out.bias", "out.weight"]
    assert red[(0, "out.weight", "", 0)]["norm"] == pytest.approx(want, rel=1e-5)
