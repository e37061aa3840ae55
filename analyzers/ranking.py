"""Execution order of anomalies across ranks, to find the first one.

:func:`execution_key` sorts anomalies (recorded, re-detected or read from the reference's JSON) in
the order training produced them: step; micro step by micro step, forward (pipeline stages
ascending) before backward (descending), each by call id; after the last micro step the gradient
reduction, then the optimizer step (parameters, ``exp_avg``, ``exp_avg_sq``, ``update``, ``ratio``);
ties by rank, then tag, then recorded order. Unknown call ids (-1) sort after the known ones of
their group. The rule and its differences from the reference: docs/config.md ("Anomalies").
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable

from trainrec.schema.events import KINDS, AnomalyDetected

__all__ = [
    "PHASE_BACKWARD",
    "PHASE_FORWARD",
    "PHASE_NAMES",
    "PHASE_OPTIMIZER",
    "PHASE_REDUCE",
    "execution_key",
    "kind_of",
    "kind_of_tag",
    "phase_of",
    "rank_anomalies",
]

PHASE_FORWARD = 0
PHASE_BACKWARD = 1
PHASE_REDUCE = 2
PHASE_OPTIMIZER = 3
PHASE_NAMES = ("fwd", "bwd", "reduce", "optim")

_PHASE_OF_KIND = {
    "actv": PHASE_FORWARD,
    "actv_grad": PHASE_BACKWARD,
    "grad_unreduced": PHASE_BACKWARD,
    "grad_reduced": PHASE_REDUCE,
}
# Last tag segment -> kind, for tags without a recorded kind (the reference's JSON).
_SUFFIX_KIND = {
    "input": "actv",
    "output": "actv",
    "actv": "actv",  # 1.2.2 activation tags: "{module}.input:{micro}/rank{R}/actv"
    "input_grad": "actv_grad",
    "output_grad": "actv_grad",
    "actv_grad": "actv_grad",
    "acc_grad": "grad_unreduced",
    "pre_grad": "grad_unreduced",
    "post_grad": "grad_reduced",
    "exp_avg": "exp_avg",
    "efxp_avg_sq": "exp_avg_sq",
    "exp_avg_sq": "exp_avg_sq",
    "adam_update": "update",
    "adam_ratio": "ratio",
    "mg_direction": "mg_direction",
}
_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}
_LAST = 1 << 62


def kind_of_tag(tag_name: str) -> str:
    """The stats kind a reference tag name belongs to ("" when unknown)."""
    if "/" not in tag_name:
        return "param"
    return _SUFFIX_KIND.get(tag_name.rsplit("/", 1)[1], "")


def kind_of(ev: AnomalyDetected) -> str:
    return ev.kind or kind_of_tag(ev.tag_name)


def phase_of(ev: AnomalyDetected) -> int:
    """PHASE_FORWARD, PHASE_BACKWARD, PHASE_REDUCE or PHASE_OPTIMIZER (also for unknown kinds)."""
    return _PHASE_OF_KIND.get(kind_of(ev), PHASE_OPTIMIZER)


def execution_key(ev: AnomalyDetected) -> tuple:
    """Sort key of one anomaly in execution order (see the module docstring)."""
    kind = kind_of(ev)
    phase = _PHASE_OF_KIND.get(kind, PHASE_OPTIMIZER)
    call = ev.call_id if ev.call_id >= 0 else _LAST
    if phase == PHASE_FORWARD or phase == PHASE_OPTIMIZER:
        stage = (ev.pp_stage, ev.vpp_stage)
    else:
        stage = (-ev.pp_stage, -ev.vpp_stage)
    micro = ev.micro_step if phase <= PHASE_BACKWARD else _LAST
    kind_rank = _KIND_ORDER.get(kind, len(_KIND_ORDER)) if phase == PHASE_OPTIMIZER else 0
    # (no op or rule: sorted() and heapq.nsmallest are stable, and the ops of one record are in its order)
    return (ev.step, micro, phase, *stage, kind_rank, call, ev.rank, ev.tag_name)


def rank_anomalies(
    anomalies: Iterable[AnomalyDetected], k: int | None = None, steps: Container[int] | None = None
) -> list[AnomalyDetected]:
    """The first ``k`` anomalies (all when None) in execution order, of ``steps`` only when given
    (any container: a list, a set, a :class:`~trainrec.analyzers.selection.StepSet`)."""
    if steps is not None:
        anomalies = (a for a in anomalies if a.step in steps)
    if k is None:
        return sorted(anomalies, key=execution_key)
    if k <= 0:
        raise ValueError(f"k must be positive, not {k}")
    return heapq.nsmallest(k, anomalies, key=execution_key)
