"""Module hooks on models that reuse a module in one forward (weight sharing), and models with
in-place operations after hooked modules (ReLU(inplace=True), a residual ``x += y``)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from trainmon_util import events_of
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
    for _step in range(2):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    fired = firings(ev, "lin")
    for step in range(2):
        assert fired[(step, DIR_FORWARD)] == [0, 0, 1, 1]
        assert fired[(step, DIR_BACKWARD)] == [0, 0, 1, 1]
    ended = [e for e in ev if isinstance(e, StepEnded)]
    assert [e.micro_steps for e in ended] == [2, 2]
