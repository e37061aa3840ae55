"""The issue's rules for the training thread, checked on every aten op a collected step runs: with every
option on, the monitor adds no float64 tensor (no float64 copy of a tensor, only per-tensor scalars)
and no clone or copy of a gradient, activation, parameter or optimizer state, on each of the engine's
paths (the one-pass kernel, torch's CPU reductions, and the code accelerators take)."""

from __future__ import annotations

import collections
import functools
import os
import threading
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trainmon_util import ALL_OPS, make, train_batches, write_config
from trainrec.recorder import TrainerMon

EVERYTHING = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
              "mv_distribution": True, "ur_distribution": True, "mg_direction": True, "ops": ALL_OPS,
              "format": "api"}
_COPIES = ("aten.clone", "aten.copy_", "aten._to_copy", "aten.contiguous")


class OpSpy(TorchDispatchMode):
    """Counts float64 results with more than one element, and copies of tensors at least ``big`` long."""

    def __init__(self, big: int) -> None:
        super().__init__()
        self.big = big
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(o, torch.Tensor):
                continue
            if o.dtype is torch.float64 and o.numel() > 1:
                self.seen[("float64", name)] += 1
            if name.startswith(_COPIES) and o.numel() >= self.big:
                self.seen[("copy", name)] += 1
        return out


def _ops_of_training(tmp_path, monkeypatch, path: str | None) -> collections.Counter:
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model, opt = make()
    mon = None
    if path is not None:
        mon = TrainerMon(write_config(tmp_path, EVERYTHING), params_have_main_grad=False)
        mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
        mon.session.context.engine.fused = path == "fused"
        mon.session.context.engine.host_paths = path != "device"
    spy = OpSpy(big=min(p.numel() for p in model.parameters() if p.dim() > 1))
    with spy:
        train_batches(model, opt)
    if mon is not None:
        assert mon.generate_metrics("actv_grad") and mon.generate_metrics("update")  # it did record
        mon.close()
    return spy.seen


@pytest.mark.parametrize("path", ["fused", "torch", "device"])
def test_no_float64_copy_and_no_clone_in_a_collected_step(tmp_path, monkeypatch, path):
    base = _ops_of_training(tmp_path / "base", monkeypatch, None)
    seen = _ops_of_training(tmp_path / "mon", monkeypatch, path)
    added = {k: n - base.get(k, 0) for k, n in seen.items() if n > base.get(k, 0)}
    assert added == {}


@pytest.mark.parametrize("wg_only", [True, False])
def test_no_tensor_is_compared_with_none(tmp_path, monkeypatch, wg_only):
    """``None in grads`` compares each tensor with None through torch's ``__eq__`` (about 25 us per
    tensor, 1.3 ms for a model's 51 gradients): the hooks and the step's end test for None by identity.
    (A spy on ``Tensor.__eq__`` itself: a TorchFunctionMode does not reach the end-of-backward callback.)"""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model, opt = make()
    cfg = {"wg_distribution": True, "ops": ALL_OPS, "format": "api"} if wg_only else EVERYTHING
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    seen = []
    eq, ne = torch.Tensor.__eq__, torch.Tensor.__ne__

    def spy_eq(self, other):
        if other is None:
            seen.append("==")
        return eq(self, other)

    def spy_ne(self, other):
        if other is None:
            seen.append("!=")
        return ne(self, other)

    monkeypatch.setattr(torch.Tensor, "__eq__", spy_eq)
    monkeypatch.setattr(torch.Tensor, "__ne__", spy_ne)
    train_batches(model, opt)
    monkeypatch.undo()
    assert mon.generate_wgrad_metrics()  # it did record
    mon.close()
    assert seen == []


def _own_grads_both_ways(mon) -> tuple[tuple, tuple]:
    fast = mon.session.collection.ownership.own_grad_lists()
    general = list(mon.session.collection.ownership.own_grads())
    return ([i for i, _ in general], [id(g) for _, g in general]), (fast[0], [id(g) for g in fast[1]])


def test_own_gradients_without_a_loop_are_those_of_the_general_path(tmp_path, monkeypatch):
    """The optimizer step's gradient list, taken without a Python step per parameter where nothing is
    unusual, is the general path's in each case it must handle: all gradients, some missing, a
    tensor-parallel duplicate, data-parallel duplicates, a main_grad, a ZeRO-partitioned parameter."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model, opt = make()
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "format": "api"}), params_have_main_grad=True)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    general, fast = _own_grads_both_ways(mon)
    assert fast == general and len(general[0]) == len(params)

    params[1].grad = None  # a parameter that got no gradient
    general, fast = _own_grads_both_ways(mon)
    assert fast == general and 1 not in general[0]

    params[2].main_grad = torch.zeros_like(params[2])  # Megatron's main_grad is the one measured
    general, fast = _own_grads_both_ways(mon)
    assert fast == general and id(params[2].main_grad) in general[1]
    del params[2].main_grad

    mon.session.context.params[3].tp_duplicate = True  # another tensor-parallel rank's copy: not this rank's to report
    mon.session.collection.ownership.params_changed()
    general, fast = _own_grads_both_ways(mon)
    assert fast == general and 3 not in general[0]
    mon.session.context.params[3].tp_duplicate = False
    mon.session.collection.ownership.params_changed()

    params[0]._hp_mapping = None  # DeepSpeed ZeRO: the optimizer's copy of the gradient is reported
    general, fast = _own_grads_both_ways(mon)
    assert fast == general
    del params[0]._hp_mapping

    mon.session.collection.ownership.dp_duplicate = True  # a data-parallel rank after the first: nothing of its own to report
    general, fast = _own_grads_both_ways(mon)
    assert fast == general and general == ([], [])
    mon.close()


# Where the device path may read a value back: the reduced gradients' inf/NaN check before the run's
# first optimizer step (a sync once).
_ALLOWED_READS = {("steps.py", "_check_reduced_grads")}
_READS = ("tolist", "numpy", "item", "__bool__", "__float__", "__int__", "__index__", "cpu", "nonzero")


@pytest.mark.parametrize("fused_adam", [False, True])
def test_the_device_path_reads_no_value_back_on_the_training_thread(tmp_path, monkeypatch, fused_adam):
    """The promise of no per-tensor device sync and no ``.item()`` in hooks, on the code accelerators take
    (``host_paths = False``): with every option on, the training thread's collected steps call no method
    that copies a tensor's values to the host (a sync on an accelerator) from the recorder, but for the
    read it documents. Adam's step counters are not read either: fused and capturable Adam keep them on
    the device (``fused=True`` keeps them where the parameters are, which is the CPU here).
    Spies on the Tensor methods themselves (on CPU these read memory without a dispatched op)."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model, opt = make(opt_cls=functools.partial(torch.optim.AdamW, fused=True) if fused_adam else torch.optim.AdamW)
    cfg = {**EVERYTHING, "format": "csv"}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    mon.session.context.engine.fused = False
    mon.session.context.engine.host_paths = False
    seen = collections.Counter()
    main = threading.main_thread()

    def spy_of(name):
        real = getattr(torch.Tensor, name)

        def spy(self, *args, **kwargs):
            if threading.current_thread() is main:
                frames = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}recorder{os.sep}" in f.filename
                          and f"{os.sep}tests{os.sep}" not in f.filename]
                if frames:
                    seen[(os.path.basename(frames[-1].filename), frames[-1].name, name)] += 1
            return real(self, *args, **kwargs)

        return spy

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, spy_of(name))
    train_batches(model, opt, steps=3)
    monkeypatch.undo()
    mon.close()
    assert mon.session.cycle.collections == 3  # it did record
    assert {k: n for k, n in seen.items() if k[:2] not in _ALLOWED_READS} == {}
