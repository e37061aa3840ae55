"""Module hooks on models that reuse a module in one forward (weight sharing), and models with
in-place operations after hooked modules (ReLU(inplace=True), a residual ``x += y``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from trainmon_util import ALL_OPS, assert_close, events_of, ref_stats, stats_table, train_random
from trainrec.recorder import TrainerMon
from trainrec.replay.names import NameResolver
from trainrec.schema.events import DIR_BACKWARD, DIR_FORWARD, HooksFired, StepEnded


class Shared(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def firings(events, name: str) -> dict:
    """{(step, direction): [micro steps of ``name``'s firings in order]}."""
    res = NameResolver()
    out: dict = {}
    for ev in events:
        res.feed(ev)
        if isinstance(ev, HooksFired):
            names = res.ids_names(ev.rank, ev.module_ids)
            dirs = np.frombuffer(ev.directions, dtype=np.uint8)
            micro = np.frombuffer(ev.micro_steps, dtype="<u2")
            for n, d, m in zip(names, dirs, micro, strict=True):
                if n == name:
                    out.setdefault((ev.step, int(d)), []).append(int(m))
    return out


def test_module_called_twice_per_forward_keeps_its_micro_step(tmp_path):
    out = tmp_path / "out"
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "wg_distribution": True, "format": "csv"},
                     live_export=False, output_dir=str(out))
    torch.manual_seed(0)
    model = Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    train_random(model, opt)
    mon.close()
    ev = events_of(out)
    fired = firings(ev, "lin")
    for step in range(2):
        assert fired[(step, DIR_FORWARD)] == [0, 0, 1, 1]
        assert fired[(step, DIR_BACKWARD)] == [0, 0, 1, 1]
    ended = [e for e in ev if isinstance(e, StepEnded)]
    assert [e.micro_steps for e in ended] == [2, 2]


class Resid(nn.Module):
    """Linear -> ReLU(inplace=True) -> Linear, then a residual added in place (``h += r``)."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 4))
        self.side = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        h = self.net(x)
        r = self.side(x)
        if self.inplace:
            h += r
        else:
            h = h + r
        return self.out(h)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # the reference model's hooks
def test_in_place_ops_after_hooked_modules_train_and_record_activation_grads(tmp_path):
    torch.manual_seed(0)
    model = Resid(inplace=True)
    ref = Resid(inplace=False)
    ref.load_state_dict(model.state_dict())
    names = {"net.0": "net.0", "net.1": "net.1", "net.2": "net.2", "out": "out"}
    want: dict = {}

    def capture(step, name):
        def bwd(mod, gin, gout):
            want[(step[0], name, "output_grad")] = gout[0].detach().clone()
            if gin[0] is not None:
                want[(step[0], name, "input_grad")] = gin[0].detach().clone()
        return bwd

    step = [0]
    for full, short in names.items():
        ref.get_submodule(full).register_full_backward_hook(capture(step, short))
    out = tmp_path / "out"
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ALL_OPS, "format": "csv"},
                     live_export=False, output_dir=str(out))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for s in range(2):
        step[0] = s
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(s))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    mon.close()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b)  # the monitored model trained exactly as the unmonitored one
    ev = events_of(out)
    got = stats_table(ev, "actv_grad")
    checked = 0
    for (s, name, slot), g in want.items():
        assert_close(got[(s, name, slot, 0)], ref_stats(g), what=f"step {s} {name} {slot}")
        checked += 1
    assert checked >= 14
    assert np.isnan(got[(0, "net.0", "input_grad", 0)]["norm"])  # the input needs no grad: a NaN row
    assert not [e for e in ev if type(e).__name__ == "HookFailed"]


def test_a_tensor_selected_by_several_calls_gets_one_gradient_hook(tmp_path, monkeypatch):
    """In a chain, a module's output is the next module's input (and a container's input is its first
    child's): each such tensor gets one gradient hook serving every call that selected it, and each
    call still records its own input/output gradient rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    want: dict = {}
    for name, mod in ref.named_modules():
        def bwd(m, gin, gout, name=name):
            want[(name, "output_grad")] = gout[0].detach().clone()
            if gin[0] is not None:
                want[(name, "input_grad")] = gin[0].detach().clone()
        mod.register_full_backward_hook(bwd)
    hooked: list = []
    register = torch.Tensor.register_hook

    def counting(self, fn):
        # the tensor itself, kept alive: a layer output freed after the forward (nothing saves it for
        # backward) could hand its id to a later one, and (id, version) pairs then collide
        hooked.append((self, self._version))
        return register(self, fn)

    monkeypatch.setattr(torch.Tensor, "register_hook", counting)
    out = tmp_path / "out"
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ALL_OPS, "format": "csv"},
                     live_export=False, output_dir=str(out))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    x = torch.randn(5, 4, requires_grad=True)
    model(x).square().mean().backward()
    opt.step()
    ref(x.detach().requires_grad_()).square().mean().backward()
    mon.close()
    # 4 calls (root "", 0, 1, 2) x (input, output) = 8 selections of 4 distinct tensors: x and the
    # three layer outputs (the root's input is x, its output layer 2's output: the same objects)
    assert len(hooked) == len({(id(t), v) for t, v in hooked}) == 4
    got = stats_table(events_of(out), "actv_grad")
    assert sorted(got) == sorted((0, name, slot, 0) for name in ("", "0", "1", "2")
                                 for slot in ("input_grad", "output_grad"))  # every call kept its rows
    for (name, slot), g in want.items():
        assert_close(got[(0, name, slot, 0)], ref_stats(g), what=f"{name!r} {slot}")
    assert len(want) == 8
