"""Tensors and modules off the common path, recorded with their own values or named once: a tensor the
engine cannot reduce, complex gradients, keyword inputs and mapping outputs, negative and conjugate
views, modules whose default selection finds no tensor."""

from __future__ import annotations

import math

import pytest
import torch
from trainmon_util import (
    ALL_OPS,
    ComplexFilter,
    assert_close,
    events_of,
    ref_stats,
    stats_table,
    write_config,
)
from trainrec.recorder import TrainerMon


class NoMinMax(torch.Tensor):
    """A tensor type without min/max reductions, as some low-precision wrapper types are."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("aminmax", "amin", "amax", "min", "max"):
            raise NotImplementedError(f"{func.__name__} is not implemented for NoMinMax")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_the_engine_cannot_measure_costs_its_own_row_only(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.ones(4).as_subclass(NoMinMax))

        def forward(self, x):
            return self.lin(x) * self.scale.as_subclass(torch.Tensor)

    torch.manual_seed(0)
    model = Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(tmp_path, {"param_distribution": True, "ops": ["min", "max", "norm"]}),
                     params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    want = {n: ref_stats(p.as_subclass(torch.Tensor)) for n, p in model.named_parameters()}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    mon.close()
    ev = events_of(tmp_path / "out")
    rows = stats_table(ev, "param")
    for name in ("lin.weight", "lin.bias"):
        assert_close(rows[(0, name, "", 0)], want[name], rtol=1e-6, what=name)
    assert all(math.isnan(v) for v in rows[(0, "scale", "", 0)].values())
    failed = [e for e in ev if type(e).__name__ == "HookFailed"]
    assert failed and "'scale'" in failed[0].where and "NoMinMax" in failed[0].error
    # its NaN row is marked in the log as standing for no values (anomaly detection skips it)
    from trainrec.replay.names import NameResolver
    from trainrec.schema.events import TensorStatsRecorded

    resolver = NameResolver()
    marks = {}
    for e in ev:
        resolver.feed(e)
        if isinstance(e, TensorStatsRecorded) and e.kind == "param":
            marks.update(zip(resolver.names(e), e.column("placeholders"), strict=True))
    assert marks == {"lin.weight": 0, "lin.bias": 0, "scale": 1}


def test_a_complex_weight_gradient_is_recorded_at_every_step(tmp_path, out):
    """A complex parameter (an FFT filter's): its reduced gradient, checked for reuse against the
    unreduced row, was cast to float32 there, with a torch UserWarning inside the optimizer step hook;
    under warnings as errors that hook failed and the step's reduced rows, of every parameter, were lost."""
    from trainrec.schema.events import HookFailed

    torch.manual_seed(0)
    model = ComplexFilter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}), params_have_main_grad=False,
                     live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    want = []
    for _ in range(2):
        model(torch.randn(3, 4)).backward()
        want.append(torch.linalg.vector_norm(model.c.grad).item())
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    assert not [e for e in ev if isinstance(e, HookFailed)]
    red = stats_table(ev, "grad_reduced")
    assert sorted(red) == [(s, n, "", 0) for s in (0, 1) for n in ("c", "lin.bias", "lin.weight")]
    for s in (0, 1):
        assert red[(s, "c", "", 0)]["norm"] == pytest.approx(want[s], rel=1e-5)


class KwAttn(torch.nn.Module):
    """Called with keyword arguments only, as HF's decoder layers call their attention."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, hidden_states=None, attention_mask=None):
        return self.proj(hidden_states) * attention_mask


class DictOut(torch.nn.Module):
    """Returns a mapping (a plain dict, or HF's ``ModelOutput`` where ``output_type`` is one), as HF's
    models do; the first field set is the hidden state, an auxiliary one follows."""

    def __init__(self, output_type=dict) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.attn = KwAttn(8)
        self.output_type = output_type

    def forward(self, input_ids):
        h = self.embed(input_ids)
        mask = torch.ones_like(h)
        y = self.attn(hidden_states=h, attention_mask=mask)
        return self.output_type(last_hidden_state=y, aux=y.detach().sum())


def _model_output_type():
    from dataclasses import dataclass

    transformers = pytest.importorskip("transformers")

    @dataclass
    class Out(transformers.utils.ModelOutput):
        last_hidden_state: torch.Tensor | None = None
        unset: torch.Tensor | None = None
        aux: torch.Tensor | None = None

    return Out


@pytest.mark.parametrize("output_type", ["dict", "ModelOutput"])
def test_keyword_inputs_and_mapping_outputs_are_recorded_by_default(tmp_path, out, output_type):
    """all_xy on a module called with keyword arguments only (HF's attention: ``self_attn(hidden_states=
    ...)``) records its first keyword argument as its input, and on a module returning a dict or HF's
    ModelOutput the first field set as its output, with their gradients; both were NaN rows (input,
    output) or no rows at all (input_grad, output_grad), silently."""
    kind = dict if output_type == "dict" else _model_output_type()
    torch.manual_seed(0)
    model = DictOut(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"xy_distribution": True, "all_xy": True, "ops": ALL_OPS}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    seen = {}

    def keep(name, t):
        seen[name] = t.detach().clone()
        t.register_hook(lambda g: seen.__setitem__(name + "_grad", g.detach().clone()))

    model.attn.register_forward_pre_hook(lambda m, a, kw: keep("attn_in", kw["hidden_states"]), with_kwargs=True)
    model.attn.register_forward_hook(lambda m, a, o: keep("attn_out", o))
    for step in range(2):
        x = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(step))
        out_ = model(x)
        (out_["last_hidden_state"] ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    act, grad = stats_table(events_of(out), "actv"), stats_table(events_of(out), "actv_grad")
    assert_close(act[(1, "attn", "input", 0)], ref_stats(seen["attn_in"]), what="attn input")
    assert_close(act[(1, "attn", "output", 0)], ref_stats(seen["attn_out"]), what="attn output")
    assert_close(grad[(1, "attn", "input_grad", 0)], ref_stats(seen["attn_in_grad"]), what="attn input_grad")
    assert_close(grad[(1, "attn", "output_grad", 0)], ref_stats(seen["attn_out_grad"]), what="attn output_grad")
    # the model's own output: its first field set, the attention's output (the same tensor)
    assert_close(act[(1, "", "output", 0)], ref_stats(seen["attn_out"]), what="model output")
    assert_close(grad[(1, "", "output_grad", 0)], ref_stats(seen["attn_out_grad"]), what="model output_grad")


class NegGrad(torch.autograd.Function):
    """The identity, whose backward hands the gradient on as a negative view of itself negated (the same
    values, ``is_neg()``): a custom backward may give one, and AccumulateGrad keeps it as ``.grad``."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch._neg_view(-g)


class Imag(torch.nn.Module):
    def forward(self, z):
        return z.imag


class ConjImag(torch.nn.Module):
    def forward(self, z):
        return z.conj().imag


class NegViews(torch.nn.Module):
    """``imag`` returns ``z.imag``, ``conj_imag`` ``z.conj().imag``: the same memory, shape, strides and
    dtype, the second a negative view; and a weight whose gradient is a negative view."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 80) + 0.5)
        self.imag = Imag()
        self.conj_imag = ConjImag()

    def forward(self, x):
        w = NegGrad.apply(self.w)
        z = torch.complex(x @ w, x @ w + 1.0)  # 4096 elements or more: rows of such tensors are reused
        a = self.imag(z)  # alive while conj_imag runs (a row is reused only then)
        return (a * self.conj_imag(z)).sum()


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_negative_views_are_recorded_with_their_own_values(tmp_path, out, kernel):
    """A negative view (``z.conj().imag``, a gradient a custom backward gave as ``torch._neg_view``) was
    measured by the one-pass kernel as its memory holds it, negated (min, max and mean wrong); and the
    row of ``z.imag`` was reused for ``z.conj().imag``, which views the same memory with the same shape,
    strides and dtype."""
    torch.manual_seed(0)
    model = NegViews()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "ops": ALL_OPS}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    if kernel == "torch":
        mon.session.context.engine.fused = False
    seen = {}
    model.conj_imag.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o.detach().clone()))
    model(torch.randn(70, 64)).backward()
    assert model.w.grad.is_neg()
    seen["grad"] = model.w.grad.detach().clone()
    opt.step()
    opt.zero_grad()
    mon.close()
    ev = events_of(out)
    act = stats_table(ev, "actv")
    assert_close(act[(0, "conj_imag", "output", 0)], ref_stats(seen["out"]), what="conj_imag output")
    assert act[(0, "conj_imag", "output", 0)]["max"] == -act[(0, "imag", "output", 0)]["min"]
    for kind in ("grad_unreduced", "grad_reduced"):
        assert_close(stats_table(ev, kind)[(0, "w", "", 0)], ref_stats(seen["grad"]), what=kind)


class Logger(torch.nn.Module):
    """Returns nothing (it would log its input)."""

    def forward(self, h):
        return None


class Meta(torch.nn.Module):
    """Returns a dict whose first value set is no tensor."""

    def forward(self, h):
        return {"shape": list(h.shape), "h": h}


class Position(torch.nn.Module):
    """Called with no argument: returns its parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(8))

    def forward(self):
        return self.p * 1.0


class NoTensorNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.log = Logger()
        self.meta = Meta()
        self.pos = Position()

    def forward(self, x):
        h = self.lin(x)
        self.log(h)
        return (self.meta(h)["h"] + self.pos()).pow(2).sum()


@pytest.mark.parametrize("backward_only", [False, True])
def test_modules_where_the_default_selection_finds_no_tensor_are_named_once(tmp_path, out, caplog, backward_only):
    """all_xy on a module whose output is None, or a dict whose first value set is no tensor, or that is
    called without arguments: its rows there were NaN (or its gradient rows missing), silently. A warning
    names each such module once, with what it gave."""
    import logging

    torch.manual_seed(0)
    model = NoTensorNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"xy_distribution": True, "all_xy": True, "ops": ["norm"], "backward_only": backward_only}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="trainrec.recorder.hooks"):
        for _ in range(3):
            model(torch.randn(4, 8)).backward()
            opt.step()
            opt.zero_grad()
    mon.close()
    warned = [r.getMessage() for r in caplog.records if "finds no tensor" in r.getMessage()]
    named = sorted(m.split("'")[1] for m in warned)
    assert named == ["log", "meta", "pos"]  # once each; none for the modules where it finds one
    by = {m.split("'")[1]: m for m in warned}
    assert "its output: None" in by["log"]
    assert "its output: a dict whose first value set is list" in by["meta"]
    assert "its input: no argument" in by["pos"]
