"""AnomalyScan over real logs: re-detection equals record-time detection, thresholds give subsets and
supersets, and the same code runs on a finished run, a crashed one (torn tail) and a live one."""

from __future__ import annotations

import os

import pytest
from anomaly_logs import write_rank
from trainrec.analyzers.anomalies import AnomalyScan
from trainrec.analyzers.ranking import rank_anomalies
from trainrec.replay.reader import LogReader
from trainrec.replay.run import open_run
from trainrec.schema import layout
from trainrec.schema.rule_config import rules_from_config
from trainrec.schema.rules import AnomalyTurbulence, NaNInf, ZScore

ALERT = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False}


def key(ev):
    return (ev.rank, ev.step, ev.micro_step, ev.call_id, ev.tag_name, ev.op, ev.rule, ev.value, ev.baseline)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Two ranks; rank 0 has a mild anomaly (x1.8) at step 12, rank 1 a strong one (x100) at step 20."""
    out = str(tmp_path_factory.mktemp("run"))
    write_rank(out, 0, alert=ALERT, inject=(12, 2, 1.8), steps=30)
    write_rank(out, 1, alert=ALERT, inject=(20, 3, 100.0), steps=30)
    return out


def scan(path, rules=()):
    return AnomalyScan(rules).feed_all(open_run(path).events())


def test_redetection_with_the_recording_rule_equals_what_was_recorded(run_dir):
    s = scan(run_dir, rules_from_config(ALERT))
    assert s.recorded, "the recorder's AlertEngine wrote anomalies"
    assert sorted(map(key, s.detected)) == sorted(map(key, s.recorded))
    assert (s.first_step, s.last_step, s.ranks) == (0, 29, {0, 1})
    assert s.stats_records == 2 * 30 * 4


def test_the_injected_anomaly_is_first(run_dir):
    s = scan(run_dir)
    first = rank_anomalies(s.anomalies, k=1)[0]
    # rank 0's mild anomaly comes first in time; rank 1's strong one is the first of step 20
    assert (first.rank, first.step, first.tag_name) == (0, 12, "0:layer2_0/rank0/output")
    assert first.op == "min" and first.value / first.baseline > 1.5
    top20 = rank_anomalies(s.anomalies, k=1, steps=[20])[0]
    assert (top20.rank, top20.tag_name) == (1, "0:layer3_0/rank1/output")


def test_another_threshold_gives_a_superset_or_subset(run_dir):
    found = {t: {key(e)[:7] for e in scan(run_dir, [AnomalyTurbulence(t)]).detected} for t in (0.3, 0.5, 1.0, 50.0)}
    assert found[50.0] <= found[1.0] <= found[0.5] <= found[0.3]
    steps = {t: {k[1] for k in found[t]} for t in found}
    assert 12 in steps[0.5] and 12 not in steps[1.0]  # the x1.8 change is above 0.5, below 1.0
    assert steps[1.0] == {20} and steps[50.0] == {20}
    assert len(found[0.3]) > len(found[1.0])


def test_other_rules_on_the_same_statistics(run_dir):
    assert scan(run_dir, [NaNInf()]).detected == []
    z = scan(run_dir, [ZScore(threshold=8)]).detected
    assert {(e.rank, e.step) for e in z} >= {(0, 12), (1, 20)}


def test_stats_path_equals_event_path(run_dir):
    r = open_run(run_dir)
    via_stats = AnomalyScan([AnomalyTurbulence(0.4)])
    for rec, names in r.stats():
        via_stats.observe_stats(rec, names, pp_stage=0, group_mates=(0, 1))
    via_events = scan(run_dir, [AnomalyTurbulence(0.4)])
    assert sorted(map(key, via_stats.detected)) == sorted(map(key, via_events.detected))


def test_kinds_filter(run_dir):
    s = AnomalyScan([AnomalyTurbulence(0.5)], kinds=["actv_grad", "param"]).feed_all(open_run(run_dir).events())
    assert s.detected == []  # the injections only touch activations
    assert s.stats_records == 240


def test_crashed_run_with_a_torn_tail(tmp_path):
    write_rank(str(tmp_path), 0, alert=ALERT, inject=(20, 3, 100.0), steps=30)
    (rank_dir,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    (log,) = layout.list_logs(rank_dir)
    with open(log, "rb") as f:
        full = f.read()
    # cut the file in the middle of a record after step 22: as if the process was killed
    cut = int(len(full) * 0.78)
    with open(log, "wb") as f:
        f.write(full[:cut])
    r = open_run(rank_dir)
    s = AnomalyScan([AnomalyTurbulence(0.5)]).feed_all(r.events())
    assert 20 <= s.last_step < 29
    assert any(reader.pending_bytes for reader in r.readers.values())
    assert rank_anomalies(s.detected, k=1)[0].step == 20
    assert sorted(map(key, s.detected)) == sorted(map(key, s.recorded))


def test_live_scan_sees_the_same_as_a_finished_one(tmp_path):
    src = tmp_path / "src"
    write_rank(str(src), 0, alert=ALERT, inject=(20, 3, 100.0), steps=30)
    (rank_dir,) = [os.path.join(src, d) for d in os.listdir(src)]
    (log,) = layout.list_logs(rank_dir)
    with open(log, "rb") as f:
        data = f.read()
    live_path = tmp_path / "live.trl"
    live = AnomalyScan([AnomalyTurbulence(0.5)])
    reader = LogReader(str(live_path))
    seen_during = []
    with open(live_path, "wb") as f:
        for i in range(0, len(data), 997):  # the writer appends in odd-sized pieces
            f.write(data[i : i + 997])
            f.flush()
            for ev in reader.poll():
                seen_during += live.feed(ev)
    finished = scan(rank_dir, [AnomalyTurbulence(0.5)])
    assert sorted(map(key, live.detected)) == sorted(map(key, finished.detected))
    assert sorted(map(key, seen_during)) == sorted(map(key, finished.detected))
    assert live.recorded and len(live.recorded) == len(finished.recorded)


def _expert_log(out_dir: str, marked: bool) -> str:
    """A rank's gradient rows over 20 steps: ``expert.0`` has a gradient on even steps only (a NaN row on
    odd ones, marked as a placeholder where ``marked``, as the recorder writes it; as an older writer
    wrote it, unmarked, otherwise), ``dense`` on every step, with a real NaN at step 13."""
    import numpy as np
    from trainrec.recorder.writer import LogWriter
    from trainrec.schema.events import TensorStatsRecorded, pack_array

    rank_dir = os.path.join(out_dir, layout.rank_dir_name(0, suffix="0000abcd"))
    nan = float("nan")
    with LogWriter(rank_dir, rank=0, world_size=1, run_id="experts") as w:
        ids = w.intern(["expert.0.weight", "dense.weight"], step=0)
        for t in range(20):
            gone = t % 2 == 1
            vals = np.array([[nan, nan] if gone else [1.0 + 0.01 * (t % 3), 0.0],
                             [nan, 3.0] if t == 13 else [2.0, 0.0]], dtype="<f4")
            w.write(TensorStatsRecorded(
                rank=0, step=t, kind="grad_unreduced", ops=("norm", "nans"), name_ids=pack_array("I", ids),
                values=vals.tobytes(), placeholders=bytes([gone, 0]) if marked and gone else b"",
            ))
    return out_dir


@pytest.mark.parametrize("rule", [AnomalyTurbulence(0.5), NaNInf()], ids=["turbulence", "naninf"])
def test_redetection_skips_placeholder_rows_and_finds_the_real_nan_first(tmp_path, rule):
    s = scan(_expert_log(str(tmp_path / "new"), marked=True), [type(rule)(**rule.args)])
    assert {(e.step, e.name) for e in s.detected} == {(13, "dense.weight")}
    first = rank_anomalies(s.detected, k=1)[0]
    assert (first.step, first.name, first.op) == (13, "dense.weight", "norm")
    # a log of a writer that did not mark them: the absent gradient's NaN rows are taken as NaN values
    old = scan(_expert_log(str(tmp_path / "old"), marked=False), [type(rule)(**rule.args)])
    assert rank_anomalies(old.detected, k=1)[0].name == "expert.0.weight"
