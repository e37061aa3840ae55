"""Backward API nodes (``...backward``) in graphs of runs recorded with the API level: where they sit,
their gradients against torch's own, and a difference only in one call's backward found there."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from graph_runs import GRAPH_CONFIG, Net, record_run
from trainrec.analyzers.graph import build_from_run, compare
from trainrec.analyzers.graph.model import API
from trainrec.recorder import record
from trainrec.replay import open_run
from trainrec.tools.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "replay"))
from hostile_logs import F, frames, rewrite  # noqa: E402

API_CONFIG = {**GRAPH_CONFIG, "api_xy": True}


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    return record_run(tmp_path_factory.mktemp("graphbwd") / "run", steps=2, config=API_CONFIG)


def _stats(t: torch.Tensor) -> dict:
    t = t.detach()
    return {"Max": t.max().item(), "Min": t.min().item(), "Mean": t.mean().item(), "Norm": t.norm().item()}


def test_backward_nodes_sit_under_module_backward_calls_with_torchs_gradients(api_run):
    g = build_from_run(open_run(api_run))
    back = {n: g.nodes[n].parent for n, node in g.nodes.items() if node.node_type == API and n.endswith(".backward")}
    assert back == {"Functional.linear.2.backward": "Module.out.Linear.backward.0",
                    "Tensor.mul.0.backward": "Module.blk.Scaled.backward.0",
                    "Functional.linear.1.backward": "Module.blk.lin.Linear.backward.0",
                    "Functional.relu.0.backward": "Module.act.ReLU.backward.0",
                    "Functional.linear.0.backward": "Module.fc1.Linear.backward.0"}
    # execution order: after every forward node, each right after its module's backward call
    order = [n.name for n in g.execution_order()]
    assert max(order.index(n) for n in g.nodes if n.endswith(".forward")) < min(order.index(n) for n in back)
    for name, parent in back.items():
        assert order.index(name) > order.index(parent)
    assert order.index("Functional.linear.1.backward") < order.index("Functional.relu.0.backward")
    # step 0 again in torch, each intermediate's gradient kept: the graph's statistics are those
    torch.manual_seed(0)
    m = Net()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    a = m.fc1(x)
    r = m.act(a)
    lin = m.blk.lin(r)
    y = m.out(lin * m.blk.factor)
    for t in (a, r, lin, y):
        t.retain_grad()
    y.pow(2).mean().backward()
    want = {"Functional.linear.2.backward": {"input.0": y.grad, "output.0": m.out.bias.grad,
                                             "output.2": m.out.weight.grad.T},
            "Tensor.mul.0.backward": {"input.0": None, "output.0": lin.grad},
            "Functional.linear.1.backward": {"input.0": lin.grad, "output.0": m.blk.lin.bias.grad,
                                             "output.1": r.grad, "output.2": m.blk.lin.weight.grad.T},
            "Functional.relu.0.backward": {"input.0": r.grad, "output.0": a.grad},
            "Functional.linear.0.backward": {"input.0": a.grad, "output.0": m.fc1.bias.grad,
                                             "output.2": m.fc1.weight.grad.T}}
    s0 = g.steps.index(0)
    for name, ports in want.items():
        got = g.port_stats(s0, name)
        for port, grad in ports.items():
            if grad is not None:
                assert got[port] == pytest.approx(_stats(grad), rel=1e-5, abs=1e-7), (name, port)
        node = g.nodes[name]
        assert node.node_type == API and all(p.dtype == "torch.float32" and p.shape for p in node.ports)
    # the multiply's gradient in is the block's output gradient (one tensor, measured once)
    assert g.port_stats(s0, "Tensor.mul.0.backward")["input.0"] == g.port_stats(s0, "Module.blk.Scaled.backward.0")["input.0"]


GRAD_FACTOR = {"value": 1.0}  # what the test op's backward multiplies the gradient by (1 but where injected)


@torch.library.custom_op("trainrec_test::pass_through", mutates_args=())
def pass_through(x: torch.Tensor) -> torch.Tensor:
    """The identity in forward; in backward the gradient times GRAD_FACTOR."""
    return x.clone()


@pass_through.register_fake
def _(x):
    return torch.empty_like(x)


pass_through.register_autograd(lambda ctx, grad: grad * GRAD_FACTOR["value"])


class PassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(torch.ops.trainrec_test.pass_through(self.fc(x))))


def _pass_run(path, doubled_at: int | None) -> str:
    torch.manual_seed(0)
    model = PassNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (the weights stay: step 2 is step 0 again)
    with record(model, opt, API_CONFIG, output_dir=str(path)):
        for step in range(3):
            GRAD_FACTOR["value"] = 2.0 if step == doubled_at else 1.0
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    GRAD_FACTOR["value"] = 1.0
    return str(path)


def test_a_difference_only_in_one_calls_backward_is_the_first_divergent_node(tmp_path, capsys):
    debug = _pass_run(tmp_path / "debug", doubled_at=1)
    bench = _pass_run(tmp_path / "bench", doubled_at=None)
    cmp = compare(build_from_run(open_run(debug)), build_from_run(open_run(bench)), threshold=1e-5)
    assert cmp.unmatched_debug == [] and cmp.unmatched_bench == []
    op = next(n for n in cmp.debug.nodes if n.endswith("pass_through.0.backward"))
    first = cmp.first
    assert (first["step"], first["node"], first["inputs_clean"]) == (1, op, True)
    assert first["input_error"] == 0.0 and first["output_error"] == pytest.approx(1.0)
    assert cmp.debug.nodes[op].parent == "Module.PassNet.backward.0"
    k = cmp.nodes.index(op)
    assert np.nanmax(cmp.output_err[[0, 2], k]) == 0.0  # only step 1's backward differs
    forward = [i for i, n in enumerate(cmp.nodes) if n.endswith(".forward") or ".forward." in n]
    assert np.nanmax(cmp.output_err[:, forward]) == 0.0  # and no forward node at all
    assert main(["graph", "compare", debug, bench, "-o", str(tmp_path / "c"), "--threshold", "1e-5"]) == 0
    assert f"node {op}" in capsys.readouterr().out
    verdict = json.loads((tmp_path / "c" / "verdict.json").read_text())
    assert (verdict["first_divergence"]["node"], verdict["first_divergence"]["step"]) == (op, 1)
    assert op in (tmp_path / "c" / "compare.html").read_text(encoding="utf-8")


_DIRECTION = 17  # ApiCallsRecorded's last field, after the envelope: its index among the fields


@pytest.mark.parametrize("label, change, what", [
    ("direction_7", lambda w: w.__setitem__(F + _DIRECTION, 7), "direction 7 is neither forward (0) nor backward (1)"),
    ("direction_str", lambda w: w.__setitem__(F + _DIRECTION, "back"), "field 'direction' has type str, expected int"),
])
def test_a_hostile_backward_record_is_damage_that_the_graph_skips(api_run, tmp_path, capsys, label, change, what):
    out = str(tmp_path / label)
    shutil.copytree(api_run, out)
    offset = _rewrite_backward(out, change)
    assert main(["check", out]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if what in ln)
    assert line.startswith("damage") and f" {offset} " in line
    assert main(["graph", "build", out, "-o", str(tmp_path / "g")]) == 0  # step 1's backward record is still there
    assert "Functional.linear.0.backward" in (tmp_path / "g" / "graph.html").read_text(encoding="utf-8")


def test_a_backward_record_cut_short_of_its_direction_is_a_clear_error(api_run, tmp_path, capsys):
    """Without its last field a record reads as an older one, of forward calls: its backward names say otherwise."""
    out = str(tmp_path / "cut")
    shutil.copytree(api_run, out)
    _rewrite_backward(out, lambda w: w.__delitem__(slice(F + _DIRECTION, None)))  # (it and the fields after it)
    assert main(["graph", "build", out, "-o", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert "trainrec graph: error:" in err and "Traceback" not in err
    assert "API call 'Functional.linear.2.backward' in a record of forward calls" in err and "damaged" in err
    assert f"{out} (rank 0, step 0, record " in err


def _rewrite_backward(out: str, change, direction: int = 1) -> int:
    """Apply ``change`` to the wire list of the run's first API record of ``direction`` (backward by
    default); that frame's offset."""
    (log,) = glob.glob(os.path.join(out, "*", "*.trl"))
    aps = [w for w in frames(log)[1] if w[0] == "ap"]
    which = next(i for i, w in enumerate(aps) if w[F + _DIRECTION] == direction)
    return rewrite(log, "ap", change, which)


def test_a_forward_record_whose_module_shapes_do_not_add_up_is_damage(api_run, tmp_path, capsys):
    out = str(tmp_path / "dims")
    shutil.copytree(api_run, out)
    offset = _rewrite_backward(out, lambda w: w.__setitem__(F + _DIRECTION + 5, b""), direction=0)  # module_dims
    assert main(["check", out]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "module_dims has 0 entries for" in ln)
    assert line.startswith("damage") and f" {offset} " in line


def test_module_calls_get_their_shapes_and_dtypes_where_the_api_level_recorded(api_run, tmp_path):
    g = build_from_run(open_run(api_run))
    want = {"Module.Net.forward.0": ((4, 6), (4, 3)), "Module.fc1.Linear.forward.0": ((4, 6), (4, 8)),
            "Module.act.ReLU.forward.0": ((4, 8), (4, 8)), "Module.blk.Scaled.forward.0": ((4, 8), (4, 8)),
            "Module.blk.lin.Linear.forward.0": ((4, 8), (4, 8)), "Module.out.Linear.forward.0": ((4, 8), (4, 3))}
    for name, (shape_in, shape_out) in want.items():
        ports = {p.name: p for p in g.nodes[name].ports}
        assert (ports["input.0"].shape, ports["output.0"].shape) == (shape_in, shape_out), name
        assert ports["input.0"].dtype == ports["output.0"].dtype == "torch.float32"
    # without the API level, none (as before); exact matching then ignores shapes
    plain = build_from_run(open_run(record_run(tmp_path / "plain", steps=1)))
    assert plain.nodes["Module.fc1.Linear.forward.0"].port("input.0").shape is None


def _batch5() -> Net:
    """Net given 5 rows instead of 4 (its module calls' shapes differ, their names do not)."""
    model = Net()
    model.register_forward_pre_hook(lambda m, args: (torch.cat([args[0], args[0][:1]]),))
    return model


def test_exact_matching_tells_module_calls_of_other_shapes_apart(api_run, tmp_path):
    torch.manual_seed(0)
    other = build_from_run(open_run(record_run(tmp_path / "b5", steps=2, config=API_CONFIG, model=_batch5())))
    cmp = compare(build_from_run(open_run(api_run)), other)
    assert "Module.fc1.Linear.forward.0" in cmp.unmatched_debug and "Module.out.Linear.forward.0" in cmp.unmatched_debug
    # the same two models recorded without the API level have no shapes: their module calls pair
    torch.manual_seed(0)
    plain = compare(build_from_run(open_run(record_run(tmp_path / "p4", steps=2))),
                    build_from_run(open_run(record_run(tmp_path / "p5", steps=2, model=_batch5()))))
    assert "Module.fc1.Linear.forward.0" in plain.pairs
