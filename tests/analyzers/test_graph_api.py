"""API call nodes in graphs of trainrec runs recorded with the API level (``api_xy``): nesting under the
module calls they were made in, comparison with real msprobe 1.2.1 dumps (level mix), an injected
difference inside an API call found as the first divergent node, and the command line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from graph_runs import DUMP_DIR, GRAPH_CONFIG, record_run
from trainrec.analyzers.graph import build_from_dump, build_from_run, compare
from trainrec.analyzers.graph.model import API
from trainrec.recorder import record
from trainrec.replay import open_run
from trainrec.tools.cli import main

API_CONFIG = {**GRAPH_CONFIG, "api_xy": True}
MSPROBE = os.path.join(os.path.dirname(DUMP_DIR), "msprobe_dump")


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    return record_run(tmp_path_factory.mktemp("graphapi") / "run", steps=2, config=API_CONFIG)


def test_api_nodes_sit_under_the_module_call_they_were_made_in(api_run):
    g = build_from_run(open_run(api_run))
    apis = {n for n, node in g.nodes.items() if node.node_type == API and n.endswith(".forward")}
    assert apis == {"Functional.linear.0.forward", "Functional.relu.0.forward", "Functional.linear.1.forward",
                    "Tensor.mul.0.forward", "Functional.linear.2.forward"}
    parent = {n: g.nodes[n].parent for n in apis}
    assert parent == {"Functional.linear.0.forward": "Module.fc1.Linear.forward.0",
                      "Functional.relu.0.forward": "Module.act.ReLU.forward.0",
                      "Functional.linear.1.forward": "Module.blk.lin.Linear.forward.0",
                      "Tensor.mul.0.forward": "Module.blk.Scaled.forward.0",
                      "Functional.linear.2.forward": "Module.out.Linear.forward.0"}
    lin = g.nodes["Functional.linear.1.forward"]
    assert [(p.name, p.shape, p.dtype) for p in lin.ports] == [
        ("input.0", (4, 8), "torch.float32"), ("input.1", (8, 8), "torch.float32"),
        ("input.2", (8,), "torch.float32"), ("output.0", (4, 8), "torch.float32")]
    # execution order: a call right before the module call it was made in, after the calls completed before
    order = [n.name for n in g.execution_order()]
    assert order.index("Functional.linear.1.forward") + 1 == order.index("Module.blk.lin.Linear.forward.0")
    assert order.index("Module.blk.lin.Linear.forward.0") < order.index("Tensor.mul.0.forward")
    # an API call's output is its module's output: the same tensor, measured once (the same statistics)
    for s in range(len(g.steps)):
        api_out = g.port_stats(s, "Functional.linear.0.forward")["output.0"]
        assert api_out == g.port_stats(s, "Module.fc1.Linear.forward.0")["output.0"]
        assert np.isfinite(list(api_out.values())).all()
    assert g.port_stats(0, "Tensor.mul.0.forward")["input.1"]["Max"] == 1.0  # the factor, a number


def test_a_run_with_the_api_level_compares_with_msprobe_dumps_api_nodes_included(api_run):
    run = build_from_run(open_run(api_run))
    same = compare(run, build_from_dump(os.path.join(MSPROBE, "bench")), fuzzy=True)
    apis = [n for n, node in run.nodes.items() if node.node_type == API]
    # every API call of the run, forward and backward, pairs with the dump's (msprobe's Tensor.__mul__ is
    # torch's Tensor.mul), the first layer's linear backward too, which msprobe puts at the top (in a
    # collection with the optimizer's calls), not under its module's backward call
    mul = {f"Tensor.mul.0.{d}": f"Tensor.__mul__.0.{d}" for d in ("forward", "backward")}
    assert {n: same.pairs[n] for n in apis} == {n: n for n in apis} | mul
    assert same.bench.nodes["Functional.linear.0.backward"].parent.startswith("Apis_Between_Modules.")
    assert same.debug.nodes["Functional.linear.0.backward"].parent == "Module.fc1.Linear.backward.0"
    assert same.unmatched_debug == ["Module.Net.forward.0", "Module.Net.backward.0"]
    for name in [n for n in apis if n.endswith(".backward")]:  # the gradients' values: float32 rounding
        k = same.nodes.index(name)
        assert np.isfinite(same.output_err[:, k]).all() and np.nanmax(same.output_err[:, k]) < 1e-5, name
        assert np.nanmax(same.input_err[:, k]) < 1e-5, name
        other = same.pairs[name]
        assert [p.name for p in run.nodes[name].ports] == [p.name for p in same.bench.nodes[other].ports]
        for s in range(len(run.steps)):
            want = same.bench.port_stats(s, other)
            assert run.port_stats(s, name) == {p: pytest.approx(v, rel=1e-5, abs=1e-7) for p, v in want.items()}
    # the other way round (the dump as the debug side) the same pairs
    back = compare(build_from_dump(os.path.join(MSPROBE, "bench")), run, fuzzy=True)
    assert {b: d for d, b in back.pairs.items() if b in apis} == {n: same.pairs[n] for n in apis}
    assert same.first is None and np.nanmax(same.errors[:, :, 7]) < 1e-5  # float32 rounding
    # the gradients through the calls are the reference's: the same ports (names, shapes), the same values
    lin = "Functional.linear.1.backward"
    assert [(p.name, p.shape) for p in run.nodes[lin].ports] == [(p.name, p.shape) for p in same.bench.nodes[lin].ports]
    assert [p.name for p in run.nodes[lin].ports] == ["input.0", "output.0", "output.1", "output.2"]
    assert np.isfinite(same.output_err[:, same.nodes.index(lin)]).all()
    k = same.nodes.index("Functional.linear.1.forward")
    assert np.isfinite(same.output_err[:, k]).all()
    # against the dump whose blk was scaled at step 1: the multiply there got another factor (its input),
    # so the first node whose inputs agree and outputs do not is the Scaled module's call
    other = compare(run, build_from_dump(os.path.join(MSPROBE, "scaled")), fuzzy=True)
    assert (other.first["step"], other.first["node"]) == (1, "Module.blk.Scaled.forward.0")
    assert other.input_err[1, other.nodes.index("Tensor.mul.0.forward")] == pytest.approx(0.5)


def _edited_dump(path, name: str, new_name: str, new_parent: str | None = None) -> str:
    """A copy of the msprobe bench dump with ``name`` renamed (and given ``new_parent`` where not None) in
    every step's dump.json, construct.json and stack.json."""
    for step in ("step0", "step1"):
        src, dst = os.path.join(MSPROBE, "bench", step, "rank"), os.path.join(path, step, "rank")
        os.makedirs(dst)
        for fname in ("dump.json", "construct.json", "stack.json"):
            with open(os.path.join(src, fname), encoding="utf-8") as f:
                doc = json.load(f)
            table = doc["data"] if fname == "dump.json" else doc
            renamed = {new_name if k == name else k: v for k, v in table.items()}
            if fname == "construct.json" and new_parent is not None:
                renamed[new_name] = new_parent
            if fname == "dump.json":
                doc["data"] = renamed
            with open(os.path.join(dst, fname), "w", encoding="utf-8") as f:
                json.dump(renamed if fname != "dump.json" else doc, f)
    return str(path)


@pytest.mark.parametrize("label, new_name, new_parent", [
    ("other_count", "Functional.linear.3.backward", None),  # another call of the same API
    ("other_api", "Functional.gelu.0.backward", None),  # another API, same counter
    ("other_module", "Functional.linear.0.backward", "Module.act.ReLU.backward.0"),  # not above fc1's backward
])
def test_a_backward_call_placed_apart_pairs_only_with_its_own_name_and_a_parent_above(api_run, tmp_path, label,
                                                                                     new_name, new_parent):
    run = build_from_run(open_run(api_run))
    dump = build_from_dump(_edited_dump(tmp_path / label, "Functional.linear.0.backward", new_name, new_parent))
    for cmp, mine in ((compare(run, dump, fuzzy=True), "unmatched_debug"),
                      (compare(dump, run, fuzzy=True), "unmatched_bench")):
        assert "Functional.linear.0.backward" in getattr(cmp, mine)
        assert "Functional.linear.1.backward" not in getattr(cmp, mine)  # (the rest still pair)
        assert new_name in getattr(cmp, "unmatched_bench" if mine == "unmatched_debug" else "unmatched_debug")


def test_two_runs_or_two_dumps_do_not_pair_backward_calls_placed_apart(api_run):
    """The tolerance is for msprobe's placement only: a graph taken for a run keeps the exact rule."""
    run = build_from_run(open_run(api_run))
    dump = build_from_dump(os.path.join(MSPROBE, "bench"))
    dump.kind = "run"
    assert "Functional.linear.0.backward" in compare(run, dump, fuzzy=True).unmatched_debug
    run.kind = "dump"
    assert "Functional.linear.0.backward" in compare(run, dump, fuzzy=True).unmatched_debug


class GeluNet(nn.Module):
    """Linear, GELU (its ``approximate`` switched where a test injects a difference), Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)
        self.approximate = "none"

    def forward(self, x):
        return self.out(F.gelu(self.fc(x) * 3.0, approximate=self.approximate))


def _gelu_run(path, tanh_at: int | None, config: dict = API_CONFIG) -> str:
    torch.manual_seed(0)
    model = GeluNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt, config, output_dir=str(path)):
        for step in range(3):
            model.approximate = "tanh" if step == tanh_at else "none"
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return str(path)


def test_a_difference_inside_an_api_call_is_the_first_divergent_node(tmp_path):
    debug = build_from_run(open_run(_gelu_run(tmp_path / "debug", tanh_at=1)))
    bench = build_from_run(open_run(_gelu_run(tmp_path / "bench", tanh_at=None)))
    cmp = compare(debug, bench, threshold=1e-5)  # exact matching: names, ancestors, shapes
    assert cmp.unmatched_debug == [] and cmp.unmatched_bench == []
    first = cmp.first
    assert (first["step"], first["node"], first["inputs_clean"]) == (1, "Functional.gelu.0.forward", True)
    assert first["input_error"] == 0.0 and first["output_error"] > 1e-5
    assert debug.nodes["Functional.gelu.0.forward"].parent == "Module.GeluNet.forward.0"
    assert [p.name for p in debug.nodes["Functional.gelu.0.forward"].ports] == [
        "input.0", "output.0", "input.approximate"]
    # without the API level the same difference is placed at the model's own call, the call made it in
    coarse = compare(build_from_run(open_run(_gelu_run(tmp_path / "d2", tanh_at=1, config=GRAPH_CONFIG))),
                     build_from_run(open_run(_gelu_run(tmp_path / "b2", tanh_at=None, config=GRAPH_CONFIG))),
                     threshold=1e-5)
    assert (coarse.first["step"], coarse.first["node"]) == (1, "Module.GeluNet.forward.0")


def test_graph_commands_show_and_name_api_nodes(tmp_path, capsys):
    debug = _gelu_run(tmp_path / "debug", tanh_at=1)
    bench = _gelu_run(tmp_path / "bench", tanh_at=None)
    assert main(["graph", "build", debug, "-o", str(tmp_path / "b")]) == 0
    html = (tmp_path / "b" / "graph.html").read_text()
    assert "Functional.gelu.0.forward" in html and "Functional.linear.1.forward" in html
    assert main(["graph", "compare", debug, bench, "-o", str(tmp_path / "c"), "--threshold", "1e-5"]) == 0
    assert "node Functional.gelu.0.forward" in capsys.readouterr().out
    verdict = json.loads((tmp_path / "c" / "verdict.json").read_text())
    assert verdict["first_divergence"]["node"] == "Functional.gelu.0.forward"
