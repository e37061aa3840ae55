"""Rows of monitored parameters into a collected step's statistics: measured in one batch, each tensor
alone where the batch fails (one tensor the engine cannot measure costs its own row, not the batch's)."""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import torch

from . import fused
from .context import RecordingContext
from .step_state import StepState
from .step_stats import StatsPart, gather_device, to_device

_NAME_ID = attrgetter("name_id")
_VPP = attrgetter("vpp")


class StepRows:
    """Measures parameters' tensors with the context's engine and adds their rows to a step."""

    def __init__(self, context: RecordingContext) -> None:
        self.context = context

    def rows_of(self, tensors: list, indices: list, what: str, extremes: np.ndarray | None = None,
                failed: list | None = None) -> torch.Tensor | np.ndarray:
        """The engine's rows of a batch (:meth:`StatsEngine.rows`: a numpy array where the one-pass kernel
        measured every tensor, else a tensor; ``extremes`` filled as it fills them); where the batch
        fails, each tensor alone (NaN, and a HookFailed naming it, for one that fails). ``failed``: a
        list given to get the positions of such rows appended."""
        ctx = self.context
        engine = ctx.engine
        try:
            return engine.rows(tensors, extremes=extremes)
        except Exception:  # noqa: BLE001 - monitoring never kills training
            if extremes is not None:
                fused.no_fingerprints(extremes)
            rows = []
            for t, i in zip(tensors, indices, strict=True):
                try:
                    rows.append(engine.compute([t]))
                except Exception as exc:  # noqa: BLE001
                    ctx.hook_failed(f"{what} of {ctx.params[i].name!r}", exc)
                    if failed is not None:
                        failed.append(len(rows))
                    rows.append(None)
            dev = gather_device(r.device for r in rows if r is not None)
            return torch.cat([to_device(r, dev) if r is not None else engine.nan_rows(1, dev) for r in rows])

    def add_rows(self, st: StepState, kind: str, rows, indices: list, placeholder=()) -> None:
        """Rows of parameters ``indices`` that fire now, one call id each (the optimizer step's);
        ``placeholder`` as StatsPart's."""
        c0 = st.call
        st.call += len(indices)
        self.add_part(st, kind, rows, indices, (), range(c0, c0 + len(indices)), placeholder)

    def add_part(self, st: StepState, kind: str, rows, indices, micros, calls, placeholder=()) -> None:
        """The step's rows of parameters ``indices``, with their names and pipeline chunks."""
        infos = list(map(self.context.params.__getitem__, indices))
        st.stats.add(StatsPart(kind, rows, list(map(_NAME_ID, infos)), micros, calls, (), list(map(_VPP, infos)),
                               placeholder))
