"""A flat, columnar view of statistics: one row per (tensor row, op), as numpy arrays.

``rows_from_events(events)`` turns a stream of events (each rank's own order kept) into a dict of
equally long numpy arrays, which ``pandas.DataFrame`` accepts as is:

=============  ========  ===========================================================
column         dtype     meaning
=============  ========  ===========================================================
rank           int32     writer's rank
step           int64     training step
kind           object    stats kind (``actv``, ``grad_reduced``, ...)
name           object    module or parameter name, resolved through NamesInterned
slot           object    ``""``, ``input``, ``output``, ``input_grad``, ``output_grad``
micro_step     int32     micro step (0 when not recorded)
call_id        int64     hook call id in execution order (-1 when unknown)
vpp_stage      int32     virtual pipeline stage
op             object    ``min``, ``max``, ``norm``, ``mean``, ``zeros``, ``nans``
value          float64   the statistic (float32 records are widened exactly)
=============  ========  ===========================================================

Work per record is vectorised (a record of 500 tensors x 6 ops costs a few numpy calls).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from trainrec.schema.events import SLOTS, Event, FileOpened, NamesInterned, TensorStatsRecorded

from .names import NameResolver

COLUMNS = ("rank", "step", "kind", "name", "slot", "micro_step", "call_id", "vpp_stage", "op", "value")
_DTYPES = {
    "rank": np.int32,
    "step": np.int64,
    "kind": object,
    "name": object,
    "slot": object,
    "micro_step": np.int32,
    "call_id": np.int64,
    "vpp_stage": np.int32,
    "op": object,
    "value": np.float64,
}
_SLOT_NAMES = list(SLOTS) + [str(i) for i in range(len(SLOTS), 256)]


def value_matrix(ev: TensorStatsRecorded) -> np.ndarray:
    """The ``rows x ops`` value matrix of a stats record (a read-only view, no copy)."""
    dt = "<f4" if ev.dtype == "f" else "<f8"
    return np.frombuffer(ev.values, dtype=dt).reshape(len(ev), len(ev.ops))


class _Codes:
    """Strings as small integer codes; each column is materialised once, at the end, by one take."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self._index: dict[str, int] = {}

    def code(self, value: str) -> int:
        i = self._index.get(value)
        if i is None:
            i = self._index[value] = len(self.values)
            self.values.append(value)
        return i

    def take(self, codes: np.ndarray) -> np.ndarray:
        table = np.empty(len(self.values), dtype=object)
        table[:] = self.values
        return table[codes] if codes.size else np.empty(0, dtype=object)


class _NameCodes:
    """Maps each rank's per-file name ids to global name codes; rebuilt when the rank's table changes
    (``changed(rank)`` is called on every NamesInterned / FileOpened of that rank)."""

    def __init__(self, resolver: NameResolver, codes: _Codes) -> None:
        self._resolver = resolver
        self._codes = codes
        self._maps: dict[int, np.ndarray] = {}

    def changed(self, rank: int) -> None:
        self._maps.pop(rank, None)

    def lookup(self, rank: int, ids: np.ndarray) -> np.ndarray:
        mapping = self._maps.get(rank)
        if mapping is None:
            table = self._resolver.table(rank)
            code = self._codes.code
            mapping = self._maps[rank] = np.fromiter((code(n) for n in table), dtype=np.int64, count=len(table))
        if ids.size and int(ids.max()) >= len(mapping):
            code = self._codes.code
            name = self._resolver.name
            return np.fromiter((code(name(rank, int(i))) for i in ids), dtype=np.int64, count=ids.size)
        return mapping[ids]


def rows_from_events(events: Iterable[Event], kinds: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Columns (see the module docstring) of every stats record in ``events``."""
    wanted = None if kinds is None else set(kinds)
    resolver = NameResolver()
    strings = _Codes()
    for s in _SLOT_NAMES:
        strings.code(s)  # slot code == slot number
    names = _NameCodes(resolver, strings)
    code = strings.code
    # Per record: rank, step, kind code, rows, ops.
    rec_rank: list[int] = []
    rec_step: list[int] = []
    rec_kind: list[int] = []
    rec_rows: list[int] = []
    rec_ops: list[int] = []
    # Per tensor row, expanded over ops at the end.
    row_cols: dict[str, list[np.ndarray]] = {c: [] for c in ("name", "slot", "micro_step", "call_id", "vpp_stage")}
    ops_parts: list[np.ndarray] = []
    value_parts: list[np.ndarray] = []
    for ev in events:
        t = type(ev)
        if t is not TensorStatsRecorded:
            if t is NamesInterned or t is FileOpened:
                names.changed(ev.rank)
            resolver.feed(ev)
            continue
        if wanted is not None and ev.kind not in wanted:
            continue
        n = len(ev)
        m = len(ev.ops)
        if n == 0 or m == 0:
            continue
        rec_rank.append(ev.rank)
        rec_step.append(ev.step)
        rec_kind.append(code(ev.kind))
        rec_rows.append(n)
        rec_ops.append(m)
        row_cols["name"].append(names.lookup(ev.rank, np.frombuffer(ev.name_ids, dtype="<u4")))
        row_cols["slot"].append(np.frombuffer(ev.slots, dtype=np.uint8) if ev.slots else np.zeros(n, np.uint8))
        row_cols["micro_step"].append(
            np.frombuffer(ev.micro_steps, dtype="<u2") if ev.micro_steps else np.zeros(n, np.uint16)
        )
        row_cols["call_id"].append(
            np.frombuffer(ev.call_ids, dtype="<u4").astype(np.int64) if ev.call_ids else np.full(n, -1, np.int64)
        )
        row_cols["vpp_stage"].append(
            np.frombuffer(ev.vpp_stages, dtype=np.uint8) if ev.vpp_stages else np.zeros(n, np.uint8)
        )
        ops_parts.append(np.tile(np.array([code(str(o)) for o in ev.ops], dtype=np.int64), n))
        value_parts.append(value_matrix(ev).ravel())
    if not rec_rows:
        return {c: np.empty(0, dtype=_DTYPES[c]) for c in COLUMNS}
    rows = np.array(rec_rows, dtype=np.int64)
    ops = np.array(rec_ops, dtype=np.int64)
    per_record = rows * ops
    per_row_ops = np.repeat(ops, rows)
    out: dict[str, np.ndarray] = {
        "rank": np.repeat(np.array(rec_rank, dtype=np.int32), per_record),
        "step": np.repeat(np.array(rec_step, dtype=np.int64), per_record),
        "kind": strings.take(np.repeat(np.array(rec_kind, dtype=np.int64), per_record)),
    }
    for c in ("name", "slot", "micro_step", "call_id", "vpp_stage"):
        col = np.repeat(np.concatenate(row_cols[c]), per_row_ops)
        out[c] = strings.take(col) if _DTYPES[c] is object else col.astype(_DTYPES[c], copy=False)
    out["op"] = strings.take(np.concatenate(ops_parts))
    out["value"] = np.concatenate([v.astype(np.float64, copy=False) for v in value_parts])
    return {c: out[c] for c in COLUMNS}


def execution_order(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Indices that sort ``rows`` in execution order: step, micro step, call id, rank (stable).

    Rows whose call id is unknown (-1: reduced weight grads, optimizer states, params) were not
    produced by a hook call; they come after every row of their step with a call id (after the last
    micro step), in rank order.
    """
    call = rows["call_id"]
    unknown = call < 0
    big = np.iinfo(np.int64).max
    call_key = np.where(unknown, big, call)
    micro_key = np.where(unknown, big, rows["micro_step"].astype(np.int64))
    return np.lexsort((rows["rank"], call_key, micro_key, rows["step"]))
