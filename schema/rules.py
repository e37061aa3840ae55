"""Anomaly rules, shared by the recorder (record time) and the analyzers (replay time).

Pure Python and numpy. Both sides feed the same statistics through the same :class:`Detector`, so a
re-detection from a log with the recording's rule config finds exactly the anomalies the recorder
found.

Series
    A rule keeps state per series: ``(rank, kind, name, slot, micro_step, vpp_stage, op)``. A name
    that appears twice in one record (a module called twice per micro step) gets one series per
    occurrence. State lives in numpy arrays indexed by a dense series id, so one record of any size
    costs a handful of vectorised operations.

Rules (config ``alert.rules``: ``[{"rule_name": NAME, "args": {...}}]``)
    ``AnomalyTurbulence(threshold, window=16, warmup=8, noise=8, range_floor=0.2, floor=0, sudden=true, nan=true)``
        What the reference documents ("relative deviation from the historical mean beyond threshold,
        up or down"), done so that a user can act on it::

            baseline  = median of the last `window` finite values of the series
            spread    = median absolute deviation of those values from the baseline
            scale     = max(|baseline|, noise * spread, range_floor * max(|baseline of min|, |baseline of max|)
                            [for min/max/mean], floor, op floor [zeros 0.2, nans 1])
            change    = |value - baseline|, and with sudden: min(that, |value - previous value|)
            flagged when change / scale > threshold

        * Both directions; a negative baseline works like a positive one.
        * A median over a window: one spike neither hides the next one (the reference's cumulative
          mean does) nor shifts the baseline for long.
        * ``sudden``: a value must also have jumped from the previous one, so a level change is one
          anomaly and not ``window/2`` of them, and a smooth ramp (Adam's bias correction, a
          zero-initialised bias growing) is none. ``sudden=false`` also catches slow drifts.
        * Warm-up: nothing is flagged before ``warmup`` finite values of the series were seen.
        * The floors on the scale stop the flood from series that sit near zero: a series whose own
          spread dwarfs its level (the mean of a gradient) must leave that spread by
          ``threshold * noise`` spreads; the min/max/mean of a tensor are judged against the
          tensor's range (a LayerNorm output's mean of 1e-5 is zero next to values of 3).
        * NaN/Inf (``nan``): the first non-finite value after a finite one is flagged, whatever the
          warm-up; the following ones are not, until a finite value was seen again. Non-finite values
          never enter the window, so a NaN does not poison the series. A series that is NaN from its
          first value is not flagged: NaN in every op is how an absent tensor (None) is recorded.
        * Placeholder rows (``TensorStatsRecorded.placeholders``: NaN rows the recorder wrote for no
          tensor's values, a parameter whose ``.grad`` is None that step, an empty tensor, the unhooked
          slot of an activation gradient pair, a tensor the engine failed on) are skipped by every
          rule: neither flagged nor fed into the series' state. So a routed expert's gradient, present
          on some steps only, is judged on the steps it has one. Logs of writers that did not mark them
          leave such rows to the rule above.
        * The ``nans`` op (a count) is flagged when it rises from 0, at any step including the first
          (with ``nan``); it has no relative rule. This is what flags a tensor that has NaN from
          the start.
    ``NaNInf()``
        Only the NaN/Inf part above: a series turning non-finite, a ``nans`` count rising from 0.
    ``ZScore(threshold=4, window=16, warmup=8, floor=0)``
        ``|value - mean| / max(std, floor, op floor)`` over the last ``window`` finite values.

Thresholds may be given as int or float (the reference rejected ``1``).

Reference JSON entries
    :func:`reference_entry` turns an :class:`AnomalyDetected` into the reference's anomaly JSON key
    ``"{tag_name}_step_{step}_call_{call_id}"`` and value (rank, step, micro_step, pp_stage,
    vpp_stage, call_id, tag_name, message, group_mates), used by both the recorder's dump and the
    analyzers' ``anomaly_analyse.json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .events import SLOTS, AnomalyDetected
from .naming import reference_tag

__all__ = [
    "RULES",
    "AnomalyTurbulence",
    "Detector",
    "NaNInf",
    "Rule",
    "SeriesIndex",
    "ZScore",
    "anomaly_message",
    "median_sorted",
    "op_floors",
    "reference_entry",
    "reference_key",
]

# Default absolute floors of the scale, per op: zeros is a fraction of elements, nans a count.
OP_FLOORS: dict[str, float] = {"zeros": 0.2, "nans": 1.0}
NANS_OP = "nans"
# Ops measured in the tensor's own units, whose scale is floored relative to its range (max |min|, |max|).
_VALUE_OPS = ("min", "max", "mean")
REFERENCE_FIELDS = (
    "rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message", "group_mates",
)


# --------------------------------------------------------------------------------------------- state
class _SeriesState:
    """Per-(series, op column) arrays: a ring of the last W finite values and the last observation.

    The ring is stored window-first, ``(W, series, ops)``, so reductions over the window run across
    contiguous planes (20x faster in numpy than over a short last axis)."""

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


def _window_median(values: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Median along the last axis of the first ``n`` finite values (NaN padding sorts last)."""
    return median_sorted(np.sort(values, axis=-1), n)


def op_floors(ops: Sequence[str], floor: float) -> np.ndarray:
    return np.array([max(floor, OP_FLOORS.get(op, 0.0)) for op in ops])


def _nan_flags(state: _SeriesState, sel: tuple, ops, x, finite) -> tuple[np.ndarray, np.ndarray]:
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


# --------------------------------------------------------------------------------------------- rules
class Rule:
    """A detection rule over series. ``observe`` judges one record and then updates the state.

    ``observe(sids, ops, values)``: ``sids`` are unique series ids (one per row), ``values`` a float64
    ``rows x len(ops)`` matrix. Returns ``(flags, baselines)``, both ``rows x len(ops)``; a baseline is
    only defined where a flag is set (elsewhere it may be NaN).
    """

    name = "Rule"

    def __init__(self, window: int = 1) -> None:
        self._state = _SeriesState(window)

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
        flags, base = _nan_flags(st, sel, ops, values, finite)
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
                med = _window_median(h, nr)
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
            nan_flags, nan_base = _nan_flags(st, sel, ops, x, finite)
            nf = np.flatnonzero(nan_flags.any(axis=1))
            if nf.size:
                # a NaN's baseline is the window's median; a nans count's is the previous count
                base[nf] = _window_median(np.moveaxis(hist[:, nf], 0, -1), n[nf])
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

# --------------------------------------------------------------------------------------------- series
class SeriesIndex:
    """Dense ids of series rows ``(rank, kind, name, slot, micro_step, vpp_stage, occurrence)``.

    A record's layout (its names and per-row columns) usually repeats every step, so the id array of
    a layout is cached and a known layout costs one dict lookup.
    """

    def __init__(self, max_layouts: int = 512) -> None:
        self._ids: dict[tuple, int] = {}
        self._layouts: dict[tuple, np.ndarray] = {}
        self._max_layouts = max_layouts

    def __len__(self) -> int:
        return len(self._ids)

    def sids(self, rank: int, kind: str, names: Sequence[str], slots: np.ndarray, micro_steps: np.ndarray,
             vpp_stages: np.ndarray) -> np.ndarray:
        names_t = tuple(names)
        lkey = (rank, kind, names_t, slots.tobytes(), micro_steps.tobytes(), vpp_stages.tobytes())
        got = self._layouts.get(lkey)
        if got is not None:
            return got
        ids = self._ids
        seen: dict[tuple, int] = {}
        out = np.empty(len(names_t), dtype=np.intp)
        for i, key in enumerate(zip(names_t, slots.tolist(), micro_steps.tolist(), vpp_stages.tolist(), strict=True)):
            occ = seen.get(key, 0)
            seen[key] = occ + 1
            full = (rank, kind, *key, occ)
            sid = ids.get(full)
            if sid is None:
                sid = ids[full] = len(ids)
            out[i] = sid
        if len(self._layouts) >= self._max_layouts:
            self._layouts.clear()
        self._layouts[lkey] = out
        return out


def _column(arr: Any, n: int, dtype, fill: int) -> np.ndarray:
    if arr is None or len(arr) == 0:
        return np.full(n, fill, dtype=dtype)
    a = np.asarray(arr)
    if len(a) != n:
        raise ValueError(f"per-row column has {len(a)} entries for {n} rows")
    return a.astype(dtype, copy=False)


def anomaly_message(rule: str, tag_name: str, op: str, step: int) -> str:
    """The reference's alert text: ``Rule R reports anomaly signal in ('tag', 'op') at step S.``"""
    return f"Rule {rule} reports anomaly signal in {(tag_name, op)!r} at step {step}."


class Detector:
    """Rules plus series ids: turns stats records into AnomalyDetected events.

    One detector per stream of records in order (one rank at record time; any number of ranks at
    replay time, since the rank is part of every series).
    """

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = list(rules)
        self.series = SeriesIndex()
        self.observed_rows = 0

    def observe(
        self,
        *,
        rank: int,
        step: int,
        kind: str,
        ops: Sequence[str],
        names: Sequence[str],
        values: np.ndarray,
        micro_steps: Any = None,
        call_ids: Any = None,
        slots: Any = None,
        vpp_stages: Any = None,
        pp_stage: int = 0,
        group_mates: Sequence[int] = (),
        wall: float = 0.0,
        placeholders: Any = None,
    ) -> list[AnomalyDetected]:
        """The anomalies of one stats record. ``placeholders``: per row, nonzero where the row stands for
        no tensor's values (see the module docstring); those rows are skipped by every rule, neither
        flagged nor fed into their series' state. None or empty: no row is one."""
        n = len(names)
        ops = tuple(ops)
        if not self.rules or n == 0 or not ops:
            return []
        x = np.asarray(values, dtype=np.float64).reshape(n, len(ops))
        micro = _column(micro_steps, n, np.int64, 0)
        calls = _column(call_ids, n, np.int64, -1)
        slot = _column(slots, n, np.int64, 0)
        vpp = _column(vpp_stages, n, np.int64, 0)
        # series ids of every row, placeholders included: a name's occurrence count (its series) must
        # not depend on whether an earlier occurrence in the record had values this step
        sids = self.series.sids(rank, kind, names, slot, micro, vpp)
        rows_of = None  # row numbers of the rows judged, where placeholders are left out
        if placeholders is not None and len(placeholders):
            if isinstance(placeholders, (bytes, bytearray, memoryview)):  # (a record's column as it is)
                placeholders = np.frombuffer(placeholders, dtype=np.uint8)
            mask = _column(placeholders, n, np.bool_, 0)
            if mask.any():
                rows_of = np.flatnonzero(~mask)
                if not len(rows_of):
                    return []
                sids, x = sids[rows_of], x[rows_of]
        self.observed_rows += n if rows_of is None else len(rows_of)
        out: list[AnomalyDetected] = []
        mates = tuple(int(m) for m in group_mates)
        for rule in self.rules:
            flags, base = rule.observe(sids, ops, x)
            if not flags.any():
                continue
            rows, cols = np.nonzero(flags)
            for j, c in zip(rows.tolist(), cols.tolist(), strict=True):
                r = j if rows_of is None else int(rows_of[j])
                s = int(slot[r])
                slot_name = SLOTS[s] if 0 <= s < len(SLOTS) else str(s)
                tag = reference_tag(kind, names[r], slot_name, int(micro[r]), rank, int(vpp[r]))
                op = ops[c]
                out.append(AnomalyDetected(
                    rank=rank, step=step, wall=wall, micro_step=int(micro[r]), pp_stage=pp_stage,
                    vpp_stage=int(vpp[r]), call_id=int(calls[r]), tag_name=tag, op=op, value=float(x[j, c]),
                    baseline=float(base[j, c]), message=anomaly_message(rule.name, tag, op, step),
                    group_mates=mates, rule=rule.name, kind=kind, name=names[r], slot=slot_name,
                ))
        return out


# --------------------------------------------------------------------------------------------- JSON
def reference_key(tag_name: str, step: int, call_id: int) -> str:
    """The reference's anomaly JSON key."""
    return f"{tag_name}_step_{step}_call_{call_id}"


def reference_entry(ev: AnomalyDetected) -> tuple[str, dict[str, Any]]:
    """``(key, value)`` of the reference's anomaly JSON for one anomaly (exactly its fields)."""
    value = {
        "rank": ev.rank,
        "step": ev.step,
        "micro_step": ev.micro_step,
        "pp_stage": ev.pp_stage,
        "vpp_stage": ev.vpp_stage,
        "call_id": ev.call_id,
        "tag_name": ev.tag_name,
        "message": ev.message,
        "group_mates": list(ev.group_mates),
    }
    return reference_key(ev.tag_name, ev.step, ev.call_id), value
