"""Activation gradients, weight gradients and parameters under torch's native tensor parallelism
(``parallelize_module``, ``ColwiseParallel`` then ``RowwiseParallel``) in a real 2-process gloo group,
all six ops, checked against statistics computed in the same worker by hooks of the test's own.

What each rank should record is what it holds of each tensor, as under Megatron (whose parallel
layers take and give their local tensors, and whose reference monitor measures those): a DTensor's
local shard where it is sharded, the whole tensor where it is replicated (``ColwiseParallel``'s input,
``RowwiseParallel``'s all-reduced output). A gradient that autograd hands to a DTensor as ``Partial``
(the gradient of ``ColwiseParallel``'s replicated input: each rank's matmul gives one addend) stands
for the sum over the group; its local tensor is one rank's addend, the gradient of nothing. The value
recorded is the sum, which the all-reduce autograd runs anyway (``DTensor.from_local``'s backward) gives."""

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
    events_of,
    init_gloo,
    rank_dirs,
    ref_stats,
    spawn_and_join,
    stats_table,
    want_of,
    write_config,
)
from trainrec.schema.events import HookFailed

pytestmark = pytest.mark.dist

TIMEOUT = 120
STEPS = 2


def _worker(rank: int, world: int, port: int, cfg_path: str, out: str, d: int, rows: int, local: bool) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.environ.pop("DYNAMIC_MONITOR", None)
    init_gloo(rank, world, port)
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from trainrec.recorder import TrainerMon

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = parallelize_blocks(Net(d), mesh, use_local_output=local)
        model.mesh = None if local else mesh
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=opt, tp_group=mesh.get_group())
        # registered after the monitor's: they see the inputs and outputs its hooks see (TP's own
        # pre-hook has made the inputs DTensors, its forward hook has made the outputs local)
        steps: list = []
        grads: list = []  # (key, gradient, placements of the tensor) in backward order: alike on every rank

        def on_grad(key, placements, g):
            grads.append((key, g, placements))

        def hook(name):
            def f(_m, args, out):
                cur = steps[-1]
                for slot, t in (("input", args[0]), ("output", out)):
                    cur[f"{name}/{slot}"] = ref_stats(held(t))
                    if t.requires_grad:
                        t.register_hook(functools.partial(on_grad, f"{name}/{slot}_grad",
                                                          getattr(t, "placements", None)))
                        if hasattr(t, "placements"):
                            cur[f"{name}/{slot}_grad/made_by"] = t.grad_fn.name()
            return f

        for n, m in model.named_modules():
            m.register_forward_hook(hook(n))
        for step in range(STEPS):
            steps.append({})
            grads.clear()
            x = torch.randn(rows, d, generator=torch.Generator().manual_seed(step))  # the same on both ranks
            x.requires_grad_()  # every input has a gradient
            y = model(x)
            (y if local else y.full_tensor()).pow(2).mean().backward()
            cur = steps[-1]
            for key, g, placements in grads:
                if placements is not None:
                    cur[f"{key}/placements"] = str(g.placements)
                    if g.placements != placements:
                        g = g.redistribute(placements=placements)  # Partial: the sum it stands for
                cur[key] = ref_stats(held(g))
            for n, p in model.named_parameters():
                cur[f"{n}/grad"] = ref_stats(p.grad.to_local())
                cur[f"{n}/grad/placements"] = str(p.grad.placements)
                cur[f"{n}/param"] = ref_stats(p.to_local())  # rows taken before the update
            opt.step()
            opt.zero_grad()
        mon.close()
        with open(os.path.join(os.path.dirname(cfg_path), f"want_{rank}.json"), "w") as f:
            json.dump(steps, f)
        dist.barrier()
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[True, False], ids=["local_output", "dtensor_output"])
def res(tmp_path_factory, request) -> dict:
    """One run per plan for the tests of this module: each rank's ``(events, [what it should record, per
    step])``. ``dtensor_output``: the plans' ``use_local_output=False``, the blocks' activations DTensors
    (RowwiseParallel's output one whose local tensor is the all-reduce's AsyncCollectiveTensor)."""
    tmp_path = tmp_path_factory.mktemp("tp")
    out = tmp_path / "out"
    cfg = write_config(tmp_path, {"xy_distribution": True, "all_xy": True, "wg_distribution": True,
                                  "param_distribution": True, "ops": ALL_OPS})
    port = free_port()
    spawn_and_join(_worker, (2, port, cfg, str(out), 8, 4, request.param), 2, TIMEOUT, "2-process tensor-parallel run")
    res = {}
    for dr in rank_dirs(out):
        ev = events_of(dr)
        res[ev[0].rank] = (ev, want_of(tmp_path, ev[0].rank))
    assert sorted(res) == [0, 1]
    return res


def _check(got: dict, want: dict, what: str) -> None:
    assert got is not None, f"{what}: no row"
    assert_close(got, want, rtol=1e-4, atol=1e-7, what=what)


def _partial_elsewhere(want: dict, key: str) -> bool:
    """Whether a gradient reached a DTensor Partial where no DTensor.from_local made that DTensor of a
    local tensor (activations that are DTensors throughout: use_local_output=False): its sum needs a
    collective, which the monitor does not run, so it is recorded as this rank's addend (README), and not
    checked here."""
    return ("Partial" in want.get(f"{key}/placements", "")
            and want.get(f"{key}/made_by") != "_FromTorchTensorBackward")


def test_activations_and_their_gradients_are_what_each_rank_holds(res):
    """Every module's input, output, input_grad and output_grad, per step and rank, all six ops: the
    shards, the replicated tensors whole, and ColwiseParallel's input gradient as the sum over the
    group (recorded as its local tensor, rank 0's addend and rank 1's, it differed between the ranks
    and from the gradient: the local tensor of a Partial DTensor)."""
    for r, (ev, steps) in res.items():
        assert not [e for e in ev if isinstance(e, HookFailed)], r
        table = {**stats_table(ev, "actv"), **stats_table(ev, "actv_grad")}
        for step, want in enumerate(steps):
            # the premise: ColwiseParallel's input gradient reaches its DTensor as a Partial one
            assert want["blocks.1.fc1/input_grad/placements"] == "(Partial(sum),)", want
            keys = [k for k in want if k.count("/") == 1 and not k.endswith(("/grad", "/param"))]
            assert len(keys) == 7 * 4  # Net, 2 blocks, 4 linears: input, output and their gradients
            for key in keys:
                if _partial_elsewhere(want, key):
                    continue
                name, slot = key.rsplit("/", 1)
                _check(table.get((step, name, slot, 0)), want[key], f"rank {r} step {step} {key}")
    for step in range(STEPS):
        for i in (0, 1):  # a replicated tensor's gradient: the same on both ranks
            a, b = (res[r][1][step][f"blocks.{i}.fc1/input_grad"] for r in (0, 1))
            assert_close(a, b, rtol=1e-5, what=f"step {step} blocks.{i}.fc1 input_grad rank 0 vs 1")


def test_weight_gradients_and_parameters_with_tp_group(res):
    """Each rank's shard of the sharded parameters, reduced and unreduced gradients and the parameters
    themselves (before the update), all six ops; the replicated RowwiseParallel bias's reduced gradient
    (the same on both ranks) on rank 0 only, its other rows on both. (With DTensor activations
    throughout, torch leaves the first block's RowwiseParallel gradients Partial, one addend per rank:
    not checked, see _partial_elsewhere.)"""
    names = [f"blocks.{i}.{n}" for i in (0, 1) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    replicated = {"blocks.0.fc2.bias", "blocks.1.fc2.bias"}
    for r, (ev, steps) in res.items():
        for kind, suffix in (("grad_reduced", "grad"), ("grad_unreduced", "grad"), ("param", "param")):
            table = stats_table(ev, kind)
            keep = set(names) - replicated if kind == "grad_reduced" and r else set(names)
            assert {k[1] for k in table} == keep, (r, kind, sorted({k[1] for k in table}))
            assert {k[0] for k in table} == set(range(STEPS)), (r, kind)
            for (step, name, _slot, _micro), row in table.items():
                if suffix == "param" or "Partial" not in steps[step][f"{name}/grad/placements"]:
                    _check(row, steps[step][f"{name}/{suffix}"], f"rank {r} {kind} step {step} {name}")
    for step in range(STEPS):
        for name in replicated:
            if "Partial" in res[0][1][step][f"{name}/grad/placements"]:
                continue
            assert_close(res[0][1][step][f"{name}/grad"], res[1][1][step][f"{name}/grad"], rtol=1e-6,
                         what=f"step {step} {name} grad rank 0 vs 1")
