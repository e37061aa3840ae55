"""Weight gradients before reduction: the batch of one micro step's gradient firings, measured at its
flush points (see docs/recorder-internals.md, "Unreduced gradients").

Each monitored parameter's post-accumulate-grad hook queues it (where allowed, as a list's
``append``: :meth:`GradBatch.list_hooks_allowed`). The queue is measured when every monitored
parameter has fired, at the end of the backward pass (before DDP writes averaged gradients back),
at the next micro step's forward, at the optimizer pre-step, or at PENDING_FLUSH_BYTES, so ``.grad``
is measured before the next micro step accumulates into it. A gradient viewing a shared buffer (DDP
buckets, Megatron) is measured in its own hook (``main_grad + .grad`` in parts of SUM_PART_NUMEL); a
ZeRO-partitioned parameter before its accumulation."""

from __future__ import annotations

import logging
import weakref
from itertools import repeat
from operator import add, attrgetter, mod
from typing import TYPE_CHECKING

import numpy as np
import torch
from trainrec.schema.events import KIND_GRAD_UNREDUCED

from . import config, fused
from .compile_mode import in_backward
from .context import RecordingContext
from .grad_places import any_in_shared_buffer, in_shared_buffer, main_grad_now
from .step_rows import StepRows
from .step_stats import StatsPart, placeholders

if TYPE_CHECKING:  # (steps.py queues its checks with queue_end_of_backward)
    from .attach import StepHooks
    from .steps import StepTracker

log = logging.getLogger(__name__)

_GRAD = attrgetter("grad")
_NAME_ID = attrgetter("name_id")
_VPP = attrgetter("vpp")
_PARAM = attrgetter("param")

# On the one-pass kernel's path, a reduced gradient whose fingerprint shows it unchanged reuses its
# unreduced row (see reduced.py); TRAINREC_REUSE_UNCHANGED_GRADS=0 measures it again instead.
REUSE_UNCHANGED = config.env_choice("TRAINREC_REUSE_UNCHANGED_GRADS", ("0", "1", ""), "1") != "0"

# The weight-gradient batch of the Python hooks is measured once its gradients hold this many bytes: it
# may be their only holder. DDP with gradient_as_bucket_view, after zero_grad() (set_to_none), copies each
# fresh gradient into its bucket in its own hook, right after the monitor's, points .grad at the bucket
# and drops the fresh tensor; a batch held to the end of the backward pass would keep a second copy of
# every gradient on the device at each collected step.
PENDING_FLUSH_BYTES = 1 << 28

# The largest temporary main_grad + .grad made at once (elements): a larger parameter (an LLM's
# embedding shard) is summed and measured in parts of this size, whose rows are combined.
SUM_PART_NUMEL = 1 << 24


def may_have_main_grads(tensors: list, params_have_main_grad: bool) -> bool:
    """False where none of ``tensors`` has a ``main_grad`` to measure, found without a Python step per
    parameter (True also for a ``main_grad`` attribute that is None: the general path then asks of each)."""
    return params_have_main_grad and any(map(hasattr, tensors, repeat("main_grad")))


class GradBatch:
    """The unreduced gradient rows of a collected step (KIND_GRAD_UNREDUCED), one batch per flush point.

    ``grad_accumulated`` takes one firing (the Python hooks'), ``drain_fired`` the list hooks' firings,
    ``settle`` measures whatever is pending; each row is kept in the step's ``last_unreduced`` for
    the reduced gradients to reuse. It reads the step, the parameters and the engine from ``context``,
    the firings of the list hooks from ``step_hooks``, and the micro steps per step from ``steps``."""

    def __init__(self, context: RecordingContext, step_hooks: StepHooks, steps: StepTracker, rows: StepRows) -> None:
        self.context = context
        self.step_hooks = step_hooks
        self.steps = steps
        self.rows = rows

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        g = self._main_grad_of(p)
        return g if g is not None else p.grad

    def grad_accumulated(self, index: int, incoming: torch.Tensor | None = None, drained: bool = False) -> None:
        """Parameter ``index`` got its gradient in this micro step (``incoming``: the gradient itself,
        given before its accumulation where DeepSpeed partitions the parameter; measured at once).
        Runs inside the backward pass once per monitored parameter: kept to few attribute lookups, as
        the backward's kernels have left the interpreter's own data out of the CPU caches. ``drained``:
        called for a firing the list hooks kept (:meth:`drain_fired`), after the backward pass."""
        st = self.context.state
        if index in st.pending_set:
            self._flush()
        counts = st.grad_count
        n = counts.get(index, 0)
        counts[index] = n + 1
        info = self.context.params[index]
        micro = st.bwd_micro.get(info.vpp)  # the micro step of the forward this backward pass belongs to
        if micro is None:
            micro = n % self.steps.grad_acc
        call = st.fire(info.name_id, 1, micro)
        # .grad is final here: keep the tensor itself (DDP may swap param.grad for a bucket view, or
        # change it, before the batch is measured). main_grad is not (see main_grad_now).
        if incoming is not None:
            g, now = incoming, True
        else:
            now = False
            p = info.param
            mg = getattr(p, "main_grad", None) if self.context.params_have_main_grad else None
            if mg is None:
                g = p.grad
            else:
                if drained:  # main_grad since the list hooks were chosen: too late for this firing's
                    self._list_hooks_fallback("a parameter has a main_grad")  # sum, measured now
                g, added, now = main_grad_now(p, mg)
                if added is not None:  # Megatron's main_grad, about to get this micro step's .grad added
                    self._flush()
                    failed: list = []
                    rows = self._rows_of_sum(g, added, index, failed)
                    st.stats.add(StatsPart(KIND_GRAD_UNREDUCED, rows, [info.name_id], [micro], [call], (),
                                           [info.vpp], placeholders([g], rows, failed)))
                    return
        pending = st.pending
        if not pending and not drained and in_backward():
            # the batch is measured at the end of this backward at the latest: before DDP's own
            # end-of-backward callback (queued at its first gradient hook, after this one) copies the
            # averaged buckets into .grad, and whether or not every monitored parameter got a gradient
            self.queue_flush_at_end_of_backward()
        pending.append((index, micro, call, g))
        st.pending_set.add(index)
        if g is None:
            st.pending_lookup = True
        if now or (len(pending) >= len(self.context.params) and g is not None):
            self._flush()
        elif in_shared_buffer(g):
            if drained:  # its owner (DDP) may have changed it since it fired: hooks that measure it then
                self._list_hooks_fallback("a gradient is a view into a shared buffer")
            self._flush()
        elif g is not None and not st.pending_lookup:
            # the batch may be the only holder of its gradients (see PENDING_FLUSH_BYTES)
            st.pending_bytes += g.nbytes
            if st.pending_bytes >= PENDING_FLUSH_BYTES:
                self._flush()

    def _end_of_backward_flush(self) -> None:
        st = self.context.state
        if st is None:
            return
        st.eob_queued = False
        try:
            self.settle(in_backward_pass=True)
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            self.context.hook_failed("gradient batch", exc)

    # List hooks: where allowed, each parameter's gradient hook is one list's bound ``append`` (no Python
    # frame inside the backward pass), replayed in order at its end; the rules and the fallback to Python
    # hooks: docs/recorder-internals.md, "Unreduced gradients".

    def queue_flush_at_end_of_backward(self) -> None:
        queue_end_of_backward(self._end_of_backward_flush)

    def list_hooks_allowed(self, cfg, compiled: bool, several_ranks: bool) -> bool:
        """Whether weight gradients may get the list hooks (see above): ``cfg`` the config, ``compiled``
        the model under torch.compile, ``several_ranks`` a distributed run of more than one rank."""
        if self.step_hooks.list_hooks_off or compiled or (cfg.xy_distribution and not cfg.forward_only):
            return False
        return not several_ranks

    def drain_fired(self, expected: bool = False) -> None:
        """The list hooks' firings, in order, through :meth:`grad_accumulated`; unless ``expected``
        (at the end of a backward pass), they were found at a later flush point: Python hooks from now on."""
        fired = self.step_hooks.fired
        items = fired.copy()
        fired.clear()
        st = self.context.state
        if st is None:
            return
        index_of = self.step_hooks.list_hooked
        idx = list(map(index_of.get, map(id, items)))
        params = self.context.params
        # (this runs right after the backward pass, whose kernels have left the interpreter's data out of
        # the CPU caches: one pass per question, few bytecodes per parameter)
        plain = None not in idx and len(set(idx)) == len(idx) and st.pending_set.isdisjoint(idx)
        if plain:
            infos = list(map(params.__getitem__, idx))
            tensors = list(map(_PARAM, infos))
            grads = list(map(_GRAD, tensors))
            plain = not (may_have_main_grads(tensors, self.context.params_have_main_grad) or any_in_shared_buffer(grads))
        if not plain:
            for i in idx:  # anything unusual: one firing at a time, as the Python hooks take them
                if i is not None:
                    self.grad_accumulated(i, None, drained=True)
        else:
            # grad_accumulated's bookkeeping for a batch of distinct, plain firings, in one loop
            # (without a Python step per firing where possible: idx holds distinct parameters)
            counts, bwd, ga = st.grad_count, st.bwd_micro, self.steps.grad_acc
            seen = list(map(counts.get, idx, repeat(0)))
            counts.update(zip(idx, map(add, seen, repeat(1)), strict=True))
            vpps = set(map(_VPP, infos))
            m = bwd.get(next(iter(vpps))) if len(vpps) == 1 else None
            if m is not None:
                micros = [m] * len(idx)
            elif len(vpps) == 1:
                micros = list(map(mod, seen, repeat(ga)))
            else:
                micros = [n % ga if (m := bwd.get(info.vpp)) is None else m for n, info in zip(seen, infos, strict=True)]
            call = st.fire_many(list(map(_NAME_ID, infos)), 1, micros)
            st.pending.extend(zip(idx, micros, range(call, call + len(idx)), grads, strict=True))
            st.pending_set.update(idx)
            if len(st.pending) >= len(params) and st.pending[-1][3] is not None:
                self._flush()
        if not expected and items:
            self._list_hooks_fallback("no end of the backward pass was seen")

    def settle(self, in_backward_pass: bool = False) -> None:
        """Every gradient firing so far measured: at a flush point outside the backward pass, or inside
        it (``in_backward_pass``: a whole model chunk recomputed under activation checkpointing, whose
        end-of-backward callback is still to come)."""
        st = self.context.state
        if st is None:
            return
        if not in_backward_pass:
            st.eob_queued = False
        if self.step_hooks.fired:
            self.drain_fired(expected=in_backward_pass)
        if st.pending:
            self._flush()

    def _list_hooks_fallback(self, why: str) -> None:
        self.step_hooks.python_hooks_from_now(why)

    def _main_grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        return getattr(p, "main_grad", None) if self.context.params_have_main_grad else None

    def _flush(self) -> None:
        st = self.context.state
        pend = st.pending
        st.pending = []
        st.pending_set = set()
        st.pending_bytes = 0
        st.pending_lookup = False
        if not pend:
            return
        idxs, micros, calls, grads = zip(*pend, strict=True)
        # (never `None in grads`: that compares every tensor with None through torch's __eq__)
        grads = list(grads) if all(g is not None for g in grads) else [
            g if g is not None else self._grad_of(self.context.params[i].param) for i, g in zip(idxs, grads, strict=True)]
        eng = self.context.engine
        extremes = np.empty((len(pend), fused.FINGERPRINT_COLUMNS)) if REUSE_UNCHANGED and eng.fused and eng.host_paths else None
        failed: list = []
        rows = self.rows.rows_of(grads, list(idxs), "gradient", extremes, failed)
        # (the rows of None and empty gradients, and of those the engine failed on, marked: NaN rows that
        # are no gradient's values, which the skipped-step check must not take for an inf/NaN gradient)
        self.rows.add_part(st, KIND_GRAD_UNREDUCED, rows, idxs, micros, calls, placeholders(grads, rows, failed))
        # (weak references: one held here would keep an incoming gradient, DeepSpeed's or FSDP2's,
        # from being taken over as .grad without a copy, and alive to the step's end)
        last = st.last_unreduced
        if isinstance(rows, np.ndarray):  # the one-pass kernel's: with fingerprints where it gave them
            if extremes is not None:
                for r, ((i, _, _, _), g, ok) in enumerate(zip(pend, grads, (extremes[:, 0] >= 0).tolist(),
                                                               strict=True)):
                    if ok and g is not None:
                        last[i] = (rows, r, weakref.ref(g), g._version, extremes[r])
            return
        for r, ((i, _, _, _), g) in enumerate(zip(pend, grads, strict=True)):
            if g is not None and self._reusable(g):
                last[i] = (rows, r, weakref.ref(g), g._version, None)

    @torch.no_grad()
    def _rows_of_sum(self, a: torch.Tensor, b: torch.Tensor, index: int, failed: list | None = None) -> torch.Tensor:
        """The row of ``a + b`` (same shape and device), with temporaries of at most
        :data:`SUM_PART_NUMEL` elements: a larger tensor is summed and measured in parts, and their
        rows combined (:meth:`StatsEngine.combine`), so no temporary of a whole large parameter is made
        while backward holds its activations. ``failed``: as :meth:`_rows_of`'s."""
        n = a.numel()
        if n <= SUM_PART_NUMEL:
            return self.rows.rows_of([torch.add(a, b)], [index], "gradient", failed=failed)
        fa, fb = a.reshape(-1), b.reshape(-1)
        parts, sizes = [], []
        for lo in range(0, n, SUM_PART_NUMEL):
            hi = min(n, lo + SUM_PART_NUMEL)
            parts.append(torch.as_tensor(self.rows.rows_of([torch.add(fa[lo:hi], fb[lo:hi])], [index], "gradient",
                                                       failed=failed)))
            sizes.append(hi - lo)
        return self.context.engine.combine(torch.cat(parts), sizes)

    def _reusable(self, g: torch.Tensor) -> bool:
        """Whether a reduced gradient may reuse its unreduced row on the torch path (see the module
        docstring): on CPU, with a norm to check. (The one-pass kernel's rows carry fingerprints instead,
        checked by :func:`fused.unchanged`.)"""
        eng = self.context.engine
        return ("norm" in eng.ops and g.device.type == "cpu" and eng.host_paths and g.layout is torch.strided
                and not (eng.fused and fused.supports(g)))


def queue_end_of_backward(fn) -> None:
    """Run ``fn`` when the running backward pass finishes (the autograd engine's callback queue, as DDP
    and FSDP use it); the callbacks run in the order they were queued. Where the engine refuses, the
    other flush points (forward of the next micro step, optimizer pre-step) remain."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except (RuntimeError, AttributeError) as exc:
        if not _queue_warned:
            _queue_warned.append(True)
            log.warning("trainrec: could not queue the end-of-backward gradient flush: %r", exc)


_queue_warned: list = []

