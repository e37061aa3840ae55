"""A 2-D device mesh on 4 real gloo processes, as in torch's 2-D parallel tutorial: tensor parallelism
(``parallelize_module``, ``ColwiseParallel`` then ``RowwiseParallel``) over the mesh's ``tp`` dimension
and FSDP2 (``fully_shard``) over its ``dp`` one, with ``monitor_gnorm_with_ad(..., dp_group=...,
tp_group=...)``. Parameters and reduced gradients are DTensors on the 2-D mesh, each rank's local
tensor a dp shard of its tp shard (``_StridedShard`` for ColwiseParallel's, sharded twice on dim 0).

What each log should hold, by the README's rules: every rank its own shards of the reduced gradients
(sharded over dp: ``dp_group`` drops none), less the RowwiseParallel bias on the second rank of each tp
group (replicated over tp: ``tp_group`` keeps it on the group's first rank only); every parameter's
unreduced gradient (this rank's whole gradient of its tp shard, before FSDP reduce-scatters it) and
parameter shard (before the update) on every rank; activations and their gradients as under tensor
parallelism alone (see test_tensor_parallel_grads.py). The logs are read back with ``open_run``."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from ranks import free_port
from tp_util import Net, held, parallelize_blocks
from trainmon_util import (
    ALL_OPS,
    assert_close,
    init_gloo,
    ref_stats,
    spawn_and_join,
    stats_table,
    want_of,
    write_config,
)
from trainrec.replay import open_run
from trainrec.schema.events import FileOpened, HookFailed

pytestmark = pytest.mark.dist

TIMEOUT = 150
STEPS = 2
D = 8


def _worker(rank: int, world: int, port: int, cfg_path: str, out: str) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.environ.pop("DYNAMIC_MONITOR", None)
    init_gloo(rank, world, port)
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from trainrec.recorder import TrainerMon

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
        torch.manual_seed(0)
        model = parallelize_blocks(Net(D), tp)
        for b in model.blocks:
            fully_shard(b, mesh=dp)
        fully_shard(model, mesh=dp)
        torch.manual_seed(0)
        twin = parallelize_blocks(Net(D), tp)  # the same weights, tensor-parallel only: this rank's gradients before FSDP's
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=opt, dp_group=dp.get_group(), tp_group=tp.get_group())
        want: dict = {"dp": dp.get_local_rank(), "tp": tp.get_local_rank(), "steps": []}
        actv: dict = {}
        grads: list = []  # (key, gradient, placements of the tensor) in backward order: alike on every rank

        def on_grad(key, placements, g):
            grads.append((key, g, placements))

        def hook(name):
            def f(_m, args, out):
                for slot, t in (("input", args[0]), ("output", out)):
                    actv[f"{name}/{slot}"] = ref_stats(held(t))
                    t.register_hook(functools.partial(on_grad, f"{name}/{slot}_grad",
                                                      getattr(t, "placements", None)))
            return f

        for n, m in model.named_modules():  # after the monitor's and FSDP's and TP's: what the monitor sees
            m.register_forward_hook(hook(n))
        for step in range(STEPS):
            # one batch per dp rank, the same on the ranks of a tp group
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(10 * step + dp.get_local_rank()))
            actv.clear()
            grads.clear()
            model(x.requires_grad_()).pow(2).mean().backward()
            for key, g, placements in grads:
                if placements is not None and g.placements != placements:
                    g = g.redistribute(placements=placements)  # Partial: the sum it stands for
                actv[key] = ref_stats(held(g))
            cur = {"actv": dict(actv),"placements": {n: str(p.placements) for n, p in model.named_parameters()},
                   "grad": {n: ref_stats(p.grad.to_local()) for n, p in model.named_parameters()},
                   "param": {n: ref_stats(p.to_local()) for n, p in model.named_parameters()}}
            if step == 0:
                twin(x).pow(2).mean().backward()
                cur["unreduced"] = {n: ref_stats(p.grad.to_local()) for n, p in twin.named_parameters()}
            want["steps"].append(cur)
            opt.step()
            opt.zero_grad()
        mon.close()
        with open(os.path.join(os.path.dirname(cfg_path), f"want_{rank}.json"), "w") as f:
            json.dump(want, f)
        dist.barrier()
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """``(run, {rank: what it should record})`` of one 4-process run."""
    tmp_path = tmp_path_factory.mktemp("mesh2d")
    out = tmp_path / "out"
    cfg = write_config(tmp_path, {"wg_distribution": True, "param_distribution": True, "xy_distribution": True,
                                  "all_xy": True, "ops": ALL_OPS})
    port = free_port()
    spawn_and_join(_worker, (4, port, cfg, str(out)), 4, TIMEOUT, "4-process 2-D (FSDP2 x TP) run")
    want = {}
    for r in range(4):
        want[r] = want_of(tmp_path, r)
    return open_run(str(out)), want


NAMES = [f"blocks.{i}.{n}" for i in (0, 1) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
TP_REPLICATED = {"blocks.0.fc2.bias", "blocks.1.fc2.bias"}


def test_four_logs_of_one_run_each_with_its_rank(mesh_run):
    run, want = mesh_run
    assert run.ranks == [0, 1, 2, 3] and run.world_size == 4 and not run.missing_ranks
    for r in run.ranks:
        assert [os.path.basename(d) for d in run.rank_dirs[r]] and all(f"-rank{r}-" in os.path.basename(d)
                                                                      for d in run.rank_dirs[r])
        assert {h.rank for p, h in run.headers.items() if p in run.files(r)} == {r}
        ev = list(run.events(r))
        assert {e.rank for e in ev} == {r}
        assert not [e for e in ev if isinstance(e, HookFailed)], r
        opened = [e for e in ev if isinstance(e, FileOpened)]
        assert opened and all(e.world_size == 4 for e in opened)
    assert all(v["placements"]["blocks.0.fc1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
               for w in want.values() for v in w["steps"]), "not the layout this test is about"
    assert sorted((w["dp"], w["tp"]) for w in want.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_reduced_gradients_deduplicated_over_tp_only(mesh_run):
    """Reduced gradients: sharded over dp, so kept on both dp ranks (each its own shard, with its own
    values); the RowwiseParallel bias, replicated over tp, on the first rank of each tp group only."""
    run, want = mesh_run
    for r in run.ranks:
        table = stats_table(run.events(r), "grad_reduced")
        keep = set(NAMES) - (TP_REPLICATED if want[r]["tp"] else set())
        for step in range(STEPS):
            assert {k[1] for k in table if k[0] == step} == keep, (r, step, sorted(k[1] for k in table))
        for (step, name, _slot, _micro), row in table.items():
            assert_close(row, want[r]["steps"][step]["grad"][name], rtol=1e-4, atol=1e-7,
                         what=f"rank {r} step {step} {name} reduced")
    # the dp ranks of a tp rank hold different shards: nothing recorded twice
    for name in NAMES:
        assert want[0]["steps"][0]["grad"][name] != want[2]["steps"][0]["grad"][name], name


def test_unreduced_gradients_and_parameters_on_every_rank(mesh_run):
    """Unreduced gradients: this rank's whole gradient of its tp shard, before FSDP's reduce-scatter (a
    tensor-parallel twin of the model, on the same batch, gives it at the first step); parameters: the
    rank's shard, before the update; both for every parameter on every rank."""
    run, want = mesh_run
    for r in run.ranks:
        unreduced = stats_table(run.events(r), "grad_unreduced")
        params = stats_table(run.events(r), "param")
        for step in range(STEPS):
            assert {k[1] for k in unreduced if k[0] == step} == set(NAMES), (r, step)
            assert {k[1] for k in params if k[0] == step} == set(NAMES), (r, step)
        for (step, name, _slot, _micro), row in unreduced.items():
            if step == 0:
                assert_close(row, want[r]["steps"][0]["unreduced"][name], rtol=1e-4, atol=1e-7,
                             what=f"rank {r} {name} unreduced")
        for (step, name, _slot, _micro), row in params.items():
            assert_close(row, want[r]["steps"][step]["param"][name], rtol=1e-4, atol=1e-7,
                         what=f"rank {r} step {step} {name} param")


def test_activations_and_their_gradients(mesh_run):
    """Every module's input, output and their gradients, as under tensor parallelism alone (see
    test_tensor_parallel_grads.py), with FSDP2's hooks on the blocks and the model too."""
    run, want = mesh_run
    for r in run.ranks:
        ev = list(run.events(r))
        table = {**stats_table(ev, "actv"), **stats_table(ev, "actv_grad")}
        for step in range(STEPS):
            expected = want[r]["steps"][step]["actv"]
            assert len(expected) == 7 * 4
            assert {(k[1], k[2]) for k in table if k[0] == step} == {tuple(k.rsplit("/", 1)) for k in expected}
            for key, w in expected.items():
                name, slot = key.rsplit("/", 1)
                assert_close(table[(step, name, slot, 0)], w, rtol=1e-4, atol=1e-7,
                             what=f"rank {r} step {step} {key}")


def _hsdp_worker(rank: int, world: int, port: int, cfg_path: str, out: str) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.environ.pop("DYNAMIC_MONITOR", None)
    init_gloo(rank, world, port)
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from trainrec.recorder import TrainerMon

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = Net(D)
        fully_shard(model, mesh=mesh)  # HSDP: sharded over "shard", replicated over "replicate"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=opt, dp_group=dist.group.WORLD)  # every rank data-parallel
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).mean().backward()
        want = {n: ref_stats(p.grad.to_local()) for n, p in model.named_parameters()}
        opt.step()
        mon.close()
        with open(os.path.join(os.path.dirname(cfg_path), f"want_{rank}.json"), "w") as f:
            json.dump(want, f)
        dist.barrier()
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def test_hsdp_replicas_reduced_gradients_are_dp_duplicates(tmp_path):
    """HSDP (``fully_shard`` on a (replicate, shard) mesh), ``dp_group`` all four ranks: ranks 2 and 3
    hold the same shards of the reduced gradients as ranks 0 and 1 (their replicas), so only 0 and 1
    record them, each its own shard (all four did: a DTensor's shard was taken for this rank's alone,
    whatever its placement over the replicate dimension)."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ALL_OPS})
    port = free_port()
    spawn_and_join(_hsdp_worker, (4, port, cfg, str(out)), 4, TIMEOUT, "4-process HSDP run")
    run = open_run(str(out))
    assert run.ranks == [0, 1, 2, 3]
    for r in run.ranks:
        want = want_of(tmp_path, r)
        table = stats_table(run.events(r), "grad_reduced")
        assert {k[1] for k in table} == (set(NAMES) if r < 2 else set()), (r, sorted(k[1] for k in table))
        for (_step, name, _slot, _micro), row in table.items():
            assert_close(row, want[name], rtol=1e-4, atol=1e-7, what=f"rank {r} {name} reduced")
        assert {k[1] for k in stats_table(run.events(r), "grad_unreduced")} == set(NAMES), r
