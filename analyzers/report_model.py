"""The data of a run report (``trainrec report``): one pass over a run's events, kept small enough for
one HTML page however long the run.

Per rank the step durations (at most ``max_points``, the slowest of each bin kept); per kind a
``tensor x step-bin`` matrix per op (at most ``max_bins`` bins, doubling in width as the run grows, a
bin keeping its extreme value); the anomalies with their heatmap cell; config switches and resumes.
Pure: :meth:`ReportBuilder.feed` events, then :meth:`ReportBuilder.model` gives plain data.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from trainrec.replay.names import NameResolver
from trainrec.replay.rows import value_matrix
from trainrec.schema.events import (
    OPS,
    SLOTS,
    AnomalyDetected,
    ConfigApplied,
    Event,
    FileOpened,
    NamesInterned,
    RunResumed,
    StepEnded,
    TensorStatsRecorded,
)

__all__ = ["KindGrid", "ReportBuilder", "ReportModel"]

_MIN = OPS.index("min")
_OP_COL = {op: i for i, op in enumerate(OPS)}


class KindGrid:
    """The ``rows x bins x ops`` matrix of one kind, growing in rows and folding bins as steps come."""

    def __init__(self, kind: str, first_step: int, max_bins: int) -> None:
        self.kind = kind
        self.first_step = first_step
        self.max_bins = max_bins
        self.width = 1  # steps per bin
        self.labels: list[str] = []
        self.index: dict[str, int] = {}
        self.ops_seen: set[str] = set()
        self.data = np.full((16, 64, len(OPS)), np.nan, dtype=np.float32)  # rows x bins x ops
        self.bins = 0  # bins used

    def rows_of(self, labels: list[str]) -> np.ndarray:
        index = self.index
        out = np.empty(len(labels), dtype=np.int64)
        for i, label in enumerate(labels):
            j = index.get(label)
            if j is None:
                j = index[label] = len(self.labels)
                self.labels.append(label)
            out[i] = j
        if len(self.labels) > self.data.shape[0]:
            grown = np.full((max(len(self.labels), 2 * self.data.shape[0]), *self.data.shape[1:]), np.nan, np.float32)
            grown[: self.data.shape[0]] = self.data
            self.data = grown
        return out

    def add(self, step: int, rows: np.ndarray, ops: tuple, values: np.ndarray) -> None:
        if step < self.first_step:  # (a resume to before the first step seen: shift everything right)
            self._shift(step)
        b = (step - self.first_step) // self.width
        while b >= self.max_bins:  # fold: every two bins into one, twice as wide
            self._fold()
            b = (step - self.first_step) // self.width
        if b >= self.data.shape[1]:
            grown = np.full((self.data.shape[0], max(b + 1, 2 * self.data.shape[1]), len(OPS)), np.nan, np.float32)
            grown[:, : self.data.shape[1]] = self.data
            self.data = grown
        self.bins = max(self.bins, b + 1)
        cell = self.data[:, b, :]  # (a view: written in place)
        unique = len(np.unique(rows)) == len(rows)  # else a row several times (micro steps)
        for src, op in enumerate(ops):
            c = _OP_COL.get(op)
            if c is None:
                continue
            self.ops_seen.add(op)
            fold = np.fmin if c == _MIN else np.fmax
            col = values[:, src].astype(np.float32, copy=False)
            if unique:
                cell[rows, c] = fold(cell[rows, c], col)
            else:
                fold.at(cell[:, c], rows, col)

    def finish(self) -> None:
        """Fold until at most ``max_bins`` bins remain (a resume to before the first step can add some)."""
        while self.bins > self.max_bins:
            self._fold()

    def bin_of(self, step: int) -> int:
        return max(0, (step - self.first_step) // self.width)

    def matrix(self, op: str) -> np.ndarray:
        """``rows x bins`` float32 of ``op``."""
        return np.ascontiguousarray(self.data[: len(self.labels), : self.bins, OPS.index(op)])

    def _fold(self) -> None:
        d = self.data
        n = (self.bins + 1) // 2
        pairs = np.full((d.shape[0], 2 * n, len(OPS)), np.nan, np.float32)
        pairs[:, : self.bins] = d[:, : self.bins]
        a, b = pairs[:, 0::2], pairs[:, 1::2]
        folded = np.fmax(a, b)
        folded[:, :, _MIN] = np.fmin(a[:, :, _MIN], b[:, :, _MIN])
        self.data = np.full_like(d, np.nan)
        self.data[:, :n] = folded
        self.bins = n
        self.width *= 2

    def _shift(self, step: int) -> None:
        extra = -(-(self.first_step - step) // self.width)
        grown = np.full((self.data.shape[0], self.data.shape[1] + extra, len(OPS)), np.nan, np.float32)
        grown[:, extra:] = self.data
        self.data = grown
        self.bins += extra
        self.first_step -= extra * self.width


@dataclass
class ReportModel:
    """Everything the page shows (plain data; matrices are numpy)."""

    steps: dict[int, tuple[list[int], list[float]]]  # rank -> (steps, durations), downsampled
    step_counts: dict[int, int]
    kinds: list[KindGrid]
    anomalies: list[dict]
    marks: list[dict]  # config switches and resumes: {"step", "rank", "type", "text"}
    values: int = 0
    extra: dict = field(default_factory=dict)


class ReportBuilder:
    """Feed the events of a run (ranks merged or one after another); then :meth:`model`."""

    def __init__(self, max_bins: int = 400, max_points: int = 2000, ranks: int = 1) -> None:
        self.max_bins = max_bins
        self.max_points = max_points
        self.multi_rank = ranks > 1
        self._resolver = NameResolver()
        self._grids: dict[str, KindGrid] = {}
        self._labels: dict[tuple, list[str]] = {}
        self._rows: dict[tuple, np.ndarray] = {}
        self._gen: dict[int, int] = {}
        self._steps: dict[int, list[tuple[int, float]]] = {}
        self._anomalies: list[AnomalyDetected] = []
        self.marks: list[dict] = []
        self.values = 0

    def feed(self, events: Iterable[Event]) -> None:
        for ev in events:
            t = type(ev)
            if t is TensorStatsRecorded:
                self._stats(ev)
            elif t is StepEnded:
                if not ev.foreign_passes:
                    self._steps.setdefault(ev.rank, []).append((ev.step, float(ev.duration)))
            elif t is NamesInterned or t is FileOpened:
                self._gen[ev.rank] = self._gen.get(ev.rank, 0) + 1
                self._resolver.feed(ev)
            elif t is AnomalyDetected:
                self._anomalies.append(ev)
            elif t is ConfigApplied:
                self.marks.append({"step": ev.step, "rank": ev.rank, "type": "config",
                                   "text": f"config {ev.reason or 'applied'} ({ev.path or 'dict'}), from step {ev.start_step}"})
            elif t is RunResumed:
                self.marks.append({"step": ev.step, "rank": ev.rank, "type": "resume",
                                   "text": f"resumed at step {ev.step} ({ev.reason or 'resume'})"})

    def _stats(self, ev: TensorStatsRecorded) -> None:
        n = len(ev)
        if n == 0 or not ev.ops:
            return
        grid = self._grids.get(ev.kind)
        if grid is None:
            grid = self._grids[ev.kind] = KindGrid(ev.kind, ev.step, self.max_bins)
        key = (ev.kind, ev.rank, self._gen.get(ev.rank, 0), ev.name_ids, ev.slots)
        rows = self._rows.get(key)
        if rows is None:
            names = self._resolver.names(ev)
            slots = ev.slots or bytes(n)
            prefix = f"rank {ev.rank} " if self.multi_rank else ""
            labels = [f"{prefix}{name}" + (f":{SLOTS[s]}" if s else "") for name, s in zip(names, slots, strict=True)]
            if len(self._rows) > 4096:
                self._rows.clear()
            rows = self._rows[key] = grid.rows_of(labels)
        grid.add(ev.step, rows, ev.ops, value_matrix(ev))
        self.values += n * len(ev.ops)

    def model(self) -> ReportModel:
        steps = {}
        counts = {}
        for rank, pairs in sorted(self._steps.items()):
            pairs.sort()
            counts[rank] = len(pairs)
            steps[rank] = _downsample(pairs, self.max_points)
        grids = [self._grids[k] for k in sorted(self._grids, key=_kind_order)]
        for grid in grids:
            grid.finish()
        anomalies = []
        for i, an in enumerate(self._anomalies):
            kind = getattr(an, "kind", "") or ""
            name = getattr(an, "name", "") or ""
            grid = self._grids.get(kind)
            row = None
            if grid is not None and name:
                prefix = f"rank {an.rank} " if self.multi_rank else ""
                row = grid.index.get(prefix + name)
                if row is None:  # an activation: the first of its slots
                    row = next((j for j, lab in enumerate(grid.labels) if lab.startswith(prefix + name + ":")), None)
            anomalies.append({
                "i": i, "step": an.step, "rank": an.rank, "kind": kind, "name": name or an.tag_name, "op": an.op,
                "value": _num(an.value), "baseline": _num(an.baseline), "rule": an.rule, "message": an.message,
                "row": row, "col": grid.bin_of(an.step) if grid is not None else None,
            })
        anomalies.sort(key=lambda a: (a["step"], a["rank"], a["i"]))
        return ReportModel(steps=steps, step_counts=counts, kinds=grids, anomalies=anomalies,
                           marks=sorted(self.marks, key=lambda m: (m["step"], m["rank"])), values=self.values)


_KIND_ORDER = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio")


def _kind_order(kind: str) -> tuple:
    return (_KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER), kind)


def _num(v) -> float | str:
    """A float for JSON: NaN and infinities as text."""
    v = float(v)
    return v if np.isfinite(v) else str(v)


def _downsample(pairs: list[tuple[int, float]], max_points: int) -> tuple[list[int], list[float]]:
    """At most ``max_points`` (step, duration): the slowest step of each run of consecutive ones."""
    if len(pairs) <= max_points:
        return [s for s, _ in pairs], [d for _, d in pairs]
    per = -(-len(pairs) // max_points)
    steps, durs = [], []
    for i in range(0, len(pairs), per):
        chunk = pairs[i : i + per]
        s, d = max(chunk, key=lambda p: p[1])
        steps.append(s)
        durs.append(d)
    return steps, durs
