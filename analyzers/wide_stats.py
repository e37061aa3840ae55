"""Statistics wide by op: per (kind, rank), batches of rows ``(step, micro step, call, tensor)`` with one
value column per op, for columnar exports (``trainrec export parquet``).

The log stores a ``rows x ops`` matrix per record, so a wide batch is that matrix's columns glued
together. Every batch of a run has one schema: an op a record lacks is marked missing (``valid``),
an op outside :data:`OPS` is counted in :attr:`WideStats.dropped_ops`, not exported. Names are codes
into :attr:`WideStats.names` (it only grows), for dictionary encoding. Pure: feed one rank's events.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
from trainrec.replay.names import NameResolver
from trainrec.replay.rows import _Codes, _NameCodes, value_matrix
from trainrec.schema.events import OPS, SLOTS, Event, FileOpened, NamesInterned, TensorStatsRecorded

__all__ = ["KEY_COLUMNS", "OPS", "WideBatch", "WideStats"]

# a kind names a directory of the dataset: one from a log (untrusted) must be a plain word
SAFE_KIND = re.compile(r"[A-Za-z0-9_]{1,64}")
KEY_COLUMNS = ("step", "micro_step", "call_id", "name", "vpp_stage", "slot", "placeholder")
BATCH_ROWS = 1 << 19  # rows per batch (a Parquet row group): a few MB per column


@dataclass
class WideBatch:
    """Rows of one kind of one rank. ``name`` and ``slot`` are codes (into ``WideStats.names`` and
    ``SLOTS``); ``values[op]`` is of :attr:`WideStats.dtype`, ``valid[op]`` a bool mask, or None where all
    are valid."""

    kind: str
    rank: int
    step: np.ndarray  # int64
    micro_step: np.ndarray  # int32
    call_id: np.ndarray  # int64, -1 where unknown
    name: np.ndarray  # int32 codes
    vpp_stage: np.ndarray  # int32
    slot: np.ndarray  # int8 codes into SLOTS
    placeholder: np.ndarray  # bool
    values: dict[str, np.ndarray]
    valid: dict[str, np.ndarray | None]

    def __len__(self) -> int:
        return len(self.step)

    @property
    def value_count(self) -> int:
        return sum(len(self.step) if m is None else int(m.sum()) for m in self.valid.values())


@dataclass
class _Pending:
    parts: list[tuple] = field(default_factory=list)  # (step, n, ops, matrix, ev, name codes)
    rows: int = 0


class WideStats:
    """Gathers the stats records of one stream into :class:`WideBatch` es, per kind."""

    def __init__(self, kinds: Iterable[str] | None = None, steps=None, batch_rows: int = BATCH_ROWS,
                 dtype=np.float32) -> None:
        self.kinds = None if kinds is None else set(kinds)
        self.dtype = np.dtype(dtype)  # of the value columns: float32 as recorded, or float64
        self.steps = steps  # a container of steps (analyzers.selection.StepSet) or None for all
        self.batch_rows = batch_rows
        self._resolver = NameResolver()
        self._codes = _Codes()
        self._names = _NameCodes(self._resolver, self._codes)
        self._pending: dict[tuple[str, int], _Pending] = {}
        self.dropped_ops: dict[str, int] = {}
        self.dropped_kinds: dict[str, int] = {}  # kinds that are no plain word: rows left out
        self.records = 0
        self.double_records = 0  # float64 records (rounded where ``dtype`` is float32)
        self.steps_seen: set[int] = set()

    @property
    def names(self) -> list[str]:
        """The names the ``name`` codes of every batch index (only grows)."""
        return self._codes.values

    def feed(self, events: Iterable[Event]) -> Iterator[WideBatch]:
        """Consume ``events``; yields every batch that filled up meanwhile."""
        kinds, steps = self.kinds, self.steps
        for ev in events:
            t = type(ev)
            if t is not TensorStatsRecorded:
                if t is NamesInterned or t is FileOpened:
                    self._names.changed(ev.rank)
                self._resolver.feed(ev)
                continue
            if (kinds is not None and ev.kind not in kinds) or (steps is not None and ev.step not in steps):
                continue
            n = len(ev)
            if n == 0 or not ev.ops:
                continue
            if not SAFE_KIND.fullmatch(ev.kind):
                self.dropped_kinds[ev.kind] = self.dropped_kinds.get(ev.kind, 0) + n
                continue
            key = (ev.kind, ev.rank)
            pend = self._pending.get(key)
            if pend is None:
                pend = self._pending[key] = _Pending()
            codes = self._names.lookup(ev.rank, np.frombuffer(ev.name_ids, dtype="<u4"))
            pend.parts.append((ev, codes))
            pend.rows += n
            self.records += 1
            if ev.dtype != "f":
                self.double_records += 1
            self.steps_seen.add(ev.step)
            for op in ev.ops:
                if op not in _OP_INDEX:
                    self.dropped_ops[op] = self.dropped_ops.get(op, 0) + n
            if pend.rows >= self.batch_rows:
                yield self._batch(key)

    def finish(self) -> Iterator[WideBatch]:
        """The batches still pending, in (kind, rank) order."""
        for key in sorted(self._pending):
            if self._pending[key].rows:
                yield self._batch(key)

    def _batch(self, key: tuple[str, int]) -> WideBatch:
        pend = self._pending.pop(key)
        parts = pend.parts
        total = pend.rows
        lens = np.fromiter((len(ev) for ev, _ in parts), dtype=np.int64, count=len(parts))
        step = np.repeat(np.fromiter((ev.step for ev, _ in parts), dtype=np.int64, count=len(parts)), lens)
        values: dict[str, np.ndarray] = {}
        valid: dict[str, np.ndarray | None] = {}
        same_ops = all(ev.ops == parts[0][0].ops for ev, _ in parts)
        dtype = self.dtype
        if same_ops and all(ev.dtype == "f" for ev, _ in parts):
            # the common case: one matrix for the batch, its columns widened once
            matrix = np.concatenate([value_matrix(ev) for ev, _ in parts]) if len(parts) > 1 else value_matrix(parts[0][0])
            for j, op in enumerate(parts[0][0].ops):
                if op in _OP_INDEX:
                    values[op] = np.ascontiguousarray(matrix[:, j], dtype=dtype)
                    valid[op] = None
        else:
            for op in OPS:
                col = np.full(total, np.nan, dtype=dtype)
                mask = np.zeros(total, dtype=bool)
                pos = 0
                for ev, _ in parts:
                    n = len(ev)
                    if op in ev.ops:
                        col[pos : pos + n] = value_matrix(ev)[:, ev.ops.index(op)]
                        mask[pos : pos + n] = True
                    pos += n
                if mask.any():
                    values[op] = col
                    valid[op] = None if mask.all() else mask
        for op in OPS:  # every batch has every op column: absent ones all missing
            if op not in values:
                values[op] = np.full(total, np.nan, dtype=dtype)
                valid[op] = np.zeros(total, dtype=bool)
        return WideBatch(
            kind=key[0],
            rank=key[1],
            step=step,
            micro_step=_column(parts, "micro_steps", "<u2", np.int32, 0, total),
            call_id=_column(parts, "call_ids", "<u4", np.int64, -1, total),
            name=np.concatenate([c for _, c in parts]).astype(np.int32, copy=False),
            vpp_stage=_column(parts, "vpp_stages", "u1", np.int32, 0, total),
            slot=_column(parts, "slots", "u1", np.int8, 0, total),
            placeholder=_column(parts, "placeholders", "u1", np.bool_, 0, total),
            values={op: values[op] for op in OPS},
            valid={op: valid[op] for op in OPS},
        )


_OP_INDEX = {op: i for i, op in enumerate(OPS)}
SLOT_NAMES = SLOTS


def _column(parts: list[tuple], attr: str, packed: str, dtype, default, total: int) -> np.ndarray:
    """A per-row array of every record of ``parts`` (``default`` where a record leaves it empty)."""
    if not any(getattr(ev, attr) for ev, _ in parts):
        return np.full(total, default, dtype=dtype)
    out = np.full(total, default, dtype=dtype)
    pos = 0
    for ev, _ in parts:
        n = len(ev)
        raw = getattr(ev, attr)
        if raw:
            out[pos : pos + n] = np.frombuffer(raw, dtype=packed)
        pos += n
    return out
