"""The anomaly rules of :mod:`trainrec.schema.rules`, run over whole series at once.

The record-time :class:`~trainrec.schema.rules.Detector` judges one record at a time against per-series
ring buffers. Re-detection has every record of a (rank, kind) at hand, so here the same rules run over a
block ``X`` of shape ``(records, series, ops)``: the window of each observation (the last ``window``
finite values of its series before it) is found with rolling reductions over a compacted copy of the
series (its finite values only), not with a Python loop over records.

The results are the Detector's, value for value: the same candidate filter, the same median, spread and
floors, the same arithmetic in the same order (``tests/analyzers/test_columnar_scan.py`` compares them).
``missing`` marks observations that are not there (a placeholder row, or a series absent from a
record): like the Detector's skipped rows, they are neither judged nor enter the state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from trainrec.schema.rules import OP_FLOORS, AnomalyTurbulence, NaNInf, Rule, ZScore

__all__ = ["Carry", "SeriesBlock", "block_flags"]

NANS_OP = "nans"
_VALUE_OPS = ("min", "max", "mean")
# Observations per chunk of the exact (sorting) step and of ZScore's windows: bounds their temporaries.
_CHUNK = 1 << 16


class Carry:
    """What a block's series carry into the next block of the same (rank, kind), the Detector's state in
    compact form: per series (axis 0, in ``index`` order) and op, the last ``depth`` finite values
    (right-aligned, NaN before), how many finite values it has seen, and whether its last observation was
    finite. So a rank's records can be judged a bounded chunk at a time."""

    def __init__(self, ops: Sequence[str], depth: int) -> None:
        self.ops = tuple(ops)
        self.depth = depth
        self.index: dict[int, int] = {}
        self.hist = np.full((0, depth, len(self.ops)), np.nan)
        self.count = np.zeros((0, len(self.ops)), np.int64)
        self.last_ok = np.zeros((0, len(self.ops)), bool)

    def rows(self, sids: np.ndarray) -> np.ndarray:
        """Rows of ``sids`` (new series get empty state)."""
        index = self.index
        new = [int(s) for s in sids.tolist() if s not in index]
        if new:
            for s in new:
                index[s] = len(index)
            k, o = len(new), len(self.ops)
            self.hist = np.concatenate([self.hist, np.full((k, self.depth, o), np.nan)])
            self.count = np.concatenate([self.count, np.zeros((k, o), np.int64)])
            self.last_ok = np.concatenate([self.last_ok, np.zeros((k, o), bool)])
        return np.fromiter((index[int(s)] for s in sids.tolist()), np.intp, count=len(sids))


class SeriesBlock:
    """One (rank, kind)'s observations and what every window rule needs of them, computed once per window
    size: for observation ``t`` of column ``(s, o)``, ``cf`` finite values came before it; ``G`` holds each
    column's finite values compacted to the front (NaN after), so its window is ``G[cf - W : cf]``.

    ``init`` (a :class:`Carry`'s ``hist``, ``count`` and ``last_ok`` for the block's series, in its
    order): the state of earlier blocks. Where every series has a full history and the block is dense,
    the history is put before the block as ``skip`` rows that are not judged; otherwise it starts ``G``.
    """

    def __init__(self, x: np.ndarray, missing: np.ndarray, ops: Sequence[str], x32: np.ndarray | None = None,
                 init: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        self.ops = tuple(ops)
        self.skip = 0  # leading rows of x that are history, not observations
        self.offset: np.ndarray | int = 0  # absolute index of a finite value minus its index in G
        k0 = lok0 = None
        if init is not None and init[1].any():
            hist, count, lok0 = init
            depth = hist.shape[1]
            k0 = np.minimum(count, depth)
            if not missing.any() and np.isfinite(x).all() and (k0 == depth).all():
                prefix = np.moveaxis(hist, 1, 0)  # depth x series x ops, all finite
                x = np.concatenate([prefix, x])
                missing = np.concatenate([np.zeros(prefix.shape[:2], bool), missing])
                if x32 is not None:
                    p32 = prefix.astype(np.float32)
                    x32 = np.concatenate([p32, x32]) if np.array_equal(p32, prefix) else None
                self.skip = depth
                self.offset = count - depth
                k0 = None
            else:
                self.offset = count - k0
        self.x = x
        self.x32 = x32  # the same values as float32, where they are exactly that (a cheap first filter)
        self.present = ~missing[:, :, None]
        self.finite = np.isfinite(x if x32 is None else x32) & self.present
        self.dense = k0 is None and bool(self.finite.all())
        self._lok0 = lok0 if k0 is not None else None
        t, s, o = x.shape
        if self.dense:
            self.cf = None  # cf[t] == t: the compacted series is the series itself
            self.g = x
        else:
            self.cf = np.cumsum(self.finite, axis=0, dtype=np.int64) - self.finite
            depth = 0 if k0 is None else init[0].shape[1]
            g = np.full((depth + t, s, o), np.nan)
            if k0 is not None:  # the history, left-aligned: G[i] = hist[depth - k0 + i] for i < k0
                self.cf += k0[None]
                src = depth - k0[None] + np.arange(depth)[:, None, None]
                held = np.take_along_axis(np.moveaxis(init[0], 1, 0), np.clip(src, 0, depth - 1), 0)
                g[:depth] = np.where(src < depth, held, np.nan)
            ti, si, oi = np.nonzero(self.finite)
            g[self.cf[ti, si, oi], si, oi] = x[ti, si, oi]
            self.g = g
        self._rolled: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._last: tuple[np.ndarray, np.ndarray] | None = None

    def carry(self, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What the block leaves for the next: ``(last depth finite values right-aligned (series x depth x
        ops), finite values among its observations, finiteness of each series' last present observation,
        whether the series had one)``."""
        t, s, o = self.x.shape
        fin = self.finite[self.skip :]
        seen = fin.sum(axis=0)
        if self.cf is None:
            total = np.full((s, o), t)
        else:
            total = self.cf[-1] + self.finite[-1]
        src = total[None] - depth + np.arange(depth)[:, None, None]
        g = self.g
        held = np.take_along_axis(g, np.clip(src, 0, len(g) - 1), 0)
        hist = np.moveaxis(np.where(src >= 0, held, np.nan), 0, 1)
        obs = self.present[self.skip :, :, 0]
        last_row = len(obs) - 1 - np.argmax(obs[::-1], axis=0)  # per series: its last present row
        return hist, seen, fin[last_row, np.arange(s)], obs.any(axis=0)

    # ------------------------------------------------------------------ per-observation state
    def count(self, window: int) -> np.ndarray:
        """Finite values in the window (the Detector's ring count)."""
        if self.cf is None:
            return np.minimum(np.arange(self.x.shape[0])[:, None, None], window) + np.zeros(self.x.shape, np.int64)
        return np.minimum(self.cf, window)

    def last(self) -> tuple[np.ndarray, np.ndarray]:
        """``(last finite value before, 0 where none; whether the previous present observation was finite)``."""
        if self._last is None:
            t = self.x.shape[0]
            if self.cf is None:
                last = np.zeros(self.x.shape)
                last[1:] = self.x[:-1]
                ok = np.ones(self.x.shape, bool)
                ok[0] = False
            else:
                gp = np.concatenate([np.zeros((1,) + self.g.shape[1:]), self.g])
                last = np.take_along_axis(gp, self.cf, axis=0)  # gp[cf] == g[cf - 1], 0 when cf == 0
                obs = self.present[:, :, 0]
                idx = np.where(obs, np.arange(t)[:, None], -1)
                prev = np.maximum.accumulate(idx, axis=0)
                prev = np.concatenate([np.full((1, obs.shape[1]), -1), prev[:-1]])
                ok = np.take_along_axis(self.finite, np.maximum(prev, 0)[:, :, None].repeat(self.x.shape[2], 2), 0)
                before = (prev < 0)[:, :, None]
                ok = np.where(before, False if self._lok0 is None else self._lok0[None], ok)
            self._last = (last, ok)
        return self._last

    def extremes(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """``fmin`` and ``fmax`` of each observation's window (NaN for an empty one)."""
        got = self._rolled.get(window)
        if got is None:
            pad = np.full((window,) + self.g.shape[1:], np.nan)
            gp = np.concatenate([pad, self.g])
            lo, hi = _rolling(gp, window, np.fmin), _rolling(gp, window, np.fmax)
            # lo[k]: the window of compacted index k (values k-W .. k-1)
            if self.cf is None:
                got = (lo[:-1], hi[:-1])
            else:
                got = (np.take_along_axis(lo, self.cf, 0), np.take_along_axis(hi, self.cf, 0))
            self._rolled[window] = got
        return got

    def windows(self, window: int, ti: np.ndarray, si: np.ndarray) -> np.ndarray:
        """The windows of observations ``(ti, si)``, all ops: ``(len, ops, W)``, NaN-padded (any order)."""
        o = self.x.shape[2]
        if self.cf is None:
            cf = np.broadcast_to(ti[:, None], (len(ti), o))
        else:
            cf = self.cf[ti, si]
        k = cf[:, :, None] - window + np.arange(window)  # compacted indexes k-W .. k-1
        ok = k >= 0
        vals = self.g[np.maximum(k, 0), si[:, None, None], np.arange(o)[None, :, None]]
        return np.where(ok, vals, np.nan)

    def ring(self, window: int, ti: np.ndarray, si: np.ndarray) -> np.ndarray:
        """The Detector's ring of observations ``(ti, si)`` in its slot order: ``(W, len, ops)`` (value
        number ``a`` of a series, counted from its first, sits in slot ``a % W``)."""
        o = self.x.shape[2]
        cf = np.broadcast_to(ti[:, None], (len(ti), o)) if self.cf is None else self.cf[ti, si]
        off = self.offset if isinstance(self.offset, int) else self.offset[si]
        slots = np.arange(window)[:, None, None]
        k = cf[None] - 1 - np.mod(cf[None] - 1 + off - slots, window)  # the latest value written to each slot
        ok = k >= 0
        vals = self.g[np.maximum(k, 0), si[None, :, None], np.arange(o)[None, None, :]]
        return np.where(ok, vals, np.nan)


def _rolling(a: np.ndarray, window: int, fn) -> np.ndarray:
    """``fn``-reduction of every ``window`` consecutive rows of ``a`` (``len(a) - window + 1`` rows), by
    doubling: a handful of passes instead of ``window``."""
    span = 1
    cur = a
    while span * 2 <= window:
        cur = fn(cur[:-span], cur[span:])
        span *= 2
    if span < window:
        cur = fn(cur[: len(cur) - (window - span)], cur[window - span :])
    return cur


def _op_floors(ops: Sequence[str], floor: float) -> np.ndarray:
    return np.array([max(floor, OP_FLOORS.get(op, 0.0)) for op in ops])


def _median_sorted(s: np.ndarray, n: np.ndarray) -> np.ndarray:
    """As :func:`trainrec.schema.rules._median_sorted`: the median of sorted, NaN-padded windows."""
    w = s.shape[-1]
    if n.size and int(n.min()) == w:
        return (s[..., (w - 1) // 2] + s[..., w // 2]) * 0.5
    lo = np.maximum(n - 1, 0) // 2
    hi = np.minimum(n // 2, w - 1)
    a = np.take_along_axis(s, lo[..., None], axis=-1)[..., 0]
    b = np.take_along_axis(s, hi[..., None], axis=-1)[..., 0]
    med = (a + b) * 0.5
    med[n == 0] = np.nan
    return med


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


def _rolling_dense(x: np.ndarray, window: int, fn, accumulate) -> np.ndarray:
    """``fn`` over the window before each row of finite ``x`` (row 0: NaN; rows below ``window``: a prefix)."""
    out = np.empty_like(x)
    out[0] = np.nan
    head = min(window, len(x))
    if head > 1:
        out[1:head] = accumulate(x[: head - 1], axis=0)
    if len(x) > window:
        out[window:] = _rolling(x[:-1], window, fn)
    return out


def _candidates32(rule: AnomalyTurbulence, block: SeriesBlock) -> tuple[np.ndarray, np.ndarray]:
    """Observations (rows, series) that may be flagged: a superset of the Detector's candidates, from a
    float32 pass over a dense block (window extremes are exact in float32; the arithmetic gets a margin)."""
    x = block.x32
    ops = block.ops
    w = rule.window
    first = max(rule.warmup, 1, block.skip)  # dense: n == min(t, w), so n >= warmup from this row
    if first >= len(x) or rule.warmup > w:
        return np.empty(0, np.intp), np.empty(0, np.intp)
    hmin = _rolling_dense(x, w, np.minimum, np.minimum.accumulate)[first:]
    hmax = _rolling_dense(x, w, np.maximum, np.maximum.accumulate)[first:]
    xs = x[first:]
    floors = _op_floors(ops, rule.floor).astype(np.float32)
    low = np.maximum(np.maximum(hmin, -hmax), np.float32(0))
    bound_scale = np.maximum(low, floors)
    if rule.range_floor and "min" in ops and "max" in ops:
        jmin, jmax = ops.index("min"), ops.index("max")
        low_abs = np.float32(rule.range_floor) * np.maximum(low[:, :, jmin], low[:, :, jmax])
        for j in (ops.index(op) for op in _VALUE_OPS if op in ops):
            np.maximum(bound_scale[:, :, j], low_abs, out=bound_scale[:, :, j])
    bound = np.maximum(xs - hmin, hmax - xs)
    if rule.sudden:
        np.minimum(bound, np.abs(xs - x[first - 1 : -1]), out=bound)
    cand = bound * np.float32(1 + 1e-4) >= bound_scale * np.float32(rule.threshold * (1 - 1e-4))
    if NANS_OP in ops:
        cand[:, :, ops.index(NANS_OP)] = False
    ti, si = np.nonzero(cand.any(axis=2))
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
    floors = _op_floors(ops, rule.floor)
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
        ti, si = np.nonzero(cand.any(axis=2))
        for c0 in range(0, len(ti), _CHUNK):
            tr, sr = ti[c0 : c0 + _CHUNK], si[c0 : c0 + _CHUNK]
            h = block.windows(w, tr, sr)  # candidates x ops x W
            nr = n[tr, sr]
            xr = x[tr, sr]
            h.sort(axis=-1)
            med = _median_sorted(h, nr)
            dev_hist = np.abs(h - med[..., None])
            dev_hist.sort(axis=-1)
            spread = _median_sorted(dev_hist, nr)
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
        ti, si = np.nonzero(nan_flags.any(axis=2))
        if len(ti):
            h = block.windows(w, ti, si)
            h.sort(axis=-1)
            base[ti, si] = _median_sorted(h, n[ti, si])
            if NANS_OP in ops:
                j = ops.index(NANS_OP)
                base[ti, si, j] = np.where(n[ti, si, j] > 0, nan_last[ti, si, j], np.nan)
        flags |= nan_flags
    return flags, base


def _turbulence_few(rule: AnomalyTurbulence, block: SeriesBlock, ti: np.ndarray,
                    si: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Detector's arithmetic, exactly, on the observations ``(ti, si)`` of a dense block only."""
    ops = block.ops
    x = block.x
    w = rule.window
    flags = np.zeros(x.shape, dtype=bool)
    base = np.empty(x.shape)
    floors = _op_floors(ops, rule.floor)
    t = rule.threshold
    jmin = ops.index("min") if rule.range_floor and "min" in ops and "max" in ops else -1
    jmax = ops.index("max") if jmin >= 0 else -1
    value_cols = [ops.index(op) for op in _VALUE_OPS if op in ops] if jmin >= 0 else []
    with np.errstate(invalid="ignore", divide="ignore"):
        for c0 in range(0, len(ti), _CHUNK):
            tr, sr = ti[c0 : c0 + _CHUNK], si[c0 : c0 + _CHUNK]
            h = block.windows(w, tr, sr)  # candidates x ops x W
            nr = np.broadcast_to(np.minimum(tr, w)[:, None], h.shape[:2])
            xr = x[tr, sr]
            last = x[tr - 1, sr]
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
            med = _median_sorted(h, nr)
            dev_hist = np.abs(h - med[..., None])
            dev_hist.sort(axis=-1)
            spread = _median_sorted(dev_hist, nr)
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
        col = x[:, :, j]
        rise = np.zeros(col.shape, dtype=bool)
        rise[1:] = (col[1:] > 0) & (col[:-1] == 0)
        rise[0] = col[0] > 0
        tj, sj = np.nonzero(rise)
        if len(tj):
            h = block.windows(w, tj, sj)
            h.sort(axis=-1)
            base[tj, sj] = _median_sorted(h, block.count(w)[tj, sj])
            base[tj, sj, j] = np.where(tj > 0, x[np.maximum(tj - 1, 0), sj, j], np.nan)
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
    floors = _op_floors(block.ops, rule.floor)
    flags = np.zeros(x.shape, dtype=bool)
    mean_all = np.full(x.shape, np.nan)
    ti, si = np.nonzero(block.present[:, :, 0])
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
