"""``optimizer.step(closure)``: the closure's forward and backward passes run inside the optimizer step,
after its pre-step hook (LBFGS always, several evaluations per step; SGD and AdamW where given one, one
evaluation). Each ``step()`` is one training step whose passes are its micro passes (none of them a
step of its own, nor a skipped one), and the reduced gradients (and mg_direction) are those the step
applied, taken at its post-step hook: the gradients the closure's last evaluation left. The tests train
for real, read the log back and compare with what the test computes itself."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn as nn
from trainmon_util import (
    ALL_OPS,
    assert_close,
    events_of,
    loss_of,
    make,
    ref_stats,
    stats_table,
    write_config,
)
from trainrec.recorder import TrainerMon
from trainrec.replay.names import NameResolver
from trainrec.schema.events import (
    DIR_FORWARD,
    HookFailed,
    HooksFired,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
)

KINDS_COMPARED = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq", "update",
                  "ratio", "mg_direction")


def rows(events, kind: str) -> list[tuple]:
    """Every row of ``kind`` as ``(step, name, micro step, call id, {op: value})``, duplicates kept (a
    parameter's unreduced gradient is recorded once per backward pass: once per closure evaluation)."""
    res = NameResolver()
    out = []
    for ev in events:
        res.feed(ev)
        if isinstance(ev, TensorStatsRecorded) and ev.kind == kind:
            vals = np.frombuffer(ev.values, dtype="<f4").reshape(len(ev), len(ev.ops))
            for name, m, c, v in zip(res.names(ev), ev.column("micro_steps"), ev.column("call_ids"), vals,
                                     strict=True):
                out.append((ev.step, name, int(m), int(c), dict(zip(ev.ops, v.tolist(), strict=True))))
    return out


def firings(events) -> list[tuple]:
    """Every hook firing as ``(step, name, direction, call id, micro step)``."""
    res = NameResolver()
    out = []
    for ev in events:
        res.feed(ev)
        if isinstance(ev, HooksFired):
            for mid, d, c, m in ev.rows():
                out.append((ev.step, res.name(ev.rank, mid), int(d), int(c), int(m)))
    return out


def assert_same_table(got: dict, want: dict, what: str) -> None:
    """Two :func:`stats_table` results hold the same rows and values (NaN rows, of an input without a
    gradient, alike)."""
    assert sorted(got) == sorted(want), what
    for key, vals in want.items():
        a, b = np.array(list(got[key].values())), np.array(list(vals.values()))
        assert list(got[key]) == list(vals) and np.array_equal(a, b, equal_nan=True), (what, key, got[key], vals)


def step_ends(events) -> list[tuple]:
    return [(e.step, e.collected, e.micro_steps, e.optimizer_skipped, e.foreign_passes)
            for e in events if isinstance(e, StepEnded)]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


# LBFGS's evaluations per step follow max_iter: a step with more of them than the step before it (which
# a step not collected once took for a skipped optimizer step and a new step) comes every other step
MAX_ITERS = (2, 5, 2, 5, 3, 6)


@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("xy", [False, True])
@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_records_one_step_per_optimizer_step_with_the_gradients_it_applied(tmp_path, out, caplog, interval, xy,
                                                                                   line_search):
    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True, "ur_distribution": True,
           "mg_direction": True, "xy_distribution": xy, "ops": ALL_OPS, "step_interval": interval}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, line_search_fn=line_search)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    evals, finals, befores = [], [], []
    with caplog.at_level(logging.WARNING, logger="trainrec"):
        for s, max_iter in enumerate(MAX_ITERS):
            opt.param_groups[0]["max_iter"] = max_iter
            opt.param_groups[0]["max_eval"] = max_iter * 5 // 4
            n = [0]

            def closure(n=n):
                n[0] += 1
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            befores.append({k: p.detach().clone() for k, p in model.named_parameters()})
            if s % 2:
                opt.step(closure=closure)  # the keyword form reaches the hooks as kwargs
            else:
                opt.step(closure)
            evals.append(n[0])
            # what the optimizer step applied: the gradients its last evaluation left
            finals.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        mon.close()
    assert min(evals) >= 2 and any(b > a for a, b in zip(evals, evals[1:], strict=False))
    ev = events_of(out)
    assert not [e for e in ev if isinstance(e, HookFailed)]
    # one training step per optimizer.step(), none skipped; its micro passes are the closure's evaluations
    n_steps = len(MAX_ITERS)
    assert [e.step for e in ev if isinstance(e, StepBegan)] == list(range(n_steps))
    assert step_ends(ev) == [(s, s % interval == 0, evals[s], False, False) for s in range(n_steps)]
    collected = [s for s in range(n_steps) if s % interval == 0]
    names = [k for k, _ in model.named_parameters()]

    # reduced gradients: one row per parameter and step, the final gradients (not the last step's)
    reduced = rows(ev, "grad_reduced")
    assert sorted((r[0], r[1]) for r in reduced) == sorted((s, k) for s in collected for k in names)
    for s, k, _, _, got in reduced:
        assert_close(got, ref_stats(finals[s][k]), rtol=1e-5, what=f"step {s} reduced {k}")
    assert not torch.equal(finals[0]["0.weight"], finals[1]["0.weight"])  # (so a step behind would show)
    # parameters: before the update, once per step
    params = rows(ev, "param")
    assert sorted((r[0], r[1]) for r in params) == sorted((s, k) for s in collected for k in names)
    for s, k, _, _, got in params:
        assert_close(got, ref_stats(befores[s][k]), rtol=1e-5, what=f"step {s} param {k}")
    # unreduced gradients: one row per evaluation (backward pass), micro step 0 (grad_acc_steps=1), the
    # last of them the final gradient
    unreduced = rows(ev, "grad_unreduced")
    for s in collected:
        for k in names:
            mine = sorted((r for r in unreduced if r[0] == s and r[1] == k), key=lambda r: r[3])
            assert len(mine) == evals[s] and {r[2] for r in mine} == {0}
            assert_close(mine[-1][4], ref_stats(finals[s][k]), rtol=1e-5, what=f"step {s} last unreduced {k}")
    # hook firings: a weight-gradient firing per evaluation, call ids in execution order: the parameter
    # rows (taken before the step's passes) first, the reduced rows (after them) last
    fired = firings(ev)
    assert {f[0] for f in fired} == set(collected)
    for s in collected:
        calls = [f[3] for f in fired if f[0] == s]
        assert calls == sorted(set(calls))
        assert sum(1 for f in fired if f[0] == s and f[1] == "0.weight") == evals[s]
        if xy:  # the model's modules run once per evaluation
            assert sum(1 for f in fired if f[0] == s and f[1] == "0" and f[2] == DIR_FORWARD) == evals[s]
            assert len({r[3] for r in rows(ev, "actv") if r[0] == s and r[1] == "0"}) == evals[s]  # call ids
        assert max(r[3] for r in params if r[0] == s) < min(calls)
        assert min(r[3] for r in reduced if r[0] == s) > max(calls)
    # LBFGS keeps no Adam state: said once, nothing recorded for it, nothing failed
    for kind in ("exp_avg", "exp_avg_sq", "update", "ratio", "mg_direction"):
        assert rows(ev, kind) == []
    said = [r.getMessage() for r in caplog.records if "no Adam state" in r.getMessage()]
    assert len(said) == 1 and "LBFGS" in said[0] and "mv_distribution" in said[0]
    said = [r.getMessage() for r in caplog.records if "not of Adam's family" in r.getMessage()]
    assert len(said) == 1 and "LBFGS" in said[0] and "mg_direction" in said[0]


def _train(tmp_path, name: str, opt_cls, closure: bool, grad_acc: int, keyword: bool = False, steps: int = 4):
    """TinyNet trained ``steps`` steps of ``grad_acc`` micro batches, with every option on; ``closure``:
    through ``opt.step(closure)`` (the closure clears the gradients and runs the micro batches), else
    the plain loop. Returns the events and, per step, the final gradients and the parameters before it."""
    out = tmp_path / name
    cfg = {"wg_distribution": True, "xy_distribution": True, "param_distribution": True, "mv_distribution": True,
           "ur_distribution": True, "mg_direction": True, "ops": ALL_OPS, "squash_name": False}
    mon = TrainerMon(write_config(tmp_path, cfg, f"{name}.json"), params_have_main_grad=False, live_export=False,
                     output_dir=str(out))
    model, opt = make(0, opt_cls)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=grad_acc, optimizer=opt)
    finals, befores, momenta = [], [], []
    for s in range(steps):
        def passes(s=s):
            opt.zero_grad()
            loss = None
            for m in range(grad_acc):
                loss = loss_of(model, grad_acc * s + m)
                loss.backward()
            return loss

        befores.append({k: p.detach().clone() for k, p in model.named_parameters()})
        momenta.append({k: opt.state[p]["exp_avg"].clone() for k, p in model.named_parameters()
                        if "exp_avg" in opt.state.get(p, {})})
        if not closure:
            passes()
            if s % 2:
                opt.step(None)  # (as accelerate's AcceleratedOptimizer passes its closure=None on)
            else:
                opt.step()
        elif keyword:
            opt.step(closure=passes)
        else:
            opt.step(passes)
        finals.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    mon.close()
    return events_of(out), finals, befores, momenta


def _sgd_momentum(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@pytest.mark.parametrize("grad_acc", [1, 2])
@pytest.mark.parametrize("opt_cls", [_sgd_momentum, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_sgd_and_adamw_with_a_closure_record_what_the_plain_loop_records(tmp_path, opt_cls, grad_acc):
    """The same training as a closure and as the plain loop: the same steps and the same rows (the
    closure's reduced gradients and mg_direction taken after its passes, as the plain loop takes them
    before its step), and both equal to the gradients and momenta the test reads itself."""
    plain, finals, befores, momenta = _train(tmp_path, "plain", opt_cls, False, grad_acc)
    for keyword in (False, True):
        ev, finals_c, _, _ = _train(tmp_path, f"closure{int(keyword)}", opt_cls, True, grad_acc, keyword)
        assert not [e for e in ev if isinstance(e, HookFailed)]
        assert step_ends(ev) == step_ends(plain) == [(s, True, grad_acc, False, False) for s in range(4)]
        for s in range(4):
            for k, g in finals[s].items():
                assert torch.equal(g, finals_c[s][k])  # (the same training)
        for kind in KINDS_COMPARED:
            assert_same_table(stats_table(ev, kind), stats_table(plain, kind), kind)
        # call ids: the parameter rows before the step's passes, the reduced rows after them
        fired = firings(ev)
        for s in range(4):
            calls = [f[3] for f in fired if f[0] == s]
            assert calls == sorted(set(calls))
            assert max(r[3] for r in rows(ev, "param") if r[0] == s) < min(calls)
            assert min(r[3] for r in rows(ev, "grad_reduced") if r[0] == s) > max(calls)
    # and, independently: the reduced rows are the final gradients, the parameters those before the step,
    # one unreduced row per micro step (its own micro step)
    for (s, name, _, micro), got in stats_table(plain, "grad_reduced").items():
        assert micro == 0
        assert_close(got, ref_stats(finals[s][name]), rtol=1e-5, what=f"step {s} reduced {name}")
    for (s, name, _, _), got in stats_table(plain, "param").items():
        assert_close(got, ref_stats(befores[s][name]), rtol=1e-5, what=f"step {s} param {name}")
    unreduced = stats_table(plain, "grad_unreduced")
    assert sorted(k[3] for k in unreduced if k[:2] == (0, "head.weight")) == list(range(grad_acc))
    mg = stats_table(plain, "mg_direction")
    if opt_cls is torch.optim.AdamW:
        for (s, name, _, _), got in mg.items():
            g, m = finals[s][name], momenta[s].get(name)
            want = 1.0 if m is None else ((torch.sign(g) * torch.sign(m)).sum().item() / g.numel() + 1) / 2
            assert got["mean"] == pytest.approx(want, abs=1e-6), (s, name)
        assert {k[0] for k in mg} == set(range(4))
    else:
        assert mg == {}  # SGD: not of Adam's family


def test_a_closure_step_after_plain_steps_is_no_skipped_step(tmp_path, out):
    """Plain steps, then steps through a closure that makes two passes (a closure may evaluate several
    times, as LBFGS's does), not collected: the passes of a step that were taken to be more than the
    last optimizer step's are the closure's, inside its step."""
    cfg = {"wg_distribution": True, "ops": ["norm"], "step_interval": 5}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make(0, torch.optim.SGD)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for s in range(6):
        if s < 3:
            opt.zero_grad()
            loss_of(model, s).backward()
            opt.step()
            continue

        def twice(s=s):
            for _ in range(2):
                opt.zero_grad()
                loss = loss_of(model, s)
                loss.backward()
            return loss

        opt.step(twice)
    mon.close()
    ev = events_of(out)
    assert step_ends(ev) == [(s, s == 0 or s == 5, 2 if s >= 3 else 1, False, False) for s in range(6)]
    assert {k[0] for k in stats_table(ev, "grad_reduced")} == {0, 5}
