"""``window_rows`` + ``rolling``: the extremes of the window before every row, the short windows at the
start too, against a plain ``sliding_window_view`` reference (NaN, short series, window 1); ``nonzero``."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from trainrec.analyzers.series_block import nonzero, rolling, window_rows


def _reference(x: np.ndarray, first: int, window: int, fn) -> np.ndarray:
    """``fn`` over rows ``max(0, i - window) .. i - 1`` for every row ``i >= first``: a prefix while
    ``i < window`` (what an accumulate gives), a full sliding window after; ops x rows x series."""
    out = []
    # row k: rows k .. k + window - 1, the window last (none when the series is shorter than the window)
    full = sliding_window_view(x, window, axis=0) if len(x) >= window else None
    for i in range(first, len(x)):
        out.append(fn.reduce(x[:i], axis=0) if i < window else fn.reduce(full[i - window], axis=-1))
    return np.moveaxis(np.array(out).reshape(-1, *x.shape[1:]), 2, 0)


def _windows(x: np.ndarray, first: int, window: int, fn, ops=None) -> np.ndarray:
    q = window_rows(x, first, window, ops)
    return rolling(q[:, :-1].swapaxes(0, 1), window, fn).swapaxes(0, 1)


@pytest.mark.parametrize("fn", [np.minimum, np.maximum, np.fmin, np.fmax])
@pytest.mark.parametrize("window", [1, 2, 5, 16])
def test_every_row_and_window_length(fn, window):
    rng = np.random.default_rng(window)
    for rows in sorted({2, window - 1, window, window + 1, 3 * window + 2, 40}):
        if rows < 2:
            continue
        x = rng.standard_normal((rows, 3, 4)).astype(np.float32)
        x[rng.random(x.shape) < 0.15] = np.nan  # NaN: minimum/maximum propagate it, fmin/fmax skip it
        x[:, 0, 0] = np.nan  # a series that is NaN throughout
        for first in range(1, rows):
            got = _windows(x, first, window, fn)
            want = _reference(x, first, window, fn)
            assert got.shape == (4, rows - first, 3)
            assert np.array_equal(got, want, equal_nan=True), (rows, first)


def test_prefix_is_the_accumulate():
    """Rows below the window see every row before them: the accumulate of the rows, shifted by one."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((10, 2, 3))
    got = _windows(x, 1, 16, np.minimum)  # 10 rows, all shorter than the window
    acc = np.minimum.accumulate(x, axis=0)[:-1]  # row i: rows 0 .. i
    assert np.array_equal(got, np.moveaxis(acc, 2, 0))


def test_selected_ops_in_their_order_and_layout():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((30, 5, 6)).astype(np.float32)
    q = window_rows(x, 4, 8, [5, 0, 2])
    assert q.shape == (3, 30 - 4 + 8, 5) and q.flags.c_contiguous
    assert np.array_equal(q[:, 8:], x[4:, :, [5, 0, 2]].transpose(2, 0, 1))  # row i of x at i - first + window
    assert np.array_equal(q[:, :4], np.broadcast_to(x[0, :, [5, 0, 2]][:, None, :], (3, 4, 5)))
    want = _reference(x, 4, 8, np.maximum)[[5, 0, 2]]
    assert np.array_equal(_windows(x, 4, 8, np.maximum, [5, 0, 2]), want)


def test_start_past_the_window_reads_no_padding():
    x = np.arange(40, dtype=np.float64).reshape(20, 2, 1)
    q = window_rows(x, 12, 4)
    assert q.shape == (1, 20 - 12 + 4, 2)
    assert np.array_equal(q[0], x[8:, :, 0])  # rows 8 .. 19: the window of row 12 is rows 8 .. 11
    assert np.array_equal(_windows(x, 12, 4, np.minimum)[0], x[8:-4, :, 0])


def test_nonzero_is_numpys():
    rng = np.random.default_rng(5)
    for shape in [(0,), (7,), (5, 3), (6, 4, 3), (1, 0, 2)]:
        a = rng.random(shape) < 0.2
        for view in (a, a[::2], a.T):
            got, want = nonzero(view), np.nonzero(view)
            assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
