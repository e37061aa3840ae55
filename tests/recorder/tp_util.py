"""The model and helpers the tensor-parallel tests share (test_tensor_parallel*.py, test_mesh_2d.py,
test_ddp_tensor_parallel.py): residual blocks of two linears that ``parallelize_blocks`` makes
ColwiseParallel then RowwiseParallel, and what a rank holds of a DTensor."""

from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.mesh = None  # where set, the blocks take and give DTensors (use_local_output=False)

    def forward(self, x):
        if self.mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        for b in self.blocks:
            x = b(x)
        return x


def parallelize_blocks(model: nn.Module, mesh, **plan_kwargs) -> nn.Module:
    """``model`` (a Block, or a Net's blocks) tensor-parallel over ``mesh``: fc1 ColwiseParallel, fc2
    RowwiseParallel, each plan made with ``plan_kwargs`` (``use_local_output=False``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for b in getattr(model, "blocks", [model]):
        parallelize_module(b, mesh, {"fc1": ColwiseParallel(**plan_kwargs), "fc2": RowwiseParallel(**plan_kwargs)})
    return model


def held(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local tensor, an AsyncCollectiveTensor's result."""
    t = t.detach()
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.wait() if hasattr(t, "wait") else t  # (also a DTensor's local tensor: redistribute's result)
