"""torch's native tensor parallelism (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``)
in a real 2-process gloo group: parameters and gradients are DTensors, each rank's shard its own, and
activations are DTensors (the inputs the plans wrap) or ``AsyncCollectiveTensor`` (a rowwise layer's
all-reduced output): neither has storage of its own."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ranks import free_port
from tp_util import Net, held, parallelize_blocks
from trainmon_util import (
    events_of,
    init_gloo,
    rank_dirs,
    spawn_and_join,
    stats_table,
    want_of,
    write_config,
)
from trainrec.schema.events import HookFailed

pytestmark = pytest.mark.dist

TIMEOUT = 120


def _worker(rank: int, world: int, port: int, cfg_path: str, d: int, rows: int) -> None:
    init_gloo(rank, world, port)
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from trainrec.recorder import TrainerMon

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = parallelize_blocks(Net(d), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=opt, tp_group=mesh.get_group())
        want: dict = {"actv": {}}

        def hook(name):
            def f(_m, args, out):
                want["actv"][f"{name}/input"] = float(held(args[0]).norm())
                want["actv"][f"{name}/output"] = float(held(out).norm())
            return f

        for n, m in model.named_modules():
            if n.count(".") == 2:
                m.register_forward_hook(hook(n))
        x = torch.randn(rows, d, generator=torch.Generator().manual_seed(1))  # the same on both ranks
        model(x).pow(2).mean().backward()
        want["grad"] = {n: float(p.grad.to_local().norm()) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        mon.close()
        with open(os.path.join(os.path.dirname(cfg_path), f"want_{rank}.json"), "w") as f:
            json.dump(want, f)
        dist.barrier()
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def run(tmp_path, monkeypatch, d: int, rows: int) -> dict:
    """Each rank's ``(events, want)``."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path, {"wg_distribution": True, "xy_distribution": True, "all_xy": True,
                                  "ops": ["norm", "max"]})
    port = free_port()
    spawn_and_join(_worker, (2, port, cfg, d, rows), 2, TIMEOUT, "2-process tensor-parallel run")
    res = {}
    for dr in rank_dirs(out):
        ev = events_of(dr)
        res[ev[0].rank] = (ev, want_of(tmp_path, ev[0].rank))
    assert sorted(res) == [0, 1]
    return res


def test_tp_group_keeps_each_ranks_shards_of_sharded_parameters(tmp_path, monkeypatch):
    """tp_group drops the reduced gradients that every rank of the group holds alike (a RowwiseParallel
    bias, replicated) on all but its first rank; a parameter sharded over the group (ColwiseParallel's
    weight and bias, RowwiseParallel's weight) has a shard of its own on each rank, recorded there (all
    of rank 1's were dropped: they lack Megatron's ``tensor_model_parallel`` attribute)."""
    res = run(tmp_path, monkeypatch, d=8, rows=4)
    for r, (ev, want) in res.items():
        red = stats_table(ev, "grad_reduced")
        names = {k[1] for k in red}
        sharded = {f"blocks.{i}.{n}" for i in (0, 1) for n in ("fc1.weight", "fc1.bias", "fc2.weight")}
        assert names == (sharded if r else set(want["grad"])), (r, sorted(names))
        for (_, name, _, _), row in red.items():
            w = want["grad"][name]
            assert abs(row["norm"] - w) <= 1e-5 * w + 1e-9, (r, name, row["norm"], w)


def _check_activations(res: dict) -> None:
    for r, (ev, want) in res.items():
        assert not [e for e in ev if isinstance(e, HookFailed)], r
        actv = stats_table(ev, "actv")
        for key, w in want["actv"].items():
            name, slot = key.rsplit("/", 1)
            got = actv.get((0, name, slot, 0))
            assert got is not None and abs(got["norm"] - w) <= 1e-5 * w, (r, key, got, w)


def test_rowwise_parallel_outputs_are_recorded(tmp_path, monkeypatch):
    """RowwiseParallel's output is an AsyncCollectiveTensor (the all-reduce's result, waited on at its
    first use), a wrapper without storage: its forward hook failed ("tensor 1 has no data") at every
    call and its row was missing. It is measured as the all-reduced tensor it stands for."""
    _check_activations(run(tmp_path, monkeypatch, d=8, rows=4))


def test_activations_without_storage_do_not_share_rows(tmp_path, monkeypatch):
    """An activation of 4096 elements or more that repeats one measured in the step reuses its row: they
    were told apart by data_ptr(), shape, strides and dtype, and a DTensor's (or AsyncCollectiveTensor's)
    data_ptr() is 0, so the second block's inputs and every RowwiseParallel output of one shape got the
    first one's row (wrong values, silently). They are keyed by the memory of their local tensors."""
    _check_activations(run(tmp_path, monkeypatch, d=64, rows=64))
