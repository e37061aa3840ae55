"""Anomalies of a run: those recorded in the log, re-detected from its statistics, or read from the
reference's ``anomaly.json`` files; and their JSON forms.

:class:`AnomalyScan` takes an event stream (one rank's or merged, complete or still growing) and
collects the recorded :class:`AnomalyDetected` events and, with rules, those the recorder's
:class:`~trainrec.schema.detector.Detector` finds in the statistics, so a rule can change without
rerunning training. :func:`parse_reference_json` reads the reference's JSON into the same events;
:func:`reference_json` and :func:`anomaly_records` write ranked anomalies out
(ranking: :mod:`trainrec.analyzers.ranking`).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from trainrec.replay.names import NameResolver
from trainrec.replay.stats_columns import StatsColumns
from trainrec.schema.detector import REFERENCE_FIELDS, Detector, reference_entry
from trainrec.schema.errors import FormatError
from trainrec.schema.events import (
    SLOTS,
    AnomalyDetected,
    Event,
    FileOpened,
    NamesInterned,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
)
from trainrec.schema.rules import Rule

from .ranking import PHASE_NAMES, kind_of, kind_of_tag, phase_of

__all__ = [
    "AnomalyScan",
    "anomaly_records",
    "parse_reference_json",
    "reference_json",
]

_DTYPES = {"f": np.dtype("<f4"), "d": np.dtype("<f8")}


class AnomalyScan:
    """Recorded and (with ``rules``) re-detected anomalies of an event stream. Feed events in order.

    ``kinds`` restricts re-detection to some stats kinds. ``first_step``/``last_step`` span every
    step seen in stats, step-end and anomaly events (the recorded range), ``ranks`` the ranks seen,
    ``skipped_steps`` the steps whose optimizer step never ran (a loss scaler found inf/NaN).
    """

    def __init__(self, rules: Sequence[Rule] = (), kinds: Iterable[str] | None = None) -> None:
        self.detector = Detector(rules) if rules else None
        self.kinds = None if kinds is None else frozenset(kinds)
        self.recorded: list[AnomalyDetected] = []
        self.detected: list[AnomalyDetected] = []
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.ranks: set[int] = set()
        self.stats_records = 0
        self.bad_records = 0
        self.skipped_steps: set[int] = set()  # steps whose optimizer step never ran (inf/NaN gradients)
        self._resolver = NameResolver()
        self._rank_info: dict[int, tuple[int, tuple]] = {}
        self._names: dict[tuple, list[str]] = {}
        self._gen: dict[int, int] = {}

    @property
    def redetecting(self) -> bool:
        return self.detector is not None

    @property
    def anomalies(self) -> list[AnomalyDetected]:
        """The re-detected anomalies when rules were given, else the recorded ones."""
        return self.detected if self.detector is not None else self.recorded

    def _saw_step(self, step: int) -> None:
        if step < 0:
            return
        if self.first_step is None or step < self.first_step:
            self.first_step = step
        if self.last_step is None or step > self.last_step:
            self.last_step = step

    def feed_all(self, events: Iterable[Event]) -> AnomalyScan:
        for ev in events:
            self.feed(ev)
        return self

    def feed(self, ev: Event | StatsColumns) -> list[AnomalyDetected]:
        """Consume one event (or a stats record as columns); returns the anomalies it brought (recorded or
        re-detected)."""
        t = type(ev)
        if t is TensorStatsRecorded or t is StatsColumns:
            self.stats_records += 1
            self.ranks.add(ev.rank)
            first, step = self.first_step, ev.step
            if first is None or not first <= step <= self.last_step:  # (a step seen before: nothing to note)
                self._saw_step(step)
            if self.detector is None or (self.kinds is not None and ev.kind not in self.kinds):
                return []
            return self._detect(ev)
        if t is StepBegan:
            return []
        if t is AnomalyDetected:
            self.ranks.add(ev.rank)
            self._saw_step(ev.step)
            self.recorded.append(ev)
            return [] if self.detector is not None else [ev]
        if t is StepEnded:
            self._saw_step(ev.step)
            if ev.optimizer_skipped:
                self.skipped_steps.add(ev.step)
        elif t is FileOpened:
            self._rank_info[ev.rank] = (ev.pp_stage, tuple(ev.group_mates))
            self._gen[ev.rank] = self._gen.get(ev.rank, 0) + 1
            self._resolver.feed(ev)
        elif t is NamesInterned:
            self._gen[ev.rank] = self._gen.get(ev.rank, 0) + 1
            self._resolver.feed(ev)
        return []

    def observe_stats(self, rec: TensorStatsRecorded, names: list[str], pp_stage: int = 0,
                      group_mates: Sequence[int] = ()) -> list[AnomalyDetected]:
        """Re-detect on one record whose row names are already resolved (e.g. from ``Run.stats``)."""
        self.stats_records += 1
        self.ranks.add(rec.rank)
        self._saw_step(rec.step)
        if self.detector is None or (self.kinds is not None and rec.kind not in self.kinds):
            return []
        return self._detect(rec, names, (pp_stage, tuple(group_mates)))

    def _row_names(self, rec: TensorStatsRecorded) -> list[str]:
        """The names of a record's rows, resolved once per layout and names table of its rank."""
        key = (rec.rank, self._gen.get(rec.rank, 0), rec.name_ids)
        names = self._names.get(key)
        if names is None:
            if len(self._names) > 4096:
                self._names.clear()
            names = self._names[key] = self._resolver.names(rec)
        return names

    def _detect(self, rec: TensorStatsRecorded, names: list[str] | None = None,
                info: tuple[int, tuple] | None = None) -> list[AnomalyDetected]:
        if rec.check() is not None:
            self.bad_records += 1
            return []
        if names is None:
            names = self._row_names(rec)
        pp_stage, mates = info if info is not None else self._rank_info.get(rec.rank, (0, ()))
        n = len(rec)
        values = np.frombuffer(rec.values, dtype=_DTYPES[rec.dtype]).reshape(n, len(rec.ops))
        found = self.detector.observe(
            rank=rec.rank, step=rec.step, kind=rec.kind, ops=rec.ops, names=names, values=values,
            micro_steps=np.frombuffer(rec.micro_steps, "<u2") if rec.micro_steps else None,
            call_ids=np.frombuffer(rec.call_ids, "<u4") if rec.call_ids else None,
            slots=np.frombuffer(rec.slots, np.uint8) if rec.slots else None,
            vpp_stages=np.frombuffer(rec.vpp_stages, np.uint8) if rec.vpp_stages else None,
            pp_stage=pp_stage, group_mates=mates, wall=rec.wall,
            placeholders=np.frombuffer(rec.placeholders, np.uint8) if rec.placeholders else None,
        )
        self.detected.extend(found)
        return found


# --------------------------------------------------------------------------------------------- JSON
_MESSAGE_RE = re.compile(r"^Rule (\S+) reports anomaly signal in (\(.*\)) at step (-?\d+)\.?$", re.S)
_INT_FIELDS = ("rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id")


def _parse_message(message: str) -> tuple[str, str]:
    """(rule, op) from the reference's message text; ("", "") when it does not have that form."""
    m = _MESSAGE_RE.match(message)
    if not m:
        return "", ""
    try:
        tag_op = ast.literal_eval(m.group(2))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return m.group(1), ""
    if isinstance(tag_op, tuple) and len(tag_op) == 2 and isinstance(tag_op[1], str):
        return m.group(1), tag_op[1]
    return m.group(1), ""


def _slot_of_tag(tag: str, kind: str) -> str:
    if kind in ("actv", "actv_grad") and "/" in tag:
        last = tag.rsplit("/", 1)[1]
        return last if last in SLOTS else ""
    return ""


def _entry_event(key: str, value: Any) -> AnomalyDetected:
    if not isinstance(value, dict):
        raise ValueError(f"entry {key!r} is not an object")
    missing = [f for f in REFERENCE_FIELDS if f not in value]
    if missing:
        raise ValueError(f"entry {key!r} lacks {', '.join(missing)}")
    for f in _INT_FIELDS:
        v = value[f]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"entry {key!r}: {f} must be an integer, not {v!r}")
    if not isinstance(value["tag_name"], str) or not isinstance(value["message"], str):
        raise ValueError(f"entry {key!r}: tag_name and message must be strings")
    mates = value["group_mates"]
    if mates is None:
        mates = []
    if not isinstance(mates, list) or not all(isinstance(m, int) and not isinstance(m, bool) for m in mates):
        raise ValueError(f"entry {key!r}: group_mates must be a list of integers, not {mates!r}")
    rule, op = _parse_message(value["message"])
    tag = value["tag_name"]
    kind = kind_of_tag(tag)
    return AnomalyDetected(
        rank=value["rank"], step=value["step"], micro_step=value["micro_step"], pp_stage=value["pp_stage"],
        vpp_stage=value["vpp_stage"], call_id=value["call_id"], tag_name=tag, op=op, value=math.nan,
        baseline=math.nan, message=value["message"], group_mates=tuple(mates), rule=rule, kind=kind,
        slot=_slot_of_tag(tag, kind),
    )


def parse_reference_json(data: bytes | str, source: str = "<json>") -> tuple[list[AnomalyDetected], list[str]]:
    """The anomalies of one reference ``anomaly.json`` (or ``anomaly_analyse.json``).

    Returns ``(anomalies, problems)``: an entry that lacks a field or has a wrong type is skipped and
    described in ``problems``. A file that is not a JSON object raises FormatError naming ``source``.
    """
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"not valid JSON ({exc})", source) from None
    if not isinstance(obj, dict):
        raise FormatError(f"expected a JSON object of anomalies, found {type(obj).__name__}", source)
    out: list[AnomalyDetected] = []
    problems: list[str] = []
    for key, value in obj.items():
        try:
            out.append(_entry_event(key, value))
        except ValueError as exc:
            problems.append(f"{source}: {exc}; skipped")
    return out, problems


def reference_json(ranked: Iterable[AnomalyDetected], k: int | None = None) -> dict[str, dict[str, Any]]:
    """The reference's ``anomaly_analyse.json`` object: insertion order is the given (ranking) order.

    Anomalies sharing the reference's key (several ops of one tag, step and call) take one place, the
    first one's, with the last one's entry (as the reference's dict update does); ``k`` counts keys.
    """
    out: dict[str, dict[str, Any]] = {}
    for ev in ranked:
        key, value = reference_entry(ev)
        if key not in out and k is not None and len(out) >= k:
            break
        out[key] = value
    return out


def anomaly_records(ranked: Iterable[AnomalyDetected]) -> list[dict[str, Any]]:
    """Our JSON records: the reference's fields plus op, value, baseline, rule, kind and phase.

    Non-finite values are kept as floats (orjson writes NaN/Inf as null)."""
    out = []
    for ev in ranked:
        _, rec = reference_entry(ev)
        rec.update(op=ev.op, value=ev.value, baseline=ev.baseline, rule=ev.rule, kind=kind_of(ev),
                   phase=PHASE_NAMES[phase_of(ev)])
        out.append(rec)
    return out
