"""Targets and selectors: which modules and which of their inputs/outputs are recorded, and the errors when they match nothing."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch
import torch.nn as nn
from trainmon_util import (
    Pair,
    events_of,
    loss_of,
    make,
    rank_dirs,
    stats_table,
    steps_with,
    train,
    write_config,
)
from trainrec.recorder import TrainerMon
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import ConfigRejected, HookFailed


def test_targets_select_params_on_segment_boundaries(tmp_path, out):
    model, _ = make()
    model.layers.append(torch.nn.Identity())  # layers.2 has no params; layers.1 must not match layers.1x
    cfg = {"wg_distribution": True, "targets": {"layers.1": {}}}
    mon = TrainerMon(write_config(tmp_path, cfg), live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert sorted(p.full for p in mon.session.context.params) == ["layers.1.bias", "layers.1.weight"]
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
    assert mon.closed and mon.session.output.writer.closed
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
