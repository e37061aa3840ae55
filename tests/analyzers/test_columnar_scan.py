"""Columnar re-detection (ColumnarScan, by rank partition, -j) against the record-by-record AnomalyScan
over the merged stream: the same anomalies, the same ranking, the same counts."""

from __future__ import annotations

import os

import numpy as np
import orjson
import pytest
from trainrec.analyzers.anomalies import AnomalyScan, anomaly_records
from trainrec.analyzers.columnar import ColumnarScan
from trainrec.analyzers.ranking import rank_anomalies
from trainrec.analyzers.series_block import Carry, SeriesBlock
from trainrec.analyzers.vector_rules import block_flags
from trainrec.recorder.writer import LogWriter
from trainrec.replay.run import open_run
from trainrec.replay.stats_columns import _FIELDS, StatsColumns
from trainrec.schema.detector import Detector
from trainrec.schema.rule_config import make_rule
from trainrec.tools.anomaly_parts import scan_parts
from varied_logs import write_varied_run

RULES = [
    ("AnomalyTurbulence", {"threshold": 0.3}),
    ("AnomalyTurbulence", {"threshold": 0.1, "sudden": False, "window": 5, "warmup": 2}),
    ("AnomalyTurbulence", {"threshold": 0.5, "range_floor": 0.0, "nan": False, "window": 1, "warmup": 0}),
    ("AnomalyTurbulence", {"threshold": 0.2, "noise": 2, "floor": 0.01, "window": 12}),
    ("NaNInf", {}),
    ("ZScore", {"threshold": 3}),
    ("ZScore", {"threshold": 2, "window": 3, "warmup": 0, "floor": 0.001}),
]


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> str:
    return write_varied_run(str(tmp_path_factory.mktemp("varied")), ranks=3, steps=40, seed=1)


def _serial(path, rules, kinds=None) -> AnomalyScan:
    return AnomalyScan(rules, kinds).feed_all(open_run(path).events())


def _json(events) -> bytes:
    """What ``anomalies -o`` writes of the first 20 (NaN values as null)."""
    return orjson.dumps(anomaly_records(rank_anomalies(events, 20)))


def _key(events) -> list[str]:
    return [repr(e) for e in events]  # (repr: NaN values compare equal)


@pytest.mark.parametrize("name,args", RULES)
def test_columnar_matches_serial(varied, name, args):
    serial = _serial(varied, [make_rule(name, args)])
    assert serial.detected, "the run must give this rule something to find"
    for jobs in (1, 2):
        part = scan_parts(open_run(varied), [make_rule(name, args)], None, jobs=jobs, progress=False)
        assert _key(rank_anomalies(part.detected)) == _key(rank_anomalies(serial.detected))
        assert _json(part.detected) == _json(serial.detected)
        assert (part.first_step, part.last_step, part.ranks, part.stats_records, part.bad_records,
                part.skipped_steps) == (serial.first_step, serial.last_step, serial.ranks, serial.stats_records,
                                        serial.bad_records, serial.skipped_steps)
        assert any("incomplete record" in note for _, note in part.notes)  # rank 2's torn tail


def test_several_rules_and_kinds(varied):
    for kinds in (None, ("param", "grad_reduced")):
        rules = [make_rule("NaNInf"), make_rule("AnomalyTurbulence", {"threshold": 0.3}), make_rule("ZScore")]
        serial = _serial(varied, rules, kinds)
        part = scan_parts(open_run(varied), rules, kinds, jobs=2, progress=False)
        assert _key(rank_anomalies(part.detected)) == _key(rank_anomalies(serial.detected))
        kinds_found = {e.kind for e in part.detected}
        assert kinds is None or kinds_found <= set(kinds)


def test_every_path_is_taken(varied):
    """The run holds what the docstring of varied_logs promises: placeholders, NaN, layout and ops changes."""
    scan = ColumnarScan([make_rule("AnomalyTurbulence", {"threshold": 0.3})])
    scan.feed_all(open_run(varied).events(rank=1))
    blocks = scan._records
    ops = {k: {r.rec.ops for r in recs} for (_, k), recs in blocks.items()}
    assert len(ops["exp_avg"]) == 2  # the Detector's path
    assert len({len(r.sids) for r in blocks[(1, "param")]}) == 2  # the layout change
    assert any(r.mask is not None for r in blocks[(1, "grad_reduced")])
    assert any(not np.isfinite(r.values).all() for r in blocks[(1, "param")])
    assert max(r.rec.step for r in blocks[(1, "param")]) == 44  # the resumed file's steps


def test_block_against_detector_random():
    """Random blocks with holes, NaN and Inf: the vectorised rules give the Detector's flags and baselines."""
    rng = np.random.default_rng(7)
    ops = ("min", "max", "norm", "mean", "zeros", "nans")
    for trial in range(8):
        t, s = 60, 9
        x = rng.lognormal(0, 0.3, (t, s, len(ops))) * np.where(rng.random((t, s, 1)) < 0.05, 30, 1)
        x[:, :, 0] *= -1
        x[:, :, 5] = np.where(rng.random((t, s)) < 0.05, 2.0, 0.0)
        x32 = None
        if trial < 2:  # dense float32 blocks: the float32 candidate filter
            x32 = x.astype(np.float32)
            x = x32.astype(np.float64)
        else:
            x[rng.random(x.shape) < 0.03] = np.nan
            x[rng.random(x.shape) < 0.01] = np.inf
        missing = rng.random((t, s)) < (0.0 if trial < 3 else 0.1)
        for name, args in RULES:
            det = Detector([make_rule(name, args)])
            want_f = np.zeros(x.shape, bool)
            want_b = np.full(x.shape, np.nan)
            for i in range(t):
                names = [f"n{j}" for j in range(s)]
                for ev in det.observe(rank=0, step=i, kind="param", ops=ops, names=names, values=x[i],
                                      placeholders=missing[i].astype(np.uint8)):
                    j, o = int(ev.name[1:]), ops.index(ev.op)
                    want_f[i, j, o] = True
                    want_b[i, j, o] = ev.baseline
            got_f, got_b = block_flags(make_rule(name, args), SeriesBlock(x, missing, ops, x32))
            assert (got_f == want_f).all(), (name, args, trial)
            assert np.array_equal(got_b[got_f], want_b[want_f], equal_nan=True), (name, args, trial)
            if x32 is not None:  # (float32 values only: the float64 copy is made when a rule asks for it)
                lazy_f, lazy_b = block_flags(make_rule(name, args), SeriesBlock(None, missing, ops, x32))
                assert (lazy_f == got_f).all() and np.array_equal(lazy_b[lazy_f], got_b[got_f], equal_nan=True)


def test_float32_blocks_without_their_float64_copy_carry_the_same():
    """Dense float32 blocks judged one after another with the carried history before them: given as float32
    only (x made on demand) or with their float64 copy, the same flags, baselines and carried state."""
    rng = np.random.default_rng(34)
    ops = ("min", "max", "norm", "mean", "zeros", "nans")
    x32 = (rng.lognormal(0, 0.3, (90, 7, len(ops))) * np.where(rng.random((90, 7, 1)) < 0.05, 30, 1)).astype(np.float32)
    x32[:, :, 5] = np.where(rng.random((90, 7)) < 0.05, 2.0, 0.0)
    x32[50, 3, 2] = np.nan  # (a block that is not dense: every path)
    for name, args in RULES:
        rule = make_rule(name, args)
        depth = max(1, getattr(rule, "window", 1))
        carries = {lazy: Carry(ops, depth) for lazy in (False, True)}
        for lo in range(0, 90, 20):
            part = np.ascontiguousarray(x32[lo : lo + 20])
            got = {}
            for lazy, carry in carries.items():
                held = carry.rows(np.arange(7))
                block = SeriesBlock(None if lazy else part.astype(np.float64), np.zeros(part.shape[:2], bool), ops,
                                    part, (carry.hist[held], carry.count[held], carry.last_ok[held]))
                flags, base = block_flags(rule, block)
                hist, seen, last_ok, observed = block.carry(depth)
                carry.hist[held] = hist
                carry.count[held] += seen
                carry.last_ok[held] = np.where(observed[:, None], last_ok, carry.last_ok[held])
                got[lazy] = (flags, base[flags], hist, seen, last_ok, block.skip)
            for a, b in zip(got[False], got[True], strict=True):
                assert np.array_equal(a, b, equal_nan=True), (name, args, lo)


def test_foreign_rank_record_falls_back_to_the_merged_scan(tmp_path):
    """A record that names another rank than its file's: the answer is still the serial one."""
    from varied_logs import _record

    out = str(tmp_path)
    rng = np.random.default_rng(3)
    for rank in (0, 1):
        rdir = os.path.join(out, f"Dec04_10-00-00-rank{rank}-{rank:08x}")
        with LogWriter(rdir, rank=rank, world_size=2, run_id="foreign", flush_interval=0.05) as w:
            ids = w.intern(["a", "b", "c"], step=-1)
            for s in range(30):
                vals = rng.lognormal(0, 0.1, (3, 6)) * (40 if s == 20 and rank == 1 else 1)
                w.write(_record(rank, s, "param", ids, vals))
                if rank == 0 and s == 25:
                    w.write(_record(1, s, "param", ids, vals * 90))  # claims rank 1
    rules = [make_rule("AnomalyTurbulence", {"threshold": 0.3})]
    serial = _serial(out, rules)
    part = scan_parts(open_run(out), rules, None, jobs=2, progress=False)
    assert any(e.rank == 1 and e.step == 25 for e in serial.detected)
    assert _key(rank_anomalies(part.detected)) == _key(rank_anomalies(serial.detected))


@pytest.mark.parametrize("chunk", [1, 3, 7, 25])
@pytest.mark.parametrize("name,args", [RULES[0], RULES[1], RULES[4], RULES[5], RULES[6]])
def test_chunks_carry_the_state(varied, chunk, name, args):
    """Records judged a few at a time (the memory bound) give the answer of the whole series: through
    chunks shorter than the window, dense chunks after a full history, and the ops change of exp_avg
    (the record-time Detector, given the state the chunks left)."""
    serial = _serial(varied, [make_rule(name, args)])
    run = open_run(varied)
    found = []
    for rank in run.ranks:
        scan = ColumnarScan([make_rule(name, args)], chunk=chunk).feed_all(run.events(rank=rank)).finish()
        found.extend(scan.detected)
    assert _key(rank_anomalies(found)) == _key(rank_anomalies(serial.detected))


def _unshared(ev):
    """A stats record as columns with its own copy of every field (nothing shared with the record before)."""
    if type(ev) is not StatsColumns:
        return ev
    wire = [ev.TAG, ev.seq, ev.rank, ev.step, ev.wall]
    for name in _FIELDS:
        value = getattr(ev, name)
        wire.append(bytes(bytearray(value)) if type(value) is bytes else tuple(value) if type(value) is tuple
                    else "".join(value) if type(value) is str else value)
    return StatsColumns(tuple(wire))


@pytest.mark.parametrize("name,args", RULES[:4])
def test_records_sharing_their_layout_are_judged_as_any(varied, name, args):
    """Records of a layout read before share its objects (the reader's stats templates), which the scan
    takes as the record before's layout: the same answer as from records sharing nothing."""
    run = open_run(varied)
    got = {}
    for shared in (True, False):
        scan = ColumnarScan([make_rule(name, args)], chunk=7)
        for r in run.ranks:
            for ev in run.events(rank=r, columnar=True):
                scan.feed(ev if shared else _unshared(ev))
        scan.finish()
        got[shared] = (_key(scan.detected), scan.values_read, scan.stats_records, scan.bad_records)
    assert got[True] == got[False] and got[True][0]
