"""The hooks on each model chunk, installed for the whole run: a training forward's start (a micro
step: counted, the gradient batch closed, the step tracker told) and end (lazy and FSDP2 parameters
hooked once made; a gradient hook on the chunk's output tells the backward pass its micro step). They
get the monitor's :class:`~.hook_context.HookContext`; the gradient hook holds it weakly."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .compile_mode import eager, in_backward, is_compiling
from .step_state import StepState

if TYPE_CHECKING:
    from .hook_context import HookContext


def make_chunk_pre_hook(ctx: HookContext, vpp: int):
    """Forward pre-hook on model chunk ``vpp``, installed for the whole run: a new micro step begins, so
    count it (module hooks take their micro step from this count), close the gradient batch, and on
    chunk 0 tell the step cycle (which notices optimizer steps that never ran)."""
    rec, monitored, step_hooks = ctx.recording, ctx.monitored, ctx.step_hooks

    def body(module, args):
        try:
            monitored.match_compiled()  # dynamo may be about to trace the modules inside: their hooks made for it
            if module.training and not in_backward():
                if vpp == 0:
                    ctx.on_micro_step()
                st = rec.state
                if st is not None:
                    # a training-mode forward under no_grad (a target computed with the model, a sample
                    # logged) is no micro step: its activations would take a micro step's place
                    st.nograd_fwd = not torch.is_grad_enabled()
                    st.chunk_open = True
                    if not st.nograd_fwd:
                        st.chunk_fwd[vpp] = st.chunk_fwd.get(vpp, 0) + 1
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            ctx.hook_failed("micro step start", exc)
        st = rec.state
        if st is not None and (st.pending or step_hooks.fired):
            try:
                ctx.grad_batch.settle(in_backward())
            except Exception as exc:  # noqa: BLE001
                ctx.hook_failed("gradient batch", exc)

    return _run_hook(ctx, body)


def _run_hook(ctx: HookContext, body):
    """``body`` as a hook installed on a model chunk for the whole run: plain where the model runs
    uncompiled (:func:`eager` costs time on every call), through :func:`eager` where it runs compiled
    or dynamo is tracing it."""
    monitored = ctx.monitored
    if monitored.compiled:
        return eager(body)
    body_eager = eager(body)

    def hook(module, *args):
        # the model was compiled after the monitor was installed and dynamo is tracing this hook: the
        # attribute is set (a side effect of the traced code) before the graph break at body_eager,
        # which then reattaches the step's hooks made for compilation before dynamo reaches them
        if is_compiling():
            monitored.compiled = True
            return body_eager(module, *args)
        return body(module, *args)

    return hook


def make_chunk_hook(ctx: HookContext, vpp: int):
    """Forward hook on model chunk ``vpp``, installed for the whole run: a gradient hook on the chunk's
    output tells the backward pass that reaches it which micro step's forward it belongs to, so weight
    gradients get that micro step (:attr:`StepState.bwd_micro`): right for a parameter used only in
    some micro steps (a routed expert, a branch), and for a pipeline stage that runs several forwards
    before their backward passes (1F1B). Where no backward reaches the output, each parameter's own
    count of its gradients is used."""
    rec, step_hooks, lazy_chunks = ctx.recording, ctx.step_hooks, ctx.lazy_chunks

    def body(module, args, output):
        st = rec.state
        if st is not None:
            # (not nograd_fwd: the chunk's own target hook, registered after this one, still asks it)
            st.chunk_open = False
            if step_hooks.fsdp2_waiting:
                step_hooks.hook_fsdp2()  # FSDP2 has made its unsharded parameters by the end of the first forward
            if step_hooks.lazy_waiting:
                ctx.monitored.hook_materialized()  # lazy modules (LazyLinear) make theirs at their first forward
        if lazy_chunks and vpp in lazy_chunks and module.training and torch.is_grad_enabled():
            try:
                ctx.materialized(vpp)  # its lazy modules (LazyLinear) have made their parameters
            except Exception as exc:  # noqa: BLE001 - monitoring never kills training
                ctx.hook_failed("lazy modules' parameters made", exc)
        if (st is None or not rec.config.wg_distribution or not module.training or not torch.is_grad_enabled()
                or in_backward()):
            return
        try:
            y = _first_grad_tensor(output)
            if y is not None:
                micro = (st.chunk_fwd.get(vpp, 1) - 1) % ctx.grad_acc
                y.register_hook(functools.partial(_on_chunk_output_grad, ctx.ref, st, vpp, micro))
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            ctx.hook_failed("model chunk output hook", exc)

    return _run_hook(ctx, body)


def _first_grad_tensor(value: Any, depth: int = 0) -> torch.Tensor | None:
    """The first non-leaf tensor that requires grad in a chunk's output (a tensor, a tuple or list, a
    dict or an HF ``ModelOutput``, nested a few levels)."""
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad and value.grad_fn is not None else None
    if depth > 3:
        return None
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    for v in items:
        t = _first_grad_tensor(v, depth + 1)
        if t is not None:
            return t
    return None


def _on_chunk_output_grad(ctx_ref, st: StepState, vpp: int, micro: int, grad):
    ctx = ctx_ref()
    if ctx is not None and ctx.recording.state is st:
        st.bwd_micro[vpp] = micro
        if ctx.step_hooks.list_handles and not st.eob_queued:  # the list hooks' firings are handled at its end
            st.eob_queued = True
            ctx.grad_batch.queue_flush_at_end_of_backward()
    return None
