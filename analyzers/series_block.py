"""Series of one (rank, kind) as numpy blocks, for the rules of :mod:`trainrec.analyzers.vector_rules`.

A :class:`SeriesBlock` answers, for every observation of a ``(records, series, ops)`` block at once,
what the record-time Detector keeps in its rings (window, extremes, last finite value).
:class:`Carry` hands that state from one block to the next, so a rank is read a chunk at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Carry", "SeriesBlock", "nonzero", "rolling", "window_rows"]


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
    """One (rank, kind)'s observations and what every window rule needs of them, once per window size:
    ``G`` holds each column's finite values compacted to the front, so the window of an observation
    that ``cf`` finite values precede is ``G[cf - W : cf]``. ``init`` (a :class:`Carry`'s state) goes
    before the block as unjudged ``skip`` rows where every series has a full history and the block is
    dense, else at the start of ``G``."""

    def __init__(self, x: np.ndarray | None, missing: np.ndarray, ops: Sequence[str], x32: np.ndarray | None = None,
                 init: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        self.ops = tuple(ops)
        self.skip = 0  # leading rows of x that are history, not observations
        self.offset: np.ndarray | int = 0  # absolute index of a finite value minus its index in G
        k0 = lok0 = None
        if init is not None and init[1].any():
            hist, count, lok0 = init
            depth = hist.shape[1]
            k0 = np.minimum(count, depth)
            if not missing.any() and np.isfinite(x if x32 is None else x32).all() and (k0 == depth).all():
                prefix = np.moveaxis(hist, 1, 0)  # depth x series x ops, all finite
                missing = np.concatenate([np.zeros(prefix.shape[:2], bool), missing])
                p32 = None if x32 is None else prefix.astype(np.float32)
                if p32 is not None and np.array_equal(p32, prefix):
                    x32 = np.concatenate([p32, x32])
                    x = None if x is None else np.concatenate([prefix, x])
                else:
                    x = np.concatenate([prefix, x32.astype(np.float64) if x is None else x])
                    x32 = None
                self.skip = depth
                self.offset = count - depth
                k0 = None
            else:
                self.offset = count - k0
        if x is None and x32 is None:
            raise ValueError("a SeriesBlock needs its values (x or x32)")
        self._x = x  # (None: made from x32 when first asked for)
        self.x32 = x32  # the same values as float32, where they are exactly that (a cheap first filter)
        self.shape = (x if x is not None else x32).shape
        self.present = ~missing[:, :, None]
        self.finite = np.isfinite(x if x32 is None else x32)
        if missing.any():
            self.finite &= self.present
        self.dense = k0 is None and bool(self.finite.all())
        self._lok0 = lok0 if k0 is not None else None
        t, s, o = self.shape
        if self.dense:
            self.cf = None  # cf[t] == t: the compacted series is the series itself (G is x)
            self._g = None
        else:
            x = self.x
            self.cf = np.cumsum(self.finite, axis=0, dtype=np.int64) - self.finite
            depth = 0 if k0 is None else init[0].shape[1]
            g = np.full((depth + t, s, o), np.nan)
            if k0 is not None:  # the history, left-aligned: G[i] = hist[depth - k0 + i] for i < k0
                self.cf += k0[None]
                src = depth - k0[None] + np.arange(depth)[:, None, None]
                held = np.take_along_axis(np.moveaxis(init[0], 1, 0), np.clip(src, 0, depth - 1), 0)
                g[:depth] = np.where(src < depth, held, np.nan)
            ti, si, oi = nonzero(self.finite)
            g[self.cf[ti, si, oi], si, oi] = x[ti, si, oi]
            self._g = g
        self._rolled: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._last: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def x(self) -> np.ndarray:
        """The values ``(records, series, ops)`` as float64 (of a float32 block: made on first use; the
        dense rules' path gathers what it needs from ``x32`` instead, see :meth:`take`)."""
        if self._x is None:
            self._x = self.x32.astype(np.float64)
        return self._x

    @property
    def g(self) -> np.ndarray:
        """The compacted series ``G`` (a dense block's is ``x``)."""
        return self.x if self._g is None else self._g

    def _values(self) -> np.ndarray:
        """``x``, or ``x32`` while ``x`` was not made (the same values: gathers are cast to float64)."""
        return self.x32 if self._x is None else self._x

    def take(self, ti: np.ndarray, si: np.ndarray) -> np.ndarray:
        """``x[ti, si]`` (float64) without making ``x`` of a float32 block."""
        return self._values()[ti, si].astype(np.float64, copy=False)

    def carry(self, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What the block leaves for the next: ``(last depth finite values right-aligned (series x depth x
        ops), finite values among its observations, finiteness of each series' last present observation,
        whether the series had one)``."""
        t, s, o = self.shape
        if self.cf is None:  # dense: every observation present and finite, the last ``depth`` rows are it
            held = np.full((depth, s, o), np.nan)
            k = min(depth, t)
            held[depth - k :] = self._values()[t - k :]  # (float32 values cast exactly)
            every = np.ones((s, o), bool)
            return np.moveaxis(held, 0, 1), np.full((s, o), t - self.skip, np.int64), every, every[:, 0].copy()
        fin = self.finite[self.skip :]
        seen = fin.sum(axis=0)
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
            return np.minimum(np.arange(self.shape[0])[:, None, None], window) + np.zeros(self.shape, np.int64)
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
            lo, hi = rolling(gp, window, np.fmin), rolling(gp, window, np.fmax)
            # lo[k]: the window of compacted index k (values k-W .. k-1)
            if self.cf is None:
                got = (lo[:-1], hi[:-1])
            else:
                got = (np.take_along_axis(lo, self.cf, 0), np.take_along_axis(hi, self.cf, 0))
            self._rolled[window] = got
        return got

    def windows(self, window: int, ti: np.ndarray, si: np.ndarray) -> np.ndarray:
        """The windows of observations ``(ti, si)``, all ops: ``(len, ops, W)``, NaN-padded (any order)."""
        o = self.shape[2]
        if self.cf is None:
            cf = np.broadcast_to(ti[:, None], (len(ti), o))
        else:
            cf = self.cf[ti, si]
        k = cf[:, :, None] - window + np.arange(window)  # compacted indexes k-W .. k-1
        ok = k >= 0
        g = self._values() if self._g is None else self._g
        vals = g[np.maximum(k, 0), si[:, None, None], np.arange(o)[None, :, None]].astype(np.float64, copy=False)
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


def nonzero(a: np.ndarray) -> tuple[np.ndarray, ...]:
    """``np.nonzero(a)`` (the same indexes, in the same order) by way of ``flatnonzero``, which numpy runs
    many times faster on a mostly false array of more than one axis."""
    return np.unravel_index(np.flatnonzero(a), a.shape)


def rolling(a: np.ndarray, window: int, fn) -> np.ndarray:
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


def window_rows(x: np.ndarray, first: int, window: int, ops: Sequence[int] | None = None) -> np.ndarray:
    """Rows ``first - window`` .. end of ``x`` ``(rows, series, ops)`` as one ``(ops, rows, series)`` array
    ``q`` (each op's plane contiguous; the op indexes ``ops`` only, in that order), rows before 0 being
    copies of row 0: the window of row ``i >= first`` (rows ``max(0, i - window)`` .. ``i - 1``) is
    ``q[:, i - first : i - first + window]`` (``1 <= first``), so ``rolling`` over ``q`` gives every window,
    the short ones at the start too (a repeated row changes no minimum or maximum)."""
    lo = max(first - window, 0)
    pad = max(window - first, 0)
    t, s, o = x.shape
    ops = range(o) if ops is None else ops
    q = np.empty((len(ops), pad + t - lo, s), x.dtype)
    for k, j in enumerate(ops):
        q[k, pad:] = x[lo:, :, j]
        q[k, :pad] = x[0, :, j]
    return q
