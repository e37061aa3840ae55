"""Execution-order ranking of anomalies across ranks, micro steps and pipeline stages, and the
reference's JSON round trip."""

from __future__ import annotations

import json
import math

import pytest
from trainrec.analyzers.anomalies import anomaly_records, parse_reference_json, reference_json
from trainrec.analyzers.ranking import execution_key, kind_of_tag, rank_anomalies
from trainrec.schema.detector import anomaly_message
from trainrec.schema.errors import FormatError
from trainrec.schema.events import AnomalyDetected
from trainrec.schema.naming import reference_tag


def anomaly(label, *, step, kind, micro=0, pp=0, vpp=0, call=-1, rank=0, name="m", slot="output", op="norm"):
    tag = reference_tag(kind, name, slot if kind in ("actv", "actv_grad") else 0, micro, rank, vpp)
    return AnomalyDetected(
        rank=rank, step=step, micro_step=micro, pp_stage=pp, vpp_stage=vpp, call_id=call, tag_name=tag, op=op,
        value=2.0, baseline=1.0, message=anomaly_message("AnomalyTurbulence", tag, op, step), group_mates=(0, 1),
        rule="AnomalyTurbulence", kind=kind, name=f"{name}:{label}", slot=slot,
    )


# The true execution order of one training step with 2 pipeline stages, 2 data-parallel ranks and
# gradient accumulation 2, then the next step.
EXPECTED = [
    anomaly("fwd m0 pp0", step=5, kind="actv", micro=0, pp=0, call=3, rank=1, name="a"),
    anomaly("fwd m0 pp1", step=5, kind="actv", micro=0, pp=1, call=1, rank=0, name="b"),
    anomaly("bwd m0 pp1 call10", step=5, kind="actv_grad", micro=0, pp=1, call=10, name="b", slot="output_grad"),
    anomaly("bwd m0 pp1 acc", step=5, kind="grad_unreduced", micro=0, pp=1, call=12, name="b.weight"),
    anomaly("bwd m0 pp0", step=5, kind="actv_grad", micro=0, pp=0, call=9, name="a", slot="input_grad"),
    anomaly("fwd m1 pp0", step=5, kind="actv", micro=1, pp=0, call=20, name="a", slot="input"),
    anomaly("bwd m1 pp0 r0", step=5, kind="actv_grad", micro=1, pp=0, call=30, rank=0, name="a", slot="input_grad"),
    anomaly("bwd m1 pp0 r1", step=5, kind="actv_grad", micro=1, pp=0, call=30, rank=1, name="a", slot="input_grad"),
    anomaly("reduce pp1", step=5, kind="grad_reduced", pp=1, call=40, name="b.weight"),
    anomaly("reduce pp0", step=5, kind="grad_reduced", pp=0, call=41, name="a.weight"),
    anomaly("param pp0", step=5, kind="param", pp=0, call=-1, name="a.weight"),
    anomaly("exp_avg pp0", step=5, kind="exp_avg", pp=0, call=50, name="a.weight"),
    anomaly("exp_avg_sq pp0", step=5, kind="exp_avg_sq", pp=0, call=51, name="a.weight"),
    anomaly("param pp1", step=5, kind="param", pp=1, call=-1, name="b.weight"),
    anomaly("next step", step=6, kind="actv", micro=0, pp=0, call=0, name="a"),
]


def test_execution_order_across_ranks_micro_steps_and_stages():
    shuffled = EXPECTED[7::-1] + EXPECTED[:7:-1]
    assert [a.name for a in rank_anomalies(shuffled)] == [a.name for a in EXPECTED]


def test_top_k_and_step_filter():
    assert rank_anomalies(reversed(EXPECTED), k=3) == EXPECTED[:3]
    assert rank_anomalies(EXPECTED, k=2, steps={6}) == EXPECTED[-1:]
    assert rank_anomalies(EXPECTED, steps=[7]) == []
    with pytest.raises(ValueError, match="positive"):
        rank_anomalies(EXPECTED, k=0)


def test_param_anomalies_are_not_ranked_first():
    # the reference gave param tags stage -1 and call -1, so they sorted before everything of a step
    param = anomaly("param", step=5, kind="param")
    first_fwd = anomaly("fwd", step=5, kind="actv", call=100)
    assert rank_anomalies([param, first_fwd])[0] is first_fwd


def test_several_ops_of_one_tag_keep_their_recorded_order():
    # (the config's ops order: the reference's anomaly.json keeps the last op's entry of a tensor, step
    # and call, and a ranking of the same anomalies must keep the same one)
    evs = [anomaly("x", step=1, kind="actv", call=2, op=op) for op in ("nans", "mean", "min")]
    assert [a.op for a in rank_anomalies(evs)] == ["nans", "mean", "min"]
    assert [a.op for a in rank_anomalies(evs, k=2)] == ["nans", "mean"]
    earlier = anomaly("w", step=1, kind="actv", call=1, op="nans")
    assert [a.name for a in rank_anomalies([*evs, earlier])] == ["m:w", "m:x", "m:x", "m:x"]


def test_kind_from_reference_tags():
    assert kind_of_tag("0:2.linear1_0/rank0/input") == "actv"
    assert kind_of_tag("0:_0/rank0/output_grad") == "actv_grad"
    assert kind_of_tag("0:head.bias/rank0/acc_grad") == "grad_unreduced"
    assert kind_of_tag("0:head.bias/rank0/pre_grad") == "grad_unreduced"
    assert kind_of_tag("0:embed.weight/rank0/post_grad") == "grad_reduced"
    assert kind_of_tag("0:embed.weight") == "param"
    assert kind_of_tag("0:embed.weight/rank0/efxp_avg_sq") == "exp_avg_sq"
    assert kind_of_tag("0:embed.weight/rank0/mg_direction") == "mg_direction"
    assert kind_of_tag("0:embed.weight/rank0/no_such_kind") == ""


def test_reference_json_round_trip_keeps_the_ranking():
    ranked = rank_anomalies(EXPECTED)
    obj = reference_json(ranked)
    data = json.dumps(obj, indent=1).encode()
    back, problems = parse_reference_json(data, "anomaly_analyse.json")
    assert problems == []
    # what the reference's file carries survives, and ranks again in the same order
    assert [(a.rank, a.step, a.micro_step, a.pp_stage, a.call_id, a.tag_name, a.message) for a in back] == [
        (a.rank, a.step, a.micro_step, a.pp_stage, a.call_id, a.tag_name, a.message) for a in ranked]
    assert [a.tag_name for a in rank_anomalies(reversed(back))] == [a.tag_name for a in ranked]
    assert [(a.op, a.rule, a.kind) for a in back] == [(a.op, a.rule, a.kind) for a in ranked]
    assert all(math.isnan(a.value) and math.isnan(a.baseline) for a in back)
    assert reference_json(back) == obj


def test_reference_json_shares_keys_like_the_reference():
    evs = [anomaly("x", step=1, kind="actv", call=2, op=op) for op in ("min", "max", "mean")]
    evs.append(anomaly("y", step=1, kind="actv", call=3, op="min", name="n"))
    obj = reference_json(evs)
    assert list(obj) == ["0:m_0/rank0/output_step_1_call_2", "0:n_0/rank0/output_step_1_call_3"]
    assert "'mean'" in obj["0:m_0/rank0/output_step_1_call_2"]["message"]  # the last op, as the reference
    assert list(reference_json(evs, k=1)) == ["0:m_0/rank0/output_step_1_call_2"]


def test_our_records_add_op_value_baseline():
    (rec,) = anomaly_records([EXPECTED[0]])
    assert rec["op"] == "norm" and rec["value"] == 2.0 and rec["baseline"] == 1.0
    assert rec["rule"] == "AnomalyTurbulence" and rec["kind"] == "actv" and rec["phase"] == "fwd"
    assert rec["tag_name"] == "0:a_0/rank1/output" and rec["group_mates"] == [0, 1]


def test_malformed_reference_json():
    with pytest.raises(FormatError, match=r"bad\.json: not valid JSON"):
        parse_reference_json(b'{"a": ', "bad.json")
    with pytest.raises(FormatError, match="expected a JSON object"):
        parse_reference_json(b"[1, 2]", "list.json")
    good = reference_json(EXPECTED[:1])
    entries = {
        **good,
        "missing": {"rank": 0, "step": 1},
        "badtype": {**next(iter(good.values())), "step": "1"},
        "notobj": 5,
    }
    got, problems = parse_reference_json(json.dumps(entries), "rank0/anomaly.json")
    assert len(got) == 1 and got[0].tag_name == EXPECTED[0].tag_name
    assert len(problems) == 3
    assert any("'missing'" in p and "lacks" in p for p in problems)
    assert any("'badtype'" in p and "step must be an integer" in p for p in problems)
    assert all(p.startswith("rank0/anomaly.json: ") for p in problems)


def test_unknown_message_format_still_ranks():
    value = {"rank": 0, "step": 3, "micro_step": 0, "pp_stage": 0, "vpp_stage": 0, "call_id": 1,
             "tag_name": "0:x_0/rank0/input", "message": "custom text", "group_mates": [0]}
    (ev,), problems = parse_reference_json(json.dumps({"k": value}))
    assert problems == [] and ev.op == "" and ev.rule == "" and ev.kind == "actv"
    assert execution_key(ev)[0] == 3
