"""Small recorded runs for the graph tests: a real model trained on CPU under ``record()``, with every
module's inputs and outputs (xy), parameters and gradients; optionally one layer scaled at one step."""

from __future__ import annotations

import os
import shutil

import torch
import torch.nn as nn
from trainrec.recorder import record

GRAPH_CONFIG = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
                "ops": ["min", "max", "mean", "norm"]}
DUMP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "graph_dump")


class Scaled(nn.Module):
    """A linear layer whose output is multiplied by ``factor`` (1 but where a test injects a difference)."""

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


def record_run(out_dir, steps: int = 4, scale_at: int | None = None, factor: float = 2.0,
               config: dict | None = None, model: nn.Module | None = None) -> str:
    """Train ``steps`` steps of :class:`Net` (same seed, same data every call) into ``out_dir``."""
    torch.manual_seed(0)
    model = model if model is not None else Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt, config or GRAPH_CONFIG, output_dir=str(out_dir)):
        for step in range(steps):
            if isinstance(model, Net):
                model.blk.factor = factor if step == scale_at else 1.0
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return str(out_dir)


def copy_dump(tmp_path, name: str = "dump") -> str:
    """A writable copy of the hand-made reference dump directory (steps 0 and 1, one rank)."""
    dst = os.path.join(str(tmp_path), name)
    shutil.copytree(DUMP_DIR, dst)
    return dst
