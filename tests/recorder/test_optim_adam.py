"""Adam state lookup and the update/ratio statistics (recorder/optim.py, recorder/adam_update.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from trainmon_util import (
    ALL_OPS,
    ComplexFilter,
    assert_close,
    events_of,
    loss_of,
    make,
    ref_stats,
    stats_table,
    write_config,
)
from trainrec.recorder import TrainerMon, adam_update, optim
from trainrec.recorder.adam_update import update_and_ratio
from trainrec.recorder.names import squash_all
from trainrec.recorder.optim import AdamState
from trainrec.recorder.stats import StatsEngine


def stepped_adamw(groups: int = 2, per_group: int = 3):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5)) for _ in range(groups * per_group)]
    opt = torch.optim.AdamW([{"params": params[g * per_group:(g + 1) * per_group]} for g in range(groups)], lr=1e-2)
    for _ in range(2):
        sum((p * p).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    return params, opt


def test_cpu_step_counters_are_read_per_parameter():
    params, opt = stepped_adamw()
    opt.state[params[1]]["step"] = torch.tensor(7.0)  # e.g. a parameter that missed steps
    entries = AdamState(opt, opt).lookup(params)
    assert [e[3] for e in entries] == [2.0, 7.0, 2.0, 2.0, 2.0, 2.0]
    assert all(type(e[3]) is float for e in entries)


def test_device_step_counters_are_not_read():
    """Fused and capturable Adam keep the step counters on the device: they stay tensors, and the bias
    corrections are computed there, one per parameter, without a read (a meta tensor has no value to
    read: any read raises). ``host_steps=False`` treats CPU counters the same way."""
    params, opt = stepped_adamw()
    for k, p in enumerate(params):  # as fused/capturable Adam keep them: on the device
        opt.state[p]["step"] = torch.tensor(float(10 + k), device="meta")
    entries = AdamState(opt, opt).lookup(params)
    assert [e[0] for e in entries] == list(range(6))
    assert all(isinstance(e[3], torch.Tensor) and e[3].is_meta for e in entries)
    scales, shifts = adam_update.bias_corrections(entries)
    assert len(scales) == len(shifts) == 6
    assert all(isinstance(x, torch.Tensor) and x.is_meta and x.dim() == 0 for x in scales + shifts)

    params, opt = stepped_adamw()
    entries = AdamState(opt, opt).lookup(params, host_steps=False)
    assert all(isinstance(e[3], torch.Tensor) for e in entries)


def test_bias_corrections_from_counters_equal_those_from_floats():
    """The device's computation (float32 tensors) of each parameter's scale and shift equals the host's
    (Python floats), to float32 rounding, over steps from 1 to 10^6, betas including 0, and two groups."""
    groups = [{"betas": (0.9, 0.999), "eps": 1e-8}, {"betas": (0.0, 0.95), "eps": 1e-6}, {}]
    steps = [0.0, 1.0, 2.0, 7.0, 100.0, 4097.0, 1e6]
    host = [(k, None, None, t, g) for k, (t, g) in enumerate((t, g) for g in groups for t in steps)]
    dev = [(k, m, v, torch.tensor(t), g) for k, m, v, t, g in host]
    for want, got in zip(adam_update.bias_corrections(host), adam_update.bias_corrections(dev), strict=True):
        assert all(isinstance(x, float) for x in want) and all(isinstance(x, torch.Tensor) for x in got)
        torch.testing.assert_close(torch.stack(got), torch.tensor(want), rtol=4e-7, atol=0)


def test_chunks_cover_every_tensor_once_and_respect_the_limit():
    numels = [5, 5, 20, 1, 1, 1, 9, 0]
    ranges = adam_update._chunks(numels, 10)
    assert ranges == [(0, 2), (2, 3), (3, 6), (6, 8)]
    assert [i for a, b in ranges for i in range(a, b)] == list(range(len(numels)))
    assert all(sum(numels[a:b]) <= 10 or b - a == 1 for a, b in ranges)
    assert adam_update._chunks([], 10) == []


def test_update_and_ratio_in_chunks_equal_one_pass(monkeypatch):
    params, opt = stepped_adamw(groups=2, per_group=4)
    entries = AdamState(opt, opt).lookup(params)
    eng = StatsEngine(("min", "max", "norm", "mean", "zeros", "nans"))
    whole = update_and_ratio(entries, eng.compute, True, True)
    sizes = []
    real_sqrt = torch._foreach_sqrt

    def spy(vs):
        sizes.append(sum(v.numel() for v in vs))
        return real_sqrt(vs)

    monkeypatch.setattr(torch, "_foreach_sqrt", spy)
    chunked = update_and_ratio(entries, eng.compute, True, True, chunk_numel=12)
    assert sizes == [10, 10, 10, 10]  # 5-element tensors, two per chunk: never all 40 at once
    for w, c in zip(whole, chunked, strict=True):
        assert torch.equal(w, c)


def test_unused_embedding_rows_give_ratio_zero_not_nan(tmp_path, monkeypatch):
    """A real AdamW run through TrainerMon: TinyNet's 32-row Embedding sees only some ids, so part of its
    exp_avg_sq is exactly 0. No ratio NaNs are recorded, and update/ratio equal a float64 computation
    (with ratio 0 where v == 0)."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    cfg = {"ur_distribution": True, "ops": ALL_OPS, "format": "csv"}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=1, optimizer=opt)
    pnames = squash_all([n for n, _ in model.named_parameters()])
    seen = {}
    for step in range(2):
        loss_of(model, step).backward()
        opt.step()
        for n, p in model.named_parameters():
            st = opt.state[p]
            seen[(step, pnames[n])] = (st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"]))
        opt.zero_grad()
    mon.close()
    events = events_of(out)
    upd, rat = stats_table(events, "update"), stats_table(events, "ratio")
    unused = 0
    for (step, name), (m, v, t) in seen.items():
        b1, b2, eps = 0.9, 0.999, 1e-8
        m_hat, v_hat = m.double() / (1 - b1**t), v.double() / (1 - b2**t)
        ratio = torch.where(v_hat == 0, torch.zeros_like(m_hat), m_hat / v_hat.sqrt())
        unused += int((v == 0).sum())
        got = rat[(step, name, "", 0)]
        assert got["nans"] == 0, f"ratio NaNs recorded for {name} step {step}"
        assert_close(got, ref_stats(ratio), rtol=1e-3, what=f"ratio {name} step {step}")
        assert_close(upd[(step, name, "", 0)], ref_stats(m_hat / (v_hat.sqrt() + eps)), rtol=1e-3,
                     what=f"update {name} step {step}")
    assert unused > 0  # the case this test is about did occur
    assert len(seen) == len(rat) == len(upd)



@pytest.mark.parametrize("path", ["host", "device"])
def test_update_and_ratio_of_fused_adamw_equal_a_float64_computation(tmp_path, monkeypatch, path):
    """Fused AdamW (its step counters are tensors where the parameters are: on an accelerator there, read
    back only with a sync) in two param groups of different betas, one parameter's counter ahead of the
    others: update and ratio as recorded, on the host path and on the accelerators' path (which computes
    the bias corrections from the counters without reading them), equal a float64 computation of each
    parameter's own step."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    cfg = {"ur_distribution": True, "ops": ALL_OPS, "format": "csv"}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)

    def fused_two_groups(params, lr):
        params = list(params)
        return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "betas": (0.8, 0.99), "eps": 1e-6}],
                                 lr=lr, fused=True)

    model, opt = make(opt_cls=fused_two_groups)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=1, optimizer=opt)
    mon.session.context.engine.fused = False
    mon.session.context.engine.host_paths = path == "host"
    pnames = squash_all([n for n, _ in model.named_parameters()])
    first = next(iter(model.parameters()))
    seen = {}
    for step in range(3):
        loss_of(model, step).backward()
        opt.step()
        for n, p in model.named_parameters():
            st, group = opt.state[p], next(g for g in opt.param_groups if any(q is p for q in g["params"]))
            seen[(step, pnames[n])] = (st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"]),
                                       group["betas"], group["eps"])
        opt.state[first]["step"].add_(5.0)  # this parameter's counter runs ahead of its group's
        opt.zero_grad()
    mon.close()
    events = events_of(out)
    upd, rat = stats_table(events, "update"), stats_table(events, "ratio")
    assert len(seen) == len(rat) == len(upd)
    assert {t for _, _, t, _, _ in seen.values()} == {1.0, 2.0, 3.0, 7.0, 13.0}
    for (step, name), (m, v, t, (b1, b2), eps) in seen.items():
        m_hat, v_hat = m.double() / (1 - b1**t), v.double() / (1 - b2**t)
        ratio = torch.where(v_hat == 0, torch.zeros_like(m_hat), m_hat / v_hat.sqrt())
        assert_close(rat[(step, name, "", 0)], ref_stats(ratio), rtol=1e-5, what=f"ratio {name} step {step}")
        assert_close(upd[(step, name, "", 0)], ref_stats(m_hat / (v_hat.sqrt() + eps)), rtol=1e-5,
                     what=f"update {name} step {step}")


def _mv_run(tmp_path, monkeypatch, between):
    """A monitored AdamW run of 2 steps; ``between(model, opt)`` runs after the monitor is installed,
    before the first step. Returns the recorded exp_avg and update tables and, per (step, parameter),
    the state after the step with its group's betas and eps."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    cfg = {"mv_distribution": True, "ur_distribution": True, "ops": ALL_OPS}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=1, optimizer=opt)
    between(model, opt)
    pnames = squash_all([n for n, _ in model.named_parameters()])
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    seen = {}
    for step in range(2):
        loss_of(model, step).backward()
        opt.step()
        for n, p in model.named_parameters():
            st, g = opt.state[p], group_of[id(p)]
            seen[(step, pnames[n])] = (st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"]),
                                       g["betas"], g["eps"])
        opt.zero_grad()
    mon.close()
    events = events_of(out)
    return stats_table(events, "exp_avg"), stats_table(events, "update"), seen


def _check_mv(ea, upd, seen):
    assert len(ea) == len(seen) and len(upd) == len(seen)
    for (step, name), (m, v, t, (b1, b2), eps) in seen.items():
        assert_close(ea[(step, name, "", 0)], ref_stats(m), what=f"exp_avg {name} step {step}")
        m_hat, v_hat = m.double() / (1 - b1**t), v.double() / (1 - b2**t)
        assert_close(upd[(step, name, "", 0)], ref_stats(m_hat / (v_hat.sqrt() + eps)), rtol=1e-3,
                     what=f"update {name} step {step}")


def test_state_loaded_after_install_is_recorded(tmp_path, monkeypatch):
    """A resume that loads the optimizer's checkpoint after monitor_gnorm_with_ad (DeepSpeed, Megatron
    and HF load it late): load_state_dict gives the optimizer a new state dict and new param groups
    (here with other betas); exp_avg and update are read from those, not from the dicts of install time."""
    model0, opt0 = make()
    loss_of(model0, 99).backward()
    opt0.step()
    opt0.param_groups[0]["betas"] = (0.5, 0.9)
    ckpt = opt0.state_dict()
    ea, upd, seen = _mv_run(tmp_path, monkeypatch, lambda model, opt: opt.load_state_dict(ckpt))
    assert {(t, betas) for _, _, t, betas, _ in seen.values()} == {(2.0, (0.5, 0.9)), (3.0, (0.5, 0.9))}
    _check_mv(ea, upd, seen)


def test_param_group_added_after_install_is_recorded(tmp_path, monkeypatch):
    """Parameters of a group added after install (add_param_group, e.g. unfreezing a layer) get their
    Adam state and their own group's betas."""
    def add_group(model, opt):
        head = list(model.head.parameters())
        opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if all(p is not h for h in head)]
        opt.add_param_group({"params": head, "betas": (0.5, 0.9)})

    ea, upd, seen = _mv_run(tmp_path, monkeypatch, add_group)
    assert seen[(1, "head.weight")][3] == (0.5, 0.9)
    _check_mv(ea, upd, seen)


class _Holder:
    """A mixed-precision wrapper's shape (Megatron's, DeepSpeed's): not a torch optimizer, steps the one
    in ``.optimizer``; ``overflow`` as DeepSpeed's fp16 optimizers keep it."""

    def __init__(self, opt, overflow=False):
        self.optimizer = opt
        self.overflow = overflow


class _Slotted:
    __slots__ = ("optimizer", "overflow")

    def __init__(self, opt):
        self.optimizer = opt
        self.overflow = False


class _NotInitialised(torch.optim.Optimizer):
    """accelerate's AcceleratedOptimizer's shape: an Optimizer subclass that never runs its __init__."""

    def __init__(self, inner):  # noqa: D107 - no super().__init__, as accelerate's
        self.optimizer = inner


def test_the_torch_optimizer_is_found_through_any_wrappers_and_its_holder_is_the_innermost_wrapper():
    """accelerate's wrapper around DeepSpeed's optimizer around the torch optimizer: the torch
    optimizer is the one hooked (the accelerate wrapper has no hooks of its own), DeepSpeed's the one
    whose masters and flag are read; a plain or a ZeroRedundancy-style optimizer is its own."""
    _, opt = make()
    ds = _Holder(opt)
    outer = _NotInitialised(ds)
    assert optim.torch_optimizer_of(outer) is opt and optim.torch_optimizer_of(ds) is opt
    assert optim.holder_of(outer, opt) is ds and optim.holder_of(ds, opt) is ds and optim.holder_of(opt, opt) is opt
    assert optim.torch_optimizer_of(_NotInitialised(None)) is not None  # nothing inside: itself
    assert optim.torch_optimizer_of(object()) is None
    from trainrec.recorder import zero

    assert zero.overflow_source(opt, (optim.holder_of(outer, opt),)) is ds
    assert zero.overflow_source(opt, (opt, None)) is None
    assert zero.overflow_source(opt, (_Holder(opt, overflow=torch.tensor(True)),)) is None  # a flag is a bool


def test_a_wrapper_that_allows_no_weak_reference_is_held_as_it_is(tmp_path, monkeypatch):
    """A DeepSpeed-like wrapper whose class has __slots__ (no weak references): binding it works, and a
    training step ends at the torch optimizer's step as usual."""
    model, opt = make()
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}),
                     params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=_Slotted(opt))
    for step in range(2):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    from trainrec.schema.events import StepEnded

    ends = [e for e in events_of(tmp_path / "out") if isinstance(e, StepEnded)]
    assert [(e.step, e.optimizer_skipped) for e in ends] == [(0, False), (1, False)]


def test_a_complex_parameter_under_adam_keeps_the_steps_rows(tmp_path, out):
    """A complex parameter (torch's Adam updates its real view): update/ratio took sqrt and clamp of the
    complex state and mg_direction its sign, which torch does not do for complex numbers. The failure
    in the optimizer step hook lost every row of every step (gradients and parameters too). Now the
    update is that of the real view, as Adam computes it, and the sign agreement is its parts'."""
    from trainrec.schema.events import HookFailed

    torch.manual_seed(0)
    model = ComplexFilter()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True, "ur_distribution": True,
           "mg_direction": True, "ops": ALL_OPS}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for _ in range(2):
        model(torch.randn(3, 4)).backward()
        opt.step()
        opt.zero_grad()
    st = opt.state[model.c]
    m, v = torch.view_as_real(st["exp_avg"]), torch.view_as_real(st["exp_avg_sq"])
    t, (b1, b2), eps = float(st["step"]), opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]
    want = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)  # the update AdamW applied at step 1
    mon.close()
    ev = events_of(out)
    assert not [e for e in ev if isinstance(e, HookFailed)]
    for kind in ("grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio"):
        assert {(k[0], k[1]) for k in stats_table(ev, kind)} >= {(1, "c"), (1, "lin.weight")}, kind
    assert_close(stats_table(ev, "update")[(1, "c", "", 0)], ref_stats(want), what="update of c")
    assert (1, "c", "", 0) in stats_table(ev, "mg_direction")


def test_a_list_of_optimizers_is_one_training_step_in_any_order(tmp_path, out):
    """Two optimizers over parts of one model (Muon's way: one for the matrices, AdamW for the rest),
    given as a list and stepped in another order than listed: one training step each time; every
    parameter's reduced gradient and value as they were before the first of them stepped; the Adam
    state of the AdamW part after its step."""
    model, _ = make()
    names = dict(model.named_parameters())
    short = squash_all(list(names))
    embed = [p for n, p in names.items() if n.startswith("embed")]
    rest = [p for n, p in names.items() if not n.startswith("embed")]
    sgd, adamw = torch.optim.SGD(embed, lr=0.1), torch.optim.AdamW(rest, lr=1e-2)
    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True, "ops": ALL_OPS}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=[adamw, sgd])
    want: dict = {}
    for step in range(3):
        loss_of(model, step).backward()
        want[step] = {short[n]: (ref_stats(p.grad), ref_stats(p)) for n, p in names.items()}
        sgd.step()  # the list's second first
        adamw.step()
        for n, p in names.items():
            if any(p is q for q in rest):
                want[step][short[n]] += (ref_stats(adamw.state[p]["exp_avg"]),)
        sgd.zero_grad()
        adamw.zero_grad()
    mon.close()
    from trainrec.schema.events import StepEnded

    ev = events_of(out)
    assert [(e.step, e.optimizer_skipped) for e in ev if isinstance(e, StepEnded)] == [(s, False) for s in range(3)]
    red, par, ea = stats_table(ev, "grad_reduced"), stats_table(ev, "param"), stats_table(ev, "exp_avg")
    for step, rows in want.items():
        assert {k[1] for k in ea if k[0] == step} == {n for n, r in rows.items() if len(r) == 3}
        for name, r in rows.items():
            assert_close(red[(step, name, "", 0)], r[0], what=f"step {step} reduced {name}")
            assert_close(par[(step, name, "", 0)], r[1], what=f"step {step} param {name}")
            if len(r) == 3:
                assert_close(ea[(step, name, "", 0)], r[2], what=f"step {step} exp_avg {name}")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("listed", [False, True])
def test_optimizers_without_adam_state_are_named_once(tmp_path, out, caplog, momentum, listed):
    """mv_distribution with SGD (state only with momentum, and never Adam's) beside AdamW in a list, or
    alone: one warning names SGD, not AdamW, whose rows are recorded. The list gave none (AdamW's
    state was found, so the parameters without any went unsaid), nor SGD alone without momentum (it
    keeps no state at all, taken for an optimizer that had not stepped yet)."""
    model, _ = make()
    names = dict(model.named_parameters())
    embed = [p for n, p in names.items() if n.startswith("embed")]
    rest = [p for n, p in names.items() if not n.startswith("embed")]
    sgd = torch.optim.SGD(embed if listed else model.parameters(), lr=0.1, momentum=momentum)
    opts = [sgd, torch.optim.AdamW(rest, lr=1e-2)] if listed else [sgd]
    cfg = {"mv_distribution": True, "ops": ["norm"]}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opts if listed else sgd)
    with caplog.at_level("WARNING", logger="trainrec"):
        for step in range(3):
            loss_of(model, step).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    mon.close()
    said = [r.getMessage() for r in caplog.records if "no Adam state" in r.getMessage()]
    assert len(said) == 1 and "SGD" in said[0] and "AdamW" not in said[0]
    recorded = {k[1] for k in stats_table(events_of(out), "exp_avg")}
    short = squash_all(list(names))
    assert recorded == ({short[n] for n in names if not n.startswith("embed")} if listed else set())


def test_mg_direction_records_nothing_for_a_listed_optimizer_outside_adams_family(tmp_path, out):
    """[SGD, AdamW]: the SGD part's parameters got the first step's 1.0 (no momentum of Adam's found)
    at every step, a constant that looked like a measurement, as a lone SGD did before; now nothing,
    as the warning says, while the AdamW part's are recorded from its first step on."""
    model, _ = make()
    names = dict(model.named_parameters())
    short = squash_all(list(names))
    embed = [p for n, p in names.items() if n.startswith("embed")]
    rest = [p for n, p in names.items() if not n.startswith("embed")]
    opts = [torch.optim.SGD(embed, lr=0.1, momentum=0.9), torch.optim.AdamW(rest, lr=1e-2)]
    mon = TrainerMon(write_config(tmp_path, {"mg_direction": True, "ops": ["mean"]}), params_have_main_grad=False,
                     live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opts)
    for step in range(3):
        loss_of(model, step).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    mon.close()
    got = stats_table(events_of(out), "mg_direction")
    want = {short[n] for n in names if not n.startswith("embed")}
    assert {(k[0], k[1]) for k in got} == {(step, n) for step in range(3) for n in want}


def test_an_optimizer_over_another_model_is_said(tmp_path, out, caplog):
    """An optimizer made for another model (a copy made before it) steps none of the monitored model's
    parameters: a warning naming it says so at install (it was silent, the model's weights never
    changing); the right optimizer, and a list holding it, raise none."""
    import copy

    model, opt = make()
    other = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-2)
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]})
    said = {}
    with caplog.at_level("WARNING", logger="trainrec"):
        for case, given in (("other", other), ("own", opt), ("list", [opt])):
            caplog.clear()
            mon = TrainerMon(cfg, params_have_main_grad=False, live_export=False)
            mon.monitor_gnorm_with_ad(model, optimizer=given)
            mon.close()
            said[case] = [r.getMessage() for r in caplog.records if "steps none of the monitored" in r.getMessage()]
    assert len(said["other"]) == 1 and "(AdamW)" in said["other"][0]
    assert said["own"] == said["list"] == []


def test_update_and_ratio_of_state_on_two_devices_in_separate_chunks(monkeypatch):
    """A model split over two devices whose state spans more than one chunk: the chunks' rows, each on
    its first tensor's device, go together on one device (torch.cat of rows on two devices raised, and
    the step lost its update and ratio rows). The meta device stands in for the second accelerator."""
    from trainrec.recorder import step_stats

    monkeypatch.setattr(step_stats, "ASYNC_COPY_DEVICES", frozenset({"cuda", "meta"}))
    group = {"betas": (0.9, 0.999), "eps": 1e-8}
    entries = [(0, torch.ones(4), torch.ones(4), 3.0, group),
               (1, torch.ones(4, device="meta"), torch.ones(4, device="meta"), 3.0, group)]

    def compute(xs, scales):
        return torch.zeros(len(xs), 3, device=xs[0].device)

    upd, ratio = update_and_ratio(entries, compute, True, True, chunk_numel=4)
    assert upd.shape == ratio.shape == (2, 3)
    assert upd.device == ratio.device == torch.device("meta")
