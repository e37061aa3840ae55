"""Which gradients this rank reports at the optimizer step: less tensor-parallel duplicates, less
data-parallel duplicates where ``dp_group`` was given, the optimizer's own copy where it keeps one."""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, is_not

import torch

from . import zero
from .binding import OptimizerBinding
from .context import RecordingContext
from .grad_batch import may_have_main_grads
from .grad_places import is_shard, shard_held_before
from .optim import OWN_GRAD

_GRAD = attrgetter("grad")


class GradOwnership:
    """This rank's gradients of the monitored parameters (``own_grads``, ``own_grad_lists``).

    ``dp_duplicate``: this rank is not ``dp_group``'s first; ``dp_ranks``: the group's ranks, in group
    order (both set by :meth:`join_dp_group`)."""

    def __init__(self, context: RecordingContext, binding: OptimizerBinding) -> None:
        self.context = context
        self.binding = binding
        self.dp_duplicate = False
        self.dp_ranks: tuple = ()
        self._replicas: dict = {}  # _dp_copy's, per (DTensor mesh, placements)
        self._plain_cache: tuple | None = None  # _plain_param_tensors'

    def join_dp_group(self, dp_group) -> None:
        """Deduplicate over ``dp_group`` (a torch process group this rank is in)."""
        import torch.distributed as dist

        self.dp_duplicate = dist.get_rank(group=dp_group) != 0
        self.dp_ranks = tuple(dist.get_process_group_ranks(dp_group))

    def params_changed(self) -> None:
        """The parameters' ``tp_duplicate`` marks changed in place: the plain list is made again."""
        self._plain_cache = None

    def own_grads(self, partitioned_only: bool = False):
        """``(index, gradient)`` of the monitored parameters this rank reports at the optimizer step: those
        with a gradient, less tensor-parallel duplicates, and less data-parallel duplicates where
        ``dp_group`` was given. Where the optimizer keeps its own reduced gradient (DeepSpeed ZeRO,
        Megatron's DistributedOptimizer), this rank's share of that (:meth:`AdamState.reduced_grad`);
        ``partitioned_only``: DeepSpeed's pieces alone, for the later calls of a step made one param group
        (or chained optimizer) at a time. A sharded gradient is this rank's own and kept on every rank,
        except where ranks of the group hold the same shard (:meth:`_dp_copy`; docs/distributed.md)."""
        adam = self.binding.adam
        reduced_grad = None
        if adam is not None:
            adam.refresh()
            reduced_grad = adam.reduced_grad
        main_grad, dp_duplicate = self.context.params_have_main_grad, self.dp_duplicate
        for i, info in enumerate(self.context.params):
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
        hit = self._replicas.get(key)
        if hit is None or hit[0] is not mesh:
            hit = self._replicas[key] = (mesh, shard_held_before(mesh, placements, self.dp_ranks))
        return hit[1]

    def own_grad_lists(self, partitioned_only: bool = False) -> tuple[list, list]:
        """:meth:`own_grads` as two lists, indices and gradients. In the common case (no tensor- or
        data-parallel duplicates, no optimizer's copy of the gradients, no ``main_grad``) without a
        Python step per parameter: at the optimizer step the interpreter's data is out of the CPU caches."""
        plist = self._plain_param_tensors()
        adam = self.binding.adam
        if (plist is not None and not partitioned_only and not self.dp_duplicate
                and (adam is None or adam.applies_own_grads(plist))
                and not may_have_main_grads(plist, self.context.params_have_main_grad)):
            grads = list(map(_GRAD, plist))
            keep = list(map(is_not, grads, repeat(None)))  # (never `None in grads`: see grad_batch._flush)
            if all(keep):
                return list(range(len(grads))), grads
            return list(compress(range(len(grads)), keep)), list(compress(grads, keep))
        own = list(self.own_grads(partitioned_only))
        return [i for i, _ in own], [g for _, g in own]

    def _plain_param_tensors(self) -> list | None:
        """The monitored parameters' tensors, in order; None where one is a tensor-parallel duplicate
        (made once per parameter list)."""
        params = self.context.params
        cached = self._plain_cache
        if cached is None or cached[0] is not params:
            plain = None if any(info.tp_duplicate for info in params) else [info.param for info in params]
            self._plain_cache = cached = (params, plain)
        return cached[1]
