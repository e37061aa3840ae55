"""Re-detection over whole series: :class:`ColumnarScan`, an :class:`AnomalyScan` that collects each
(rank, kind)'s stats records into numpy blocks and runs the rules over them at :meth:`~ColumnarScan.finish`
(:mod:`trainrec.analyzers.vector_rules`), instead of one record at a time.

It answers exactly as :class:`AnomalyScan` fed the same events, in the same ranking; a (rank, kind)
whose records differ in ops goes through the record-time Detector instead. :class:`ScanPart` is what
a scan of some ranks hands back across a process boundary; :func:`merge_parts` joins them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from trainrec.replay.stats_columns import StatsColumns
from trainrec.schema.detector import Detector, anomaly_message
from trainrec.schema.events import SLOTS, AnomalyDetected, TensorStatsRecorded
from trainrec.schema.naming import reference_tag
from trainrec.schema.rules import Rule

from .anomalies import _DTYPES, AnomalyScan
from .series_block import Carry, SeriesBlock, nonzero
from .vector_rules import block_flags

__all__ = ["ColumnarScan", "ScanPart", "merge_parts"]


@dataclass(slots=True)
class _Record:
    """What a found anomaly needs of its record (values go into the block)."""

    seq: int  # arrival order in the scan
    rec: TensorStatsRecorded | StatsColumns
    names: list[str]
    sids: np.ndarray
    pp_stage: int
    mates: tuple
    env: tuple | None = None  # (names generation, FileOpened info) of its rank when it came

    @property
    def mask(self) -> np.ndarray | None:
        """Placeholder rows (None: none)."""
        raw = self.rec.placeholders
        if not raw or not raw.strip(b"\x00"):
            return None
        return np.frombuffer(raw, np.uint8).astype(bool)

    @property
    def values(self) -> np.ndarray:
        rec = self.rec
        return np.frombuffer(rec.values, _DTYPES[rec.dtype]).reshape(len(rec), len(rec.ops)).astype(np.float64)


@dataclass
class ScanPart:
    """The answer of a scan of some ranks: everything :mod:`trainrec.tools.cmd_anomalies` prints."""

    detected: list[AnomalyDetected] = field(default_factory=list)
    recorded: list[AnomalyDetected] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    ranks: set[int] = field(default_factory=set)
    stats_records: int = 0
    bad_records: int = 0
    skipped_steps: set[int] = field(default_factory=set)
    values: int = 0  # statistics values read (the benchmark's unit)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (path, note) of damaged or torn files
    foreign: bool = False  # a record named a rank other than its file's: partitions are not independent


class ColumnarScan(AnomalyScan):
    """An :class:`AnomalyScan` whose re-detection runs over whole series; call :meth:`finish` after the
    last event (before that, :attr:`detected` holds only part of the re-detected anomalies).

    Records are judged ``chunk`` at a time per (rank, kind), each chunk carrying its series' state into
    the next (:class:`~trainrec.analyzers.vector_rules.Carry`): memory is about ``chunk`` records of
    each kind, whatever the number of steps."""

    def __init__(self, rules: Sequence[Rule] = (), kinds: Iterable[str] | None = None, chunk: int = 256) -> None:
        super().__init__(rules, kinds)
        self.values_read = 0
        self.chunk = max(1, chunk)
        self._records: dict[tuple[int, str], list[_Record]] = {}
        self._carry: dict[tuple[int, str], Carry] = {}
        self._serial: dict[tuple[int, str], Detector] = {}  # (rank, kind)s whose ops changed
        self._found: list[tuple[tuple, AnomalyDetected]] = []
        self._depth = max([1, *(getattr(rule, "window", 1) for rule in self.detector.rules)]) if rules else 1
        self._seq = 0

    def _detect(self, rec: TensorStatsRecorded, names: list[str] | None = None,
                info: tuple[int, tuple] | None = None) -> list[AnomalyDetected]:
        if type(rec) is not StatsColumns and rec.check() is not None:  # (columns were checked when decoded)
            self.bad_records += 1
            return []
        key = (rec.rank, rec.kind)
        records = self._records.get(key)
        env = None
        if names is None and info is None:
            env = (self._gen.get(rec.rank, 0), self._rank_info.get(rec.rank))
            if records:
                prev = records[-1]
                p = prev.rec
                if (p.name_ids is rec.name_ids and p.ops is rec.ops and p.slots is rec.slots
                        and p.micro_steps is rec.micro_steps and p.vpp_stages is rec.vpp_stages and prev.env == env):
                    # (the record before's layout, the same objects: a stats template's; the same names table
                    # and rank info: its names, series, stage and mates, as the general path below finds them)
                    self.values_read += (len(rec.name_ids) >> 2) * len(rec.ops)
                    records.append(_Record(self._seq, rec, prev.names, prev.sids, prev.pp_stage, prev.mates, env))
                    self._seq += 1
                    if len(records) >= self.chunk:
                        self._flush(key)
                    return []
        if names is None:
            names = self._row_names(rec)
        n = len(rec.name_ids) // 4  # (rows; len() of a StatsColumns is a Python call)
        if n == 0 or not rec.ops:
            return []
        pp_stage, mates = info if info is not None else self._rank_info.get(rec.rank, (0, ()))
        self.values_read += n * len(rec.ops)
        if records is None:
            records = self._records[key] = []
        prev = records[-1] if records else None
        if (prev is not None and prev.names is names and prev.rec.name_ids == rec.name_ids
                and prev.rec.slots == rec.slots and prev.rec.micro_steps == rec.micro_steps
                and prev.rec.vpp_stages == rec.vpp_stages):
            sids = prev.sids  # the same layout as the record before: the same series
        else:
            sids = self.detector.series.sids(
                rec.rank, rec.kind, names, _col(rec.slots, n, np.uint8, 0).astype(np.int64),
                _col(rec.micro_steps, n, "<u2", 0).astype(np.int64), _col(rec.vpp_stages, n, np.uint8, 0).astype(np.int64))
        if prev is not None and prev.mates == tuple(mates) and prev.pp_stage == pp_stage:
            mates = prev.mates
        else:
            mates = tuple(int(m) for m in mates)
        records.append(_Record(self._seq, rec, names, sids, pp_stage, mates, env))
        self._seq += 1
        if len(records) >= self.chunk:
            self._flush(key)
        return []

    def finish(self) -> ColumnarScan:
        """Run the rules over every collected (rank, kind) and fill :attr:`detected`."""
        for key in list(self._records):
            self._flush(key)
        self._carry.clear()
        self._serial.clear()
        self._found.sort(key=lambda item: item[0])
        self.detected.extend(ev for _, ev in self._found)
        self._found.clear()
        return self

    def part(self) -> ScanPart:
        """The scan's answer (after :meth:`finish`)."""
        return ScanPart(
            detected=list(self.detected), recorded=list(self.recorded), first_step=self.first_step,
            last_step=self.last_step, ranks=set(self.ranks), stats_records=self.stats_records,
            bad_records=self.bad_records, skipped_steps=set(self.skipped_steps), values=self.values_read,
        )

    # ------------------------------------------------------------------ internals
    def _flush(self, key: tuple[int, str]) -> None:
        """Judge the records collected for ``key``."""
        records = self._records.pop(key, [])
        if not records:
            return
        if key not in self._serial:
            carry = self._carry.get(key)
            ops = carry.ops if carry is not None else tuple(records[0].rec.ops)
            same = next((i for i, r in enumerate(records) if tuple(r.rec.ops) != ops), len(records))
            if same:
                if carry is None:
                    carry = self._carry[key] = Carry(ops, self._depth)
                self._found.extend(self._detect_block(records[:same], carry))
            if same == len(records):
                return
            records = records[same:]
            self._serial[key] = self._seeded_detector(self._carry.pop(key, None))
        self._found.extend(self._detect_serially(self._serial[key], records))

    def _detect_block(self, records: list[_Record], carry: Carry) -> list[tuple[tuple, AnomalyDetected]]:
        ops = carry.ops
        first = records[0].sids
        x32 = None
        if all(r.sids is first for r in records):
            series = first
            row_of = None  # series s is row s of every record
            if all(r.rec.dtype == "f" for r in records):
                x32 = np.frombuffer(b"".join(r.rec.values for r in records), "<f4").reshape(
                    len(records), len(first), len(ops))
                x = None  # (SeriesBlock makes the float64 copy only if a rule asks for it)
                shape = x32.shape
            else:
                x = np.stack([r.values for r in records])
                shape = x.shape
            missing = np.zeros(shape[:2], dtype=bool)
            for t, r in enumerate(records):
                mask = r.mask
                if mask is not None:
                    missing[t] = mask
        else:
            series = np.unique(np.concatenate([r.sids for r in records]))
            x = np.full((len(records), len(series), len(ops)), np.nan)
            missing = np.ones(x.shape[:2], dtype=bool)
            row_of = []
            for t, r in enumerate(records):
                cols = np.searchsorted(series, r.sids)
                x[t, cols] = r.values
                mask = r.mask
                missing[t, cols] = False if mask is None else mask
                rows = np.full(len(series), -1, dtype=np.int64)
                rows[cols] = np.arange(len(cols))
                row_of.append(rows)
        held = carry.rows(series)
        block = SeriesBlock(x, missing, ops, x32, (carry.hist[held], carry.count[held], carry.last_ok[held]))
        skip = block.skip
        out = []
        for ri, rule in enumerate(self.detector.rules):
            flags, base = block_flags(rule, block)
            ti, si, oi = nonzero(flags[skip:])
            for t, s, o in zip(ti.tolist(), si.tolist(), oi.tolist(), strict=True):
                r = records[t]
                row = s if row_of is None else int(row_of[t][s])
                value = float(block.take(np.intp(t + skip), np.intp(s))[o])
                ev = _anomaly(r, rule.name, row, o, value, float(base[t + skip, s, o]))
                out.append(((r.seq, ri, row, o), ev))
        hist, seen, last_ok, observed = block.carry(carry.depth)
        carry.hist[held] = hist
        carry.count[held] += seen
        carry.last_ok[held] = np.where(observed[:, None], last_ok, carry.last_ok[held])
        return out

    def _seeded_detector(self, carry: Carry | None) -> Detector:
        """A record-time Detector holding the state the chunks so far left (same series ids)."""
        det = Detector([type(rule)(**rule.args) for rule in self.detector.rules])
        det.series = self.detector.series
        if carry is None or not carry.index:
            return det
        sids = np.fromiter(carry.index, np.intp, count=len(carry.index))
        rows = np.fromiter(carry.index.values(), np.intp, count=len(carry.index))
        for rule in det.rules:
            # (the rule's ring state, written as its own update() would have left it)
            st = rule._state
            cols = st.columns(carry.ops)
            st.ensure(int(sids.max()) + 1)
            w = st.window
            count = carry.count[rows]
            held = np.minimum(count, w)
            for m in range(w):  # the m-th newest value of each column, where it has one
                si, oi = np.nonzero(held > m)
                absolute = count[si, oi] - 1 - m
                st.ring[absolute % w, sids[si], cols[oi]] = carry.hist[rows[si], carry.depth - 1 - m, oi]
            st.pos[sids[:, None], cols[None, :]] = count % w
            st.count[sids[:, None], cols[None, :]] = held
            st.last[sids[:, None], cols[None, :]] = np.where(count > 0, carry.hist[rows, -1], 0.0)
            st.last_ok[sids[:, None], cols[None, :]] = carry.last_ok[rows]
        return det

    def _detect_serially(self, det: Detector, records: list[_Record]) -> list[tuple[tuple, AnomalyDetected]]:
        """The record-time Detector over records of one (rank, kind)."""
        out = []
        for r in records:
            rec = r.rec
            found = det.observe(
                rank=rec.rank, step=rec.step, kind=rec.kind, ops=rec.ops, names=r.names, values=r.values,
                micro_steps=np.frombuffer(rec.micro_steps, "<u2") if rec.micro_steps else None,
                call_ids=np.frombuffer(rec.call_ids, "<u4") if rec.call_ids else None,
                slots=np.frombuffer(rec.slots, np.uint8) if rec.slots else None,
                vpp_stages=np.frombuffer(rec.vpp_stages, np.uint8) if rec.vpp_stages else None,
                pp_stage=r.pp_stage, group_mates=r.mates, wall=rec.wall,
                placeholders=np.frombuffer(rec.placeholders, np.uint8) if rec.placeholders else None,
            )
            out.extend(((r.seq, i), ev) for i, ev in enumerate(found))
        return out


def _col(raw: bytes, n: int, dtype, fill: int) -> np.ndarray:
    return np.frombuffer(raw, dtype) if raw else np.full(n, fill, dtype=dtype)


def _anomaly(r: _Record, rule: str, row: int, col: int, value: float, baseline: float) -> AnomalyDetected:
    """The event the Detector makes for one flag (field for field)."""
    rec = r.rec
    s = int(rec.slots[row]) if rec.slots else 0
    slot_name = SLOTS[s] if 0 <= s < len(SLOTS) else str(s)
    micro = int(np.frombuffer(rec.micro_steps, "<u2")[row]) if rec.micro_steps else 0
    vpp = int(rec.vpp_stages[row]) if rec.vpp_stages else 0
    call = int(np.frombuffer(rec.call_ids, "<u4")[row]) if rec.call_ids else -1
    name = r.names[row]
    tag = reference_tag(rec.kind, name, slot_name, micro, rec.rank, vpp)
    op = rec.ops[col]
    return AnomalyDetected(
        rank=rec.rank, step=rec.step, wall=rec.wall, micro_step=micro, pp_stage=r.pp_stage, vpp_stage=vpp,
        call_id=call, tag_name=tag, op=op, value=value, baseline=baseline,
        message=anomaly_message(rule, tag, op, rec.step), group_mates=r.mates, rule=rule, kind=rec.kind,
        name=name, slot=slot_name,
    )


def merge_parts(parts: Iterable[ScanPart]) -> ScanPart:
    """One answer from the parts of a partitioned scan (parts in rank order)."""
    out = ScanPart()
    for p in parts:
        out.detected.extend(p.detected)
        out.recorded.extend(p.recorded)
        if p.first_step is not None:
            out.first_step = p.first_step if out.first_step is None else min(out.first_step, p.first_step)
            out.last_step = p.last_step if out.last_step is None else max(out.last_step, p.last_step)
        out.ranks |= p.ranks
        out.stats_records += p.stats_records
        out.bad_records += p.bad_records
        out.skipped_steps |= p.skipped_steps
        out.values += p.values
        out.notes.extend(p.notes)
        out.foreign |= p.foreign
    return out
