"""The per-series state of the anomaly rules (:mod:`.rules`): a ring of each series' last finite values
and its last observation, in numpy arrays indexed by a dense series id, so that one record of any
size costs a handful of vectorised operations; with the window statistics the rules take of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["NANS_OP", "OP_FLOORS", "SeriesState", "median_sorted", "nonfinite_flags", "op_floors", "window_median"]

# Default absolute floors of the scale, per op: zeros is a fraction of elements, nans a count.
OP_FLOORS: dict[str, float] = {"zeros": 0.2, "nans": 1.0}
NANS_OP = "nans"


class SeriesState:
    """Per-(series, op column) arrays: a ring of the last W finite values and the last observation.

    The ring is stored window-first, ``(W, series, ops)``, so reductions over the window run across
    contiguous planes (much faster in numpy than over a short last axis)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.cols: dict[str, int] = {}
        self.ring = np.full((window, 0, 0), np.nan)
        self.pos = np.zeros((0, 0), dtype=np.int32)
        self.count = np.zeros((0, 0), dtype=np.int32)  # finite values in the ring (<= window)
        self.last = np.zeros((0, 0))  # last finite value (0 before any)
        self.last_ok = np.zeros((0, 0), dtype=bool)  # the last observation was finite

    def columns(self, ops: Sequence[str]) -> np.ndarray:
        cols = self.cols
        for op in ops:
            if op not in cols:
                cols[op] = len(cols)
        return np.fromiter((cols[op] for op in ops), dtype=np.intp, count=len(ops))

    def ensure(self, n_series: int) -> None:
        rows, ncols = self.pos.shape
        want_cols = len(self.cols)
        if n_series <= rows and want_cols <= ncols:
            return
        new_rows = max(n_series, rows * 2, 64) if n_series > rows else rows
        new_cols = max(want_cols, ncols)

        def grow(a: np.ndarray, fill) -> np.ndarray:
            shape = (new_rows, new_cols) + a.shape[2:]
            b = np.full(shape, fill, dtype=a.dtype)
            b[: a.shape[0], : a.shape[1]] = a
            return b

        ring = np.full((self.window, new_rows, new_cols), np.nan)
        ring[:, :rows, :ncols] = self.ring
        self.ring = ring
        self.pos = grow(self.pos, 0)
        self.count = grow(self.count, 0)
        self.last = grow(self.last, 0.0)
        self.last_ok = grow(self.last_ok, False)

    def index(self, sids: np.ndarray, cols: np.ndarray) -> tuple:
        """A selector of the (rows x ops) block: slices (views, no copies) when the series ids are
        consecutive and the op columns in order, which is the usual case; index arrays otherwise."""
        n = len(sids)
        self.ensure(int(sids.max()) + 1 if n else 0)
        k = len(cols)
        c0 = int(cols[0]) if k else 0
        cs = slice(c0, c0 + k) if k and np.array_equal(cols, np.arange(c0, c0 + k)) else cols[None, :]
        s0 = int(sids[0]) if n else 0
        if n and int(sids[-1]) - s0 == n - 1 and (n < 3 or bool((np.diff(sids) == 1).all())):
            rs = slice(s0, s0 + n)
        else:
            rs = sids[:, None]
        if isinstance(rs, slice) != isinstance(cs, slice):
            # mixed slice/array indexing moves axes around; use arrays for both
            rs = sids[:, None] if isinstance(rs, slice) else rs
            cs = cols[None, :] if isinstance(cs, slice) else cs
        return rs, cs

    def update(self, sel: tuple, x: np.ndarray, finite: np.ndarray) -> None:
        """Push the finite values of ``x`` (rows x ops) into their rings; note the last observation."""
        rs, cs = sel
        w = self.window
        pos = self.pos[rs, cs]
        if isinstance(rs, slice) and pos.size and finite.all() and pos.min() == pos.max():
            # the usual case: every series of the block advances together, one plane copy
            p = int(pos.flat[0])
            self.ring[p, rs, cs] = x
            self.pos[rs, cs] = (p + 1) % w
            self.count[rs, cs] = np.minimum(self.count[rs, cs] + 1, w)
            self.last[rs, cs] = x
            self.last_ok[rs, cs] = True
            return
        _, nrows, ncols = self.ring.shape
        r = np.arange(rs.start, rs.stop)[:, None] if isinstance(rs, slice) else rs
        c = np.arange(cs.start, cs.stop)[None, :] if isinstance(cs, slice) else cs
        flat = (pos * nrows + r) * ncols + c  # where each value goes in the (W, series, ops) ring
        self.ring.reshape(-1)[flat[finite]] = x[finite]
        self.pos[rs, cs] = np.where(finite, pos + 1, pos) % w
        self.count[rs, cs] = np.where(finite, np.minimum(self.count[rs, cs] + 1, w), self.count[rs, cs])
        self.last[rs, cs] = np.where(finite, x, self.last[rs, cs])
        self.last_ok[rs, cs] = finite

    def values(self, sel: tuple) -> np.ndarray:
        """The windows of a selection, ``(W, rows, ops)`` (a view for slice selections)."""
        return self.ring[(slice(None), *sel)]


def median_sorted(s: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Median along the last axis of sorted windows holding ``n`` finite values (NaN padding last)."""
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


def window_median(values: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Median along the last axis of the first ``n`` finite values (NaN padding sorts last)."""
    return median_sorted(np.sort(values, axis=-1), n)


def op_floors(ops: Sequence[str], floor: float) -> np.ndarray:
    return np.array([max(floor, OP_FLOORS.get(op, 0.0)) for op in ops])


def nonfinite_flags(state: SeriesState, sel: tuple, ops, x, finite) -> tuple[np.ndarray, np.ndarray]:
    """A series turning non-finite after a finite value, and a nans count rising from 0 (also at the
    first observation); with their baselines. A series that is NaN from its start is not flagged: the
    reference (and the recorder) write NaN for a tensor that is absent (None), and a real NaN tensor
    shows in its finite ``nans`` count."""
    last = state.last[sel]
    flags = ~finite & state.last_ok[sel]
    if NANS_OP in ops:
        j = ops.index(NANS_OP)
        flags[:, j] |= finite[:, j] & (x[:, j] > 0) & (last[:, j] == 0)
    return flags, np.where(state.count[sel] > 0, last, np.nan)

