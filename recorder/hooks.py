"""Hook closures installed on modules and parameters (the per-step state they fill: :mod:`.step_state`).

Every hook goes through a public torch API and the monitor keeps its handle: module forward
(pre-)hooks for activations, ``Tensor.register_hook`` on a call's selected tensors for activation
gradients, ``register_post_accumulate_grad_hook`` for weight gradients. Hooks observe and never
change tensors.

No full backward hooks: they make an in-place op on a module's input or output raise in the user's
forward. So ``input_grad`` is the gradient of the input *tensor* over all its uses (docs/config.md,
"What is recorded"). A tensor selected by several calls gets one gradient hook, measured once.

Hooks are attached on collected steps only, keep results on the device, and report an exception as
HookFailed instead of raising it. Under ``torch.compile`` they are wrapped by
:func:`.compile_mode.eager`. Tensor hooks hold the :class:`~.hook_context.HookContext` weakly."""

from __future__ import annotations

import functools
import logging
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch
from trainrec.schema.events import (
    DIR_BACKWARD,
    DIR_FORWARD,
    KIND_ACTV,
    KIND_ACTV_GRAD,
    SLOT_INPUT,
    SLOT_INPUT_GRAD,
    SLOT_OUTPUT,
    SLOT_OUTPUT_GRAD,
)

from .compile_mode import eager, in_backward
from .fused import _PLAIN, local_tensor
from .selectors import SLOTS, found_text, inputs_of, select
from .step_state import StepState, rows_for
from .step_stats import StatsPart, placeholders

if TYPE_CHECKING:
    from .hook_context import HookContext

log = logging.getLogger(__name__)


class ModuleTarget:
    """One monitored module: its name id, vpp stage and selectors per slot (None = default). ``wants``:
    the slots recorded, those its targets entry names (the reference's documentation: a module in
    targets is monitored as configured there, others of all_xy in all four), all four where the entry
    names none (``{}``) or the module is monitored through all_xy or no targets; the others get no
    rows (nor api metrics: the reference computes nothing for them), and their CSV columns are nan."""

    __slots__ = ("name_id", "name", "vpp", "sel", "wants", "key")

    def __init__(self, name_id: int, name: str, vpp: int, sel: dict, key: str | None = None) -> None:
        self.name_id = name_id
        self.name = name
        self.vpp = vpp
        self.sel = sel
        self.wants = frozenset(sel) if sel else frozenset(SLOTS)
        self.key = key if key is not None else name  # the targets key as written (errors name it)


class GradCall:
    """One monitored forward call waiting for its activation gradients."""

    __slots__ = ("mid", "micro", "vpp", "call", "in_hooked", "out_hooked", "pair")

    def __init__(self, mid: int, micro: int, vpp: int, in_hooked: bool, pair: bool = True) -> None:
        self.mid = mid
        self.micro = micro
        self.vpp = vpp
        self.call: int | None = None  # the backward firing's call id, set at the first gradient
        self.in_hooked = in_hooked
        self.out_hooked = False
        self.pair = pair  # both gradient slots recorded (else the other has no row at all, not a NaN one)


def _needs_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _hook_grad(ctx: HookContext, st: StepState, x: torch.Tensor, gc: GradCall, slot: int, name: str) -> None:
    """Have ``x``'s gradient recorded for call ``gc`` in ``slot``: one hook per tensor object and value
    (an in-place op in between, ``ReLU(inplace=True)``, makes the same object another autograd value,
    whose gradient differs: it gets its own hook)."""
    known = st.grad_hooks.get(id(x))
    recomputing = in_backward()
    if known is not None and known[0]() is x and known[1] == x._version:
        once = known[4]
        if once is None or not once.fired:
            if known[3] or not recomputing:
                known[2].append((gc, slot, name))
            # else a tensor of the training forward met again in a recomputation: non-reentrant
            # activation checkpointing re-runs its segment on the segment's own inputs, whose gradient
            # belongs to the forward's call (hooked there); a second user would record it twice
            return
        once.handle.remove()  # a hook that served an earlier backward pass: a new one for this call
    users = [(gc, slot, name)]
    node = _conversion_node(x) if type(x) not in _PLAIN else None
    if node is not None:
        # a DTensor made from a local tensor (tensor parallelism's input layouts: DTensor.from_local, then
        # redistribute): its gradient can reach it Partial (ColwiseParallel's replicated input: each
        # rank's matmul gives one addend, whose local tensor is the gradient of nothing). The node that
        # made it hands the gradient back in the layout it was made from, the addends summed by the
        # all-reduce autograd runs there anyway: measured there (a Shard gradient is the same local
        # tensor either way)
        once = _Once()
        once.handle = node.register_hook(functools.partial(_conversion_grad_cb, ctx.ref, st, users, once))
        st.grad_hooks[id(x)] = (weakref.ref(x), x._version, users, recomputing, once)
        return
    base = x._base
    whole_view = (base is not None and base.grad_fn is not None and base.numel() == x.numel()
                  and not ctx.monitored.compiled)
    once = _Once() if x.is_leaf or whole_view else None
    once_handle = x.register_hook(_make_grad_cb(ctx, st, users, once))
    if once is not None:
        once.handle = once_handle
    if x.is_leaf:
        # a leaf tensor (a Parameter passed as a module's input) keeps its hooks across backward passes:
        # this one serves one backward pass, and goes at the next call or at the step's end at the latest
        st.leaf_hooks.append(once)
    elif whole_view:
        # A view (a Linear's output on 3-D input is a view of its 2-D matmul) loses its tensor hooks
        # when it is modified in place later (ReLU(inplace=True), x += y): then the node that made its
        # base, still in the graph, gets the gradient of the value the module produced, in the base's
        # shape (the same elements). Whichever runs first records it, once.
        base.grad_fn.register_prehook(functools.partial(_node_grad_cb, ctx.ref, st, users, once))
    st.grad_hooks[id(x)] = (weakref.ref(x), x._version, users, recomputing, once)


class _Once:
    """A gradient hook that serves one backward pass (its handle), and whether it has."""

    __slots__ = ("handle", "fired")

    def __init__(self) -> None:
        self.handle = None
        self.fired = False


def _grad_cb(ctx_ref, st: StepState, users: list, once: _Once | None, grad):
    if once is not None:
        if once.fired:  # an earlier backward pass's call, or the view's base node ran first
            return None
        once.fired = True
    ctx = ctx_ref()  # weak: a graph kept alive (the last loss in a variable) must not keep the monitor
    if ctx is None or ctx.recording.state is not st:  # the step ended (or monitoring stopped) before this gradient
        return None
    rows = None
    # last hooked first: backward runs the forward in reverse. A module returning its child's output
    # gets the gradient before that child (as the reference's backward hooks, which wrap the output
    # again), and a gradient that is one module's input and the module before it's output is the
    # later module's input gradient first
    for gc, slot, name in reversed(users):
        try:
            if gc.call is None:
                gc.call = st.fire(gc.mid, DIR_BACKWARD, gc.micro)
            if rows is None:
                rows = rows_for(ctx.recording, st, (grad,))
                empty = not local_tensor(grad).numel()  # (a NaN row, no values: see StatsPart.placeholder)
            other_hooked = gc.out_hooked if slot == SLOT_INPUT_GRAD else gc.in_hooked
            if other_hooked or not gc.pair:
                part_rows, slots, marks = rows, (slot,), (True,) if empty else ()
            else:  # the other slot gets no gradient: a NaN row, as the reference's None
                nan_second = slot == SLOT_INPUT_GRAD
                part_rows, slots = _with_nan_row(rows, nan_second), (SLOT_INPUT_GRAD, SLOT_OUTPUT_GRAD)
                marks = (empty, True) if nan_second else (True, empty)
            n = len(slots)
            st.stats.add(StatsPart(KIND_ACTV_GRAD, part_rows, (gc.mid,) * n, (gc.micro,) * n, (gc.call,) * n,
                                   slots, (gc.vpp,) * n, marks))
        except Exception as exc:  # noqa: BLE001
            ctx.hook_failed(f"backward hook of {name!r}", exc)
    return None


def _node_grad_cb(ctx_ref, st: StepState, users: list, once: _Once, grad_outputs):
    """Pre-hook on the node that made a view's base: :func:`_grad_cb` with the gradient of its output."""
    if not once.fired and grad_outputs and grad_outputs[0] is not None:
        _grad_cb(ctx_ref, st, users, once, grad_outputs[0])
    return None


def _conversion_grad_cb(ctx_ref, st: StepState, users: list, once: _Once, grad_inputs, _grad_outputs):
    """Post-hook on the node that made a DTensor from a local tensor (see :func:`_hook_grad`):
    :func:`_grad_cb` with the gradient it hands back."""
    if grad_inputs and grad_inputs[0] is not None:
        _grad_cb(ctx_ref, st, users, once, grad_inputs[0])
    return None


# autograd nodes that make a DTensor of another tensor without changing its value (DTensor.from_local,
# DTensor.redistribute): their inputs' gradients are the DTensor's, laid out as those inputs were
_CONVERSIONS = frozenset({"_FromTorchTensorBackward", "RedistributeBackward"})


def _conversion_node(x: torch.Tensor):
    """The node that made the DTensor ``x`` from a local tensor or another DTensor's layout, or None."""
    fn = x.grad_fn
    return fn if fn is not None and getattr(x, "placements", None) is not None and fn.name() in _CONVERSIONS else None


@functools.cache
def _grad_cb_eager():
    """``eager(_grad_cb)``, made at first use (torch.compiler imports dynamo)."""
    return eager(_grad_cb)


def _make_grad_cb(ctx: HookContext, st: StepState, users: list, once: _Once | None = None):
    """The gradient hook of one tensor: a partial of one function wrapped once (making a wrapper per
    tensor, several per module call, would cost time on the hot path)."""
    return functools.partial(_grad_cb_eager() if ctx.monitored.compiled else _grad_cb, ctx.ref, st, users, once)


def _with_nan_row(rows, nan_second: bool):
    """The one row of ``rows`` and a NaN row (second if ``nan_second``, else first)."""
    if isinstance(rows, np.ndarray):
        out = np.full((2, rows.shape[1]), np.nan, dtype=np.float32)
        out[0 if nan_second else 1] = rows[0]
        return out
    nan = torch.full_like(rows, float("nan"))
    return torch.cat((rows, nan) if nan_second else (nan, rows))


def warn_no_tensor(ctx: HookContext, t: ModuleTarget, module, found: dict) -> None:
    """Once per module: the default selection (no selector) found no tensor in its ``found`` sides
    (``{"input": value, "output": value}``, what it looked at), so the slots there get NaN rows and no
    gradient rows (a module returning None, or a dict whose first value set is no tensor)."""
    warned = ctx.no_tensor_warned
    if t.name_id in warned:
        return
    warned.add(t.name_id)
    what = "; ".join(f"its {side}: {'no argument' if side == 'input' and not value else found_text(value)}"
                     for side, value in found.items())
    log.warning("trainrec: module %r (%s): the default selection (the tensor, element 0 of a tuple or list, the first "
                "value set of a dict or ModelOutput; for an input given by keyword only, the first keyword argument "
                "set) finds no tensor in its %s (%s), so its rows there are NaN and no gradient is recorded there; "
                "give it a selector in targets (print_struct shows its inputs and outputs), or leave it out",
                t.name, type(module).__name__, " and ".join(found), what)


def make_pre_hook(ctx: HookContext, t: ModuleTarget, forward: bool = True):
    """Forward pre-hook (activation gradients): a gradient hook on the selected input tensor. Where the
    module's forward hook does not measure its input (not ``forward``), it says whether the default
    selection found none (:func:`warn_no_tensor`)."""
    sel_in = t.sel.get("input_grad")
    key_in = f"targets.{t.key}.input_grad"
    mid = t.name_id
    vpp = t.vpp
    want_in = "input_grad" in t.wants
    pair = want_in and "output_grad" in t.wants
    # (where the forward hook measures the same default input, it says so)
    check_in = want_in and sel_in is None and not (forward and "input" in t.wants and t.sel.get("input") is None)
    rec = ctx.recording

    def hook(module, args, kwargs=None):  # (registered with_kwargs; see _KWARGS_GONE)
        st = rec.state
        if st is None or not module.training or not torch.is_grad_enabled():
            return
        try:
            x = select(inputs_of(args, kwargs, sel_in), sel_in, key_in) if want_in else None
            if check_in and x is None:
                warn_no_tensor(ctx, t, module, {"input": inputs_of(args, kwargs, sel_in)})
            gc = GradCall(mid, st.micro_of(vpp, mid, st.bwd_count, ctx.grad_acc), vpp, _needs_grad(x), pair)
            st.open_calls.setdefault(mid, []).append(gc)
            if gc.in_hooked:
                _hook_grad(ctx, st, x, gc, SLOT_INPUT_GRAD, t.name)
        except Exception as exc:  # noqa: BLE001
            ctx.hook_failed(f"backward hook of {t.name!r}", exc)

    return hook


def make_forward_hook(ctx: HookContext, t: ModuleTarget, forward: bool = True, backward: bool = True):
    """Forward hook: activation statistics (``forward``), and the gradient hook on the selected output
    tensor of the call opened by :func:`make_pre_hook` (``backward``)."""
    sel_in = t.sel.get("input")
    sel_out = t.sel.get("output")
    sel_gout = t.sel.get("output_grad")
    key_in = f"targets.{t.key}.input"
    key_out = f"targets.{t.key}.output"
    key_gout = f"targets.{t.key}.output_grad"
    mid = t.name_id
    vpp = t.vpp
    want_in, want_out, want_gout = ("input" in t.wants), ("output" in t.wants), ("output_grad" in t.wants)
    # the slots of the forward row: those recorded (an unrecorded one has no row, as the reference's);
    # Targets.attach passes forward=False where the entry names neither
    fwd_slots = tuple(s for s, want in ((SLOT_INPUT, want_in), (SLOT_OUTPUT, want_out)) if want)
    n = len(fwd_slots)
    mids, vpps = (mid,) * n, (vpp,) * n
    # default selections that find no tensor: said once per module (warn_no_tensor), where this hook's
    # forward part measures the slot, else where its backward part selects it
    check_in, check_out = want_in and sel_in is None, want_out and sel_out is None
    check_gout = want_gout and sel_gout is None and not (forward and check_out)
    rec = ctx.recording
    no_tensor_warned = ctx.no_tensor_warned

    def hook(module, args, *kwargs_output):  # (registered with_kwargs: kwargs, output; see _KWARGS_GONE)
        kwargs, output = kwargs_output if len(kwargs_output) == 2 else (None, kwargs_output[0])
        st = rec.state
        if st is None or not module.training or (st.nograd_fwd if st.chunk_open else not torch.is_grad_enabled()):
            # a training-mode call under no_grad: inside a chunk's forward, as that forward began (reentrant
            # checkpointing runs its segment's first forward under no_grad, inside a recorded one); a
            # module called outside it (a target made with the model's embedding), as it is called
            return
        if backward:  # also in a recomputation (reentrant checkpointing: its gradients flow from there)
            opened = st.open_calls.get(mid)
            if opened:
                gc = opened.pop()
                try:
                    y = select(output, sel_gout, key_gout) if want_gout else None
                    if check_gout and y is None:
                        warn_no_tensor(ctx, t, module, {"output": output})
                    if _needs_grad(y):
                        gc.out_hooked = True
                        _hook_grad(ctx, st, y, gc, SLOT_OUTPUT_GRAD, t.name)
                except Exception as exc:  # noqa: BLE001
                    ctx.hook_failed(f"backward hook of {t.name!r}", exc)
        if not forward or in_backward():
            return
        try:
            micro = st.micro_of(vpp, mid, st.fwd_count, ctx.grad_acc)
            call = st.fire(mid, DIR_FORWARD, micro)
            if n == 2:
                xs = (select(inputs_of(args, kwargs, sel_in), sel_in, key_in), select(output, sel_out, key_out))
            else:
                xs = (select(inputs_of(args, kwargs, sel_in), sel_in, key_in) if want_in
                      else select(output, sel_out, key_out),)
            if ((check_in and xs[0] is None) or (check_out and xs[-1] is None)) and mid not in no_tensor_warned:
                found = {}
                if check_in and xs[0] is None:
                    found["input"] = inputs_of(args, kwargs, sel_in)
                if check_out and xs[-1] is None:
                    found["output"] = output
                warn_no_tensor(ctx, t, module, found)
            rows = rows_for(rec, st, xs)
            # (a slot that found no tensor, or an empty one, such as an expert no token was routed to:
            # its NaN row marked, so that anomaly detection does not take it for a tensor holding NaN)
            st.stats.add(StatsPart(KIND_ACTV, rows, mids, (micro,) * n, (call,) * n, fwd_slots, vpps,
                                   placeholders(xs, rows)))
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            ctx.hook_failed(f"forward hook of {t.name!r}", exc)

    return hook


def make_grad_hook(ctx: HookContext, index: int, incoming: bool | str = False):
    """Post-accumulate-grad hook of monitored parameter ``index``; with ``incoming``, a gradient hook
    on the parameter instead (``Tensor.register_hook``: it runs before the gradient is accumulated,
    and before any post-accumulate-grad hook), given this micro step's gradient; with ``incoming ==
    "unsharded"``, the post-accumulate-grad hook of FSDP2's unsharded parameter, whose gradient is this
    rank's own before FSDP reduce-scatters it (and then drops it): measured at once."""

    ref = ctx.ref  # a tensor's hooks are out of the garbage collector's sight (see HookContext)

    def hook(param_or_grad):
        c = ref()
        if c is None or c.recording.state is None:
            return
        try:
            c.grad_batch.grad_accumulated(index, param_or_grad if incoming else None)
        except Exception as exc:  # noqa: BLE001
            c.hook_failed(f"gradient hook of {c.recording.params[index].name!r}", exc)

    if incoming == "unsharded":
        def unsharded_hook(param):
            if param.grad is not None:
                hook(param.grad)

        return unsharded_hook
    return hook
