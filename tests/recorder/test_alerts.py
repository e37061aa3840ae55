"""AlertEngine: record-time detection, rate-limited alerts, the reference-compatible anomaly.json."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
from trainrec.recorder.alerts import AlertEngine, AnomalyJsonDump
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import AnomalyDetected

CFG = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}
OPS = ("min", "max", "norm", "mean", "zeros", "nans")
REFERENCE_FIELDS = ["rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message",
                    "group_mates"]


def stats_rows(n, scale=1.0):
    """Plausible stats of n tensors: min, max, norm, mean, zeros, nans."""
    base = np.array([-1.0, 1.0, 10.0, 0.3, 0.0, 0.0])
    v = np.tile(base, (n, 1))
    v[:, :4] *= scale
    return v


def feed(engine, step, values, names, kind="actv", slots=None, call_ids=None):
    n = len(names)
    return engine.observe(
        step=step, kind=kind, ops=OPS, names=names, values=values,
        micro_steps=np.zeros(n, np.uint16), call_ids=np.arange(n, dtype=np.uint32) if call_ids is None else call_ids,
        slots=np.full(n, 2, np.uint8) if slots is None else slots, vpp_stages=np.zeros(n, np.uint8),
    )


def test_observe_returns_events_and_dumps_reference_json(tmp_path):
    eng = AlertEngine(CFG, rank=1, pp_stage=0, group_mates=(0, 1), dump_dir=str(tmp_path / "anomaly_detected"))
    names = [f"layers.{i}" for i in range(4)]
    for step in range(10):
        assert feed(eng, step, stats_rows(4), names) == []
    vals = stats_rows(4)
    vals[2, :4] *= 100  # layer 2's output explodes at step 10
    found = feed(eng, 10, vals, names)
    assert {(e.name, e.op) for e in found} == {("layers.2", op) for op in ("min", "max", "norm", "mean")}
    assert all(isinstance(e, AnomalyDetected) and e.step == 10 and e.rank == 1 for e in found)
    path = tmp_path / "anomaly_detected" / "rank1" / "anomaly.json"
    data = json.loads(path.read_text())
    # the reference's key omits the op: several ops of one tag and step share one entry, the last op's
    assert list(data) == ["0:layers.2_0/rank1/output_step_10_call_2"]
    entry = data["0:layers.2_0/rank1/output_step_10_call_2"]
    assert list(entry) == REFERENCE_FIELDS
    assert entry == {
        "rank": 1, "step": 10, "micro_step": 0, "pp_stage": 0, "vpp_stage": 0, "call_id": 2,
        "tag_name": "0:layers.2_0/rank1/output",
        "message": "Rule AnomalyTurbulence reports anomaly signal in ('0:layers.2_0/rank1/output', 'mean') at step 10.",
        "group_mates": [0, 1],
    }
    eng.close()
    eng.close()  # idempotent
    assert feed(eng, 11, vals, names) == []


def test_the_closing_count_says_why_the_file_has_fewer_entries(tmp_path, caplog):
    """4 anomalies (4 ops of one tensor) share one entry of the reference's file: the closing line
    says so, instead of a total the file does not hold."""
    eng = AlertEngine(CFG, rank=1, pp_stage=0, group_mates=(0, 1), dump_dir=str(tmp_path / "anomaly_detected"))
    names = [f"layers.{i}" for i in range(4)]
    for step in range(10):
        feed(eng, step, stats_rows(4), names)
    vals = stats_rows(4)
    vals[2, :4] *= 100
    assert len(feed(eng, 10, vals, names)) == 4
    with caplog.at_level(logging.WARNING, logger="trainrec.recorder.alerts"):
        eng.close()
    path = tmp_path / "anomaly_detected" / "rank1" / "anomaly.json"
    assert [r.getMessage() for r in caplog.records][-1] == (
        f"trainrec: rank 1: 4 anomalies in total; 1 entries in {path}, where anomalies of several ops of one "
        "tensor in one call share an entry (the log has every one: trainrec anomalies)")


def test_dump_file_is_valid_after_every_write_and_only_grows(tmp_path):
    eng = AlertEngine(CFG, rank=0, pp_stage=0, group_mates=(0,), dump_dir=str(tmp_path))
    names = ["a", "b", "c"]
    path = tmp_path / "rank0" / "anomaly.json"
    sizes = []
    expected = set()
    for step in range(40):
        vals = stats_rows(3)
        if step >= 10 and step % 3 == 0:
            vals[step % 3, :4] *= 10.0 if step % 2 else 0.01  # spikes up and down
        for ev in feed(eng, step, vals, names):
            expected.add(f"{ev.tag_name}_step_{ev.step}_call_{ev.call_id}")
        data = json.loads(path.read_text())
        assert set(data) == expected
        sizes.append(path.stat().st_size)
    assert len(expected) >= 8
    assert sizes == sorted(sizes)
    eng.close()
    assert oct(path.stat().st_mode & 0o777) == "0o640"


def test_earlier_anomaly_file_is_kept_not_wiped(tmp_path):
    rank_dir = tmp_path / "rank0"
    rank_dir.mkdir()
    old = {"0:x_step_1_call_0": {"rank": 0, "step": 1}}
    (rank_dir / "anomaly.json").write_text(json.dumps(old))
    dump = AnomalyJsonDump(str(tmp_path), 0)
    dump.close()
    kept = [p for p in os.listdir(rank_dir) if p.startswith("anomaly-")]
    assert len(kept) == 1 and json.loads((rank_dir / kept[0]).read_text()) == old
    assert json.loads((rank_dir / "anomaly.json").read_text()) == {}


def test_resume_continues_the_existing_file(tmp_path):
    eng = AlertEngine(CFG, rank=0, pp_stage=0, group_mates=(0,), dump_dir=str(tmp_path))
    for step in range(9):
        feed(eng, step, stats_rows(1), ["w"])
    first = feed(eng, 9, stats_rows(1, 50.0), ["w"])
    eng.close()
    assert first
    eng2 = AlertEngine(CFG, rank=0, pp_stage=0, group_mates=(0,), dump_dir=str(tmp_path), resume=True)
    for step in range(10, 19):
        feed(eng2, step, stats_rows(1), ["w"])
    second = feed(eng2, 19, stats_rows(1, 50.0), ["w"])
    eng2.close()
    assert second
    data = json.loads((tmp_path / "rank0" / "anomaly.json").read_text())
    assert sorted(v["step"] for v in data.values()) == [9, 19]


def test_alerts_are_rate_limited(tmp_path, caplog):
    eng = AlertEngine({"rules": [{"rule_name": "NaNInf"}]}, rank=0, pp_stage=0, group_mates=(0,), dump_dir=None,
                      log_limit=3)
    names = [f"t{i}" for i in range(200)]
    with caplog.at_level(logging.WARNING, logger="trainrec.recorder.alerts"):
        assert feed(eng, 0, stats_rows(200), names) == []
        nan_rows = np.full((200, 6), np.nan)
        nan_rows[:, 5] = 7  # the NaN count
        found = feed(eng, 1, nan_rows, names)
        feed(eng, 2, stats_rows(200), names)
        eng.close()
    assert len(found) == 200 * 6  # every op of every tensor: first NaN, NaN count rising from 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) <= 3 + 2
    assert sum("reports anomaly signal" in m for m in lines) == 3
    assert any("step 1: 1200 anomalies (3 shown above)" in m for m in lines)


def test_bad_config_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as info:
        AlertEngine({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": "high"}}]}, rank=0,
                    pp_stage=0, group_mates=(0,), dump_dir=None)
    assert info.value.key == "alert.rules[0].args.threshold"


def test_no_rules_means_no_work(tmp_path):
    eng = AlertEngine({"rules": [], "dump": True}, rank=0, pp_stage=0, group_mates=(), dump_dir=str(tmp_path))
    assert not eng.enabled
    assert feed(eng, 0, stats_rows(2), ["a", "b"]) == []
    assert feed(eng, 1, np.full((2, 6), np.nan), ["a", "b"]) == []
    assert not (tmp_path / "rank0").exists()


def test_zero_initialised_biases_of_a_real_model_do_not_flood():
    """A real torch model with zero-initialised biases trained by AdamW: the reference's rule flags its
    bias parameters hundreds of times; ours does not."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours, reference_count = _train_biases(torch, nn)
    finally:
        torch.set_num_threads(threads)
    assert reference_count > 200
    assert len(ours) <= 5


def _train_biases(torch, nn):
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 1))
    for m in net:
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    eng = AlertEngine({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}, rank=0,
                      pp_stage=0, group_mates=(0,), dump_dir=None)
    biases = [(n, p) for n, p in net.named_parameters() if n.endswith("bias")]
    w = torch.randn(32, 1)
    reference_state: dict = {}
    reference_count = 0
    ours = []
    for step in range(60):
        x = torch.randn(64, 32)
        ((net(x) - x @ w) ** 2).mean().backward()
        rows = []
        for _, p in biases:
            t = p.detach().double()
            rows.append([t.min().item(), t.max().item(), t.norm().item(), t.mean().item(),
                         (t.abs() < 1e-8).double().mean().item(), torch.isnan(t).sum().item()])
        vals = np.array(rows)
        ours += eng.observe(step=step, kind="param", ops=OPS, names=[n for n, _ in biases], values=vals)
        # the reference's rule: cumulative mean, flag cur > mean*(1+t) if mean > 0 else cur < mean*(1+t)
        for i, (n, _) in enumerate(biases):
            for j, op in enumerate(OPS):
                v = vals[i, j]
                if (n, op) in reference_state:
                    avg, cnt = reference_state[(n, op)]
                    up = avg * 1.5
                    reference_count += bool(v > up) if avg > 0 else bool(v < up)
                    reference_state[(n, op)] = ((avg * cnt + v) / (cnt + 1), cnt + 1)
                else:
                    reference_state[(n, op)] = (v, 1)
        opt.step()
        opt.zero_grad()
    return ours, reference_count
