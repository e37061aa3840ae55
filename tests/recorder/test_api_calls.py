"""The recorder's API level (``api_xy``): torch functions and tensor methods called inside the model's
forward, recorded through a TorchFunctionMode, read back from the log."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from trainrec.analyzers.graph import build_from_run
from trainrec.recorder import record
from trainrec.replay import open_run
from trainrec.replay.names import NameResolver
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import DIR_FORWARD, ApiCallsRecorded, unpack_array

CONFIG = {"xy_distribution": True, "all_xy": True, "ops": ["min", "max", "mean", "norm"]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = F.relu(self.lin(x))
        return torch.matmul(h, h.transpose(0, 1)) * 0.5  # (the line a stack names)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.blk = Block()

    def forward(self, x):
        return self.blk(self.fc(x)).sum(dim=1)


EXPECTED = ["Functional.linear.0.forward", "Functional.linear.1.forward", "Functional.relu.0.forward",
            "Tensor.transpose.0.forward", "Torch.matmul.0.forward", "Tensor.mul.0.forward", "Tensor.sum.0.forward"]
MODULES = {"Functional.linear.0.forward": "fc", "Functional.linear.1.forward": "blk.lin",
           "Functional.relu.0.forward": "blk", "Tensor.transpose.0.forward": "blk", "Torch.matmul.0.forward": "blk",
           "Tensor.mul.0.forward": "blk", "Tensor.sum.0.forward": ""}


def _train(out, config: dict, steps: int = 2, model: nn.Module | None = None, probe=None) -> tuple[str, list]:
    torch.manual_seed(0)
    model = model or Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with record(model, opt, config, output_dir=str(out)) as rec:
        for step in range(steps):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            if probe is not None:
                probe(model, x)
            loss = model(x).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    return os.path.dirname(os.path.dirname(rec.log_path)), losses


def _train_micro_steps(out, config: dict) -> str:
    """Two steps of two micro steps each (grad_acc_steps=2) recorded into ``out``; the run's directory."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt, config, output_dir=str(out), grad_acc_steps=2) as rec:
        for step in range(2):
            for micro in range(2):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + micro))
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return os.path.dirname(os.path.dirname(rec.log_path))


def _calls(path, direction: int = DIR_FORWARD) -> list[dict]:
    """Every recorded API call of ``direction`` (forward calls, or the gradients through them), decoded:
    step, micro step, name, module, position, ports, stack."""
    res, out = NameResolver(), []
    for ev in open_run(path).events():
        res.feed(ev)
        if not isinstance(ev, ApiCallsRecorded) or ev.direction != direction:
            continue
        assert ev.check() is None
        name = lambda i, r=ev.rank: res.name(r, i)  # noqa: E731
        vals = unpack_array("f", ev.values).tolist()
        dims = unpack_array("q", ev.dims).tolist()
        depths = unpack_array("H", ev.stack_depths) if ev.stack_depths else None
        frames = [name(i) for i in unpack_array("I", ev.stack_frames)]
        k = d = f = 0
        for c, (nid, mid, pos, n) in enumerate(zip(unpack_array("I", ev.name_ids), unpack_array("I", ev.module_ids),
                                                  unpack_array("I", ev.positions), unpack_array("H", ev.port_counts),
                                                  strict=True)):
            ports = {}
            for j in range(k, k + n):
                nd = ev.ndims[j]
                shape = None if nd == 255 else tuple(dims[d:d + nd])
                d += 0 if nd == 255 else nd
                ports[name(unpack_array("I", ev.port_ids)[j])] = {
                    "type": name(unpack_array("I", ev.type_ids)[j]), "dtype": name(unpack_array("I", ev.dtype_ids)[j]),
                    "shape": shape, "requires_grad": ev.requires_grad[j],
                    "stats": dict(zip(ev.ops, vals[j * len(ev.ops):(j + 1) * len(ev.ops)], strict=True))}
            k += n
            stack = ()
            if depths is not None:
                stack, f = tuple(frames[f:f + depths[c]]), f + depths[c]
            out.append({"step": ev.step, "micro": ev.micro_step, "name": name(nid),
                        "module": None if mid == 0xFFFFFFFF else name(mid), "position": pos, "ports": ports,
                        "stack": stack})
    return out


def _stats(t: torch.Tensor) -> dict:
    t = t.detach().float()
    return {"min": t.min().item(), "max": t.max().item(), "mean": t.mean().item(), "norm": t.norm().item()}


def test_calls_are_named_counted_nested_and_measured_as_torch_measures_them(tmp_path):
    torch.manual_seed(0)
    model = Net()
    start = copy.deepcopy(model)  # the weights of step 0's forward
    path, _ = _train(tmp_path / "out", {**CONFIG, "api_xy": True}, model=model)
    calls = _calls(path)
    for step in (0, 1):
        names = [c["name"] for c in calls if c["step"] == step]
        assert sorted(names) == sorted(EXPECTED)  # nothing of the recorder's own (its statistics, its hooks)
        assert {c["name"]: c["module"] for c in calls if c["step"] == step} == MODULES
    # execution order: the hook position grows along the forward (fc's firing comes before blk's calls)
    first = [c for c in calls if c["step"] == 0]
    assert [c["name"] for c in first] == ["Functional.linear.0.forward", "Functional.linear.1.forward",
                                          "Functional.relu.0.forward", "Tensor.transpose.0.forward",
                                          "Torch.matmul.0.forward", "Tensor.mul.0.forward", "Tensor.sum.0.forward"]
    pos = [c["position"] for c in first]
    assert pos == sorted(pos) and pos[1] > pos[0] and pos[-1] > pos[-2]
    by = {c["name"]: c for c in first}
    # the statistics are torch's own on the same tensors
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = start.fc(x)
        h = F.relu(start.blk.lin(a))
        mm = torch.matmul(h, h.transpose(0, 1))
    lin0 = by["Functional.linear.0.forward"]["ports"]
    assert list(lin0) == ["input.0", "input.1", "input.2", "output.0"]
    for port, t in (("input.0", x), ("input.1", start.fc.weight), ("input.2", start.fc.bias), ("output.0", a)):
        assert lin0[port]["stats"] == pytest.approx(_stats(t), rel=1e-6, abs=1e-7)
        assert lin0[port]["shape"] == tuple(t.shape) and lin0[port]["dtype"] == "torch.float32"
    assert lin0["input.1"]["requires_grad"] == 1 and lin0["input.0"]["requires_grad"] == 0
    mat = by["Torch.matmul.0.forward"]["ports"]
    assert mat["output.0"]["stats"] == pytest.approx(_stats(mm), rel=1e-6, abs=1e-7)
    assert mat["input.1"]["shape"] == (8, 4)
    # numbers and keyword arguments: their values, after the outputs (the reference's order)
    mul = by["Tensor.mul.0.forward"]["ports"]
    assert mul["input.1"]["type"] == "float" and mul["input.1"]["stats"]["max"] == 0.5
    assert mul["output.0"]["stats"] == pytest.approx(_stats(mm * 0.5), rel=1e-6, abs=1e-7)
    relu = by["Functional.relu.0.forward"]["ports"]
    assert list(relu) == ["input.0", "output.0", "input.inplace"] and relu["input.inplace"]["type"] == "bool"
    assert list(by["Tensor.sum.0.forward"]["ports"]) == ["input.0", "output.0", "input.dim"]
    assert all(c["stack"] == () for c in calls)  # no stack unless asked


def test_off_by_default_no_records_no_mode_and_training_unchanged(tmp_path):
    seen = []

    def probe(model, x):  # a forward hook of the test's: how many TorchFunctionModes are active in the forward
        h = model.blk.lin.register_forward_hook(lambda m, a, o: seen.append(torch._C._len_torch_function_stack()))
        model._probe = h

    def run(config, name):
        seen.clear()
        path, losses = _train(tmp_path / name, config, probe=probe)
        return path, losses, list(seen)

    path, losses_off, seen_off = run(CONFIG, "off")
    assert _calls(path) == [] and seen_off and set(seen_off) == {0}
    path, losses_on, seen_on = run({**CONFIG, "api_xy": True}, "on")
    assert _calls(path) and set(seen_on) == {1}
    assert torch._C._len_torch_function_stack() == 0  # popped after every forward
    assert losses_on == losses_off  # the level observes: training is the same
    path, _, seen_disabled = run({**CONFIG, "api_xy": {"enable": False, "stack": True}}, "disabled")
    assert _calls(path) == [] and set(seen_disabled) == {0}


def test_the_stack_where_asked(tmp_path):
    path, _ = _train(tmp_path / "out", {**CONFIG, "api_xy": {"stack": True}})
    calls = _calls(path)
    mat = next(c for c in calls if c["name"] == "Torch.matmul.0.forward")
    assert mat["stack"][0].startswith(f"File {os.path.abspath(__file__)}, line ")
    assert "in forward" in mat["stack"][0] and "torch.matmul(h, h.transpose(0, 1))" in mat["stack"][0]
    assert any("in _train" in frame for frame in mat["stack"])
    assert not any("trainrec" in frame and "recorder" in frame for frame in mat["stack"])
    assert all(c["stack"] for c in calls)
    # the same lines each step (interned once), and the graph's node carries them
    again = next(c for c in calls if c["name"] == "Torch.matmul.0.forward" and c["step"] == 1)
    assert again["stack"] == mat["stack"]
    assert build_from_run(open_run(path)).nodes["Torch.matmul.0.forward"].stack == list(mat["stack"])


def test_uncollected_steps_and_eval_forwards_record_nothing(tmp_path):
    torch.manual_seed(0)
    model = Net()
    path, _ = _train(tmp_path / "out", {**CONFIG, "api_xy": True, "start_step": 1}, steps=3, model=model)
    assert {c["step"] for c in _calls(path)} == {1, 2}
    model.eval()
    with record(model, None, {**CONFIG, "api_xy": True}, output_dir=str(tmp_path / "eval")) as rec:
        model(torch.randn(4, 6))
        rec.step()
    assert _calls(os.path.dirname(os.path.dirname(rec.log_path))) == []


def test_a_forward_that_raises_leaves_no_mode_behind(tmp_path):
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            self.lin(x)
            raise ValueError("bad batch")

    model = Bad()
    with record(model, None, {**CONFIG, "api_xy": True}, output_dir=str(tmp_path / "out")):
        with pytest.raises(ValueError, match="bad batch"):
            model(torch.randn(2, 3))
        assert torch._C._len_torch_function_stack() == 0
        torch.matmul(torch.ones(2, 2), torch.ones(2, 2))  # outside the forward: nothing recorded


@pytest.mark.parametrize("extra", [{"xy_distribution": False}, {"backward_only": True}])
def test_without_module_forward_calls_it_warns_and_records_nothing(tmp_path, caplog, extra):
    path, _ = _train(tmp_path / "out", {**CONFIG, **extra, "wg_distribution": True, "api_xy": True}, steps=1)
    assert "api_xy records API calls inside the module forward calls" in caplog.text
    assert _calls(path) == []


def test_reload_xy_off_stops_it(tmp_path):
    from trainrec.recorder import TrainerMon

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({**CONFIG, "api_xy": True}, params_have_main_grad=False, output_dir=str(tmp_path / "out"))
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for step in range(3):
        if step == 1:
            mon.reload_xy(False)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert {c["step"] for c in _calls(os.path.dirname(os.path.dirname(mon.log_path)))} == {0}


@pytest.mark.parametrize("api_xy, extra, match", [
    ({"stack": 1}, {}, "api_xy.stack"),
    ({"depth": True}, {}, "unknown key 'depth'"),
    ("yes", {}, "expected true, false or an object"),
    ({"backward": "no"}, {}, "api_xy.backward"),
])
def test_bad_api_xy_config_is_refused(tmp_path, api_xy, extra, match):
    with pytest.raises(ConfigError, match=match):
        record(Net(), None, {**CONFIG, **extra, "api_xy": api_xy}, output_dir=str(tmp_path / "out"))


def test_micro_steps_count_on_and_nest_under_their_own_module_calls(tmp_path):
    """Two micro steps per step: a name's counter goes on through the step (the reference counts per
    step), each pass is its own record with its micro step, and the graph puts each call under the
    module call of its own micro step."""
    path = _train_micro_steps(tmp_path / "out", {**CONFIG, "api_xy": True})
    calls = [c for c in _calls(path) if c["step"] == 1]
    lin = [(c["name"], c["micro"], c["module"]) for c in calls if c["name"].startswith("Functional.linear")]
    assert lin == [("Functional.linear.0.forward", 0, "fc"), ("Functional.linear.1.forward", 0, "blk.lin"),
                   ("Functional.linear.2.forward", 1, "fc"), ("Functional.linear.3.forward", 1, "blk.lin")]
    g = build_from_run(open_run(path))
    assert g.nodes["Functional.linear.0.forward"].parent == "Module.fc.Linear.forward.0"
    assert g.nodes["Functional.linear.2.forward"].parent == "Module.fc.Linear.forward.1"
    assert g.nodes["Functional.linear.3.forward"].parent == "Module.blk.lin.Linear.forward.1"
    assert g.nodes["Tensor.sum.1.forward"].parent == "Module.Net.forward.1"
    # the second micro step's input is its own batch
    x1 = torch.randn(4, 6, generator=torch.Generator().manual_seed(11))
    assert g.port_stats(g.steps.index(1), "Functional.linear.2.forward")["input.0"]["Max"] == pytest.approx(
        x1.max().item())


def test_trainrec_dump_shows_the_records_with_names_resolved(tmp_path, capsys):
    import json

    from trainrec.tools.cli import main

    path, _ = _train(tmp_path / "out", {**CONFIG, "api_xy": {"stack": True}}, steps=1)
    assert main(["dump", path, "--type", "ap"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["type"], r["direction"]) for r in lines] == [("ApiCallsRecorded", 0), ("ApiCallsRecorded", 1)]
    assert sorted(lines[1]["names"]) == sorted(n.replace(".forward", ".backward") for n in EXPECTED)
    rec = lines[0]
    assert sorted(rec["names"]) == sorted(EXPECTED) and rec["modules"][rec["names"].index("Tensor.sum.0.forward")] == ""
    assert len(rec["values"]) == len(rec["ports"]) == sum(rec["port_counts"]) and len(rec["values"][0]) == 4
    assert rec["types"][rec["ports"].index("input.inplace")] == "bool"
    assert len(rec["frames"]) == sum(rec["stack_depths"]) and rec["frames"][0].startswith("File ")
    # the module calls of the pass, in completion order, with their input's and output's dtype and shape
    assert rec["module_call_names"] == ["fc", "blk.lin", "blk", ""]
    assert rec["module_dtypes"] == ["torch.float32"] * 8 and rec["module_ndims"] == [2, 2, 2, 2, 2, 2, 2, 1]
    assert rec["module_dims"] == [4, 6, 4, 8, 4, 8, 4, 8, 4, 8, 4, 4, 4, 6, 4]
