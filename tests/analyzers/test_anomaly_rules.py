"""The anomaly rules of trainrec.schema.rules: the reference's synthetic series, NaN handling, floors,
vectorisation, config validation and the reference's JSON entry format."""

from __future__ import annotations

import math

import numpy as np
import pytest
from trainrec.schema.detector import Detector, anomaly_message, reference_entry
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import AnomalyDetected
from trainrec.schema.rule_config import make_rule, rules_from_config, validate_alert_config
from trainrec.schema.rules import AnomalyTurbulence, NaNInf, ZScore

NAN = float("nan")
INF = float("inf")
LEAD = [1.0] * 8  # the default warm-up is 8 values


def flags(series, rule, op="mean"):
    """Indices flagged by ``rule`` on one series of one op."""
    out = []
    for i, v in enumerate(series):
        f, _ = rule.observe(np.array([0]), (op,), np.array([[v]], dtype=float))
        if f[0, 0]:
            out.append(i)
    return out


def baselines(series, rule, op="mean"):
    out = []
    for v in series:
        _, b = rule.observe(np.array([0]), (op,), np.array([[v]], dtype=float))
        out.append(float(b[0, 0]))
    return out


# ----------------------------------------------------------------------- the reference's table
def test_spike_does_not_hide_the_next_one():
    # reference: 1 1 1 2* 1 1.6 1 -> 1.6 missed because the spike raised the cumulative mean
    assert flags(LEAD + [2, 1, 1.6, 1], AnomalyTurbulence(0.5)) == [8, 10]
    assert flags([1, 1, 1, 2, 1, 1.6, 1], AnomalyTurbulence(0.5, warmup=2)) == [3, 5]


def test_drops_are_flagged():
    # reference: 1 1 1 0.1 -> never flagged although its documentation says "up or down"
    assert flags(LEAD + [0.1], AnomalyTurbulence(0.5)) == [8]
    assert flags(LEAD + [0.6], AnomalyTurbulence(0.5)) == []  # a 40 % drop is within 0.5
    assert flags(LEAD + [0.4], AnomalyTurbulence(0.5)) == [8]


def test_negative_baselines_both_directions():
    neg = [-1.0] * 8
    assert flags(neg + [-1.6], AnomalyTurbulence(0.5)) == [8]
    assert flags(neg + [5.0], AnomalyTurbulence(0.5)) == [8]  # the reference misses this one
    assert flags(neg + [-1.3, -0.8], AnomalyTurbulence(0.5)) == []


def test_first_nans_are_flagged_by_the_nans_op():
    # reference: nan-count 0 0 0 7 7* -> the first NaNs are missed (zero baseline)
    assert flags([0, 0, 0, 7, 7], AnomalyTurbulence(0.5), op="nans") == [3]
    assert flags([0, 0, 0, 7, 7, 0, 0, 2], AnomalyTurbulence(0.5), op="nans") == [3, 7]
    assert flags([0, 0, 0, 7, 7], NaNInf(), op="nans") == [3]
    # a count there from the first step is flagged too, and the baseline reported is the earlier count
    assert flags([3], NaNInf(), op="nans") == [0]
    assert baselines([0, 0, 5], AnomalyTurbulence(0.5), op="nans")[2] == 0.0


def test_nan_is_flagged_once_and_does_not_poison():
    rule = AnomalyTurbulence(0.5)
    series = LEAD + [NAN, NAN, NAN, 1, 1, 2, 1, INF, -INF, 1, 0.1]
    assert flags(series, rule) == [8, 13, 15, 18]
    # the baseline after the NaNs is still the median of the finite values
    b = baselines(LEAD + [NAN, NAN, 3.0], AnomalyTurbulence(0.5))
    assert b[-1] == 1.0 and b[-3] == 1.0  # the NaN's own baseline too


def test_nan_right_after_the_start_is_flagged_despite_warmup():
    assert flags([1, NAN, 1], AnomalyTurbulence(0.5)) == [1]
    assert flags([1, INF], NaNInf()) == [1]
    # NaN from the first value on is how an absent tensor (None) is recorded: no anomaly...
    assert flags([NAN, NAN, NAN], AnomalyTurbulence(0.5)) == []
    # ...while a real tensor with NaN from the start shows in its (finite) nans count
    assert flags([4, 4], AnomalyTurbulence(0.5), op="nans") == [0]


def test_warmup_and_window():
    rule = AnomalyTurbulence(0.5, warmup=5)
    assert flags([1, 1, 1, 1, 10, 1, 10], rule) == [6]  # index 4 is still in the warm-up
    # with sudden (the default) a lasting level change is one anomaly, not window/2 of them
    assert flags(LEAD + [10] * 20, AnomalyTurbulence(0.5)) == [8]
    # without sudden the median needs about window/2 values to move to the new level
    f = flags(LEAD + [10] * 20, AnomalyTurbulence(0.5, window=8, sudden=False))
    assert f[0] == 8 and 2 <= len(f) <= 5 and f == list(range(8, 8 + len(f)))


def test_slow_drift_needs_sudden_false():
    drift = [1.3**i for i in range(16)]
    assert flags(drift, AnomalyTurbulence(0.5, warmup=3, sudden=False, noise=0)) != []
    # the reference flags a x1.3 drift from the 4th step on; ours does with sudden=false and
    # noise=0, and by default treats a smooth drift as no turbulence (documented)
    assert flags(drift, AnomalyTurbulence(0.5, warmup=3, sudden=False, noise=0))[0] == 3


def test_near_zero_series_do_not_flood():
    rng = np.random.default_rng(1)
    # the mean of a gradient: noise around zero, where a relative deviation means nothing
    noise = list(rng.normal(0.0, 1e-3, 400))
    flagged = flags(noise, AnomalyTurbulence(0.5))
    assert len(flagged) < 0.06 * len(noise)
    # a real jump out of that noise is still found
    assert flags(noise[:100] + [0.05], AnomalyTurbulence(0.5))[-1] == 100


def test_mean_is_judged_against_the_tensor_range():
    # a LayerNorm output: values within +-3, mean 1e-5 noise -> no anomalies
    rng = np.random.default_rng(2)
    rule = AnomalyTurbulence(0.5)
    ops = ("min", "max", "mean")
    hits = 0
    for _ in range(200):
        row = np.array([[-3 + rng.normal(0, 0.05), 3 + rng.normal(0, 0.05), rng.normal(0, 1e-5)]])
        f, _ = rule.observe(np.array([0]), ops, row)
        hits += int(f.sum())
    assert hits == 0
    # but a mean that moves by a good part of the range is flagged
    f, _ = rule.observe(np.array([0]), ops, np.array([[-3.0, 3.0, 1.0]]))
    assert f[0].tolist() == [False, False, True]


def test_zeros_op_floor():
    rule = AnomalyTurbulence(0.5)
    assert flags([0.0] * 10 + [1 / 128], rule, op="zeros") == []
    assert flags([0.0] * 10 + [0.2], AnomalyTurbulence(0.5), op="zeros") == [10]


def test_threshold_change_gives_subset_and_superset():
    rng = np.random.default_rng(3)
    data = rng.lognormal(0, 0.4, size=(300, 50))
    data[150, 7] *= 20

    def run(threshold):
        rule = AnomalyTurbulence(threshold)
        found = set()
        for t in range(len(data)):
            f, _ = rule.observe(np.arange(50), ("norm",), data[t][:, None])
            found.update((t, int(i)) for i in np.nonzero(f[:, 0])[0])
        return found

    low, mid, high = run(0.3), run(0.5), run(1.0)
    assert high <= mid <= low
    assert len(high) < len(mid) < len(low)
    assert (150, 7) in high


def test_zscore_rule():
    rng = np.random.default_rng(4)
    base = list(10 + rng.normal(0, 0.1, 30))
    assert flags(base + [12.0], ZScore(threshold=4))[-1] == 30
    assert flags(base, ZScore(threshold=6)) == []
    assert flags([5.0] * 10 + [NAN, 5.0], ZScore()) == []  # NaN is NaNInf's business, and never poisons


def test_nan_inf_rule_flags_only_non_finite():
    assert flags(LEAD + [100.0, NAN, 1.0], NaNInf()) == [9]


# ----------------------------------------------------------------------- vectorisation
def test_vectorised_record_equals_one_series_at_a_time():
    rng = np.random.default_rng(5)
    rows, steps = 16, 45
    ops = ("min", "max", "norm", "mean", "zeros", "nans")
    data = rng.normal(1, 0.3, size=(steps, rows, len(ops)))
    data[:, :, 4] = rng.uniform(0, 0.2, size=(steps, rows))
    data[:, :, 5] = 0
    data[30, 3, :4] = NAN  # a tensor full of NaN: min..mean are NaN, the nans count rises from 0
    data[30, 3, 5] = 9
    data[40, 11, 2] = 50
    names = [f"layer{i}" for i in range(rows)]
    together = Detector([AnomalyTurbulence(0.3), ZScore(3)])
    apart = [Detector([AnomalyTurbulence(0.3), ZScore(3)]) for _ in range(rows)]
    got_together, got_apart = [], []
    for t in range(steps):
        order = rng.permutation(rows)  # row order changes: the series follow the names
        for ev in together.observe(rank=0, step=t, kind="actv", ops=ops, names=[names[i] for i in order],
                                   values=data[t][order], slots=np.full(rows, 2)):
            got_together.append((ev.step, ev.name, ev.op, ev.rule))
        for i in range(rows):
            for ev in apart[i].observe(rank=0, step=t, kind="actv", ops=ops, names=[names[i]],
                                       values=data[t][i : i + 1], slots=np.array([2])):
                got_apart.append((ev.step, ev.name, ev.op, ev.rule))
    assert sorted(got_together) == sorted(got_apart)
    assert (40, "layer11", "norm", "AnomalyTurbulence") in got_together
    assert (30, "layer3", "mean", "AnomalyTurbulence") in got_together
    assert (30, "layer3", "nans", "AnomalyTurbulence") in got_together
    assert not any(step == 31 and name == "layer3" for step, name, _, _ in got_together)


def test_duplicate_names_in_a_record_are_separate_series():
    det = Detector([AnomalyTurbulence(0.5)])
    for step in range(12):
        # the same module called twice per step with very different sizes
        vals = np.array([[1.0], [100.0]])
        assert det.observe(rank=0, step=step, kind="actv", ops=("norm",), names=["m", "m"], values=vals) == []
    ev = det.observe(rank=0, step=12, kind="actv", ops=("norm",), names=["m", "m"], values=np.array([[1.0], [1.0]]))
    assert len(ev) == 1 and ev[0].value == 1.0 and ev[0].baseline == 100.0


def test_ops_order_and_new_ops_between_records():
    rule = AnomalyTurbulence(0.5)
    for _ in range(10):
        rule.observe(np.array([0]), ("min", "max"), np.array([[1.0, 2.0]]))
    f, b = rule.observe(np.array([0]), ("max", "norm", "min"), np.array([[20.0, 5.0, 1.0]]))
    assert f[0].tolist() == [True, False, False]  # norm is a new series, still in its warm-up
    assert b[0, 0] == 2.0


def test_detector_event_fields_and_message():
    det = Detector([AnomalyTurbulence(0.5, warmup=1)])
    kw = dict(rank=1, kind="actv", ops=("min", "mean"), names=["2.linear1"], micro_steps=np.array([1]),
              call_ids=np.array([44]), slots=np.array([1]), vpp_stages=np.array([0]), pp_stage=3, group_mates=(0, 1))
    det.observe(step=19, values=np.array([[1.0, 1.0]]), **kw)
    (ev,) = det.observe(step=20, values=np.array([[1.0, 9.0]]), **kw)
    assert isinstance(ev, AnomalyDetected)
    assert ev.tag_name == "0:2.linear1_1/rank1/input"
    assert ev.message == "Rule AnomalyTurbulence reports anomaly signal in ('0:2.linear1_1/rank1/input', 'mean') at step 20."
    assert (ev.rank, ev.step, ev.micro_step, ev.pp_stage, ev.vpp_stage, ev.call_id) == (1, 20, 1, 3, 0, 44)
    assert (ev.op, ev.value, ev.baseline, ev.rule, ev.kind, ev.name, ev.slot) == (
        "mean", 9.0, 1.0, "AnomalyTurbulence", "actv", "2.linear1", "input")
    assert ev.group_mates == (0, 1)
    # unknown call ids (empty column) are -1, as the reference writes for param tags
    det = Detector([NaNInf()])
    assert det.observe(rank=0, step=2, kind="param", ops=("norm",), names=["w"], values=np.array([[1.0]])) == []
    (p,) = det.observe(rank=0, step=3, kind="param", ops=("norm",), names=["w"], values=np.array([[NAN]]))
    assert p.call_id == -1 and p.tag_name == "0:w"


def test_reference_entry_has_exactly_the_reference_fields():
    ev = AnomalyDetected(rank=0, step=20, micro_step=0, pp_stage=0, vpp_stage=0, call_id=44,
                         tag_name="0:2.linear1_0/rank0/input", op="mean", value=3.0, baseline=1.0,
                         message=anomaly_message("AnomalyTurbulence", "0:2.linear1_0/rank0/input", "mean", 20),
                         group_mates=(0,), rule="AnomalyTurbulence")
    key, value = reference_entry(ev)
    assert key == "0:2.linear1_0/rank0/input_step_20_call_44"
    assert value == {
        "rank": 0, "step": 20, "micro_step": 0, "pp_stage": 0, "vpp_stage": 0, "call_id": 44,
        "tag_name": "0:2.linear1_0/rank0/input",
        "message": "Rule AnomalyTurbulence reports anomaly signal in ('0:2.linear1_0/rank0/input', 'mean') at step 20.",
        "group_mates": [0],
    }
    assert list(value) == ["rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name",
                           "message", "group_mates"]


# ----------------------------------------------------------------------- config
def test_alert_config_accepts_the_reference_and_int_thresholds():
    cfg = validate_alert_config({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1}}],
                                 "dump": True})
    assert cfg == {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1.0}}], "dump": True}
    assert isinstance(cfg["rules"][0]["args"]["threshold"], float)
    assert validate_alert_config(None) == {"rules": [], "dump": False}
    assert validate_alert_config({"rules": [], "dump": None}) == {"rules": [], "dump": False}  # null: not set
    rules = rules_from_config({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5, "window": 8}},
                                         {"rule_name": "NaNInf", "args": {}}, {"rule_name": "ZScore"}]})
    assert [r.name for r in rules] == ["AnomalyTurbulence", "NaNInf", "ZScore"]
    assert rules[0].window == 8
    assert make_rule("ZScore", {"threshold": 3, "window": 10.0}).window == 10


@pytest.mark.parametrize(
    ("raw", "key", "text"),
    [
        ([], "alert", "object"),
        ({"rules": {}}, "alert.rules", "list"),
        ({"rules": [{"rule_name": "Nope", "args": {}}]}, "alert.rules[0].rule_name", "known rules: AnomalyTurbulence"),
        ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {}}]}, "alert.rules[0].args.threshold", "needs"),
        ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": True}}]},
         "alert.rules[0].args.threshold", "number"),
        ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": "0.5"}}]},
         "alert.rules[0].args.threshold", "number"),
        ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": -1}}]},
         "alert.rules[0].args.threshold", ">= 0"),
        ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": float("nan")}}]},
         "alert.rules[0].args.threshold", "finite"),
        ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5, "window": 2.5}}]},
         "alert.rules[0].args.window", "whole"),
        ({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5, "thresh": 1}}]},
         "alert.rules[0].args.thresh", "unknown argument"),
        ({"rules": [{"args": {}}]}, "alert.rules[0].rule_name", "missing"),
        ({"rules": ["AnomalyTurbulence"]}, "alert.rules[0]", "object"),
        ({"rules": [], "dump": "yes"}, "alert.dump", "true or false"),
        ({"rules": [], "dumps": True}, "alert.dumps", "unknown key"),
    ],
)
def test_alert_config_errors_name_the_key(raw, key, text):
    with pytest.raises(ConfigError, match=text) as info:
        validate_alert_config(raw, source="monitor.json")
    assert info.value.key == key
    assert str(info.value).startswith(f"monitor.json: config key {key!r}")


# ----------------------------------------------------------------------- the documented math, naively
def naive_turbulence(data, ops, threshold, window=16, warmup=8, noise=8.0, range_floor=0.2, floor=0.0, sudden=True):
    """AnomalyTurbulence as its docstring states it, one value at a time in plain Python."""
    import statistics

    floors = {"zeros": 0.2, "nans": 1.0}
    steps, rows, _ = data.shape
    hist = {}
    last = {}
    last_ok = {}
    out = set()
    for t in range(steps):
        meds = {}
        for r in range(rows):
            for op in ops:
                h = hist.get((r, op), [])
                meds[(r, op)] = statistics.median(h) if h else math.nan
        for r in range(rows):
            for j, op in enumerate(ops):
                v = float(data[t, r, j])
                h = hist.setdefault((r, op), [])
                prev = last.get((r, op), 0.0)
                if not math.isfinite(v):
                    if last_ok.get((r, op), False):
                        out.add((t, r, op))
                    last_ok[(r, op)] = False
                    continue
                if op == "nans":
                    if v > 0 and prev == 0:
                        out.add((t, r, op))
                elif len(h) >= warmup and h:
                    med = meds[(r, op)]
                    spread = statistics.median(abs(x - med) for x in h)
                    scale = max(abs(med), noise * spread, floor, floors.get(op, 0.0))
                    if op in ("min", "max", "mean") and "min" in ops and "max" in ops:
                        scale = max(scale, range_floor * max(abs(meds[(r, "min")]), abs(meds[(r, "max")])))
                    change = abs(v - med)
                    if sudden:
                        change = min(change, abs(v - prev))
                    if change > threshold * scale:
                        out.add((t, r, op))
                h.append(v)
                del h[:-window]
                last[(r, op)] = v
                last_ok[(r, op)] = True
    return out


@pytest.mark.parametrize("sudden", [True, False])
@pytest.mark.parametrize("sigma", [0.1, 0.3])
def test_vectorised_rule_equals_the_documented_math(sudden, sigma):
    rng = np.random.default_rng(11)
    ops = ("min", "max", "norm", "mean", "zeros", "nans")
    steps, rows = 40, 12
    mag = 10.0 ** rng.uniform(-6, 2, rows)
    noise = rng.lognormal(0, sigma, (steps, rows))
    data = np.stack([-mag * noise, mag * noise * 1.1, 5 * mag * noise, mag * rng.normal(0, 0.05, (steps, rows)),
                     rng.uniform(0, 0.3, (steps, rows)), np.zeros((steps, rows))], axis=2)
    data[:, 0, :4] = 0.0  # a tensor that stays exactly zero, then moves
    data[30:, 0, :4] = 1e-3
    data[20, 3, :] *= 40  # spikes, up and down
    data[25, 4, :4] /= 40
    data[15:18, 5, :5] = np.nan  # NaN for a while, with its count
    data[15:18, 5, 5] = 12
    data[22, 6, 2] = np.inf
    got = set()
    rule = AnomalyTurbulence(0.5, sudden=sudden)
    for t in range(steps):
        f, _ = rule.observe(np.arange(rows), ops, data[t])
        got.update((t, int(r), ops[j]) for r, j in zip(*np.nonzero(f), strict=True))
    expected = naive_turbulence(data, ops, 0.5, sudden=sudden)
    assert got == expected
    assert len(got) > 20
    assert {(20, 3, "norm"), (15, 5, "nans"), (15, 5, "mean"), (22, 6, "norm")} <= got
    if sigma == 0.1:  # a drop cannot leave a noisy series' spread: at sigma 0.3 the noise floor wins
        assert (25, 4, "norm") in got


# ----------------------------------------------------------------------- placeholder rows
def _expert_steps(det, steps=20, absent=lambda t: t % 2 == 1, mark=True, poison_at=None):
    """Two parameters' gradient rows per step: ``expert.0`` has a gradient on even steps only (a NaN
    row on the others, marked as a placeholder where ``mark``), ``dense`` on every step (a real NaN at
    ``poison_at``). Returns the anomalies per step."""
    ops = ("norm", "nans")
    found = {}
    for t in range(steps):
        gone = absent(t)
        vals = np.array([[NAN, NAN] if gone else [1.0 + 0.01 * (t % 3), 0.0],
                         [NAN, 4.0] if t == poison_at else [2.0 + 0.01 * (t % 2), 0.0]])
        marks = np.array([1 if gone else 0, 0], np.uint8) if mark else None
        found[t] = det.observe(rank=0, step=t, kind="grad_unreduced", ops=ops, names=["expert.0", "dense"],
                               values=vals, placeholders=marks)
    return found


def test_placeholder_rows_are_neither_flagged_nor_fed_into_the_series():
    unmarked = _expert_steps(Detector([AnomalyTurbulence(0.5)]), mark=False)
    assert [(t, e.name, e.op) for t, evs in unmarked.items() for e in evs][:1] == [(1, "expert.0", "norm")]
    for rule in (AnomalyTurbulence(0.5), NaNInf(), ZScore(3)):
        det = Detector([rule])
        found = _expert_steps(det, poison_at=13)
        got = [(t, e.name, e.op) for t, evs in found.items() for e in evs]
        assert got and all(name == "dense" and t == 13 for t, name, _ in got), (rule, got)
        assert det.observed_rows == 20 + 10  # the ten placeholder rows were not judged


def test_placeholder_rows_keep_the_series_of_a_repeated_name():
    """A name twice in a record (a module called twice): the occurrences are separate series whether
    or not the first one is a placeholder this step."""
    det = Detector([AnomalyTurbulence(0.5, warmup=2)])
    one = np.array([[1.0], [5.0]])
    for t in range(6):
        marks = np.array([t % 2, 0], np.uint8)
        vals = np.array([[NAN], [5.0]]) if t % 2 else one
        assert det.observe(rank=0, step=t, kind="actv_grad", ops=("norm",), names=["m", "m"], values=vals,
                           slots=np.array([3, 3]), placeholders=marks) == []
    ev = det.observe(rank=0, step=6, kind="actv_grad", ops=("norm",), names=["m", "m"],
                     values=np.array([[1.0], [50.0]]), slots=np.array([3, 3]), placeholders=b"\x00\x00")
    assert [(e.value, e.baseline) for e in ev] == [(50.0, 5.0)]
    assert det.observe(rank=0, step=7, kind="actv_grad", ops=("norm",), names=["m", "m"],
                       values=np.array([[NAN], [NAN]]), placeholders=np.array([1, 1], np.uint8)) == []
