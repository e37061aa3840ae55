"""The API level's backward (``api_xy``'s ``backward``): the gradients through each recorded API call,
the reference's ``Functional.linear.0.backward``.

As the reference (mindstudio-probe 1.2.1): one post-hook, made at the forward, on the autograd node
that made a call's first output tensor; ``input.i`` is the gradient the node takes in for its i-th
output, ``output.i`` the one it hands to its i-th input (none where not computed). The passes go to
the log with the step's records (:func:`write_backward`). Behaviour and limits: docs/graphs.md,
"The API level"."""

from __future__ import annotations

import functools

import torch
from trainrec.schema.events import DIR_BACKWARD

from .api_record import ApiPass, write_pass
from .step_state import rows_for


class BackwardCall:
    """One recorded call whose gradients are awaited: its backward name, module, micro step, stage."""

    __slots__ = ("name", "module", "micro", "vpp", "fired")

    def __init__(self, name: str, module: int, micro: int, vpp: int) -> None:
        self.name, self.module, self.micro, self.vpp = name, module, micro, vpp
        self.fired = False


def first_tensor(outs: list) -> torch.Tensor | None:
    """The tensor whose autograd node the reference hooks: the first among a call's outputs."""
    return next((v for _, v in outs if isinstance(v, torch.Tensor)), None)


def watch(ctx, st, out: torch.Tensor, call: BackwardCall) -> bool:
    """Have the gradients through the node that made ``out`` recorded for ``call`` (``ctx``: the
    monitor's :class:`~.hook_context.HookContext`, held weakly); False where ``out`` was made by no
    node (it needs no gradient, or it is a leaf)."""
    node = out.grad_fn
    if node is None:
        return False
    # (the hook lives as long as the autograd graph, which frees it: no handle to keep)
    node.register_hook(functools.partial(_grad_cb, ctx.ref, st, call))
    return True


def _grad_cb(ctx_ref, st, call: BackwardCall, grad_inputs, grad_outputs):
    if call.fired:
        return None
    call.fired = True
    ctx = ctx_ref()  # weak: a graph kept alive must not keep the monitor
    if ctx is None or ctx.recording.state is not st or st.written:
        return None  # the step ended (or monitoring stopped) before this gradient
    try:
        ports = [(f"input.{i}", g) for i, g in enumerate(grad_outputs) if isinstance(g, torch.Tensor)]
        ports += [(f"output.{i}", g) for i, g in enumerate(grad_inputs) if isinstance(g, torch.Tensor)]
        if not ports:
            return None
        block = rows_for(ctx.recording, st, tuple(g for _, g in ports))
        key = (call.micro, call.vpp)
        p = st.api_passes.get(key)
        if p is None:
            p = st.api_passes[key] = ApiPass(st, call.micro, call.vpp, DIR_BACKWARD)
        p.add(ctx.name_table.intern, call.name, call.module, st.call, ports, block, None)
    except Exception as exc:  # noqa: BLE001 - monitoring never kills training
        ctx.hook_failed(f"API call {call.name}", exc)
    return None


def write_backward(ctx, st) -> None:
    """The step's backward passes to the log, in the order their first gradients came (at the step's end)."""
    passes, st.api_passes = st.api_passes, {}
    for p in passes.values():
        write_pass(ctx, p)


__all__ = ["BackwardCall", "first_tensor", "watch", "write_backward"]
