"""Anomaly rules, shared by the recorder (record time) and the analyzers (replay time).

Their per-series state is :mod:`.rule_state`, their config :mod:`.rule_config`, and :mod:`.detector`
applies them to stats records.

Rules (config ``alert.rules``: ``[{"rule_name": NAME, "args": {...}}]``)
    ``AnomalyTurbulence(threshold, window=16, warmup=8, noise=8, range_floor=0.2, floor=0, sudden=true, nan=true)``
        the reference's relative deviation, both directions, against the median of a window;
    ``NaNInf()``
        a series turning non-finite, a ``nans`` count rising from 0;
    ``ZScore(threshold=4, window=16, warmup=8, floor=0)``
        ``|value - mean| / max(std, floor, op floor)`` over the last ``window`` finite values.

Placeholder rows are skipped by every rule. Thresholds may be int or float. The formulas and what
each argument does: docs/config.md, "Anomaly rules"."""

from __future__ import annotations

from typing import Any

import numpy as np

from .rule_state import NANS_OP, SeriesState, median_sorted, nonfinite_flags, op_floors, window_median

__all__ = ["RULES", "AnomalyTurbulence", "NaNInf", "Rule", "ZScore"]

# Ops measured in the tensor's own units, whose scale is floored relative to its range (max |min|, |max|).
_VALUE_OPS = ("min", "max", "mean")


class Rule:
    """A detection rule over series. ``observe`` judges one record and then updates the state.

    ``observe(sids, ops, values)``: ``sids`` are unique series ids (one per row), ``values`` a float64
    ``rows x len(ops)`` matrix. Returns ``(flags, baselines)``, both ``rows x len(ops)``; a baseline is
    only defined where a flag is set (elsewhere it may be NaN).
    """

    name = "Rule"

    def __init__(self, window: int = 1) -> None:
        self._state = SeriesState(window)

    @property
    def args(self) -> dict[str, Any]:
        raise NotImplementedError

    def observe(self, sids: np.ndarray, ops: tuple[str, ...], values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f"{self.name}({args})"


class NaNInf(Rule):
    """The first NaN/Inf of a series; a ``nans`` count rising from 0."""

    name = "NaNInf"

    def __init__(self) -> None:
        super().__init__(window=1)

    @property
    def args(self) -> dict[str, Any]:
        return {}

    def observe(self, sids, ops, values):
        st = self._state
        sel = st.index(sids, st.columns(ops))
        finite = np.isfinite(values)
        flags, base = nonfinite_flags(st, sel, ops, values, finite)
        st.update(sel, values, finite)
        return flags, base


class AnomalyTurbulence(Rule):
    """Relative deviation from a windowed median beyond ``threshold``, both directions (see module doc)."""

    name = "AnomalyTurbulence"

    def __init__(
        self,
        threshold: float,
        window: int = 16,
        warmup: int = 8,
        noise: float = 8.0,
        floor: float = 0.0,
        nan: bool = True,
        sudden: bool = True,
        range_floor: float = 0.2,
    ) -> None:
        super().__init__(window=window)
        self.sudden = bool(sudden)
        self.range_floor = float(range_floor)
        self.threshold = float(threshold)
        self.window = int(window)
        self.warmup = int(warmup)
        self.noise = float(noise)
        self.floor = float(floor)
        self.nan = bool(nan)

    @property
    def args(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold, "window": self.window, "warmup": self.warmup,
            "noise": self.noise, "floor": self.floor, "nan": self.nan, "sudden": self.sudden,
            "range_floor": self.range_floor,
        }

    def observe(self, sids, ops, values):
        st = self._state
        sel = st.index(sids, st.columns(ops))
        x = values
        finite = np.isfinite(x)
        hist = st.values(sel)  # W x rows x ops (a view in the usual case)
        n = st.count[sel]
        last = st.last[sel]
        floors = op_floors(ops, self.floor)
        t = self.threshold
        jmin = ops.index("min") if self.range_floor and "min" in ops and "max" in ops else -1
        jmax = ops.index("max") if jmin >= 0 else -1
        value_cols = [ops.index(op) for op in _VALUE_OPS if op in ops] if jmin >= 0 else []
        flags = np.zeros(x.shape, dtype=bool)
        base = np.full(x.shape, np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            # 1. Candidates, cheaply: the change is at most the distance to the window's extremes
            #    (and, with sudden, to the previous value); the scale is at least L below. Only
            #    candidates (a small fraction) get the exact medians, which need sorting.
            hmin = np.fmin.reduce(hist, axis=0)
            hmax = np.fmax.reduce(hist, axis=0)
            low = np.where(hmin > 0, hmin, np.where(hmax < 0, -hmax, 0.0))  # <= |median|
            bound_scale = np.maximum(low, floors)
            if jmin >= 0:
                low_abs = np.maximum(low[:, jmin], low[:, jmax])
                for j in value_cols:
                    bound_scale[:, j] = np.maximum(bound_scale[:, j], self.range_floor * low_abs)
            bound = np.maximum(np.abs(x - hmin), np.abs(x - hmax))
            if self.sudden:
                bound = np.fmin(bound, np.abs(x - last))
            cand = finite & (n >= max(self.warmup, 1)) & (bound > t * bound_scale)
            if NANS_OP in ops:
                cand[:, ops.index(NANS_OP)] = False
            rows = np.flatnonzero(cand.any(axis=1))
            if rows.size:
                # 2. Exact: median baseline, MAD spread, floors, change, deviation
                h = np.moveaxis(hist[:, rows], 0, -1)  # candidates x ops x W
                nr = n[rows]
                xr = x[rows]
                med = window_median(h, nr)
                dev_hist = np.abs(h - med[..., None])
                dev_hist.sort(axis=-1)
                spread = median_sorted(dev_hist, nr)
                scale = np.maximum(np.maximum(np.abs(med), self.noise * spread), floors)
                if jmin >= 0:
                    absmax = np.maximum(np.abs(med[:, jmin]), np.abs(med[:, jmax]))
                    for j in value_cols:
                        scale[:, j] = np.fmax(scale[:, j], self.range_floor * absmax)
                diff = np.abs(xr - med)
                if self.sudden:
                    diff = np.fmin(diff, np.abs(xr - last[rows]))
                flags[rows] = cand[rows] & (diff / scale > t)
                base[rows] = med
        if self.nan:
            nan_flags, nan_base = nonfinite_flags(st, sel, ops, x, finite)
            nf = np.flatnonzero(nan_flags.any(axis=1))
            if nf.size:
                # a NaN's baseline is the window's median; a nans count's is the previous count
                base[nf] = window_median(np.moveaxis(hist[:, nf], 0, -1), n[nf])
                if NANS_OP in ops:
                    j = ops.index(NANS_OP)
                    base[nf, j] = nan_base[nf, j]
            flags |= nan_flags
        st.update(sel, x, finite)
        return flags, base


class ZScore(Rule):
    """``|value - mean| / max(std, floor) > threshold`` over the last ``window`` finite values."""

    name = "ZScore"

    def __init__(self, threshold: float = 4.0, window: int = 16, warmup: int = 8, floor: float = 0.0) -> None:
        super().__init__(window=window)
        self.threshold = float(threshold)
        self.window = int(window)
        self.warmup = int(warmup)
        self.floor = float(floor)

    @property
    def args(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "window": self.window, "warmup": self.warmup, "floor": self.floor}

    def observe(self, sids, ops, values):
        st = self._state
        sel = st.index(sids, st.columns(ops))
        x = values
        finite = np.isfinite(x)
        # (a window-first copy: numpy sums a view window by window and an index copy pairwise, so the
        # last bit of the mean would depend on which rows a record holds; this way it does not)
        hist = np.ascontiguousarray(st.values(sel))  # W x rows x ops
        n = st.count[sel]
        with np.errstate(invalid="ignore", divide="ignore"):
            ok = np.isfinite(hist)
            mean = np.where(ok, hist, 0.0).sum(axis=0) / n
            var = (np.where(ok, hist - mean, 0.0) ** 2).sum(axis=0) / n
            scale = np.maximum(np.sqrt(var), op_floors(ops, self.floor))
            z = np.abs(x - mean) / scale
            flags = finite & (n >= max(self.warmup, 2)) & (z > self.threshold)
        st.update(sel, x, finite)
        return flags, mean


RULES: dict[str, type[Rule]] = {cls.name: cls for cls in (AnomalyTurbulence, NaNInf, ZScore)}
