"""The ops, eps and optimizer-state options (mv, ur, mg_direction) of TrainerMon."""

from __future__ import annotations

import glob

import pytest
import torch
from trainmon_util import events_of, loss_of, make, stats_table, steps_with, train, write_config
from trainrec.recorder import TrainerMon
from trainrec.recorder.names import squash_all
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import HookFailed, TensorStatsRecorded


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


def test_mv_and_ur_on_plain_adam_without_opt_ty(tmp_path, out):
    mon, model, opt = train(tmp_path, {"mv_distribution": True, "ur_distribution": True, "format": "csv"}, steps=2,
                            close=False)
    mon.close()
    ev = events_of(out)
    for kind in ("exp_avg", "exp_avg_sq", "update", "ratio"):
        assert steps_with(ev, kind) == [0, 1], kind
    assert len(stats_table(ev, "exp_avg")) == 2 * len(list(model.parameters()))


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


def test_unrecorded_options_are_said_once(tmp_path, out, caplog, monkeypatch):
    from trainrec.recorder import failures

    monkeypatch.setattr(failures, "_warned", set())
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
    monkeypatch.setattr(failures, "_warned", set())
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
