"""Hooks get the monitor's HookContext, not the monitor: the model's hooks hold the context, and hooks
on tensors (out of the garbage collector's sight) hold it only weakly."""

from __future__ import annotations

import functools
import types
import weakref

import torch
from trainmon_util import batch, make, write_config
from trainrec.recorder import TrainerMon
from trainrec.recorder.hook_context import HookContext


def _held(fn, depth: int = 0, seen: set | None = None) -> list:
    """What a hook function holds: its closure's values, a partial's arguments, a wrapped function's,
    a bound method's object (and, for one of the recorder's own objects, its attributes), recursively."""
    seen = set() if seen is None else seen
    if id(fn) in seen or depth > 4:
        return []
    seen.add(id(fn))
    out: list = []
    if isinstance(fn, functools.partial):
        inner = [fn.func, *fn.args, *fn.keywords.values()]
    elif isinstance(fn, types.MethodType):
        obj = fn.__self__
        inner = [fn.__func__, obj]
        if type(obj).__module__.startswith("trainrec.recorder") and hasattr(obj, "__dict__"):
            inner += list(vars(obj).values())
    elif isinstance(fn, types.FunctionType):
        inner = [c.cell_contents for c in (fn.__closure__ or ()) if c.cell_contents is not None]
        inner += [fn.__wrapped__] if hasattr(fn, "__wrapped__") else []
    else:
        return [fn]
    for v in inner:
        out.append(v)
        if callable(v) and not isinstance(v, (type, TrainerMon, HookContext, weakref.ref)):
            out += _held(v, depth + 1, seen)
    return out


def _module_hooks(model: torch.nn.Module) -> list:
    return [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()]


def _tensor_hooks(tensors) -> list:
    hooks = []
    for t in tensors:
        for d in (t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)):
            hooks += list((d or {}).values())
    return hooks


def test_the_models_hooks_hold_the_hook_context_and_tensor_hooks_hold_it_weakly(tmp_path):
    cfg = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "api_xy": True, "format": "api"}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False,
                     output_dir=str(tmp_path / "out"))
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    mon.session.step_hooks.python_hooks_from_now("the test looks at the Python weight-gradient hooks")
    x, _ = batch(0)
    out = model(x)  # a collected step: the step's hooks attached, gradient hooks on its tensors made
    st = mon.session.context.state
    assert st is not None and st.grad_hooks

    module_held = [v for h in _module_hooks(model) for v in _held(h)]
    assert not any(isinstance(v, TrainerMon) for v in module_held)
    assert any(v is mon.session.hooks for v in module_held)  # (the chunk hooks, the module hooks, the API level's)

    activations = [t for ref, *_ in st.grad_hooks.values() if (t := ref()) is not None]
    tensor_hooks = _tensor_hooks([out, *activations, *model.parameters()])
    assert len(tensor_hooks) > len(list(model.parameters()))
    tensor_held = [v for h in tensor_hooks for v in _held(h)]
    assert not any(isinstance(v, (TrainerMon, HookContext)) for v in tensor_held)
    assert any(v is mon.session.hooks.ref for v in tensor_held)
    out.sum().backward()
    opt.step()
    mon.close()


def test_the_hook_context_lives_as_long_as_its_monitor(tmp_path):
    """The context's weak reference is what tensor hooks hold: alive with the monitor, None after it."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "format": "api"}), params_have_main_grad=False,
                     live_export=False, output_dir=str(tmp_path / "out"))
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    ref = mon.session.hooks.ref
    assert ref() is mon.session.hooks and ref().recording is mon.session.context and ref().grad_acc == 1
    mon.close()
    del mon, model, opt
    import gc

    gc.collect()
    assert ref() is None
