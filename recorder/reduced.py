"""Reduced gradients and parameters at the optimizer pre-step.

A reduced gradient is measured again unless its last unreduced row provably still holds: the same
tensor, the same version counter, and a check that it is unchanged (AMP's unscale, ``.data`` and
numpy writes leave the counter alone). On the torch CPU path the check is the norm, recomputed
bitwise as the engine computes it; on the kernel's path (CPU float32, 64K elements or more) it is
:func:`fused.unchanged`: both extremes and a sample of one 64-byte line per KiB. Its blind spot, a
few scattered writes through ``.data`` or numpy, is covered by ``TRAINREC_REUSE_UNCHANGED_GRADS=0``.
Accelerators always measure again (a check would sync)."""

from __future__ import annotations

import numpy as np
import torch
from trainrec.schema.events import KIND_GRAD_REDUCED

from . import fused, zero
from .binding import OptimizerBinding
from .context import RecordingContext
from .dedup import GradOwnership
from .step_rows import StepRows
from .step_state import StepState
from .step_stats import gather_device, placeholders, to_device
from .targets import uninitialized


class ReducedRows:
    """The reduced gradient rows (KIND_GRAD_REDUCED) of this rank's gradients (``ownership``), and the
    parameter rows (``param_pieces``, ``param_rows``: under ZeRO 3 this rank's pieces, via ``binding``)."""

    def __init__(self, context: RecordingContext, ownership: GradOwnership, binding: OptimizerBinding,
                 rows: StepRows) -> None:
        self.context = context
        self.ownership = ownership
        self.binding = binding
        self.rows = rows

    def reduced_grads(self, st: StepState, partitioned_only: bool = False) -> None:
        """The reduced gradient rows, in the order of the monitored parameters. A gradient that is still
        the tensor measured at the end of the backward pass, with the same version counter, reuses that
        row where a check shows it unchanged (see the module docstring); the others are measured."""
        idx, grads = self.ownership.own_grad_lists(partitioned_only)
        if not idx:
            return
        last_unreduced = st.last_unreduced
        if not last_unreduced:  # nothing to reuse (on the one-pass kernel's path by default)
            failed: list = []
            rows = self.rows.rows_of(grads, idx, "reduced gradient", failed=failed)
            self.rows.add_rows(st, KIND_GRAD_REDUCED, rows, idx, placeholders(grads, rows, failed))
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
            eng = self.context.engine
            cand = torch.stack([c[2] for c in normed])
            same = (eng.norms([c[1] for c in normed]) == cand[:, eng.ops.index("norm")]).tolist()
            for (k, *_), row, ok in zip(normed, cand, same, strict=True):
                if ok:
                    rows[k] = row
        todo = [k for k, r in enumerate(rows) if r is None]
        failed: list = []  # (positions in todo)
        if todo:
            measured = self.rows.rows_of([own[k][1] for k in todo], [own[k][0] for k in todo], "reduced gradient",
                                     failed=failed)
            if len(todo) == len(own):  # nothing reused (on accelerators always): the batch as it is
                self.rows.add_rows(st, KIND_GRAD_REDUCED, measured, [i for i, _ in own], placeholders(grads, measured, failed))
                return
            for j, k in enumerate(todo):
                rows[k] = measured[j]
        if all(isinstance(r, np.ndarray) for r in rows):
            out = np.stack(rows)
        else:
            dev = gather_device(r.device for r in rows if isinstance(r, torch.Tensor))
            out = torch.stack([to_device(torch.from_numpy(r) if isinstance(r, np.ndarray) else r, dev) for r in rows])
        self.rows.add_rows(st, KIND_GRAD_REDUCED, out, [i for i, _ in own],
                       placeholders(grads, out, [todo[j] for j in failed]))

    def param_pieces(self) -> tuple[list, list]:
        """The monitored parameters as this rank holds them, and their indices: under ZeRO 3, the
        rank's piece of each (outside its forward a parameter is empty there; a parameter wholly in
        other ranks' partitions is left out)."""
        tensors, indices = [], []
        for i, info in enumerate(self.context.params):
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

    def param_rows(self, st: StepState, kind: str, tensors, indices) -> None:
        tensors = list(tensors)
        if tensors:
            failed: list = []
            rows = self.rows.rows_of(tensors, list(indices), kind, failed=failed)
            self.rows.add_rows(st, kind, rows, list(indices), placeholders(tensors, rows, failed))
