"""Megatron's DistributedDataParallel as far as the monitor sees it, in a real 2-process gloo group:
``main_grad`` is a view into one contiguous fp32 gradient buffer, and a hook on each parameter's
gradient accumulator (registered by the wrapper, before the monitor's) adds ``.grad`` into it and
clears ``.grad``. With ``overlap_grad_reduce``, on the last micro step, that same hook starts the
asynchronous all-reduce of a bucket as soon as its last parameter is ready, while backward goes on;
without it, ``finish_grad_sync`` reduces every bucket after backward. Megatron itself needs CUDA and
is not installed here, so the stand-in follows megatron-core's ``distributed_data_parallel.py`` and
``param_and_grad_buffer.py`` (scale by 1/dp, then all-reduce the bucket) and checks the monitor's
side: each micro step's unreduced row is this rank's own accumulated gradient, never a partly or
fully reduced bucket, and the reduced row is the dp average."""

from __future__ import annotations

import contextlib
import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from ranks import free_port
from trainmon_util import init_gloo, logs_by_rank, loss_of, make, spawn_and_join, write_config

pytestmark = pytest.mark.dist

TIMEOUT = 120
GRAD_ACC = 2
STEPS = 2


class StandInMegatronDDP(torch.nn.Module):
    """Gradients as megatron-core's DDP handles them (buckets in reverse parameter order, as the
    gradients become ready)."""

    def __init__(self, module: torch.nn.Module, bucket_numel: int, overlap: bool) -> None:
        super().__init__()
        self.module = module
        self.overlap = overlap
        self.is_last_microbatch = True
        params = [p for p in module.parameters() if p.requires_grad]
        self.grad_data = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
        self.buckets: list[dict] = []
        self.bucket_of: dict[torch.Tensor, dict] = {}
        off, start, members = 0, 0, []
        for p in reversed(params):
            p.main_grad = self.grad_data[off:off + p.numel()].view_as(p)
            off += p.numel()
            members.append(p)
            if off - start >= bucket_numel or p is params[0]:
                b = {"view": self.grad_data[start:off], "params": members, "ready": set(), "handle": None}
                self.buckets.append(b)
                for q in members:
                    self.bucket_of[q] = b
                start, members = off, []
        self.grad_accs = []  # kept alive: a hook on a gradient accumulator lives as long as the node
        for p in params:
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._make_backward_post_hook(p))
            self.grad_accs.append(acc)

    def _make_backward_post_hook(self, p: torch.Tensor):
        def hook(*_unused):
            if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
                p.main_grad.add_(p.grad.data)
            p.grad = None
            if self.overlap and self.is_last_microbatch:
                b = self.bucket_of[p]
                b["ready"].add(p)
                if len(b["ready"]) == len(b["params"]):
                    self._start_grad_sync(b)

        return hook

    def _start_grad_sync(self, b: dict) -> None:
        b["view"].mul_(1.0 / dist.get_world_size())
        b["handle"] = dist.all_reduce(b["view"], async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def finish_grad_sync(self) -> None:
        for b in self.buckets:
            if not self.overlap:
                self._start_grad_sync(b)
            assert b["handle"] is not None, "a bucket was never reduced"
            b["handle"].wait()
            b["handle"] = None
            b["ready"].clear()

    def zero_grad_buffer(self) -> None:
        self.grad_data.zero_()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _worker(rank: int, world: int, port: int, cfg_path: str, overlap: bool) -> None:
    init_gloo(rank, world, port)
    try:
        from trainrec.recorder import TrainerMon

        model, _ = make(seed=0)
        local = copy.deepcopy(model)  # the same net, no wrapper: this rank's own gradients
        ddp = StandInMegatronDDP(model, bucket_numel=100, overlap=overlap)
        assert len(ddp.buckets) >= 3  # several reductions per backward
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = TrainerMon(cfg_path, params_have_main_grad=True, live_export=False)
        mon.monitor_gnorm_with_ad(ddp, grad_acc_steps=GRAD_ACC, optimizer=opt, dp_group=dist.group.WORLD)
        names = [n for n, _ in ddp.named_parameters()]
        want: dict = {"unreduced": {}, "reduced": {}}
        for step in range(STEPS):
            local.load_state_dict(model.state_dict())
            local.zero_grad()
            ddp.zero_grad_buffer()
            for micro in range(GRAD_ACC):
                batch = 100 * rank + 10 * step + micro
                loss_of(local, batch).backward()
                want["unreduced"][f"{step}/{micro}"] = [float(q.grad.norm()) for q in local.parameters()]
                with ddp.no_sync() if micro < GRAD_ACC - 1 else contextlib.nullcontext():
                    loss_of(ddp, batch).backward()
            ddp.finish_grad_sync()
            for p in model.parameters():  # Megatron's FP32Optimizer: the optimizer steps on main_grad
                p.grad = p.main_grad
            want["reduced"][str(step)] = [float(p.main_grad.norm()) for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        mon.close()
        want["names"] = names
        with open(os.path.join(os.path.dirname(cfg_path), f"want_{rank}.json"), "w") as f:
            json.dump(want, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [False, True], ids=["finish_grad_sync", "overlap_grad_reduce"])
def test_main_grad_in_megatrons_buffer_unreduced_is_the_ranks_own_gradient(tmp_path, monkeypatch, overlap):
    """Before, the last parameter to fire in a micro step was measured before the wrapper's hook had
    added its gradient (a row of zeros on the first micro step), and with overlap_grad_reduce the
    batch measured at the end of backward read buckets already averaged across ranks."""
    from trainmon_util import stats_table
    from trainrec.recorder.names import squash_all
    from trainrec.schema.events import HookFailed

    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ["norm", "max"]})
    spawn_and_join(_worker, (2, free_port(), cfg, overlap), 2, TIMEOUT, "2-process gloo run")
    h = logs_by_rank(out)
    assert sorted(h) == [0, 1]
    wants = {}
    for r in (0, 1):
        with open(tmp_path / f"want_{r}.json") as f:
            wants[r] = json.load(f)
    short = list(squash_all(wants[0]["names"]).values())
    for r in (0, 1):
        ev = h[r][2]
        assert not [e for e in ev if isinstance(e, HookFailed)]
        un = stats_table(ev, "grad_unreduced")
        assert len(un) == STEPS * GRAD_ACC * len(short)
        for step in range(STEPS):
            for micro in range(GRAD_ACC):
                for name, w in zip(short, wants[r]["unreduced"][f"{step}/{micro}"], strict=True):
                    got = un[(step, name, "", micro)]["norm"]
                    assert abs(got - w) <= 1e-5 * w + 1e-7, (r, step, micro, name, got, w)
    # reduced: the dp average, recorded by the dp group's first rank only
    red = stats_table(h[0][2], "grad_reduced")
    assert stats_table(h[1][2], "grad_reduced") == {}
    for step in range(STEPS):
        for name, w in zip(short, wants[0]["reduced"][str(step)], strict=True):
            got = red[(step, name, "", 0)]["norm"]
            assert abs(got - w) <= 1e-5 * w + 1e-7, (step, name, got, w)
        # the average differs from each rank's own gradient, so the unreduced rows above were taken
        # before any reduction
        assert any(abs(wants[0]["reduced"][str(step)][k] - wants[0]["unreduced"][f"{step}/{GRAD_ACC - 1}"][k]) > 1e-3
                   for k in range(len(short)))
