"""Graphs built from a recorded trainrec run and from the reference's dump directory."""

from __future__ import annotations

import json
import os

import pytest
from graph_runs import DUMP_DIR, copy_dump, record_run
from trainrec.analyzers.graph import GraphInputError, build_from_dump, build_from_run
from trainrec.analyzers.graph.model import API, API_LIST, OPS, ROOT_NAME
from trainrec.replay import open_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return record_run(tmp_path_factory.mktemp("graph") / "run", steps=3)


def test_run_graph_has_the_module_tree_calls_and_ports(run_dir):
    run = open_run(run_dir)
    g = build_from_run(run)
    assert g.steps == [0, 1, 2]
    top = "Module.Net.forward.0"
    assert g.root.children[0] == top
    assert g.nodes[top].children == ["Module.fc1.Linear.forward.0", "Module.act.ReLU.forward.0",
                                     "Module.blk.Scaled.forward.0", "Module.out.Linear.forward.0"]
    assert g.nodes["Module.blk.Scaled.forward.0"].children == ["Module.blk.lin.Linear.forward.0"]
    fc1 = g.nodes["Module.fc1.Linear.forward.0"]
    assert [p.name for p in fc1.ports] == ["input.0", "output.0", "parameters.weight", "parameters.bias"]
    # backward calls nest the same way, and each module's gradients hang under its last backward call
    assert g.nodes["Module.blk.lin.Linear.backward.0"].parent == "Module.blk.Scaled.backward.0"
    assert g.nodes["Module.fc1.Linear.parameters_grad"].parent == "Module.fc1.Linear.backward.0"
    # execution order: forward calls by completion (children first), then backward, then gradients
    order = [n.name for n in g.execution_order()]
    assert order.index("Module.blk.lin.Linear.forward.0") < order.index("Module.blk.Scaled.forward.0")
    assert order.index(top) < order.index("Module.Net.backward.0") < order.index("Module.fc1.Linear.parameters_grad")


def test_run_graph_values_are_the_recorded_rows(run_dir):
    run = open_run(run_dir)
    g = build_from_run(run)
    rows = run.to_rows(kinds=["actv", "grad_reduced"])
    for step in (0, 2):
        for kind, name, slot, port_node, port in (
            ("actv", "blk.lin", "output", "Module.blk.lin.Linear.forward.0", "output.0"),
            ("actv", "fc1", "input", "Module.fc1.Linear.forward.0", "input.0"),
            ("grad_reduced", "out.weight", "", "Module.out.Linear.parameters_grad", "parameters_grad.weight"),
        ):
            for op in ("max", "norm"):
                sel = ((rows["step"] == step) & (rows["kind"] == kind) & (rows["name"] == name)
                       & (rows["slot"] == slot) & (rows["op"] == op))
                want = rows["value"][sel]
                assert len(want) == 1
                got = g.values[g.steps.index(step), g.port_index[(port_node, port)], OPS.index(op.title())]
                assert got == pytest.approx(want[0], rel=1e-6)


def test_a_run_without_xy_statistics_says_what_to_record(tmp_path):
    d = record_run(tmp_path / "noxy", steps=1, config={"wg_distribution": True, "ops": ["norm"]})
    with pytest.raises(GraphInputError, match="no module input/output statistics .* xy_distribution: true"):
        build_from_run(open_run(d))


def test_dump_graph_tree_groups_and_steps():
    g = build_from_dump(DUMP_DIR)
    assert g.steps == [0, 1]
    assert g.root.children == ["Module.fc1.Linear.forward.0", "Functional.relu.0.forward",
                               "Module.fc2.Linear.forward.0", "Apis_Between_Modules.0",
                               "Module.fc2.Linear.backward.0", "Module.fc1.Linear.backward.0"]
    group = g.nodes["Apis_Between_Modules.0"]
    assert group.node_type == API_LIST and group.children == ["Tensor.pow.0.forward", "Torch.mean.0.forward"]
    lin = g.nodes["Functional.linear.0.forward"]
    assert lin.node_type == API and lin.parent == "Module.fc1.Linear.forward.0"
    assert [p.name for p in lin.ports] == ["input.0", "input.1", "input.2", "output.0"]
    assert lin.port("input.1").shape == (16, 8) and lin.port("input.1").dtype == "torch.float32"
    assert g.nodes["Module.fc2.Linear.parameters_grad"].parent == "Module.fc2.Linear.backward.0"
    assert g.nodes["Functional.relu.0.forward"].stack[0].startswith("File train.py")
    # values: straight from dump.json, per step
    with open(os.path.join(DUMP_DIR, "step1", "rank", "dump.json")) as f:
        entry = json.load(f)["data"]["Module.fc1.Linear.forward.0"]["output"][0]
    got = g.values[1, g.port_index[("Module.fc1.Linear.forward.0", "output.0")]]
    assert got.tolist() == [entry[op] for op in OPS]
    # a non-tensor argument's value stands for its statistics
    pow_exp = g.values[0, g.port_index[("Tensor.pow.0.forward", "input.1")]]
    assert pow_exp.tolist() == [2.0, 2.0, 2.0, 2.0]
    assert ROOT_NAME not in g.port_keys


def test_dump_step_and_rank_directories_are_found(tmp_path):
    d = copy_dump(tmp_path)
    one = build_from_dump(os.path.join(d, "step1", "rank"))
    assert one.steps == [1] and len(one.nodes) == len(build_from_dump(d).nodes)
    os.rename(os.path.join(d, "step0", "rank"), os.path.join(d, "step0", "rank3"))
    with pytest.raises(GraphInputError, match=r"no rank0 directory \(ranks there: \[3\]\)"):
        build_from_dump(d, rank=0)


@pytest.mark.parametrize("missing", ["construct.json", "stack.json", "dump.json"])
def test_a_dump_missing_a_file_names_it(tmp_path, missing):
    d = copy_dump(tmp_path)
    os.remove(os.path.join(d, "step1", "rank", missing))
    with pytest.raises(GraphInputError, match=f"step1/rank: missing {missing}.*PrecisionDebugger"):
        build_from_dump(d)


def test_a_damaged_dump_json_is_named(tmp_path):
    d = copy_dump(tmp_path)
    with open(os.path.join(d, "step0", "rank", "dump.json"), "w") as f:
        f.write('{"data": ')
    with pytest.raises(GraphInputError, match="dump.json: cannot be read as JSON"):
        build_from_dump(d)


def test_micro_steps_and_a_call_outside_the_model_forward(tmp_path):
    """Two micro steps per step: each module's calls are numbered through the step, each nests under
    the model call of its own micro step; a call of fc1 made after the model's forward stays on top."""
    import torch
    from graph_runs import GRAPH_CONFIG, Net
    from trainrec.recorder import record

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt, GRAPH_CONFIG, output_dir=str(tmp_path / "acc")):
        for _ in range(2):
            for _ in range(2):
                model(torch.randn(4, 6)).sum().backward()
            model.fc1(torch.randn(2, 6))  # e.g. an evaluation probe outside the model's forward
            opt.step()
            opt.zero_grad()
    g = build_from_run(open_run(str(tmp_path / "acc")))
    assert g.root.children == ["Module.Net.forward.0", "Module.Net.forward.1", "Module.fc1.Linear.forward.2",
                               "Module.Net.backward.0", "Module.Net.backward.1"]
    assert "Module.fc1.Linear.forward.0" in g.nodes["Module.Net.forward.0"].children
    assert "Module.fc1.Linear.forward.1" in g.nodes["Module.Net.forward.1"].children
    assert g.nodes["Module.fc1.Linear.forward.2"].parent == ROOT_NAME
    assert g.nodes["Module.blk.lin.Linear.backward.1"].parent == "Module.blk.Scaled.backward.1"
