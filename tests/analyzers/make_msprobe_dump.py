"""Regenerate tests/analyzers/msprobe_dump/: real dump directories of mindstudio-probe 1.2.1.

Run in a venv of its own (it needs numpy<2)::

    python -m venv /tmp/msvenv && /tmp/msvenv/bin/pip install torch==2.13.0 "numpy<2" mindstudio-probe==1.2.1
    /tmp/msvenv/bin/python tests/analyzers/make_msprobe_dump.py

It trains the graph tests' small network (the same layers as graph_runs.Net) for 2 steps on CPU under
msprobe's PrecisionDebugger (task statistics, level mix) twice: ``bench`` and ``scaled``, whose
``blk`` output is doubled at step 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch
import torch.nn as nn
from msprobe.pytorch import PrecisionDebugger

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "msprobe_dump")


class Scaled(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.factor = 1.0

    def forward(self, x):
        return self.lin(x) * self.factor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.blk = Scaled(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.blk(self.act(self.fc1(x))))


def dump(name: str, scale_at: int | None) -> None:
    dump_path = os.path.join(OUT, name)
    config = os.path.join(OUT, f"{name}_config.json")
    with open(config, "w") as f:
        json.dump({"task": "statistics", "dump_path": dump_path, "rank": [], "step": [], "level": "mix",
                   "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"}}, f)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PrecisionDebugger(config_path=config, model=model)
    for step in range(2):
        model.blk.factor = 2.0 if step == scale_at else 1.0
        debugger.start()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()
    os.remove(config)


if __name__ == "__main__":
    if len(sys.argv) > 1:  # one dump per process: PrecisionDebugger is a process-wide singleton
        dump(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
        sys.exit(0)
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    subprocess.run([sys.executable, __file__, "bench"], check=True)
    subprocess.run([sys.executable, __file__, "scaled", "1"], check=True)
