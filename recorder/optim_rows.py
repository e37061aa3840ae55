"""Optimizer rows of a collected step: Adam's state (``exp_avg``, ``exp_avg_sq``), ``update`` and
``ratio``, and ``mg_direction`` (gradients against the momentum, as the reference computes it)."""

from __future__ import annotations

import logging

import torch
from trainrec.schema.events import KIND_EXP_AVG, KIND_EXP_AVG_SQ, KIND_MG_DIRECTION, KIND_RATIO, KIND_UPDATE

from .adam_update import device_update_and_ratio, fused_adam_rows, update_and_ratio
from .binding import OptimizerBinding
from .context import RecordingContext
from .dedup import GradOwnership
from .fused import local_tensor
from .step_rows import StepRows
from .step_state import StepState
from .step_stats import gather_device, to_device

log = logging.getLogger(__name__)


class OptimizerRows:
    """Rows read from the bound optimizer's Adam state (``binding.adam``), for this rank's gradients
    (``ownership``). Warns once where there is no such state to read."""

    def __init__(self, context: RecordingContext, ownership: GradOwnership, binding: OptimizerBinding,
                 rows: StepRows) -> None:
        self.context = context
        self.ownership = ownership
        self.binding = binding
        self.rows = rows
        self._warned_no_optimizer = False
        self._warned_mg_direction = False

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

    def optimizer_rows(self, st: StepState, cfg) -> None:
        """Adam's ``exp_avg``/``exp_avg_sq`` (``cfg.mv_distribution``) and ``update``/``ratio``
        (``cfg.ur_distribution``), after the update."""
        if not (cfg.mv_distribution or cfg.ur_distribution) or self._no_optimizer():
            return
        eng = self.context.engine
        # (counters on the CPU are read there; on the accelerators' path, as those on a device, not read)
        entries = self.binding.adam.lookup([p.param for p in self.context.params], host_steps=eng.host_paths)
        if not entries:
            return
        idx = [e[0] for e in entries]
        rows = fused_adam_rows(entries, eng.ops, eng.eps, cfg.mv_distribution, cfg.ur_distribution) \
            if eng.fused and eng.host_paths else None
        if rows is not None:  # one read of each state pair for all four (CPU, float32 state)
            for kind, r in zip((KIND_EXP_AVG, KIND_EXP_AVG_SQ, KIND_UPDATE, KIND_RATIO), rows, strict=True):
                if r is not None:
                    self.rows.add_rows(st, kind, r, idx)
            return
        if cfg.mv_distribution:
            self.rows.add_rows(st, KIND_EXP_AVG, self.context.engine.compute([e[1] for e in entries]), idx)
            self.rows.add_rows(st, KIND_EXP_AVG_SQ, self.context.engine.compute([e[2] for e in entries]), idx)
        if cfg.ur_distribution:
            pair = device_update_and_ratio(entries, eng) if eng.triton_devices else None
            upd, ratio = pair if pair is not None else update_and_ratio(entries, eng.compute, True, True)
            self.rows.add_rows(st, KIND_UPDATE, upd, idx)
            self.rows.add_rows(st, KIND_RATIO, ratio, idx)

    def mg_direction_rows(self, st: StepState, partitioned_only: bool = False, momenta: tuple | None = None) -> None:
        """mg_direction at the optimizer pre-step, as the reference computes it: per parameter,
        ``((sign(g) . sign(exp_avg)).sum() / numel + 1) / 2`` with the gradient about to be applied and the
        momentum before this update (1.0 where there is no state yet). A scalar row per parameter. Nothing
        for an optimizer outside Adam's family (one warning), one in a list of optimizers, or one with no
        Adam state. ``momenta``: :meth:`momenta` as a ``step(closure)``'s pre-step hook kept them (the
        gradients come later, from the closure)."""
        if momenta is None:
            momenta = self.momenta()
            if momenta is None:
                return
        state, stepped = momenta
        if not state and stepped:
            return
        idx, vals = [], []
        for i, g in zip(*self.ownership.own_grad_lists(partitioned_only), strict=True):
            m = state.get(i)
            if m is None and not self.binding.adam.in_adam_family(self.context.params[i].param):
                continue  # a listed optimizer outside Adam's family (SGD beside AdamW): none to come
            if m is not None and m.numel() != g.numel():
                continue  # state of another shape (sharded): not this parameter's
            idx.append(i)
            vals.append(mg_direction(g, m))
        if idx:
            dev = gather_device(v.device for v in vals)  # (a model split over devices)
            self.rows.add_rows(st, KIND_MG_DIRECTION, scalar_rows(torch.stack([to_device(v, dev) for v in vals]),
                                                              self.context.engine.ops, self.context.engine.eps), idx)

    def momenta(self, snapshot: bool = False) -> tuple[dict, bool] | None:
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
        state = {e[0]: e[1] for e in self.binding.adam.lookup([p.param for p in self.context.params], host_steps=False)}
        if snapshot:
            with torch.no_grad():
                state = {i: torch.view_as_complex(torch.sign(torch.view_as_real(m))) if m.is_complex()
                         else torch.sign(m) for i, m in state.items()}
        return state, self.binding.adam.stepped


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
