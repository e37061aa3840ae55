"""Comparing graphs: matching modes, the reference's precision rules, the first divergent node and
step, and data-parallel ranks that depart."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch.nn as nn
from graph_runs import DUMP_DIR, copy_dump, record_run
from trainrec.analyzers.graph import GraphInputError, build_from_dump, build_from_run, compare
from trainrec.analyzers.graph.matching import api_key
from trainrec.analyzers.graph.ranks import compare_ranks
from trainrec.replay import open_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("graphcmp")
    return {"bench": record_run(base / "bench", steps=4), "same": record_run(base / "same", steps=4),
            "scaled": record_run(base / "scaled", steps=4, scale_at=2)}


def _graph(path):
    return build_from_run(open_run(path))


def test_identical_runs_agree_everywhere(runs):
    cmp = compare(_graph(runs["same"]), _graph(runs["bench"]))
    v = cmp.verdict()
    assert v["matched"] == v["debug_nodes"] == v["bench_nodes"] and v["unmatched_debug"] == 0
    assert v["first_divergence"] is None and v["errors_per_step"] == [0, 0, 0, 0]
    assert np.all(cmp.precision == 0)
    assert np.all(cmp.errors[np.isfinite(cmp.errors)] == 0) and np.isfinite(cmp.errors).mean() > 0.9


def test_a_layer_scaled_at_one_step_is_the_first_divergent_node_and_step(runs):
    cmp = compare(_graph(runs["scaled"]), _graph(runs["bench"]))
    first = cmp.first
    assert (first["step"], first["node"]) == (2, "Module.blk.Scaled.forward.0")
    assert first["inputs_clean"] and first["input_error"] == 0.0
    assert first["output_error"] == pytest.approx(1.0, rel=1e-5)  # doubled: |2n - n| / n
    # steps before agree; the scaled node is an error by the reference's rule (inputs agree, outputs not)
    k = cmp.nodes.index("Module.blk.Scaled.forward.0")
    assert cmp.precision[:2].max() == 0 and cmp.precision[2, k] == 1.0
    assert cmp.precision[2, cmp.nodes.index("Module.blk.lin.Linear.forward.0")] == 0.0
    # the layers after it see different inputs: not the first divergent node though their outputs differ
    assert cmp.output_err[2, cmp.nodes.index("Module.out.Linear.forward.0")] > 0.1
    # a collection takes its worst child
    assert cmp.node_precision(2)["Module.Net.forward.0"] == 1.0
    # a threshold above the difference sees none
    assert compare(_graph(runs["scaled"]), _graph(runs["bench"]), threshold=5.0).first is None


def test_two_different_models_are_refused(tmp_path, runs):
    other = record_run(tmp_path / "other", steps=1, model=nn.Sequential(nn.Linear(6, 3)))
    with pytest.raises(GraphInputError, match="two different models"):
        compare(_graph(other), _graph(runs["bench"]))


def _edit(d: str, step: int, fn) -> None:
    path = os.path.join(d, f"step{step}", "rank", "dump.json")
    with open(path) as f:
        dump = json.load(f)
    fn(dump["data"])
    with open(path, "w") as f:
        json.dump(dump, f)


def test_exact_matching_needs_equal_names_ancestors_and_shapes(tmp_path):
    d = copy_dump(tmp_path)

    def reshape(data):
        data["Functional.relu.0.forward"]["output"][0]["shape"] = [4, 17]

    _edit(d, 0, reshape)
    cmp = compare(build_from_dump(d), build_from_dump(DUMP_DIR))
    assert cmp.unmatched_debug == ["Functional.relu.0.forward"] == cmp.unmatched_bench
    assert len(cmp.pairs) == len(cmp.debug.nodes) - 1


def _renumber(d: str) -> None:
    """Bench's API call counters shifted (another code base counted more calls), its construct too."""
    for step in (0, 1):
        for name in ("dump.json", "construct.json", "stack.json"):
            path = os.path.join(d, f"step{step}", "rank", name)
            with open(path) as f:
                text = f.read()
            text = text.replace("Functional.linear.1.forward", "Functional.linear.7.forward")
            text = text.replace("Functional.linear.0.forward", "Functional.linear.3.forward")
            with open(path, "w") as f:
                f.write(text)


def test_fuzzy_matching_pairs_api_calls_by_order_within_their_module(tmp_path):
    d = copy_dump(tmp_path)
    _renumber(d)
    debug, bench = build_from_dump(DUMP_DIR), build_from_dump(d)
    exact = compare(debug, bench)
    assert sorted(exact.unmatched_debug) == ["Functional.linear.0.forward", "Functional.linear.1.forward"]
    fuzzy = compare(debug, bench, fuzzy=True)
    assert fuzzy.unmatched_debug == [] and fuzzy.unmatched_bench == []
    assert fuzzy.pairs["Functional.linear.0.forward"] == "Functional.linear.3.forward"
    assert fuzzy.pairs["Functional.linear.1.forward"] == "Functional.linear.7.forward"
    assert api_key("Functional.linear.12.forward") == "Functional.linear.forward"


def test_precision_rules_dtype_nan_and_warning(tmp_path):
    d = copy_dump(tmp_path)

    def half(data):  # (a port's dtype and shape are taken from the first step it appears in)
        data["Module.fc2.Linear.forward.0"]["parameters"]["weight"]["dtype"] = "torch.float16"

    def change(data):
        data["Torch.mean.0.forward"]["output"][0]["Max"] = "inf"  # msprobe writes inf as a string
        data["Tensor.pow.0.forward"]["output"][0]["Norm"] *= 1.01  # 1% off, inputs equal: a warning

    _edit(d, 0, half)
    _edit(d, 1, change)
    cmp = compare(build_from_dump(d), build_from_dump(DUMP_DIR), threshold=0.05)
    prec = {n: cmp.precision[1, k] for k, n in enumerate(cmp.nodes)}
    assert "dtype torch.float16 vs torch.float32" in cmp.static_error["Module.fc2.Linear.forward.0"]
    assert prec["Module.fc2.Linear.forward.0"] == 1.0 and cmp.precision[0, cmp.nodes.index("Module.fc2.Linear.forward.0")] == 1.0
    assert prec["Torch.mean.0.forward"] == 1.0  # inf on the debug side only
    assert cmp.overflow[1, cmp.nodes.index("Torch.mean.0.forward")] == 3  # critical: inputs finite
    assert prec["Tensor.pow.0.forward"] == 0.5
    assert prec["Module.fc1.Linear.forward.0"] == 0.0
    # inf appearing is a divergence whatever the threshold; the 1% change is under it
    assert (cmp.first["step"], cmp.first["node"]) == (1, "Torch.mean.0.forward")


def _record_rank(out, rank: int, monkeypatch, scale_at=None) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TRAINREC_RUN_ID", "graph-ranks")
    record_run(out, steps=4, scale_at=scale_at)


def test_the_departing_rank_step_and_node_are_named(tmp_path, monkeypatch):
    out = tmp_path / "ranks"
    _record_rank(out, 0, monkeypatch)
    _record_rank(out, 1, monkeypatch, scale_at=1)
    run = open_run(str(out))
    assert run.ranks == [0, 1]
    graphs = {r: build_from_run(run, r) for r in run.ranks}
    every = compare_ranks(graphs, scope="all")
    assert every["departs"]["rank"] == 1 and every["departs"]["step"] == 1
    assert every["departs"]["node"] == "Module.blk.Scaled.forward.0"
    dp = compare_ranks(graphs, scope="dp")  # gradients depart at that step, weights at the next
    assert (dp["departs"]["rank"], dp["departs"]["step"]) == (1, 1)
    assert dp["departs"]["node"].endswith(".parameters_grad")
    same = compare_ranks({0: graphs[0], 1: build_from_run(run, 0)})
    assert same["departs"] is None


def _rename(d: str, old: str, new: str) -> None:
    for step in (0, 1):
        for name in ("dump.json", "construct.json", "stack.json"):
            path = os.path.join(d, f"step{step}", "rank", name)
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.replace(old, new))


def test_layer_mapping_pairs_renamed_modules_and_their_api_calls(tmp_path):
    bench_dir = copy_dump(tmp_path)
    _rename(bench_dir, "Module.fc1.", "Module.proj.")
    debug, bench = build_from_dump(DUMP_DIR), build_from_dump(bench_dir)
    exact = compare(debug, bench)
    assert sorted(exact.unmatched_debug) == ["Functional.linear.0.forward", "Module.fc1.Linear.backward.0",
                                             "Module.fc1.Linear.forward.0", "Module.fc1.Linear.parameters_grad"]
    mapped = compare(debug, bench, layer_mapping={"TopLayer": {"fc1": "proj"}})
    assert mapped.unmatched_debug == [] and mapped.unmatched_bench == []
    assert mapped.pairs["Module.fc1.Linear.forward.0"] == "Module.proj.Linear.forward.0"
    assert mapped.pairs["Module.fc1.Linear.parameters_grad"] == "Module.proj.Linear.parameters_grad"
    assert mapped.pairs["Functional.linear.0.forward"] == "Functional.linear.0.forward"
    with pytest.raises(GraphInputError, match="names no class of .*nothing would be mapped"):
        compare(debug, bench, layer_mapping={"GPTModel": {"fc1": "proj"}})


def test_a_node_mapping_pairs_what_it_names(tmp_path):
    bench_dir = copy_dump(tmp_path)
    _rename(bench_dir, '"Functional.relu.0.forward"', '"Functional.gelu.0.forward"')
    debug, bench = build_from_dump(DUMP_DIR), build_from_dump(bench_dir)
    assert compare(debug, bench).unmatched_debug == ["Functional.relu.0.forward"]
    cmp = compare(debug, bench, mapping={"Functional.relu.0.forward": "Functional.gelu.0.forward"})
    assert cmp.unmatched_debug == [] and cmp.pairs["Functional.relu.0.forward"] == "Functional.gelu.0.forward"
    with pytest.raises(GraphInputError, match="none of its 1 entries names a node of both sides"):
        compare(debug, bench, mapping={"Functional.nothing.0.forward": "Functional.gelu.0.forward"})


MSPROBE = os.path.join(os.path.dirname(DUMP_DIR), "msprobe_dump")  # real msprobe 1.2.1 dumps (make_msprobe_dump.py)


def test_real_msprobe_dumps_the_scaled_layer_is_the_first_divergence():
    bench = build_from_dump(os.path.join(MSPROBE, "bench"))
    assert bench.steps == [0, 1]
    # its tree: APIs under their modules, top-level API runs grouped, gradients under the last backward
    assert bench.nodes["Functional.linear.1.forward"].parent == "Module.blk.lin.Linear.forward.0"
    assert bench.nodes["Module.blk.lin.Linear.forward.0"].parent == "Module.blk.Scaled.forward.0"
    assert bench.nodes["Module.fc1.Linear.parameters_grad"].parent == "Module.fc1.Linear.backward.0"
    assert "Tensor.pow.0.forward" in bench.nodes["Apis_Between_Modules.0"].children
    assert bench.nodes["Functional.linear.0.forward"].port("input.1").shape == (8, 6)
    cmp = compare(build_from_dump(os.path.join(MSPROBE, "scaled")), bench)
    assert cmp.unmatched_debug == [] and cmp.unmatched_bench == []
    first = cmp.first
    assert (first["step"], first["node"], first["inputs_clean"]) == (1, "Module.blk.Scaled.forward.0", True)
    assert first["output_error"] == pytest.approx(1.0, rel=1e-5)
    assert cmp.precision[0].max() == 0.0  # step 0 agrees everywhere
    fuzzy = compare(build_from_dump(os.path.join(MSPROBE, "scaled")), bench, fuzzy=True)
    assert len(fuzzy.pairs) == len(cmp.pairs) and fuzzy.first["node"] == first["node"]


def test_a_trainrec_run_against_msprobe_dumps_of_the_same_training(tmp_path):
    """The same network, seed, data and optimizer recorded by trainrec and dumped by msprobe 1.2.1: with
    fuzzy matching the modules pair by name (the run's graph has the model's own call on top) and agree
    to float32 rounding; against the dump whose layer was doubled, that layer at step 1 is named."""
    run = build_from_run(open_run(record_run(tmp_path / "run", steps=2)))
    same = compare(run, build_from_dump(os.path.join(MSPROBE, "bench")), fuzzy=True)
    assert same.unmatched_debug == ["Module.Net.forward.0", "Module.Net.backward.0"]
    assert len(same.pairs) - 1 == len(run.nodes) - 3  # every other node of the run pairs
    assert same.first is None and np.nanmax(same.errors[:, :, 7]) < 1e-5
    other = compare(run, build_from_dump(os.path.join(MSPROBE, "scaled")), fuzzy=True)
    assert (other.first["step"], other.first["node"]) == (1, "Module.blk.Scaled.forward.0")
