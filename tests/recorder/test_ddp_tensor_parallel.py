"""Data parallelism over a tensor-parallel model on 4 real gloo processes (a 2x2 mesh, ``dp`` then
``tp``; ``parallelize_module`` over ``tp``), checked against statistics the worker computes itself.

``ddp``: torch's documented 2-D DDP + TP, ``DistributedDataParallel(model, device_mesh=mesh["dp"])``.
DDP (``_pre_dp_module_transform``) replaces each DTensor parameter with a plain ``nn.Parameter`` of its
local tensor, carrying the DTensor's spec in ``_st_info``; DDP and the optimizer hold those. Its
forward pre-hook then sets DTensors made from them (``DTensor.from_local``) as plain attributes, so
from the first forward on ``named_parameters()`` is empty (torch's forward hook that should put the
Parameters back finds none), and the DTensors of that first forward are reused. The monitor, made
after DDP, holds the local Parameters, under the names they had: unreduced gradients are this rank's
local gradient of its tp shard, reduced ones DDP's average over dp, kept on the first dp rank only and,
for parameters replicated over tp (``RowwiseParallel``'s bias), on the first tp rank only.

``dp_dim``/``world``: tensor parallelism alone, the DTensor parameters' gradients all-reduced over
the dp dimension by the training loop (as Megatron's own DDP would), ``dp_group`` the dp dimension or
every rank (the tests are in test_dp_group_tp_overlap.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ranks import free_port
from tp_util import Block, held, parallelize_blocks
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

pytestmark = pytest.mark.dist

TIMEOUT = 120
STEPS = 2
D = 8
NAMES = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
TP_REPLICATED = {"fc2.bias"}


def _tp(mesh) -> Block:
    torch.manual_seed(0)
    return parallelize_blocks(Block(D), mesh)


def _worker(rank: int, world: int, port: int, cfg_path: str, out: str, mode: str) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.environ.pop("DYNAMIC_MONITOR", None)
    init_gloo(rank, world, port)
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from trainrec.recorder import TrainerMon

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
        model = _tp(tp)
        twin = _tp(tp)  # the same weights, tensor-parallel only: this rank's own gradients
        ddp = mode.startswith("ddp")
        net = torch.nn.parallel.DistributedDataParallel(model, device_mesh=dp) if ddp else model
        params = dict(model.named_parameters())  # what the optimizer and the monitor hold
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
        dp_group = dist.group.WORLD if mode.endswith("world") else dp.get_group()
        mon.monitor_gnorm_with_ad(model, optimizer=opt, dp_group=dp_group, tp_group=tp.get_group())
        want: dict = {"dp": dp.get_local_rank(), "tp": tp.get_local_rank(), "steps": [],
                      "types": {n: type(p).__name__ for n, p in params.items()}}
        for step in range(STEPS):
            with torch.no_grad():
                for n, p in twin.named_parameters():
                    held(p).copy_(held(params[n]))
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(10 * step + dp.get_local_rank()))
            cur = {"param": {n: ref_stats(held(p)) for n, p in params.items()}}
            twin.zero_grad()
            twin(x).pow(2).mean().backward()
            cur["unreduced"] = {n: ref_stats(held(p.grad)) for n, p in twin.named_parameters()}
            net(x).pow(2).mean().backward()
            if not ddp:  # the training loop's own data-parallel reduction
                for p in params.values():
                    dist.all_reduce(held(p.grad), group=dp.get_group())
                    held(p.grad).div_(2)
            cur["reduced"] = {n: ref_stats(held(p.grad)) for n, p in params.items()}
            cur["named"] = sorted(n for n, _ in model.named_parameters())
            want["steps"].append(cur)
            opt.step()
            opt.zero_grad()
            if mode == "ddp_reload" and step == 0:
                mon.reload_xy(True)  # targets selected again, from a module that now lists no parameters
        mon.close()
        with open(os.path.join(os.path.dirname(cfg_path), f"want_{rank}.json"), "w") as f:
            json.dump(want, f)
        dist.barrier()
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _run(tmp_path_factory, mode: str):
    tmp_path = tmp_path_factory.mktemp(mode)
    out = tmp_path / "out"
    cfg = write_config(tmp_path, {"wg_distribution": True, "param_distribution": True, "ops": ALL_OPS})
    port = free_port()
    spawn_and_join(_worker, (4, port, cfg, str(out), mode), 4, TIMEOUT, f"4-process {mode} run")
    want = {}
    for r in range(4):
        want[r] = want_of(tmp_path, r)
    return open_run(str(out)), want


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return _run(tmp_path_factory, "ddp")


def _check_reduced_rows(run, want) -> None:
    """Reduced gradients on the first dp rank only; there, every tp shard on each tp rank, the
    tp-replicated bias on the first tp rank only; values as torch's."""
    assert run.ranks == [0, 1, 2, 3]
    for r in run.ranks:
        table = stats_table(run.events(r), "grad_reduced")
        w = want[r]
        keep = set() if w["dp"] else NAMES - (TP_REPLICATED if w["tp"] else set())
        for step in range(STEPS):
            assert {k[1] for k in table if k[0] == step} == keep, (r, step, sorted(k[1] for k in table))
    _check_values(run, want, "grad_reduced", "reduced")


def _check_values(run, want, kind: str, key: str) -> None:
    for r in run.ranks:
        for (step, name, _slot, _micro), row in stats_table(run.events(r), kind).items():
            assert_close(row, want[r]["steps"][step][key][name], rtol=1e-4, atol=1e-7,
                         what=f"rank {r} step {step} {name} {kind}")


def test_ddp_replaces_the_dtensor_parameters(ddp_run):
    """What torch does (the layout the other tests are about): DDP holds plain Parameters, and from
    the first forward on the module lists none."""
    _run, want = ddp_run
    for w in want.values():
        assert set(w["types"].values()) == {"Parameter"}
        assert [s["named"] for s in w["steps"]] == [[]] * STEPS


def test_ddp_over_tp_reduced_gradients_deduplicated(ddp_run):
    """Reduced: DDP's average over dp, on the first dp rank only; there, every tp shard on each tp
    rank, the tp-replicated bias on the first tp rank only. (Rank 1 recorded none: the local
    Parameters DDP puts in place of the DTensors were taken for tp duplicates.)"""
    run, want = ddp_run
    _check_reduced_rows(run, want)
    assert want[0]["steps"][0]["reduced"]["fc1.weight"] != want[0]["steps"][0]["unreduced"]["fc1.weight"]


def test_ddp_over_tp_unreduced_gradients_and_parameters_on_every_rank(ddp_run):
    run, want = ddp_run
    for r in run.ranks:
        for kind in ("grad_unreduced", "param"):
            table = stats_table(run.events(r), kind)
            for step in range(STEPS):
                assert {k[1] for k in table if k[0] == step} == NAMES, (r, kind, step)
        _check_values(run, want, "grad_unreduced", "unreduced")
        _check_values(run, want, "param", "param")



def test_ddp_over_tp_with_dp_group_every_rank(tmp_path_factory):
    """``dp_group`` every rank, under 2-D DDP + TP: rank 1 holds tp shards of its own (no rank before
    it in the group holds them), ranks 2 and 3 DDP's copies of ranks 0's and 1's; the same rows as with
    the dp dimension, and as for the DTensors themselves (test_dp_group_tp_overlap.py). (Ranks 1 to 3
    recorded none: DDP's local Parameters were taken for whole gradients, alike on every rank.)"""
    run, want = _run(tmp_path_factory, "ddp_world")
    _check_reduced_rows(run, want)


def test_ddp_over_tp_targets_selected_again_after_the_first_forward(tmp_path_factory):
    """A re-selection of the targets after the first step keeps recording the weights: the parameters
    DDP holds are the ones selected at install, but the module no longer lists them (torch's
    ``_reconstruct_dtensor`` left plain DTensor attributes in their place). (It found none, and the
    steps after it recorded no weights.)"""
    run, want = _run(tmp_path_factory, "ddp_reload")
    _check_reduced_rows(run, want)
    for r in run.ranks:
        for kind in ("grad_unreduced", "param"):
            table = stats_table(run.events(r), kind)
            assert {k[1] for k in table if k[0] == 1} == NAMES, (r, kind)
