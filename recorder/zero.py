"""DeepSpeed ZeRO: where this rank's piece of a partitioned parameter lies.

ZeRO keeps the fp32 master weights, the reduced gradient and the optimizer state of each param group
(ZeRO 3: sub-group) in one flat fp32 partition per rank. A model parameter has a piece in this rank's
partition, or none; its statistics on this rank are those of its piece, as with FSDP2's shards.

- ZeRO 1 and 2 (and ``BF16_Optimizer``): the parameter is whole on every rank and
  ``param._hp_mapping`` gives its piece (group, offset, length; None where it lies elsewhere).
- ZeRO 3: ``ds_tensor`` holds this rank's piece; ``param._z3_optimizer.grad_position`` gives
  sub-group, offset and length in ``fp32_partitioned_groups_flat``; the last rank's padding is cut.

Only attributes DeepSpeed sets are read; nothing of DeepSpeed is imported or changed."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple

import torch


class Piece(NamedTuple):
    """``flat[start:start + count]`` is this rank's piece; ``group``: the torch param group index."""

    flat: torch.Tensor
    start: int
    count: int
    group: int | None


def is_partitioned(p: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO keeps ``p``'s master copy, gradient and optimizer state in flat partitions."""
    return hasattr(p, "_hp_mapping") or (hasattr(p, "ds_id") and hasattr(p, "_z3_optimizer"))


def any_maybe_partitioned(params: Sequence[torch.Tensor]) -> bool:
    """False where :func:`is_partitioned` is False for every one of ``params``, found without a Python
    call per parameter (it runs at every step); True may also mean a ``ds_id`` without a ZeRO 3
    optimizer, where the caller asks :func:`is_partitioned` of each."""
    return any(map(hasattr, params, repeat("_hp_mapping"))) or any(map(hasattr, params, repeat("ds_id")))


def z3_optimizer_of(params) -> object | None:
    """The ZeRO 3 optimizer that partitions ``params`` (None without ZeRO 3)."""
    for p in params:
        z3 = getattr(p, "_z3_optimizer", None)
        if z3 is not None:
            return z3
    return None


def piece_of(p: torch.Tensor, groups: list[dict]) -> Piece | None:
    """Where this rank's piece of partitioned ``p`` lies (``groups``: the torch optimizer's param groups
    as they are between steps); None where this rank holds none of ``p``, or the map is not there."""
    frag = getattr(p, "_hp_mapping", None)
    if frag is not None:
        flat, gi = _flat_of(frag, groups)
        a = frag.hp_fragment_address
        return Piece(flat, int(a.start), int(a.numel), gi) if flat is not None else None
    z3 = getattr(p, "_z3_optimizer", None)
    if z3 is None:
        return None
    try:
        sub, start, n = z3.grad_position[z3.get_param_id(p)]
        flat = z3.fp32_partitioned_groups_flat[sub]
        gi = z3.sub_group_to_group_id[sub]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    count = _valid(p, int(n))
    return Piece(flat, int(start), count, gi) if count > 0 else None


def local_param(p: torch.Tensor) -> torch.Tensor | None:
    """ZeRO 3: this rank's piece of parameter ``p`` (its ``ds_tensor`` without the padding), for
    parameter statistics outside the forward, where ``p`` itself is empty. None for other tensors."""
    ds = getattr(p, "ds_tensor", None)
    if ds is None or not hasattr(p, "ds_id"):
        return None
    return ds.reshape(-1).narrow(0, 0, max(0, _valid(p, ds.numel())))


def step_part(opt: torch.optim.Optimizer, z3) -> tuple[bool, bool]:
    """ZeRO 3: ``(first, last)``: whether this call of ``opt.step`` steps the first and the last
    sub-group's flat partition (the others' ``params`` lists are empty during a call)."""
    flats = z3.fp32_partitioned_groups_flat
    stepping = [q for g in opt.param_groups for q in g["params"]]
    if not flats or not stepping:
        return True, True
    return any(q is flats[0] for q in stepping), any(q is flats[-1] for q in stepping)


def overflow_source(opt: torch.optim.Optimizer, candidates) -> object | None:
    """DeepSpeed's optimizer around torch optimizer ``opt`` (ZeRO 1, 2 or 3, or its fp16 optimizers
    without ZeRO), among ``candidates``: what keeps the flag ``overflow``, set by each of its
    ``step()`` calls (True: the gradients reduced across ranks held an inf or NaN, every rank's
    step was skipped and the torch optimizer's never ran). Candidates are what holds ``opt`` directly
    (:func:`.optim.holder_of`, past accelerate's ``DeepSpeedOptimizerWrapper``). None where none of
    them is one."""
    for w in candidates:
        if w is not None and w is not opt and getattr(w, "optimizer", None) is opt and isinstance(
                getattr(w, "overflow", None), bool):
            return w
    return None


def referrers_of(opt: torch.optim.Optimizer):
    """What refers to ``opt`` directly, found through the garbage collector (one walk of every tracked
    object, so not for a hot path). An instance whose attributes are
    a dict of their own appears as that dict; its owner is looked up only for a dict that holds ``opt``
    as ``optimizer`` with a bool ``overflow`` beside it. Candidates for :func:`overflow_source` where
    DeepSpeed is loaded and nothing the monitor was given names its optimizer: the reference's
    ``optimizer=optimizer.optimizer`` (the torch optimizer inside DeepSpeed's) with a model that is
    not the engine (``engine.module``). Nothing is called."""
    import gc

    for r in gc.get_referrers(opt):
        if isinstance(r, dict):
            if r.get("optimizer") is opt and isinstance(r.get("overflow"), bool):
                yield from (o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r)
        else:
            yield r


def steps_taken(w) -> int | None:
    """How many times DeepSpeed's optimizer ``w`` (see :func:`overflow_source`) has stepped, skipped
    steps included: its dynamic loss scaler's count (None with a static scale, which keeps none)."""
    n = getattr(getattr(w, "loss_scaler", None), "cur_iter", None)
    return n if isinstance(n, int) else None


def _flat_of(frag, groups: list[dict]) -> tuple[torch.Tensor | None, int | None]:
    """The flat partition (a parameter of the torch optimizer) that ``frag``'s piece lies in."""
    ptr = frag.hp_fragment.untyped_storage().data_ptr()
    gi = getattr(frag, "param_group_index", None)
    order = ([gi] if isinstance(gi, int) and 0 <= gi < len(groups) else []) + list(range(len(groups)))
    for i in order:
        for flat in groups[i]["params"]:
            if flat.untyped_storage().data_ptr() == ptr:
                return flat, i
    return None, None


def _valid(p: torch.Tensor, partition: int) -> int:
    """ZeRO 3: how many of this rank's ``partition`` elements of ``p`` are ``p``'s (the rest is padding)."""
    import torch.distributed as dist

    numel = int(getattr(p, "ds_numel", p.numel()))
    group = getattr(p, "ds_process_group", None)
    rank = dist.get_rank(group=group) if dist.is_available() and dist.is_initialized() else 0
    return min(partition, numel - rank * partition)
