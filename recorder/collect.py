"""What a collected step records besides the module hooks: weight gradients, parameters, Adam state,
and the end of the step (one host copy, HooksFired, the deferred TensorStatsRecorded build).

A mixin of :class:`~trainrec.recorder.monitor.TrainerMon` (what it reads of it: :class:`StepCollector`);
the records go out through :class:`~trainrec.recorder.step_output.StepOutput`.

Weight gradients: the post-accumulate-grad hook of each monitored parameter queues it (in one process
without DDP, DeepSpeed, FSDP or Megatron, the hook is a list's ``append`` and the queueing happens at
the end of the backward pass: see the comment above :meth:`StepCollector._list_hooks_allowed`); the queue is
measured in one batch when every monitored parameter has fired in this micro step, at the end of the
backward pass (a callback queued in the autograd engine at the batch's first gradient, so it runs
before DDP's end-of-backward callback writes the averaged gradients back), when the next micro step's
forward begins (a forward pre-hook on each model chunk), at the optimizer pre-step, or once the
Python hooks' queue holds PENDING_FLUSH_BYTES of gradients (it may be their only holder), whichever
comes first, so ``.grad`` is measured before the next micro step accumulates into it. A
gradient that is a view into a shared buffer (DDP bucket views, Megatron's grad buffer) is measured
in its own hook, with the queue: the buffer's owner changes it in place right after (DDP divides it
by the world size and all-reduces the bucket while backward goes on). Megatron's ``main_grad`` in its
grad buffer is measured there as ``main_grad + .grad``, the value Megatron's own hook, which runs
next, gives it before it may start the bucket's reduction (``overlap_grad_reduce``), in parts of at
most SUM_PART_NUMEL elements; a ``main_grad`` kept elsewhere is looked up at the end of the
backward pass, after every such hook has run.
A parameter that DeepSpeed ZeRO partitions is measured in a gradient hook that runs before the
gradient is accumulated (DeepSpeed's own post-accumulate-grad hook moves it into a bucket that is
reduced while backward goes on): its unreduced row is that micro step's gradient on this rank
(DeepSpeed accumulates micro steps in its own partitions, not in ``.grad``).
Reduced gradients (optimizer pre-step) are measured again, except where the last unreduced row of a
parameter is known to hold: its gradient is still the tensor measured then, with the same version
counter, and a check shows it unchanged (AMP's unscale, apex/Megatron fused scaling, ``.data`` and
numpy writes leave the version counter as it was). On the torch path (CPU) the check is the norm,
recomputed exactly as the engine computes it (one dot product, bitwise reproducible). On the one-pass
kernel's path (CPU float32) a norm would read the whole gradient, as measuring it again does; there the
check (:func:`fused.unchanged`, for gradients of 64K elements or more) reads back the two elements where
the kernel found the min and max, which a scaling, clip, shift or average changes unless it leaves the
tensor as it was, and a sample of one 64-byte line per KiB, which any write to 256 consecutive elements
or more changes (zeroing rows of an embedding's gradient, a mask, an all-reduce): a read of one line in
16 instead of all of them (on the benchmark model 0.2-0.3 ms instead of 1.2 ms per step). What it cannot
see is a write through ``.data`` or numpy (the others move the version counter) to a few scattered
elements that holds neither extreme nor a sampled line; ``TRAINREC_REUSE_UNCHANGED_GRADS=0`` measures
every reduced gradient again. Elsewhere (accelerators: the check would cost a synchronisation) they are
measured again.
"""

from __future__ import annotations

import logging
import time
import weakref
from itertools import compress, repeat
from operator import add, attrgetter, is_not, mod

import numpy as np
import torch
from trainrec.schema.events import (
    KIND_EXP_AVG,
    KIND_EXP_AVG_SQ,
    KIND_GRAD_REDUCED,
    KIND_GRAD_UNREDUCED,
    KIND_MG_DIRECTION,
    KIND_RATIO,
    KIND_UPDATE,
    StepEnded,
)

from . import config, fused, zero
from .fused import local_tensor
from .grad_places import any_in_shared_buffer, in_shared_buffer, is_shard, main_grad_now, shard_held_before
from .hooks import StepState, in_backward
from .optim import OWN_GRAD, device_update_and_ratio, fused_adam_rows, update_and_ratio
from .step_stats import StatsPart, gather_device, placeholders, to_device
from .targets import uninitialized

log = logging.getLogger(__name__)

_GRAD = attrgetter("grad")
_NAME_ID = attrgetter("name_id")
_VPP = attrgetter("vpp")
_PARAM = attrgetter("param")

# On the one-pass kernel's path, a reduced gradient whose fingerprint shows it unchanged reuses its
# unreduced row (see the module docstring); TRAINREC_REUSE_UNCHANGED_GRADS=0 measures it again instead.
REUSE_UNCHANGED = config.env_choice("TRAINREC_REUSE_UNCHANGED_GRADS", ("0", "1", ""), "1") != "0"

# The weight-gradient batch of the Python hooks is measured once its gradients hold this many bytes: it
# may be their only holder. DDP with gradient_as_bucket_view, after zero_grad() (set_to_none), copies each
# fresh gradient into its bucket in its own hook, right after the monitor's, points .grad at the bucket
# and drops the fresh tensor; a batch held to the end of the backward pass would keep a second copy of
# every gradient on the device at each collected step.
PENDING_FLUSH_BYTES = 1 << 28

class StepCollector:
    """Gradient, parameter and optimizer-state rows of a collected step, and the step's end.

    Its own state is made by :meth:`_init_collection`. What it reads of the monitor it is mixed into:
    ``config``, ``rank``, ``world_size``, ``params_have_main_grad``, ``_state``, ``_engine``,
    ``_params``, ``_targets``, ``_compiled``, ``_distributed``, ``_collections``, ``_step_t0``, the parts
    ``step_output``, ``binding``, ``steps`` and ``step_hooks``, and ``_emit`` and ``_hook_failed``.
    """

    def _init_collection(self) -> None:
        self._dp_duplicate = False  # this rank is not dp_group's first
        self._dp_ranks: tuple = ()  # dp_group's ranks, in group order
        self._dp_replicas: dict = {}  # _dp_copy's, per (DTensor mesh, placements)
        self._plain_params_cache: tuple | None = None  # _plain_param_tensors
        self._warned_no_optimizer = False
        self._warned_mg_direction = False

    # ------------------------------------------------------------------ gradients and optimizer state
    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        g = self._main_grad_of(p)
        return g if g is not None else p.grad

    def _on_grad_accumulated(self, index: int, incoming: torch.Tensor | None = None, drained: bool = False) -> None:
        """Parameter ``index`` got its gradient in this micro step (``incoming``: the gradient itself,
        given before its accumulation where DeepSpeed partitions the parameter; measured at once).
        Runs inside the backward pass once per monitored parameter: kept to few attribute lookups, as
        the backward's kernels have left the interpreter's own data out of the CPU caches. ``drained``:
        called for a firing the list hooks kept (:meth:`_drain_fired`), after the backward pass."""
        st = self._state
        if index in st.pending_set:
            self._flush_grads()
        counts = st.grad_count
        n = counts.get(index, 0)
        counts[index] = n + 1
        info = self._params[index]
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
            mg = getattr(p, "main_grad", None) if self.params_have_main_grad else None
            if mg is None:
                g = p.grad
            else:
                if drained:  # main_grad since the list hooks were chosen: too late for this firing's
                    self._list_hooks_fallback("a parameter has a main_grad")  # sum, measured now
                g, added, now = main_grad_now(p, mg)
                if added is not None:  # Megatron's main_grad, about to get this micro step's .grad added
                    self._flush_grads()
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
            self._queue_flush_at_end_of_backward()
        pending.append((index, micro, call, g))
        st.pending_set.add(index)
        if g is None:
            st.pending_lookup = True
        if now or (len(pending) >= len(self._params) and g is not None):
            self._flush_grads()
        elif in_shared_buffer(g):
            if drained:  # its owner (DDP) may have changed it since it fired: hooks that measure it then
                self._list_hooks_fallback("a gradient is a view into a shared buffer")
            self._flush_grads()
        elif g is not None and not st.pending_lookup:
            # the batch may be the only holder of its gradients (see PENDING_FLUSH_BYTES)
            st.pending_bytes += g.nbytes
            if st.pending_bytes >= PENDING_FLUSH_BYTES:
                self._flush_grads()

    def _end_of_backward_flush(self) -> None:
        st = self._state
        if st is None:
            return
        st.eob_queued = False
        try:
            self._settle_grads(in_backward_pass=True)
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            self._hook_failed("gradient batch", exc)

    # Where nothing but this process's autograd engine touches a gradient inside the backward pass (no
    # DDP, DeepSpeed, FSDP or Megatron hooks: one process, or ranks that reduce after it) and no module
    # backward hook fires between the gradients (xy_distribution off or forward_only), the gradient hook
    # of each monitored parameter is the bound ``append`` of one list (``StepHooks.fired``): no Python frame runs
    # inside the backward pass for it (on the benchmark model's 51 parameters, 0.2-0.8 ms less per step
    # than Python hooks, paired in one process; the hooks' own time was about 0.6 ms). The list
    # keeps the firing order; the end-of-backward callback, queued by the model chunk's output gradient
    # hook (chunk_hooks.make_chunk_hook), hands each firing to _on_grad_accumulated in that order, so call ids,
    # micro steps and the measured batch are those of the Python hooks. Where a firing is found anywhere
    # else (no chunk output gradient reached that backward pass), or the gradient turns out to be a view
    # into a shared buffer or a main_grad, the parameters get the Python hooks from then on.

    def _queue_flush_at_end_of_backward(self) -> None:
        _queue_end_of_backward(self._end_of_backward_flush)

    def _list_hooks_allowed(self) -> bool:
        cfg = self.config
        if self.step_hooks.list_hooks_off or self._compiled or (cfg.xy_distribution and not cfg.forward_only):
            return False
        return not (self._distributed and self.world_size > 1)

    def _drain_fired(self, expected: bool = False) -> None:
        """The list hooks' firings, in order, through :meth:`_on_grad_accumulated`; unless ``expected``
        (at the end of a backward pass), they were found at a later flush point: Python hooks from now on."""
        fired = self.step_hooks.fired
        items = fired.copy()
        fired.clear()
        st = self._state
        if st is None:
            return
        index_of = self.step_hooks.list_hooked
        idx = list(map(index_of.get, map(id, items)))
        params = self._params
        # (this runs right after the backward pass, whose kernels have left the interpreter's data out of
        # the CPU caches: one pass per question, few bytecodes per parameter)
        plain = None not in idx and len(set(idx)) == len(idx) and st.pending_set.isdisjoint(idx)
        if plain:
            infos = list(map(params.__getitem__, idx))
            tensors = list(map(_PARAM, infos))
            grads = list(map(_GRAD, tensors))
            plain = not (self._may_have_main_grads(tensors) or any_in_shared_buffer(grads))
        if not plain:
            for i in idx:  # anything unusual: one firing at a time, as the Python hooks take them
                if i is not None:
                    self._on_grad_accumulated(i, None, drained=True)
        else:
            # _on_grad_accumulated's bookkeeping for a batch of distinct, plain firings, in one loop
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
                self._flush_grads()
        if not expected and items:
            self._list_hooks_fallback("no end of the backward pass was seen")

    def _settle_grads(self, in_backward_pass: bool = False) -> None:
        """Every gradient firing so far measured: at a flush point outside the backward pass, or inside
        it (``in_backward_pass``: a whole model chunk recomputed under activation checkpointing, whose
        end-of-backward callback is still to come)."""
        st = self._state
        if st is None:
            return
        if not in_backward_pass:
            st.eob_queued = False
        if self.step_hooks.fired:
            self._drain_fired(expected=in_backward_pass)
        if st.pending:
            self._flush_grads()

    def _list_hooks_fallback(self, why: str) -> None:
        self.step_hooks.python_hooks_from_now(why)

    def _main_grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        return getattr(p, "main_grad", None) if self.params_have_main_grad else None

    def _may_have_main_grads(self, tensors: list) -> bool:
        """False where :meth:`_main_grad_of` is None for every one of ``tensors``, found without a Python
        step per parameter (True also for a ``main_grad`` attribute that is None: the general path then
        asks of each)."""
        return self.params_have_main_grad and any(map(hasattr, tensors, repeat("main_grad")))

    def _flush_grads(self) -> None:
        st = self._state
        pend = st.pending
        st.pending = []
        st.pending_set = set()
        st.pending_bytes = 0
        st.pending_lookup = False
        if not pend:
            return
        idxs, micros, calls, grads = zip(*pend, strict=True)
        # (never `None in grads`: that compares every tensor with None through torch's __eq__, ~25 us each)
        grads = list(grads) if all(g is not None for g in grads) else [
            g if g is not None else self._grad_of(self._params[i].param) for i, g in zip(idxs, grads, strict=True)]
        eng = self._engine
        extremes = np.empty((len(pend), fused.FINGERPRINT_COLUMNS)) if REUSE_UNCHANGED and eng.fused and eng.host_paths else None
        failed: list = []
        rows = self._rows_of(grads, list(idxs), "gradient", extremes, failed)
        # (the rows of None and empty gradients, and of those the engine failed on, marked: NaN rows that
        # are no gradient's values, which the skipped-step check must not take for an inf/NaN gradient)
        self._add_part(st, KIND_GRAD_UNREDUCED, rows, idxs, micros, calls, placeholders(grads, rows, failed))
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
            return self._rows_of([torch.add(a, b)], [index], "gradient", failed=failed)
        fa, fb = a.reshape(-1), b.reshape(-1)
        parts, sizes = [], []
        for lo in range(0, n, SUM_PART_NUMEL):
            hi = min(n, lo + SUM_PART_NUMEL)
            parts.append(torch.as_tensor(self._rows_of([torch.add(fa[lo:hi], fb[lo:hi])], [index], "gradient",
                                                       failed=failed)))
            sizes.append(hi - lo)
        return self._engine.combine(torch.cat(parts), sizes)

    def _reusable(self, g: torch.Tensor) -> bool:
        """Whether a reduced gradient may reuse its unreduced row on the torch path (see the module
        docstring): on CPU, with a norm to check. (The one-pass kernel's rows carry fingerprints instead,
        checked by :func:`fused.unchanged`.)"""
        eng = self._engine
        return ("norm" in eng.ops and g.device.type == "cpu" and eng.host_paths and g.layout is torch.strided
                and not (eng.fused and fused.supports(g)))

    def _own_grads(self, partitioned_only: bool = False):
        """``(index, gradient)`` of the monitored parameters this rank reports at the optimizer step:
        those with a gradient, less tensor-parallel duplicates, and less data-parallel duplicates where
        ``dp_group`` was given. Where the optimizer keeps its own copy of the reduced gradient
        (DeepSpeed ZeRO, Megatron's DistributedOptimizer), this rank's share of that
        (:meth:`AdamState.reduced_grad`); ``partitioned_only``: DeepSpeed's pieces alone, for the
        later calls of a step made one param group at a time (or one chained optimizer at a time: a
        Megatron chain readies every member's gradients before the first steps).

        ``dp_group`` drops a gradient on all but the group's first rank only where every rank of the
        group holds the same one: the reference's documentation gives the deduplication for a run
        "without a distributed optimizer" (its code drops every rank's but the first). A share of a
        sharded gradient (an optimizer's piece, an FSDP2 DTensor's local shard) is this rank's alone
        and is recorded on every rank, but where another rank of the group holds the same one (see
        :meth:`_dp_copy`: HSDP's replicas)."""
        adam = self.binding.adam
        reduced_grad = None
        if adam is not None:
            adam.refresh()
            reduced_grad = adam.reduced_grad
        main_grad, dp_duplicate = self.params_have_main_grad, self._dp_duplicate
        for i, info in enumerate(self._params):
            p = info.param
            if info.tp_duplicate or (partitioned_only and not zero.is_partitioned(p)):
                continue
            g = OWN_GRAD if reduced_grad is None else reduced_grad(p)
            if g is OWN_GRAD:  # _grad_of, inline: this runs for every parameter at every step
                g = getattr(p, "main_grad", None) if main_grad else None
                if g is None:
                    g = p.grad
                if g is not None and dp_duplicate and self._dp_copy(g, p):
                    continue
            if g is not None:
                yield i, g

    def _dp_copy(self, g: torch.Tensor, p: torch.Tensor) -> bool:
        """Whether a rank before this one in ``dp_group`` holds the same ``g``, the gradient of ``p``
        (this rank is not the group's first): a plain or whole gradient, or a DTensor's shard that a
        rank before this one in the group holds too (see :func:`shard_held_before`: HSDP's replicas,
        ``fully_shard`` on a (replicate, shard) mesh; a tensor-parallel shard whose dp replicas hold it
        too). Under 2-D DDP + TP ``p`` is the plain Parameter DDP put in a DTensor's place, the
        DTensor's layout in its ``_st_info``: its gradient is that DTensor's local shard."""
        if is_shard(g):
            mesh, placements = g.device_mesh, g.placements
        else:
            spec = getattr(p, "_st_info", None)  # torch's DTensorSpec
            mesh, placements = getattr(spec, "mesh", None), getattr(spec, "placements", None)
            if mesh is None or placements is None or all(pl.is_replicate() for pl in placements):
                return True
        key = (id(mesh), tuple(placements))
        hit = self._dp_replicas.get(key)
        if hit is None or hit[0] is not mesh:
            hit = self._dp_replicas[key] = (mesh, shard_held_before(mesh, placements, self._dp_ranks))
        return hit[1]

    def _own_grad_lists(self, partitioned_only: bool = False) -> tuple[list, list]:
        """:meth:`_own_grads` as two lists, indices and gradients. In the common case (no tensor- or
        data-parallel duplicates, no optimizer's copy of the gradients, no ``main_grad``) without a
        Python step per parameter: this runs at the optimizer step, after the backward's kernels have
        left the interpreter's data out of the CPU caches (the generator's loop cost about 0.25 ms there
        for the benchmark model's 51 parameters)."""
        plist = self._plain_param_tensors()
        adam = self.binding.adam
        if (plist is not None and not partitioned_only and not self._dp_duplicate
                and (adam is None or adam.applies_own_grads(plist))
                and not self._may_have_main_grads(plist)):
            grads = list(map(_GRAD, plist))
            keep = list(map(is_not, grads, repeat(None)))  # (never `None in grads`: see _flush_grads)
            if all(keep):
                return list(range(len(grads))), grads
            return list(compress(range(len(grads)), keep)), list(compress(grads, keep))
        own = list(self._own_grads(partitioned_only))
        return [i for i, _ in own], [g for _, g in own]

    def _plain_param_tensors(self) -> list | None:
        """The monitored parameters' tensors, in order; None where one is a tensor-parallel duplicate
        (made once per parameter list)."""
        params = self._params
        cached = self._plain_params_cache
        if cached is None or cached[0] is not params:
            plain = None if any(info.tp_duplicate for info in params) else [info.param for info in params]
            self._plain_params_cache = cached = (params, plain)
        return cached[1]

    def _reduced_grads(self, st: StepState, partitioned_only: bool = False) -> None:
        """The reduced gradient rows, in the order of the monitored parameters. A gradient that is still
        the tensor measured at the end of the backward pass, with the same version counter, reuses that
        row where a check shows it unchanged (see the module docstring); the others are measured."""
        idx, grads = self._own_grad_lists(partitioned_only)
        if not idx:
            return
        last_unreduced = st.last_unreduced
        if not last_unreduced:  # nothing to reuse (on the one-pass kernel's path by default)
            failed: list = []
            rows = self._rows_of(grads, idx, "reduced gradient", failed=failed)
            self._add_rows(st, KIND_GRAD_REDUCED, rows, idx, placeholders(grads, rows, failed))
            return
        own = list(zip(idx, grads, strict=True))
        rows: list = [None] * len(own)
        fingerprinted, normed = [], []  # (position, gradient, unreduced row, fingerprint)
        for k, (i, g) in enumerate(own):
            last = last_unreduced.get(i)
            if last is not None and last[2]() is g and last[3] == g._version:
                (normed if last[4] is None else fingerprinted).append((k, g, last[0][last[1]], last[4]))
        if fingerprinted:
            # The version counter misses writes that bypass autograd's view of the tensor: AMP's
            # unscale, apex/Megatron fused scaling, .data, numpy. Each tensor's min and max, read again
            # at the elements where the kernel found them, must be what they were.
            same = fused.unchanged([c[1] for c in fingerprinted], np.stack([c[3] for c in fingerprinted]))
            for (k, _, row, _), ok in zip(fingerprinted, same, strict=True):
                if ok:
                    rows[k] = row
        if normed:
            # The torch path's check: the norm, recomputed exactly as the engine computes it (one dot
            # product per tensor, bitwise reproducible), must match.
            eng = self._engine
            cand = torch.stack([c[2] for c in normed])
            same = (eng.norms([c[1] for c in normed]) == cand[:, eng.ops.index("norm")]).tolist()
            for (k, *_), row, ok in zip(normed, cand, same, strict=True):
                if ok:
                    rows[k] = row
        todo = [k for k, r in enumerate(rows) if r is None]
        failed: list = []  # (positions in todo)
        if todo:
            measured = self._rows_of([own[k][1] for k in todo], [own[k][0] for k in todo], "reduced gradient",
                                     failed=failed)
            if len(todo) == len(own):  # nothing reused (on accelerators always): the batch as it is
                self._add_rows(st, KIND_GRAD_REDUCED, measured, [i for i, _ in own], placeholders(grads, measured, failed))
                return
            for j, k in enumerate(todo):
                rows[k] = measured[j]
        if all(isinstance(r, np.ndarray) for r in rows):
            out = np.stack(rows)
        else:
            dev = gather_device(r.device for r in rows if isinstance(r, torch.Tensor))
            out = torch.stack([to_device(torch.from_numpy(r) if isinstance(r, np.ndarray) else r, dev) for r in rows])
        self._add_rows(st, KIND_GRAD_REDUCED, out, [i for i, _ in own],
                       placeholders(grads, out, [todo[j] for j in failed]))

    def _param_pieces(self) -> tuple[list, list]:
        """The monitored parameters as this rank holds them, and their indices: under ZeRO 3, the
        rank's piece of each (outside its forward a parameter is empty there; a parameter wholly in
        other ranks' partitions is left out)."""
        tensors, indices = [], []
        for i, info in enumerate(self._params):
            p = info.param
            if uninitialized(p):
                continue  # a lazy module's that no forward has made yet: no values to measure
            if self.binding.z3 is not None:
                piece = zero.local_param(p)
                if piece is not None:
                    if not piece.numel():
                        continue
                    p = piece
            tensors.append(p)
            indices.append(i)
        return tensors, indices

    def _param_rows(self, st: StepState, kind: str, tensors, indices) -> None:
        tensors = list(tensors)
        if tensors:
            failed: list = []
            rows = self._rows_of(tensors, list(indices), kind, failed=failed)
            self._add_rows(st, kind, rows, list(indices), placeholders(tensors, rows, failed))

    def _rows_of(self, tensors: list, indices: list, what: str, extremes: np.ndarray | None = None,
                 failed: list | None = None) -> torch.Tensor | np.ndarray:
        """The engine's rows of a batch (:meth:`StatsEngine.rows`: a numpy array where the one-pass kernel
        measured every tensor, else a tensor; ``extremes`` filled as it fills them); where the batch
        fails, each tensor alone, so that one tensor the engine cannot measure costs its own row (NaN,
        and a HookFailed naming it), not the batch's. ``failed``: a list given to get the positions of
        such rows appended."""
        try:
            return self._engine.rows(tensors, extremes=extremes)
        except Exception:  # noqa: BLE001 - monitoring never kills training
            if extremes is not None:
                fused.no_fingerprints(extremes)
            rows = []
            for t, i in zip(tensors, indices, strict=True):
                try:
                    rows.append(self._engine.compute([t]))
                except Exception as exc:  # noqa: BLE001
                    self._hook_failed(f"{what} of {self._params[i].name!r}", exc)
                    if failed is not None:
                        failed.append(len(rows))
                    rows.append(None)
            dev = gather_device(r.device for r in rows if r is not None)
            return torch.cat([to_device(r, dev) if r is not None else self._engine.nan_rows(1, dev) for r in rows])

    def _add_rows(self, st: StepState, kind: str, rows: torch.Tensor, indices: list, placeholder=()) -> None:
        """Rows of parameters ``indices`` that fire now, one call id each (the optimizer step's);
        ``placeholder`` as StatsPart's."""
        c0 = st.call
        st.call += len(indices)
        self._add_part(st, kind, rows, indices, (), range(c0, c0 + len(indices)), placeholder)

    def _add_part(self, st: StepState, kind: str, rows, indices, micros, calls, placeholder=()) -> None:
        """The step's rows of parameters ``indices``, with their names and pipeline chunks."""
        infos = list(map(self._params.__getitem__, indices))
        st.stats.add(StatsPart(kind, rows, list(map(_NAME_ID, infos)), micros, calls, (), list(map(_VPP, infos)),
                               placeholder))

    def _no_optimizer(self) -> bool:
        """True (with one warning per run) where no torch optimizer is known to read Adam state from."""
        if self.binding.adam is not None:
            return False
        if not self._warned_no_optimizer:
            self._warned_no_optimizer = True
            log.warning("trainrec: mv_distribution, ur_distribution and mg_direction read the optimizer's Adam "
                        "state, and no torch optimizer is known (none was given, and none over the model's "
                        "parameters has stepped): nothing is recorded for them; pass optimizer=")
        return True

    def _optimizer_rows(self, st: StepState) -> None:
        cfg = self.config
        if not (cfg.mv_distribution or cfg.ur_distribution) or self._no_optimizer():
            return
        eng = self._engine
        # (counters on the CPU are read there; on the accelerators' path, as those on a device, not read)
        entries = self.binding.adam.lookup([p.param for p in self._params], host_steps=eng.host_paths)
        if not entries:
            return
        idx = [e[0] for e in entries]
        rows = fused_adam_rows(entries, eng.ops, eng.eps, cfg.mv_distribution, cfg.ur_distribution) \
            if eng.fused and eng.host_paths else None
        if rows is not None:  # one read of each state pair for all four (CPU, float32 state)
            for kind, r in zip((KIND_EXP_AVG, KIND_EXP_AVG_SQ, KIND_UPDATE, KIND_RATIO), rows, strict=True):
                if r is not None:
                    self._add_rows(st, kind, r, idx)
            return
        if cfg.mv_distribution:
            self._add_rows(st, KIND_EXP_AVG, self._engine.compute([e[1] for e in entries]), idx)
            self._add_rows(st, KIND_EXP_AVG_SQ, self._engine.compute([e[2] for e in entries]), idx)
        if cfg.ur_distribution:
            pair = device_update_and_ratio(entries, eng) if eng.triton_devices else None
            upd, ratio = pair if pair is not None else update_and_ratio(entries, eng.compute, True, True)
            self._add_rows(st, KIND_UPDATE, upd, idx)
            self._add_rows(st, KIND_RATIO, ratio, idx)

    def _mg_direction_rows(self, st: StepState, partitioned_only: bool = False, momenta: tuple | None = None) -> None:
        """mg_direction at the optimizer pre-step, as the reference computes it: per parameter,
        ``((sign(g) . sign(exp_avg)).sum() / numel + 1) / 2`` with the gradient about to be applied and
        the momentum before this update (1.0 where there is no state yet: the first step). A scalar
        row per parameter; its ops are those of a 0-d tensor (min = max = mean = value). Nothing for an
        optimizer outside Adam's family (no ``betas``: SGD, Adagrad, RMSprop; one warning), nor for the
        parameters of one in a list of optimizers, nor where it keeps state but no Adam state, instead of
        the first step's 1.0 at every step. ``momenta``: :meth:`_momenta` as the pre-step hook of a
        ``step(closure)`` kept them (the gradients come after it, from the closure; here, at the post-step
        hook, the state is the update's)."""
        if momenta is None:
            momenta = self._momenta()
            if momenta is None:
                return
        state, stepped = momenta
        if not state and stepped:
            return
        idx, vals = [], []
        for i, g in zip(*self._own_grad_lists(partitioned_only), strict=True):
            m = state.get(i)
            if m is None and not self.binding.adam.in_adam_family(self._params[i].param):
                continue  # a listed optimizer outside Adam's family (SGD beside AdamW): none to come
            if m is not None and m.numel() != g.numel():
                continue  # state of another shape (sharded): not this parameter's
            idx.append(i)
            vals.append(mg_direction(g, m))
        if idx:
            dev = gather_device(v.device for v in vals)  # (a model split over devices)
            self._add_rows(st, KIND_MG_DIRECTION, scalar_rows(torch.stack([to_device(v, dev) for v in vals]),
                                                              self._engine.ops, self._engine.eps), idx)

    def _momenta(self, snapshot: bool = False) -> tuple[dict, bool] | None:
        """``({parameter index: exp_avg}, whether the optimizer holds any state)`` for mg_direction, before
        the update; None (warned once) where there is none to compare with: no optimizer known, or one
        outside Adam's family. ``snapshot``: each ``exp_avg`` as its signs (``torch.sign``, the real and
        imaginary parts' of a complex one: what :func:`mg_direction` takes of it, NaNs kept), for a
        ``step(closure)``, whose update comes before its gradients can be read: a tensor the size of
        each momentum, held from the pre-step hook to the post-step hook."""
        if self._no_optimizer():
            return None
        if not self.binding.adam.adam_family:
            if not self._warned_mg_direction:
                self._warned_mg_direction = True
                log.warning("trainrec: mg_direction compares gradients with Adam's momentum (exp_avg); %s is "
                            "not of Adam's family: nothing is recorded for it", type(self.binding.adam.torch_opt).__name__)
            return None
        state = {e[0]: e[1] for e in self.binding.adam.lookup([p.param for p in self._params], host_steps=False)}
        if snapshot:
            with torch.no_grad():
                state = {i: torch.view_as_complex(torch.sign(torch.view_as_real(m))) if m.is_complex()
                         else torch.sign(m) for i, m in state.items()}
        return state, self.binding.adam.stepped

    def _write_step(self, st: StepState) -> None:
        """The step's hook firings and statistics, to the log (and to the api metrics)."""
        self._settle_grads()
        for leaf in st.leaf_hooks:  # gradient hooks on leaf tensors outlive backward passes: not this step
            leaf.handle.remove()
        st.leaf_hooks.clear()
        self._collections += 1
        self.step_output.write(st)

    def _spill(self) -> None:
        """Runs on the spill thread (:func:`.step_output.spill_loop`)."""
        self.step_output.spill(self._state, self._step_t0, lambda: self._state)

    def _finish_step(self, st: StepState, optimizer_skipped: bool = False, foreign_passes: bool = False) -> None:
        self._write_step(st)
        self._emit(StepEnded(rank=self.rank, step=st.step, wall=time.time(),
                             duration=time.perf_counter() - self._step_t0, collected=True,
                             micro_steps=max([self.steps.grad_acc, *(st.chunk_fwd or st.fwd_count).values()]),
                             optimizer_skipped=optimizer_skipped, foreign_passes=foreign_passes))

def _queue_end_of_backward(fn) -> None:
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


# The largest temporary main_grad + .grad made at once (elements): a larger parameter (an LLM's
# embedding shard) is summed and measured in parts of this size, whose rows are combined.
SUM_PART_NUMEL = 1 << 24


@torch.no_grad()
def mg_direction(g: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """``((sign(g) . sign(m)).sum() / numel + 1) / 2`` as a float32 0-d tensor on ``g``'s device (no sync):
    1 where every sign agrees, 0 where every one differs; 1.0 without ``m``. The signs are multiplied
    in place in one temporary of ``g``'s dtype (values -1, 0, 1: exact in any float dtype) and summed
    in float32, as the reference sums them; a NaN in either gives NaN. No float64 copy."""
    g, m = local_tensor(g), local_tensor(m)
    if g.layout is not torch.strided:
        g = g.to_dense()  # a sparse gradient (nn.Embedding(sparse=True)): signs of every element
    if m is None:
        return torch.ones((), dtype=torch.float32, device=g.device)
    if g.is_complex():  # (no sign for complex numbers: the real and imaginary parts', as Adam updates them)
        g, m = torch.view_as_real(g), torch.view_as_real(m) if m.is_complex() else m
    agree = torch.sign(g.reshape(-1))
    agree.mul_(torch.sign(m.reshape(-1).to(g.device)))
    return (agree.sum(dtype=torch.float32) / g.numel() + 1.0) / 2.0


def scalar_rows(values: torch.Tensor, ops, eps: float) -> torch.Tensor:
    """``[n, len(ops)]`` rows of 0-d tensors with ``values``: what the ops give for a single value."""
    cols = {"min": values, "max": values, "mean": values, "norm": values.abs(),
            "zeros": (values.abs() < eps).to(torch.float32), "nans": torch.isnan(values).to(torch.float32)}
    return torch.stack([cols[op] for op in ops], dim=1)
