"""The API level (``api_xy``): torch functions and tensor methods called inside the model's forward,
msprobe's ``mix`` level, recorded through ``torch.overrides.TorchFunctionMode``.

On a collected step the model chunk's forward pre-hook pushes :class:`ApiMode` and its forward hook
(``always_call``) pops it, so only the training forward is seen. Each call is named as the
reference names it (``Functional.linear.0.forward``), placed under its enclosing monitored module,
and measured on the xy path (:func:`.hooks.rows_for`); one
:class:`~trainrec.schema.events.ApiCallsRecorded` per forward pass goes to the log (:mod:`.api_record`),
and the gradients through the calls in backward (:mod:`.api_backward`). Nested calls, the recorder's
own calls, attribute reads, private and metadata methods (:data:`SKIPPED`) and calls without tensors
are not recorded: the rule is in docs/graphs.md, "The API level"."""

from __future__ import annotations

import linecache
import logging
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import api_backward
from .api_record import NO_MODULE, ApiPass, write_pass
from .compile_mode import in_backward
from .selectors import inputs_of, select
from .step_state import rows_for, stack_rows

log = logging.getLogger(__name__)

# methods and functions that give metadata, Python values or hooks, not computed tensors
SKIPPED = frozenset({
    "dim", "size", "numel", "nelement", "ndimension", "stride", "storage_offset", "data_ptr", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "is_inference", "element_size", "get_device", "is_pinned",
    "is_shared", "is_set_to", "has_names", "untyped_storage", "storage", "item", "tolist", "numpy",
    "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "requires_grad_", "backward",
    "__get__", "__set__", "__delete__", "__len__", "__repr__", "__str__", "__format__", "__hash__", "__bool__",
    "__index__", "__int__", "__float__", "__complex__", "__iter__", "__reduce_ex__", "__setstate__",
    "__deepcopy__", "__array__", "__dlpack__", "__dlpack_device__", "__contains__", "__torch_function__",
})
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"})
_FUNCTIONAL = {id(v): k for k, v in vars(F).items() if callable(v) and not isinstance(v, type)}
_RECORDER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_names: dict = {}  # func -> reference name without counter, or None (skipped)
_UNKNOWN = object()


def api_name(func) -> str | None:
    """The reference's name of ``func`` without counter (``Functional.linear``), None where skipped."""
    try:
        out = _names.get(func, _UNKNOWN)
    except TypeError:  # (an unhashable callable)
        out = _UNKNOWN
    if out is not _UNKNOWN:
        return out
    name = getattr(func, "__name__", None)
    out = None
    if isinstance(name, str) and name not in SKIPPED and not (name.startswith("_") and not name.endswith("__")):
        qual = getattr(func, "__qualname__", "") or ""
        if _FUNCTIONAL.get(id(func)) == name and getattr(F, name, None) is func:
            out = f"Functional.{name}"
        elif qual.startswith(("TensorBase.", "Tensor.", "_TensorBase.")):
            out = f"Tensor.{name}"
        elif (getattr(func, "__module__", None) or "").startswith("torch.nn.functional"):
            out = f"Functional.{name}"
        else:
            out = f"Torch.{name}"
    try:  # (a property's getter is a new object at each read, equal to the last one: one entry each)
        _names[func] = out
    except TypeError:
        pass
    return out


def _from_recorder() -> bool:
    """Whether the call being handled was made by the recorder's own code: its first caller outside torch."""
    f = sys._getframe(2)  # (0: this, 1: the handler)
    while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
        f = f.f_back
    return f is not None and f.f_code.co_filename.startswith(_RECORDER_DIR)


def _stack(intern, frames: dict) -> list[int]:
    """The call stack of the call being handled, innermost first, as interned lines the reference's
    way (``File {path}, line {n}, in {function}, \\n {code}``), the recorder's and torch.overrides'
    frames left out. ``frames``: (code, line) -> id, the lines made so far."""
    out = []
    f = sys._getframe(1)
    while f is not None:
        key = (f.f_code, f.f_lineno)
        i = frames.get(key)
        if i is None:
            path = f.f_code.co_filename
            if path.startswith(_RECORDER_DIR) or path.endswith(os.sep + "overrides.py"):
                i = frames[key] = -1
            else:
                line = linecache.getline(path, f.f_lineno).strip()
                i = frames[key] = intern(f"File {path}, line {f.f_lineno}, in {f.f_code.co_name}, \n {line}")
        if i >= 0:
            out.append(i)
        f = f.f_back
    return out


class ApiLevel:
    """The API level of one monitor: its hooks, the mode, and the calls of the pass in progress.
    ``ctx``: the monitor's :class:`~.hook_context.HookContext`."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        cfg = ctx.recording.config
        self.stack_wanted = bool(cfg.api_xy.get("stack"))
        # the gradients through the calls (api_backward.py), where xy records backward too
        self.backward_wanted = bool(cfg.api_xy.get("backward", True)) and not cfg.forward_only
        self.mode = ApiMode(self)
        self.pass_: ApiPass | None = None
        self.modules: list[int] = []  # name ids of the monitored modules whose forward is open
        self.counts: dict[str, int] = {}  # calls per name in the step (self.counted's)
        self.counted = None  # the StepState they count
        self.pushed_by: object | None = None  # the chunk whose forward pushed the mode
        self.frames: dict = {}  # (code, line) -> interned stack line (-1: left out)

    def attach(self, chunks: list, modules: list) -> list:
        """Hooks for a collected step: on each model chunk (the mode) and each monitored module (the stack
        of open calls), ``modules`` as ``[(module, ModuleTarget)]``. Returns their handles."""
        handles = []
        for vpp, chunk in enumerate(chunks):
            # (after the monitor's own chunk pre-hook, which counts the micro step and may begin the step)
            handles.append(chunk.register_forward_pre_hook(self._chunk_pre(vpp)))
        for module, t in modules:
            handles.append(module.register_forward_pre_hook(self._module_pre(t.name_id)))
            handles.append(module.register_forward_hook(self._module_post(t), with_kwargs=True, always_call=True))
        for chunk in chunks:  # (after the modules' hooks: a chunk that is a monitored module closes its call first)
            handles.append(chunk.register_forward_hook(self._chunk_post, always_call=True))
        return handles

    def _chunk_pre(self, vpp: int):
        def hook(module, args):
            ctx = self.ctx
            rec = ctx.recording
            st = rec.state
            if (self.pass_ is not None or st is None or ctx.output.writer is None or ctx.monitored.compiled
                    or not module.training or not torch.is_grad_enabled() or in_backward() or not rec.config.api_level):
                return
            fwd = st.chunk_fwd.get(vpp, 1)
            self.pass_ = ApiPass(st, (fwd - 1) % ctx.grad_acc, vpp)
            if self.counted is not st:
                self.counted, self.counts = st, {}
            self.modules.clear()
            self.pushed_by = module
            self.mode.__enter__()

        return hook

    def _chunk_post(self, module, args, output):
        if self.pushed_by is not module:
            return
        self.pushed_by = None
        p, self.pass_ = self.pass_, None
        self.mode.__exit__(None, None, None)
        self.modules.clear()
        if p is not None and (len(p.names) or len(p.mod_calls)):
            try:
                write_pass(self.ctx, p)
            except Exception as exc:  # noqa: BLE001 - monitoring never kills training
                self.ctx.hook_failed("the API level's records", exc)

    def _module_pre(self, name_id: int):
        def hook(module, args):
            if self.pass_ is not None:
                self.modules.append(name_id)

        return hook

    def _module_post(self, t):
        """The module's forward hook: its call closed, with the dtypes and shapes of the tensors
        module-level xy selects (the default selection, or the targets' selectors)."""
        sel_in, sel_out = t.sel.get("input"), t.sel.get("output")

        def hook(module, args, *kwargs_output):  # (registered with_kwargs; see selectors._KWARGS_GONE)
            p = self.pass_
            if p is None:
                return
            if self.modules:
                self.modules.pop()
            kwargs, output = kwargs_output if len(kwargs_output) == 2 else (None, kwargs_output[0])
            try:
                x = select(inputs_of(args, kwargs, sel_in), sel_in, f"targets.{t.key}.input")
                y = select(output, sel_out, f"targets.{t.key}.output")
                p.add_module_call(self.ctx.name_table.intern, t.name_id, p.st.call, (x, y))
            except Exception as exc:  # noqa: BLE001 - (a selector that does not fit: the xy hook says so)
                log.debug("trainrec: no shapes of module %r's call: %s", t.name, exc)

        return hook

    # ------------------------------------------------------------------ one call
    def record(self, name: str, func, args: tuple, kwargs: dict):
        """Run ``func`` and record the call (the mode's handler, with the mode popped). Whatever fails
        in the recording is a HookFailed, and the call's result is returned as it is."""
        p = self.pass_
        before = None
        try:
            fname = getattr(func, "__name__", "")
            inplace = ((fname.endswith("_") and not fname.endswith("__")) or fname in _INPLACE_DUNDERS
                       or kwargs.get("out") is not None)
            positional, keywords = _flatten("input", enumerate(args)), _flatten("input", kwargs.items())
            if inplace and positional + keywords:  # in place: the inputs as they were
                before = self._rows(p, positional + keywords)
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            self.ctx.hook_failed(f"API call {name}", exc)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            self._add(p, name, positional, keywords, out, before)
        except Exception as exc:  # noqa: BLE001
            self.ctx.hook_failed(f"API call {name}", exc)
        return out

    def _add(self, p: ApiPass, name: str, positional: list, keywords: list, out, before: list | None) -> None:
        """The call's record in the pass, and the watch on its gradients (:mod:`.api_backward`)."""
        ins = positional + keywords
        outs = _flatten("output", enumerate(out) if isinstance(out, (tuple, list)) else ((0, out),))
        if not any(isinstance(v, torch.Tensor) for _, v in ins + outs):
            return
        rows = before + self._rows(p, outs) if before is not None else self._rows(p, ins + outs)
        # the reference's order: positional inputs, outputs, keyword inputs
        n_pos = len(positional)
        block = stack_rows(rows[:n_pos] + rows[len(ins):] + rows[n_pos:len(ins)])
        intern = self.ctx.name_table.intern
        stack = _stack(intern, self.frames) if self.stack_wanted else None
        n = self.counts.get(name, 0)
        module = self.modules[-1] if self.modules else NO_MODULE
        p.add(intern, f"{name}.{n}.forward", module, p.st.call, positional + outs + keywords, block, stack)
        self.counts[name] = n + 1
        if self.backward_wanted:
            first = api_backward.first_tensor(outs)
            if first is not None and first.requires_grad:
                api_backward.watch(self.ctx, p.st, first, api_backward.BackwardCall(
                    f"{name}.{n}.backward", module, p.micro, p.vpp))

    def _rows(self, p: ApiPass, items: list) -> list:
        """One row per ``(port, value)``: the statistics of a tensor, a number's value, else NaN."""
        ops = p.st.stats.ops
        out: list = [None] * len(items)
        tensors = [k for k, (_, v) in enumerate(items) if isinstance(v, torch.Tensor)]
        if tensors:
            rows = rows_for(self.ctx.recording, p.st, tuple(items[k][1] for k in tensors))
            for j, k in enumerate(tensors):
                out[k] = rows[j]
        eps = self.ctx.recording.config.eps
        for k, (_, v) in enumerate(items):
            if out[k] is None:
                out[k] = _number_row(v, ops, eps)
        return out


class ApiMode(TorchFunctionMode):
    """Hands each call made inside the model's forward to :meth:`ApiLevel.record` (see the module
    docstring for which are recorded)."""

    def __init__(self, level: ApiLevel) -> None:
        super().__init__()
        self.level = level

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = api_name(func)
        if name is None or self.level.pass_ is None or _from_recorder():
            return func(*args, **kwargs)
        return self.level.record(name, func, args, kwargs)


def _flatten(role: str, items) -> list:
    """``(port name, value)`` of ``(key, value)`` items worth a port: tensors, numbers and other plain
    values at the top level and one list or tuple deep (``input.0``, ``input.0.1``, ``input.inplace``);
    None left out."""
    out = []
    for key, v in items:
        if isinstance(v, (list, tuple)):
            out += [(f"{role}.{key}.{j}", w) for j, w in enumerate(v) if _plain(w)]
        elif _plain(v):
            out.append((f"{role}.{key}", v))
    return out


def _plain(v) -> bool:
    return v is not None and (isinstance(v, (torch.Tensor, bool, int, float, str, torch.dtype, torch.device,
                                             torch.memory_format, slice)) or v is Ellipsis)


def _number_row(v, ops: tuple, eps: float) -> np.ndarray:
    """The row of a number (its value as min, max, mean; its size as norm), NaN for other values."""
    if isinstance(v, (bool, int, float)):
        x = float(v)
        cols = {"min": x, "max": x, "mean": x, "norm": abs(x), "zeros": float(abs(x) < eps),
                "nans": float(math.isnan(x))}
        return np.asarray([cols[op] for op in ops], dtype=np.float32)
    return np.full(len(ops), np.nan, dtype=np.float32)


__all__ = ["SKIPPED", "ApiLevel", "ApiMode", "api_name"]
