"""The anomaly detector: the rules of :mod:`.rules` applied to stats records, shared by the recorder
(record time) and the analyzers (replay time).

Pure Python and numpy. Both sides feed the same statistics through the same :class:`Detector`, so a
re-detection from a log with the recording's rule config finds exactly the anomalies the recorder
found.

Series
    A rule keeps state per series: ``(rank, kind, name, slot, micro_step, vpp_stage, op)``. A name
    that appears twice in one record (a module called twice per micro step) gets one series per
    occurrence. State lives in numpy arrays indexed by a dense series id, so one record of any size
    costs a handful of vectorised operations.

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
from .rules import Rule

__all__ = ["REFERENCE_FIELDS", "Detector", "SeriesIndex", "anomaly_message", "reference_entry", "reference_key"]

REFERENCE_FIELDS = (
    "rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message", "group_mates",
)


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
        no tensor's values (see :mod:`.rules`); those rows are skipped by every rule, neither
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
