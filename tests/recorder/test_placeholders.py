"""Placeholder rows (NaN rows the recorder writes for tensors it has no values for) are marked in the
log, and anomaly detection skips them, live (the ``alert`` config) and when re-detecting on replay."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
from trainrec.analyzers.anomalies import AnomalyScan
from trainrec.analyzers.ranking import rank_anomalies
from trainrec.recorder import record
from trainrec.recorder.stats import StatsEngine
from trainrec.recorder.step_stats import StatsPart, StepStats, build_stats_events
from trainrec.replay.run import open_run
from trainrec.schema.events import AnomalyDetected, TensorStatsRecorded
from trainrec.schema.rule_config import rules_from_config

ALERT = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False}
POISON_STEP = 7  # (before the warm-up of 8 values ends: the first anomaly of the run is a NaN)


class TwoExperts(nn.Module):
    """A dense layer, then two "experts": the second gets the tokens on even steps only; on odd ones no
    token is routed to it, and it runs on an empty batch (as an MoE layer calls an expert with the
    tokens routed to it: an empty input, output and activation gradients, NaN rows that stand for no
    values)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 1)

    def forward(self, x, use_second: bool):
        h = torch.relu(self.dense(x))
        y = self.experts[0](h)
        routed = torch.arange(len(h)) if use_second else torch.arange(0)
        y = y.index_add(0, routed, self.experts[1](h[routed]))
        return self.head(y)


def _train(tmp_path, steps: int = 20, poison: int | None = POISON_STEP):
    torch.manual_seed(0)
    model = TwoExperts()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = {"wg_distribution": True, "xy_distribution": True, "alert": ALERT}
    with record(model, opt, config=cfg, output_dir=str(tmp_path / "out")) as rec:
        for step in range(steps):
            x = torch.randn(16, 8)
            (model(x, use_second=step % 2 == 0) ** 2).mean().backward()
            if step == poison:
                with torch.no_grad():
                    model.dense.weight.grad[0, 0] = math.nan  # a real NaN, in the gradient the step applies
            opt.step()
            opt.zero_grad(set_to_none=True)
    return open_run(rec.log_path)


def _second_expert(ev) -> bool:
    return "experts.1." in ev.name


def test_an_unrouted_expert_gets_no_nan_anomaly_and_a_real_nan_is_first(tmp_path):
    run = _train(tmp_path)
    recorded = [e for e in run.events() if isinstance(e, AnomalyDetected)]
    # the recorder marked the second expert's NaN rows of the steps no token was routed to it, and only those
    marked: dict = {}
    for rec, names in run.stats():
        values = np.frombuffer(rec.values, "<f4").reshape(len(rec), len(rec.ops))
        for name, mark, row in zip(names, rec.column("placeholders"), values, strict=True):
            if name == "experts.1" and rec.step < POISON_STEP:
                marked.setdefault((rec.kind, rec.step % 2), set()).add(bool(mark))
                assert bool(mark) == bool(np.isnan(row).all()), (rec.kind, rec.step)
    assert marked == {("actv", 0): {False}, ("actv", 1): {True}, ("actv_grad", 0): {False}, ("actv_grad", 1): {True}}
    # live (the alert config): nothing flagged for the unrouted expert before the real NaN (before the
    # change, its first empty step's NaN rows were: step 1, first in execution order)
    assert not [e for e in recorded if _second_expert(e) and e.step <= POISON_STEP]
    assert not [e for e in recorded if math.isnan(e.value) and e.step < POISON_STEP]
    first = rank_anomalies(recorded, k=1)[0]
    assert (first.step, first.kind, first.name) == (POISON_STEP, "grad_reduced", "dense.weight")
    # on replay, re-detection with the recording's rule finds the same
    scan = AnomalyScan(rules_from_config(ALERT)).feed_all(run.events())
    key = lambda e: (e.step, e.kind, e.name, e.slot, e.micro_step, e.op, e.call_id)  # noqa: E731
    assert sorted(map(key, scan.detected)) == sorted(map(key, recorded))


def test_without_a_nan_the_alternating_expert_is_quiet(tmp_path):
    run = _train(tmp_path, poison=None)
    found = [e for e in run.events() if isinstance(e, AnomalyDetected)]
    assert not [e for e in found if math.isnan(e.value)], found


def test_step_stats_carry_the_marks_into_the_records_and_none_without_any():
    eng = StatsEngine(("norm", "nans"))
    st = StepStats(eng.ops)
    st.add(StatsPart("grad_unreduced", eng.compute([torch.ones(3), None]), [0, 1], placeholder=(False, True)))
    st.add(StatsPart("actv", eng.compute([torch.ones(2)]), [2]))
    st.add(StatsPart("grad_unreduced", eng.compute([torch.ones(1)]), [3]))
    hs = st.finish(step=4)
    actv, grad = build_stats_events(hs, rank=0, file_ids=np.arange(4, dtype=np.uint32), wall=0.0)
    assert (actv.kind, actv.placeholders) == ("actv", b"")
    assert (grad.kind, list(grad.column("placeholders"))) == ("grad_unreduced", [0, 1, 0])
    assert grad.check() is None
    plain = StepStats(eng.ops)
    plain.add(StatsPart("param", eng.compute([torch.ones(3)]), [0]))
    hs = plain.finish(step=5)
    assert hs.placeholders is None
    (ev,) = build_stats_events(hs, rank=0, file_ids=np.arange(1, dtype=np.uint32), wall=0.0)
    assert isinstance(ev, TensorStatsRecorded) and ev.placeholders == b""
