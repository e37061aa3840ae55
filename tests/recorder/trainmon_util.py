"""Shared helpers of the TrainerMon tests: small CPU models, config files, reading a rank's log back."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch
import torch.nn as nn
from trainrec.replay.names import NameResolver
from trainrec.replay.reader import read_log
from trainrec.schema.events import SLOTS, TensorStatsRecorded

ALL_OPS = ["min", "max", "norm", "mean", "zeros", "nans"]


def new_threads(before) -> list:
    """The live threads not among ``before`` (idents, or threads), less the process's SIGTERM watcher
    (installed once per process with the SIGTERM handler, as that is: no monitor's own)."""
    import threading

    return [t for t in threading.enumerate() if t.ident not in before and t not in before
            and t.is_alive() and t.name != "trainrec-sigterm"]


class Pair(nn.Module):
    """A module with two inputs and a tuple output (for tuple selectors)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x, y):
        h = self.proj(x) + y
        return h, h.detach() * 0


class ComplexFilter(nn.Module):
    """A linear layer times a complex parameter (a learned filter): the loss is real, the gradient and
    Adam's state of ``c`` complex."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.c = nn.Parameter(torch.randn(4, dtype=torch.complex64))

    def forward(self, x):
        return (self.lin(x) * self.c).abs().sum()


class TinyNet(nn.Module):
    """embed -> layers.0 (Linear+ReLU) -> layers.1 (Linear) -> pair(x, x) -> head."""

    def __init__(self, vocab: int = 32, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.ReLU()), nn.Linear(d, d)])
        self.pair = Pair(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        h, _ = self.pair(h, h)
        return self.head(h)


def make(seed: int = 0, opt_cls=torch.optim.AdamW):
    torch.manual_seed(seed)
    model = TinyNet()
    opt = opt_cls(model.parameters(), lr=1e-2)
    return model, opt


def batch(i: int):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 32, (4, 5), generator=g), torch.randint(0, 32, (4, 5), generator=g)


def train_random(model, opt, steps: int = 2, grad_acc: int = 2, shape: tuple = (3, 4)) -> None:
    """``steps`` optimizer steps of ``grad_acc`` micro steps each, on random inputs of ``shape`` (the
    global RNG's), with ``model(x).sum()`` as the loss."""
    for _ in range(steps):
        for _ in range(grad_acc):
            model(torch.randn(*shape)).sum().backward()
        opt.step()
        opt.zero_grad()


def loss_of(model, i: int):
    x, y = batch(i)
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train_batches(model, opt, steps: int = 2, grad_acc: int = 2) -> None:
    """``steps`` optimizer steps of ``grad_acc`` micro steps each, on :func:`batch` ``grad_acc * step +
    micro`` with :func:`loss_of`."""
    for step in range(steps):
        for micro in range(grad_acc):
            loss_of(model, grad_acc * step + micro).backward()
        opt.step()
        opt.zero_grad()


def write_config(tmp_path, cfg: dict, name: str = "config.json") -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def train(tmp_path, cfg: dict, steps: int = 3, grad_acc: int = 1, close: bool = True, **kw):
    """A TrainerMon with config ``cfg`` on :func:`make`'s model, ``steps`` optimizer steps of
    ``grad_acc`` micro-steps; returns (monitor, model, optimizer)."""
    from trainrec.recorder import TrainerMon

    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=grad_acc, optimizer=opt, **kw)
    for s in range(steps):
        for m in range(grad_acc):
            loss_of(model, s * 7 + m).backward()
        opt.step()
        opt.zero_grad()
    if close:
        mon.close()
    return mon, model, opt


def steps_with(events, kind: str) -> list[int]:
    """The steps at which ``kind`` has statistics records."""
    return sorted({e.step for e in events if isinstance(e, TensorStatsRecorded) and e.kind == kind})


def rank_dirs(out_dir) -> list[str]:
    return sorted(d for d in glob.glob(os.path.join(str(out_dir), "*-rank*-*")) if os.path.isdir(d))


def events_of(out_dir_or_log) -> list:
    p = str(out_dir_or_log)
    if not p.endswith(".trl"):
        dirs = rank_dirs(p) if not os.path.basename(p).count("-rank") else [p]
        logs = sorted(glob.glob(os.path.join(dirs[-1], "*.trl")))
        p = logs[-1]
    reader, events = read_log(p)
    assert reader.problems == []
    return events


def logs_by_rank(out) -> dict:
    """rank -> (rank dir, FileOpened, events) of each rank's one log under ``out``."""
    from trainrec.schema.events import FileOpened

    res = {}
    for d in rank_dirs(out):
        (log,) = glob.glob(os.path.join(d, "*.trl"))
        ev = events_of(log)
        assert isinstance(ev[0], FileOpened)
        res[ev[0].rank] = (d, ev[0], ev)
    return res


def stats_table(events, kind: str) -> dict:
    """{(step, name, slot, micro_step): {op: value}} for every row of ``kind``."""
    res = NameResolver()
    out: dict = {}
    for ev in events:
        res.feed(ev)
        if isinstance(ev, TensorStatsRecorded) and ev.kind == kind:
            vals = np.frombuffer(ev.values, dtype="<f4").reshape(len(ev), len(ev.ops))
            names = res.names(ev)
            slots = ev.column("slots")
            micro = ev.column("micro_steps")
            for r, name in enumerate(names):
                out[(ev.step, name, SLOTS[slots[r]], micro[r])] = dict(zip(ev.ops, vals[r].tolist(), strict=True))
    return out


def ref_stats(t: torch.Tensor, eps: float = 1e-8) -> dict:
    """The six statistics computed independently, in float64."""
    d = t.detach().to(torch.float64)
    return {
        "min": d.min().item(), "max": d.max().item(), "norm": d.norm().item(), "mean": d.mean().item(),
        "zeros": (d.abs() < eps).double().mean().item(), "nans": torch.isnan(d).sum().item(),
    }


def assert_close(got: dict, want: dict, rtol: float = 2e-4, atol: float = 1e-6, what: str = "") -> None:
    for op, v in want.items():
        if op not in got:
            continue
        g = got[op]
        assert abs(g - v) <= atol + rtol * abs(v), f"{what} {op}: recorded {g}, expected {v}"


def init_gloo(rank: int, world: int, port: int) -> None:
    """A spawned worker's side of a real gloo group on this machine (1 intra-op thread per process)."""
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


def want_of(dir_path, rank: int):
    """What a spawned worker of ``rank`` saved as ``want_{rank}.json`` in ``dir_path``: the statistics
    it computed itself, for the test to compare with what the monitor recorded."""
    import json

    with open(os.path.join(dir_path, f"want_{rank}.json")) as f:
        return json.load(f)


def spawn_and_join(worker, args: tuple, nprocs: int, timeout: float, what: str) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; fail the test (killing them) when they
    do not all finish within ``timeout`` seconds; a worker's exception fails it too."""
    import time

    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish in {timeout} s")


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed tests cannot run here, or None: DeepSpeed (the dev extra) is not installed, or
    there is no C++ compiler (at start DeepSpeed builds its CPU shared-memory comm op, then caches it)."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("deepspeed") is None:
        return "needs deepspeed (the dev extra)"
    if not (shutil.which("c++") or shutil.which("g++")):
        return "DeepSpeed on CPU needs a C++ compiler (it builds its comm op at start)"
    return None
