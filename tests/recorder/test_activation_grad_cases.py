"""Activation and weight gradients in autograd's hard cases: autocast, checkpointing, views modified in place, parameters passed as inputs, routed micro-steps."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn as nn
from trainmon_util import ALL_OPS, events_of, loss_of, make, stats_table, write_config
from trainrec.recorder import TrainerMon
from trainrec.recorder.monitor import PRINT_STRUCT_EXIT
from trainrec.schema.events import HooksFired


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
    mon.session.binding.opt.step()
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
