"""Real torch.distributed (gloo) runs with 2 and 4 processes: one log per rank, ranks, world size, a
shared run id, pipeline stage from process_group, and dp_group / tp_group deduplication."""

from __future__ import annotations

import glob
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from trainmon_util import events_of, loss_of, make, rank_dirs, stats_table, write_config
from trainrec.schema.events import FileOpened

TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg_path: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    try:
        from trainrec.recorder import TrainerMon

        model, _ = make(seed=0)
        if mode == "ddp":
            pg = None
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
            mon.monitor_gnorm_with_ad(model, optimizer=opt, dp_group=dist.group.WORLD)
            net = ddp
        else:  # 4 ranks: tp groups {0,1},{2,3}; dp groups {0,2},{1,3}
            tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            tp_group, dp_group = tp[rank // 2], dp[rank % 2]
            model.head.weight.tensor_model_parallel = True
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            mon = TrainerMon(cfg_path, process_group=dp_group, params_have_main_grad=False, live_export=False)
            mon.monitor_gnorm_with_ad(model, optimizer=opt, dp_group=dp_group, tp_group=tp_group)
            net = model
            pg = dp_group
        for step in range(2):
            loss_of(net, 100 * rank + step).backward()
            opt.step()
            opt.zero_grad()
        mon.close()
        del pg
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, tmp_path, monkeypatch, mode: str) -> None:
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ["norm", "max"]})
    ctx = mp.start_processes(_worker, args=(world, free_port(), cfg, mode), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world}-process gloo run did not finish in {TIMEOUT} s")
    return out


def headers(out) -> dict:
    res = {}
    for d in rank_dirs(out):
        (log,) = glob.glob(os.path.join(d, "*.trl"))
        ev = events_of(log)
        fo = ev[0]
        assert isinstance(fo, FileOpened)
        res[fo.rank] = (d, fo, ev)
    return res


def test_two_ranks_ddp_one_log_per_rank_and_dp_dedup(tmp_path, monkeypatch):
    out = run(2, tmp_path, monkeypatch, "ddp")
    h = headers(out)
    assert sorted(h) == [0, 1]
    assert {fo.world_size for _, fo, _ in h.values()} == {2}
    assert len({fo.run_id for _, fo, _ in h.values()}) == 1
    for r, (d, fo, _) in h.items():
        assert f"-rank{r}-" in os.path.basename(d) and fo.dir_name == os.path.basename(d)
    red0 = stats_table(h[0][2], "grad_reduced")
    un0 = stats_table(h[0][2], "grad_unreduced")
    un1 = stats_table(h[1][2], "grad_unreduced")
    assert stats_table(h[1][2], "grad_reduced") == {}  # dp duplicate: only the dp group's first rank
    assert red0 and un1
    # DDP averaged the two ranks' different gradients in place: the reduced rows are recomputed
    key = (0, "head.weight", "", 0)
    assert red0[key]["norm"] != un0[key]["norm"]
    assert red0[key]["norm"] <= max(un0[key]["norm"], un1[key]["norm"]) + 1e-6


def test_four_ranks_tp_dp_dedup_and_pipeline_stage(tmp_path, monkeypatch):
    out = run(4, tmp_path, monkeypatch, "groups")
    h = headers(out)
    assert sorted(h) == [0, 1, 2, 3]
    assert len({fo.run_id for _, fo, _ in h.values()}) == 1
    assert {r: (fo.pp_stage, tuple(fo.group_mates)) for r, (_, fo, _) in h.items()} == {
        0: (0, (0, 2)), 1: (0, (1, 3)), 2: (1, (0, 2)), 3: (1, (1, 3))}
    names = {r: {k[1] for k in stats_table(ev, "grad_reduced")} for r, (_, _, ev) in h.items()}
    assert names[2] == set() and names[3] == set()  # dp rank 1
    assert names[1] == {"head.weight"}  # tp rank 1 keeps only tensor-parallel params
    assert "head.bias" in names[0] and "head.weight" in names[0]
    for r in range(4):
        assert stats_table(h[r][2], "grad_unreduced")
