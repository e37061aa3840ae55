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
    # torch's Tensor.mul) but one: msprobe puts the first layer's linear backward at the top, not under
    # its module's backward call
    mul = {f"Tensor.mul.0.{d}": f"Tensor.__mul__.0.{d}" for d in ("forward", "backward")}
    paired = [n for n in apis if n != "Functional.linear.0.backward"]
    assert {n: same.pairs[n] for n in paired} == {n: n for n in paired} | mul
    assert same.unmatched_debug == ["Module.Net.forward.0", "Module.Net.backward.0", "Functional.linear.0.backward"]
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
