"""The API level's backward (``api_xy``): the gradients through each recorded call, taken where the
reference takes them (the autograd node that made the call's first output), equal to torch's own."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_api_calls import CONFIG, MODULES, Block, Net, _calls, _stats, _train, _train_micro_steps
from torch.utils.checkpoint import checkpoint
from trainrec.analyzers.graph import build_from_run
from trainrec.recorder import record
from trainrec.replay import open_run
from trainrec.schema.events import DIR_BACKWARD

API = {**CONFIG, "api_xy": True}


def _torch_step0(model: Net) -> dict:
    """Step 0 of ``_train`` on ``model`` without the recorder, every intermediate's gradient kept."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    a = model.fc(x)
    lin = model.blk.lin(a)
    h = F.relu(lin)
    ht = h.transpose(0, 1)
    mm = torch.matmul(h, ht)
    y = mm * 0.5
    s = y.sum(dim=1)
    for t in (a, lin, h, ht, mm, y, s):
        t.retain_grad()
    s.pow(2).mean().backward()
    return dict(x=x, a=a, lin=lin, h=h, ht=ht, mm=mm, y=y, s=s)


def test_gradients_through_each_call_are_torchs_own(tmp_path):
    torch.manual_seed(0)
    model = Net()
    start = copy.deepcopy(model)
    path, _ = _train(tmp_path / "out", API, model=model)
    back = [c for c in _calls(path, DIR_BACKWARD) if c["step"] == 0]
    # every forward call has its backward, in the order backward ran them (the reverse of the forward)
    assert [c["name"] for c in back] == ["Tensor.sum.0.backward", "Tensor.mul.0.backward", "Torch.matmul.0.backward",
                                        "Tensor.transpose.0.backward", "Functional.relu.0.backward",
                                        "Functional.linear.1.backward", "Functional.linear.0.backward"]
    assert {c["name"]: c["module"] for c in back} == {n.replace(".forward", ".backward"): m for n, m in MODULES.items()}
    fwd = [c for c in _calls(path) if c["step"] == 0]
    pos = [c["position"] for c in back]
    assert pos == sorted(pos) and pos[0] > max(c["position"] for c in fwd)  # hook firings went on in backward
    t = _torch_step0(start)
    g = {k: v.grad for k, v in t.items() if k != "x"}
    want = {  # the reference's ports: input.i what the call's node took in, output.i what it handed on
        "Tensor.sum.0.backward": {"input.0": g["s"], "output.0": g["y"]},
        "Tensor.mul.0.backward": {"input.0": g["y"], "output.0": g["mm"]},
        "Torch.matmul.0.backward": {"input.0": g["mm"], "output.0": g["mm"] @ t["ht"].detach().T, "output.1": g["ht"]},
        "Tensor.transpose.0.backward": {"input.0": g["ht"], "output.0": g["ht"].T},
        "Functional.relu.0.backward": {"input.0": g["h"], "output.0": g["lin"]},
        "Functional.linear.1.backward": {"input.0": g["lin"], "output.0": start.blk.lin.bias.grad,
                                         "output.1": g["a"], "output.2": start.blk.lin.weight.grad.T},
        # the input x needs no gradient: none computed, no port (the reference's null)
        "Functional.linear.0.backward": {"input.0": g["a"], "output.0": start.fc.bias.grad,
                                         "output.2": start.fc.weight.grad.T},
    }
    for c in back:
        assert list(c["ports"]) == list(want[c["name"]]), c["name"]
        for port, grad in want[c["name"]].items():
            got = c["ports"][port]
            assert got["stats"] == pytest.approx(_stats(grad), rel=1e-5, abs=1e-7), (c["name"], port)
            assert got["shape"] == tuple(grad.shape) and got["dtype"] == "torch.float32" and got["type"] == "torch.Tensor"
            assert got["requires_grad"] == 0
    assert {c["step"] for c in _calls(path, DIR_BACKWARD)} == {0, 1}


def test_off_with_backward_false_or_forward_only_and_training_unchanged(tmp_path):
    path_on, losses_on = _train(tmp_path / "on", API)
    path_off, losses_off = _train(tmp_path / "off", {**CONFIG, "api_xy": {"backward": False}})
    path_fo, _ = _train(tmp_path / "fo", {**API, "forward_only": True})
    path_none, losses_none = _train(tmp_path / "none", CONFIG)
    assert _calls(path_on, DIR_BACKWARD) and _calls(path_off, DIR_BACKWARD) == [] and _calls(path_fo, DIR_BACKWARD) == []
    assert [c["name"] for c in _calls(path_off)] == [c["name"] for c in _calls(path_on)]  # the forward as before
    assert losses_on == losses_off == losses_none  # the hooks observe: training is the same


def test_micro_steps_each_their_own_record_and_calls_numbered_on(tmp_path):
    path = _train_micro_steps(tmp_path / "out", API)
    back = [c for c in _calls(path, DIR_BACKWARD) if c["step"] == 1]
    lin = [(c["name"], c["micro"], c["module"]) for c in back if c["name"].startswith("Functional.linear")]
    assert lin == [("Functional.linear.1.backward", 0, "blk.lin"), ("Functional.linear.0.backward", 0, "fc"),
                   ("Functional.linear.3.backward", 1, "blk.lin"), ("Functional.linear.2.backward", 1, "fc")]
    # in the graph, each under its own micro step's backward call of its module
    g = build_from_run(open_run(path))
    assert {n: g.nodes[n].parent for n in ("Functional.linear.0.backward", "Functional.linear.2.backward",
                                          "Functional.linear.3.backward", "Tensor.sum.1.backward")} == {
        "Functional.linear.0.backward": "Module.fc.Linear.backward.0",
        "Functional.linear.2.backward": "Module.fc.Linear.backward.1",
        "Functional.linear.3.backward": "Module.blk.lin.Linear.backward.1",
        "Tensor.sum.1.backward": "Module.Net.backward.1"}


def test_a_graph_run_twice_records_its_first_backward_and_a_later_step_none_of_an_old_graph(tmp_path):
    """retain_graph: the second backward through the same calls records nothing more; a graph kept from
    step 0 and run backward in step 1 records nothing into step 1 (its calls were step 0's)."""
    torch.manual_seed(0)
    model = Net()
    with record(model, None, API, output_dir=str(tmp_path / "out")) as rec:  # (steps by hand, weights kept)
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
        rec.step()
        loss.backward()  # step 1: step 0's graph
        model(torch.randn(4, 6)).pow(2).mean().backward()
        rec.step()
    back = _calls(os.path.dirname(os.path.dirname(rec.log_path)), DIR_BACKWARD)
    for step in (0, 1):
        names = [c["name"] for c in back if c["step"] == step]
        assert len(names) == len(set(names)) == 7


class Checkpointed(nn.Module):
    """Net with its block under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.blk = Block()
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.blk, self.fc(x), use_reentrant=self.reentrant).sum(dim=1)


@pytest.mark.parametrize("reentrant, inside", [(False, True), (True, False)])
def test_activation_checkpointing(tmp_path, reentrant, inside):
    """Non-reentrant: the training forward's graph runs backward, every call has its gradients.
    Reentrant: the segment's first forward runs without gradients and its recomputation in backward
    is not recorded, so the calls inside it have none (a limit, documented)."""
    torch.manual_seed(0)
    path, _ = _train(tmp_path / "out", API, steps=1, model=Checkpointed(reentrant))
    back = [c["name"] for c in _calls(path, DIR_BACKWARD)]
    assert len(_calls(path)) == 7
    outside = ["Tensor.sum.0.backward", "Functional.linear.0.backward"]
    assert back == (["Tensor.sum.0.backward", "Tensor.mul.0.backward", "Torch.matmul.0.backward",
                     "Tensor.transpose.0.backward", "Functional.relu.0.backward", "Functional.linear.1.backward",
                     "Functional.linear.0.backward"] if inside else outside)
