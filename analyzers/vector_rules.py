"""The anomaly rules of :mod:`trainrec.schema.rules`, run over whole series at once.

Re-detection has every record of a (rank, kind) at hand, so the rules run over a block ``X`` of
shape ``(records, series, ops)``, with rolling reductions over each series' finite values instead of
a Python loop over records. The results are the record-time Detector's, value for value (same
filter, median, spread, floors and arithmetic order; ``tests/analyzers/test_columnar_scan.py``).
``missing`` observations (placeholder rows, absent series) are neither judged nor enter the state.
"""

from __future__ import annotations

import numpy as np
from trainrec.schema.rule_state import median_sorted, op_floors
from trainrec.schema.rules import AnomalyTurbulence, NaNInf, Rule, ZScore

from .series_block import SeriesBlock, nonzero, rolling, window_rows

__all__ = ["block_flags"]

NANS_OP = "nans"
_VALUE_OPS = ("min", "max", "mean")
# Observations per chunk of the exact (sorting) step and of ZScore's windows: bounds their temporaries.
_CHUNK = 1 << 16


def _nan_flags(block: SeriesBlock, ops: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A series turning non-finite after a finite value; a nans count rising from 0 (present rows only)."""
    x = block.x
    last, last_ok = block.last()
    finite = np.isfinite(x)
    flags = ~finite & last_ok & block.present
    if NANS_OP in ops:
        j = ops.index(NANS_OP)
        flags[:, :, j] |= block.finite[:, :, j] & (x[:, :, j] > 0) & (last[:, :, j] == 0)
    return flags, last


def _candidates32(rule: AnomalyTurbulence, block: SeriesBlock) -> tuple[np.ndarray, np.ndarray]:
    """Observations (rows, series) that may be flagged: a superset of the Detector's candidates, from a
    float32 pass over a dense block (window extremes are exact in float32; the arithmetic gets a margin).

    Ops-major planes and in-place arithmetic keep the passes and temporaries few. Where an op's floor is
    0 its scale is not clamped at 0: a scale <= 0 passes the test either way (the bound is >= 0)."""
    x = block.x32
    ops = block.ops
    w = rule.window
    first = max(rule.warmup, 1, block.skip)  # dense: n == min(t, w), so n >= warmup from this row
    if first >= len(x) or rule.warmup > w:
        return np.empty(0, np.intp), np.empty(0, np.intp)
    judged = [j for j, op in enumerate(ops) if op != NANS_OP]  # a nans count is never a candidate
    plane = {j: k for k, j in enumerate(judged)}
    q = window_rows(x, first, w, judged)  # judged ops x rows x series
    xs, prev = q[:, w:], q[:, w - 1 : -1]
    rows = q[:, :-1].swapaxes(0, 1)  # rolling runs along axis 0; its results keep the ops-major layout
    hmin = rolling(rows, w, np.minimum).swapaxes(0, 1)
    hmax = rolling(rows, w, np.maximum).swapaxes(0, 1)
    if w == 1:  # (the rolling of one row is the rows themselves: the arithmetic below is in place)
        hmin, hmax = hmin.copy(), hmax.copy()
    scale = np.negative(hmax)
    np.maximum(scale, hmin, out=scale)  # the window's smallest magnitude where it has one sign, else <= 0
    # (a threshold or range floor <= 0: a scale below 0 could fail where 0 passes; clamp as the Detector does)
    clamp = not (rule.threshold > 0 and rule.range_floor >= 0)
    if rule.range_floor and "min" in ops and "max" in ops:
        low_abs = np.maximum(scale[plane[ops.index("min")]], scale[plane[ops.index("max")]])
        if clamp:
            np.maximum(low_abs, np.float32(0), out=low_abs)
        low_abs *= np.float32(rule.range_floor)
        for k in (plane[ops.index(op)] for op in _VALUE_OPS if op in ops):
            np.maximum(scale[k], low_abs, out=scale[k])
    floors = op_floors(ops, rule.floor).astype(np.float32).tolist()
    for k, j in enumerate(judged):
        if floors[j] > 0 or clamp:
            np.maximum(scale[k], np.float32(max(floors[j], 0.0)), out=scale[k])
    bound = np.subtract(xs, hmin, out=hmin)
    np.subtract(hmax, xs, out=hmax)
    np.maximum(bound, hmax, out=bound)
    if rule.sudden:
        step = np.subtract(xs, prev, out=hmax)
        np.minimum(bound, np.abs(step, out=step), out=bound)
    bound *= np.float32(1 + 1e-4)
    scale *= np.float32(rule.threshold * (1 - 1e-4))
    cand = np.greater_equal(bound, scale)
    found = np.flatnonzero(cand)
    if not len(found):
        return np.empty(0, np.intp), np.empty(0, np.intp)
    ti, si = np.divmod(np.unique(found % (cand.shape[1] * cand.shape[2])), cand.shape[2])
    return ti + first, si


def _turbulence(rule: AnomalyTurbulence, block: SeriesBlock) -> tuple[np.ndarray, np.ndarray]:
    if block.dense and block.x32 is not None and rule.window >= 1:
        return _turbulence_few(rule, block, *_candidates32(rule, block))
    ops = block.ops
    x = block.x
    w = rule.window
    n = block.count(w)
    last, _ = block.last()
    hmin, hmax = block.extremes(w)
    floors = op_floors(ops, rule.floor)
    t = rule.threshold
    jmin = ops.index("min") if rule.range_floor and "min" in ops and "max" in ops else -1
    jmax = ops.index("max") if jmin >= 0 else -1
    value_cols = [ops.index(op) for op in _VALUE_OPS if op in ops] if jmin >= 0 else []
    flags = np.zeros(x.shape, dtype=bool)
    base = np.full(x.shape, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        low = np.where(hmin > 0, hmin, np.where(hmax < 0, -hmax, 0.0))
        bound_scale = np.maximum(low, floors)
        if jmin >= 0:
            low_abs = np.maximum(low[:, :, jmin], low[:, :, jmax])
            for j in value_cols:
                bound_scale[:, :, j] = np.maximum(bound_scale[:, :, j], rule.range_floor * low_abs)
        bound = np.maximum(np.abs(x - hmin), np.abs(x - hmax))
        if rule.sudden:
            bound = np.fmin(bound, np.abs(x - last))
        cand = block.finite & (n >= max(rule.warmup, 1)) & (bound > t * bound_scale)
        if NANS_OP in ops:
            cand[:, :, ops.index(NANS_OP)] = False
        ti, si = nonzero(cand.any(axis=2))
        for c0 in range(0, len(ti), _CHUNK):
            tr, sr = ti[c0 : c0 + _CHUNK], si[c0 : c0 + _CHUNK]
            h = block.windows(w, tr, sr)  # candidates x ops x W
            nr = n[tr, sr]
            xr = x[tr, sr]
            h.sort(axis=-1)
            med = median_sorted(h, nr)
            dev_hist = np.abs(h - med[..., None])
            dev_hist.sort(axis=-1)
            spread = median_sorted(dev_hist, nr)
            scale = np.maximum(np.maximum(np.abs(med), rule.noise * spread), floors)
            if jmin >= 0:
                absmax = np.maximum(np.abs(med[:, jmin]), np.abs(med[:, jmax]))
                for j in value_cols:
                    scale[:, j] = np.fmax(scale[:, j], rule.range_floor * absmax)
            diff = np.abs(xr - med)
            if rule.sudden:
                diff = np.fmin(diff, np.abs(xr - last[tr, sr]))
            flags[tr, sr] = cand[tr, sr] & (diff / scale > t)
            base[tr, sr] = med
    if rule.nan:
        nan_flags, nan_last = _nan_flags(block, ops)
        ti, si = nonzero(nan_flags.any(axis=2))
        if len(ti):
            h = block.windows(w, ti, si)
            h.sort(axis=-1)
            base[ti, si] = median_sorted(h, n[ti, si])
            if NANS_OP in ops:
                j = ops.index(NANS_OP)
                base[ti, si, j] = np.where(n[ti, si, j] > 0, nan_last[ti, si, j], np.nan)
        flags |= nan_flags
    return flags, base


def _turbulence_few(rule: AnomalyTurbulence, block: SeriesBlock, ti: np.ndarray,
                    si: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Detector's arithmetic, exactly, on the observations ``(ti, si)`` of a dense block only."""
    ops = block.ops
    w = rule.window
    flags = np.zeros(block.shape, dtype=bool)
    base = np.empty(block.shape)
    floors = op_floors(ops, rule.floor)
    t = rule.threshold
    jmin = ops.index("min") if rule.range_floor and "min" in ops and "max" in ops else -1
    jmax = ops.index("max") if jmin >= 0 else -1
    value_cols = [ops.index(op) for op in _VALUE_OPS if op in ops] if jmin >= 0 else []
    with np.errstate(invalid="ignore", divide="ignore"):
        for c0 in range(0, len(ti), _CHUNK):
            tr, sr = ti[c0 : c0 + _CHUNK], si[c0 : c0 + _CHUNK]
            h = block.windows(w, tr, sr)  # candidates x ops x W
            nr = np.broadcast_to(np.minimum(tr, w)[:, None], h.shape[:2])
            xr = block.take(tr, sr)
            last = block.take(tr - 1, sr)
            hmin = np.fmin.reduce(h, axis=-1)
            hmax = np.fmax.reduce(h, axis=-1)
            low = np.where(hmin > 0, hmin, np.where(hmax < 0, -hmax, 0.0))
            bound_scale = np.maximum(low, floors)
            if jmin >= 0:
                low_abs = np.maximum(low[:, jmin], low[:, jmax])
                for j in value_cols:
                    bound_scale[:, j] = np.maximum(bound_scale[:, j], rule.range_floor * low_abs)
            bound = np.maximum(np.abs(xr - hmin), np.abs(xr - hmax))
            if rule.sudden:
                bound = np.fmin(bound, np.abs(xr - last))
            cand = (nr >= max(rule.warmup, 1)) & (bound > t * bound_scale)
            if NANS_OP in ops:
                cand[:, ops.index(NANS_OP)] = False
            h.sort(axis=-1)
            med = median_sorted(h, nr)
            dev_hist = np.abs(h - med[..., None])
            dev_hist.sort(axis=-1)
            spread = median_sorted(dev_hist, nr)
            scale = np.maximum(np.maximum(np.abs(med), rule.noise * spread), floors)
            if jmin >= 0:
                absmax = np.maximum(np.abs(med[:, jmin]), np.abs(med[:, jmax]))
                for j in value_cols:
                    scale[:, j] = np.fmax(scale[:, j], rule.range_floor * absmax)
            diff = np.abs(xr - med)
            if rule.sudden:
                diff = np.fmin(diff, np.abs(xr - last))
            flags[tr, sr] = cand & (diff / scale > t)
            base[tr, sr] = med
    if rule.nan and NANS_OP in ops:
        # every value finite: only a nans count rising from 0 can be flagged; its baseline is the last count
        j = ops.index(NANS_OP)
        col = block.x32[:, :, j]  # (comparisons only: the same in float32)
        rise = np.zeros(col.shape, dtype=bool)
        rise[1:] = (col[1:] > 0) & (col[:-1] == 0)
        rise[0] = col[0] > 0
        tj, sj = nonzero(rise)
        if len(tj):
            h = block.windows(w, tj, sj)
            h.sort(axis=-1)
            base[tj, sj] = median_sorted(h, block.count(w)[tj, sj])
            base[tj, sj, j] = np.where(tj > 0, block.take(np.maximum(tj - 1, 0), sj)[:, j], np.nan)
            flags[:, :, j] |= rise
    return flags, base


def _nan_inf(block: SeriesBlock) -> tuple[np.ndarray, np.ndarray]:
    flags, last = _nan_flags(block, block.ops)
    return flags, np.where(block.count(1) > 0, last, np.nan)


def _window_sum(a: np.ndarray, single: np.ndarray) -> np.ndarray:
    """``a.sum(axis=0)`` as the Detector's window-first copy sums it: window by window, except for an
    observation alone in its record (one row, one op), which numpy sums pairwise."""
    out = a[0].copy()
    for j in range(1, len(a)):
        out += a[j]
    for i in np.flatnonzero(single):
        out[i] = a[:, i : i + 1].sum(axis=0)[0]
    return out


def _zscore(rule: ZScore, block: SeriesBlock, single: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = block.x
    w = rule.window
    n = block.count(w)
    floors = op_floors(block.ops, rule.floor)
    flags = np.zeros(x.shape, dtype=bool)
    mean_all = np.full(x.shape, np.nan)
    ti, si = nonzero(block.present[:, :, 0])
    step = max(1, _CHUNK // max(1, w))
    with np.errstate(invalid="ignore", divide="ignore"):
        for c0 in range(0, len(ti), step):
            tr, sr = ti[c0 : c0 + step], si[c0 : c0 + step]
            hist = block.ring(w, tr, sr)  # W x rows x ops, the Detector's ring
            alone = single[tr]
            nr = n[tr, sr]
            xr = x[tr, sr]
            ok = np.isfinite(hist)
            mean = _window_sum(np.where(ok, hist, 0.0), alone) / nr
            var = _window_sum(np.where(ok, hist - mean, 0.0) ** 2, alone) / nr
            scale = np.maximum(np.sqrt(var), floors)
            z = np.abs(xr - mean) / scale
            flags[tr, sr] = np.isfinite(xr) & (nr >= max(rule.warmup, 2)) & (z > rule.threshold)
            mean_all[tr, sr] = mean
    return flags, mean_all


def block_flags(rule: Rule, block: SeriesBlock) -> tuple[np.ndarray, np.ndarray]:
    """``(flags, baselines)`` of one rule over a block, both ``(records, series, ops)``; a baseline is
    only defined where a flag is set."""
    if isinstance(rule, ZScore):
        single = (block.present[:, :, 0].sum(axis=1) * block.x.shape[2]) == 1
        return _zscore(rule, block, single)
    if isinstance(rule, AnomalyTurbulence):
        return _turbulence(rule, block)
    if isinstance(rule, NaNInf):
        return _nan_inf(block)
    raise TypeError(f"no vectorised form of rule {rule.name}")
