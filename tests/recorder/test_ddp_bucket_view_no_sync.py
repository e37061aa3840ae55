"""Plain DDP with ``gradient_as_bucket_view=True`` (``.grad`` a view into DDP's buckets, small buckets:
several all-reduces per backward) and gradient accumulation, the first of two micro steps under
``no_sync()``, in a real 2-process gloo group, all six ops against the worker's own torch statistics.

Each micro step's unreduced row is this rank's accumulated local gradient at that point (a copy of the
net without DDP gives it), not the average DDP writes into the bucket during the second backward; the
reduced row is DDP's average of the two ranks' accumulated gradients, kept on rank 0 (``dp_group``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ranks import free_port
from trainmon_util import (
    ALL_OPS,
    assert_close,
    init_gloo,
    loss_of,
    make,
    ref_stats,
    spawn_and_join,
    stats_table,
    want_of,
)
from trainmon_util import write_config as _write_config
from trainrec.recorder.names import squash_all
from trainrec.replay import open_run

pytestmark = pytest.mark.dist

TIMEOUT = 120
STEPS = 2
ACC = 2


def _worker(rank: int, world: int, port: int, cfg_path: str, out: str, set_to_none: bool) -> None:
    import copy

    import torch.distributed as dist

    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.environ.pop("DYNAMIC_MONITOR", None)
    init_gloo(rank, world, port)
    try:
        from trainrec.recorder import TrainerMon

        model, _ = make(seed=0)
        local = copy.deepcopy(model)  # this rank's own gradients
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.001)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
        mon.monitor_gnorm_with_ad(model, grad_acc_steps=ACC, optimizer=opt, dp_group=dist.group.WORLD)
        short = squash_all([n for n, _ in model.named_parameters()])
        want: dict = {"unreduced": {}, "reduced": {}, "average": {}}
        for step in range(STEPS):
            local.load_state_dict(model.state_dict())
            local.zero_grad()
            for micro in range(ACC):
                i = 100 * rank + 10 * step + micro
                loss_of(local, i).backward()
                want["unreduced"][f"{step}/{micro}"] = {short[n]: ref_stats(p.grad) for n, p in local.named_parameters()}
                if micro < ACC - 1:
                    with ddp.no_sync():
                        loss_of(ddp, i).backward()
                else:
                    loss_of(ddp, i).backward()
            want["reduced"][str(step)] = {short[n]: ref_stats(p.grad) for n, p in model.named_parameters()}
            avg = {}
            for n, p in local.named_parameters():  # the average of the ranks' accumulated gradients
                g = p.grad.clone()
                dist.all_reduce(g)
                avg[short[n]] = ref_stats(g / world)
            want["average"][str(step)] = avg
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        mon.close()
        with open(os.path.join(os.path.dirname(cfg_path), f"want_{rank}.json"), "w") as f:
            json.dump(want, f)
        dist.barrier()
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_bucket_view_no_sync_unreduced_per_micro_step_and_reduced_average(tmp_path, set_to_none):
    out = tmp_path / "out"
    cfg = _write_config(tmp_path, {"wg_distribution": True, "ops": ALL_OPS})
    port = free_port()
    spawn_and_join(_worker, (2, port, cfg, str(out), set_to_none), 2, TIMEOUT, "2-process DDP bucket-view run")
    run = open_run(str(out))
    assert run.ranks == [0, 1]
    want = {}
    for r in (0, 1):
        want[r] = want_of(tmp_path, r)
    names = set(want[0]["reduced"]["0"])
    for r in (0, 1):
        un = stats_table(run.events(r), "grad_unreduced")
        assert {(k[0], k[3]) for k in un} == {(s, m) for s in range(STEPS) for m in range(ACC)}
        assert len(un) == STEPS * ACC * len(names)
        for (step, name, _slot, micro), row in un.items():
            assert_close(row, want[r]["unreduced"][f"{step}/{micro}"][name], rtol=1e-4, atol=1e-7,
                         what=f"rank {r} step {step} micro {micro} {name} unreduced")
        red = stats_table(run.events(r), "grad_reduced")
        if r:
            assert red == {}  # a dp_group duplicate of rank 0's
            continue
        assert {(k[0], k[1], k[3]) for k in red} == {(s, n, 0) for s in range(STEPS) for n in names}
        for (step, name, _slot, _micro), row in red.items():
            assert_close(row, want[r]["reduced"][str(step)][name], rtol=1e-4, atol=1e-7,
                         what=f"rank {r} step {step} {name} reduced")
            assert_close(row, want[r]["average"][str(step)][name], rtol=1e-4, atol=1e-6,
                         what=f"rank {r} step {step} {name} average")
    # the ranks' own gradients differ: the unreduced rows are not the average
    assert want[0]["unreduced"]["0/1"]["head.weight"] != want[0]["average"]["0"]["head.weight"]
