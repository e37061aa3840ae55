"""The reference's tag names, derived from a stats row (kind, name, slot, micro step, rank, vpp stage).

A stats row stores the plain (possibly squashed) module or parameter name; the reference's tag names
are projections of it, used by exports, anomaly JSON and ranking:

=================  ===========================================  ===========================
kind               tag                                          example
=================  ===========================================  ===========================
actv               ``{vpp}:{name}_{micro}/rank{R}/input``       ``0:0.self_attn_0/rank0/output``
actv_grad          ``{vpp}:{name}_{micro}/rank{R}/input_grad``  ``0:_0/rank0/input_grad``
grad_unreduced     ``{vpp}:{name}/rank{R}/acc_grad``            ``0:head.bias/rank0/acc_grad``
grad_reduced       ``{vpp}:{name}/rank{R}/post_grad``           ``0:embed.weight/rank0/post_grad``
param              ``{vpp}:{name}``                             ``0:embed.weight``
exp_avg            ``{vpp}:{name}/rank{R}/exp_avg``
exp_avg_sq         ``{vpp}:{name}/rank{R}/efxp_avg_sq``         (the reference's typo, kept)
update / ratio     ``{vpp}:{name}/rank{R}/adam_update`` / ``adam_ratio``
mg_direction       ``{vpp}:{name}/rank{R}/mg_direction``
=================  ===========================================  ===========================

The rank segment is absent when ``rank`` is None (the reference omits it without torch.distributed).
A TensorBoard scalar tag is ``f"{tag}_{op}"``.
"""

from __future__ import annotations

from .events import SLOTS

_SUFFIX = {
    "grad_unreduced": "acc_grad",
    "grad_reduced": "post_grad",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "efxp_avg_sq",
    "update": "adam_update",
    "ratio": "adam_ratio",
}

# Training stage of a tag's last segment, as the reference's ranking uses it.
STAGE_FORWARD = 0
STAGE_BACKWARD = 1
STAGE_OPTIMIZER = 2


def reference_tag(kind: str, name: str, slot: int | str = 0, micro_step: int = 0, rank: int | None = 0, vpp_stage: int = 0) -> str:
    """The reference's tag name for one stats row (without the ``_{op}`` suffix)."""
    rank_seg = "" if rank is None else f"/rank{rank}"
    if kind in ("actv", "actv_grad"):
        slot_name = SLOTS[slot] if isinstance(slot, int) else slot
        return f"{vpp_stage}:{name}_{micro_step}{rank_seg}/{slot_name}"
    if kind == "param":
        return f"{vpp_stage}:{name}"
    suffix = _SUFFIX.get(kind, kind)
    return f"{vpp_stage}:{name}{rank_seg}/{suffix}"


def stage_of_kind(kind: str) -> int:
    """Forward (0), backward (1) or optimizer (2) stage of a stats kind."""
    if kind == "actv":
        return STAGE_FORWARD
    if kind in ("actv_grad", "grad_unreduced"):
        return STAGE_BACKWARD
    return STAGE_OPTIMIZER
