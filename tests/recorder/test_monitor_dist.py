"""Real torch.distributed (gloo) runs with 2 and 4 processes: one log per rank, ranks, world size, a
shared run id, pipeline stage from process_group, and dp_group / tp_group deduplication."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
from ranks import free_port
from trainmon_util import (
    init_gloo,
    logs_by_rank,
    loss_of,
    make,
    spawn_and_join,
    stats_table,
    write_config,
)

pytestmark = pytest.mark.dist

TIMEOUT = 120


def _worker(rank: int, world: int, port: int, cfg_path: str, mode: str) -> None:
    init_gloo(rank, world, port)
    try:
        from trainrec.recorder import TrainerMon

        model, _ = make(seed=0)
        local = None
        if mode == "ddp_unused":
            model.unused = torch.nn.Linear(3, 3)  # never called: no gradient, no hook firing
        if mode == "ddp_acc":  # gradient accumulation over 2 micro steps, the first under no_sync()
            import copy
            import json

            from trainrec.recorder.names import squash_all

            local = copy.deepcopy(model)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
            mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt, dp_group=dist.group.WORLD)
            short = squash_all([n for n, _ in model.named_parameters()])
            expected = {}
            for step in range(2):
                local.load_state_dict(model.state_dict())
                local.zero_grad()
                for micro in range(2):
                    batch = 100 * rank + 10 * step + micro
                    loss_of(local, batch).backward()  # .grad accumulates: what the hook sees at this micro step
                    expected[f"{step}/{micro}"] = {short[n]: float(q.grad.norm()) for n, q in local.named_parameters()}
                    if micro == 0:
                        with ddp.no_sync():
                            loss_of(ddp, batch).backward()
                    else:
                        loss_of(ddp, batch).backward()
                opt.step()
                opt.zero_grad()
            mon.close()
            with open(os.path.join(os.path.dirname(cfg_path), f"ddp_acc_{rank}.json"), "w") as f:
                json.dump(expected, f)
            dist.barrier()
            return
        if mode in ("ddp_view", "ddp_unused"):
            import copy

            local = copy.deepcopy(model)  # the same net without DDP: this rank's own gradients
        if mode == "fsdp2":  # parameters, gradients and Adam state are DTensors: each rank holds a shard
            import copy

            from torch.distributed.fsdp import fully_shard

            pg = None
            fsdp2_local = copy.deepcopy(model)  # this rank's own gradient, before FSDP reduce-scatters it
            fully_shard(model)
            net = model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
            # dp_group: each rank still records its own shard of the reduced gradients (not duplicates)
            mon.monitor_gnorm_with_ad(model, optimizer=opt, dp_group=dist.group.WORLD)
        elif mode == "zero":  # torch's ZeRO-1: each rank's local AdamW holds the state of its shard
            from torch.distributed.optim import ZeroRedundancyOptimizer

            pg = None
            net = torch.nn.parallel.DistributedDataParallel(model)
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
            mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
            mon.monitor_gnorm_with_ad(model, optimizer=opt, dp_group=dist.group.WORLD)
        elif mode in ("fsdp1", "fsdp1_flat"):  # orig params: 1-d views of this rank's part of the flat parameters
            import logging

            from torch.distributed.fsdp import FullyShardedDataParallel

            pg = None
            warned: list = []
            handler = logging.Handler()
            handler.emit = lambda record: warned.append(record.getMessage())
            for name in ("trainrec.recorder.monitor", "trainrec.recorder.failures"):  # (warn_once's)
                logging.getLogger(name).addHandler(handler)
            if mode == "fsdp1_flat":
                import copy

                local = copy.deepcopy(model)
            net = FullyShardedDataParallel(model, use_orig_params=mode == "fsdp1", device_id=torch.device("cpu"))
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
            mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
            mon.monitor_gnorm_with_ad(net, optimizer=opt, dp_group=dist.group.WORLD)
            expected = {"warned": warned}
        elif mode in ("ddp", "ddp_view", "ddp_unused"):
            pg = None
            # ddp_view: grads are views into DDP's buckets, which are averaged in place while backward
            # goes on (small buckets: several all-reduces per backward); ddp_unused: DDP copies the
            # averaged buckets into .grad at the end of backward, and not every parameter fires
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, gradient_as_bucket_view=mode == "ddp_view", bucket_cap_mb=0.001 if mode == "ddp_view" else 25,
                find_unused_parameters=mode == "ddp_unused")
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
        expected = {} if not mode.startswith("fsdp1") else expected
        for step in range(2):
            if mode == "fsdp1_flat":  # the flat parameter's gradient before reduce-scatter: the whole unit's
                with FullyShardedDataParallel.summon_full_params(net):
                    local.load_state_dict({k.replace("_fsdp_wrapped_module.", ""): v.clone() for k, v in
                                           net.state_dict().items()})
                local.zero_grad()
                loss_of(local, 100 * rank + step).backward()
                expected[f"flat{step}"] = float(torch.cat([q.grad.flatten() for q in local.parameters()]).norm())
            elif local is not None:
                local.load_state_dict(model.state_dict())
                local.zero_grad()
                loss_of(local, 100 * rank + step).backward()
                from trainrec.recorder.names import squash_all

                short = squash_all([n for n, _ in local.named_parameters()])  # the names the log uses
                expected[step] = {short[n]: float(q.grad.norm()) for n, q in local.named_parameters()
                                  if q.grad is not None}
            if mode == "fsdp2":
                from trainrec.recorder.names import squash_all

                fsdp2_local.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
                fsdp2_local.zero_grad()
                loss_of(fsdp2_local, 100 * rank + step).backward()
                short = squash_all([n for n, _ in fsdp2_local.named_parameters()])
                expected[f"un{step}"] = {short[n]: float(q.grad.norm()) for n, q in fsdp2_local.named_parameters()}
            loss_of(net, 100 * rank + step).backward()
            if mode == "fsdp2":

                short = squash_all([n for n, _ in model.named_parameters()])
                expected[step] = {short[n]: float(q.to_local().norm()) for n, q in model.named_parameters()}
                expected[f"grad{step}"] = {short[n]: float(q.grad.to_local().norm()) for n, q in model.named_parameters()}
            if mode == "fsdp1":
                from trainrec.recorder.names import squash_all

                short = squash_all([n for n, _ in net.named_parameters()])
                expected[f"grad{step}"] = {short[n]: float(q.grad.norm()) for n, q in net.named_parameters()
                                           if q.grad is not None and q.numel()}
            opt.step()
            if mode == "zero":
                from trainrec.recorder.names import squash_all

                short = squash_all([n for n, _ in model.named_parameters()])
                state = opt.optim.state
                expected[step] = {short[n]: float(state[q]["exp_avg"].norm())
                                  for n, q in model.named_parameters() if q in state}
            opt.zero_grad()
        mon.close()
        if mode in ("zero", "fsdp2", "fsdp1", "fsdp1_flat"):
            import json

            with open(os.path.join(os.path.dirname(cfg_path), f"{mode}_state_{rank}.json"), "w") as f:
                json.dump(expected, f)
        if local is not None and mode != "fsdp1_flat":
            import json

            with open(os.path.join(os.path.dirname(cfg_path), f"local_grads_{rank}.json"), "w") as f:
                json.dump(expected, f)
        del pg
        # DDP's reducer, ZeRO's optimizer and their gloo work objects go while the process group is alive:
        # left to the interpreter's exit, gloo's teardown sometimes aborted a worker ("terminate called
        # without an active exception", SIGABRT) in full-suite runs
        net = opt = mon = model = local = None  # noqa: F841
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, tmp_path, monkeypatch, mode: str, cfg: dict | None = None) -> None:
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path, cfg or {"wg_distribution": True, "ops": ["norm", "max"]})
    spawn_and_join(_worker, (world, free_port(), cfg, mode), world, TIMEOUT, f"{world}-process gloo run")
    return out


def test_two_ranks_ddp_one_log_per_rank_and_dp_dedup(tmp_path, monkeypatch):
    out = run(2, tmp_path, monkeypatch, "ddp")
    h = logs_by_rank(out)
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
    h = logs_by_rank(out)
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


@pytest.mark.parametrize("mode", ["ddp_view", "ddp_unused"])
def test_ddp_unreduced_grads_are_this_ranks_own(tmp_path, monkeypatch, mode):
    """The unreduced rows are this rank's own gradients (as a copy of the net without DDP computes them)
    and the reduced ones the average: with gradient_as_bucket_view (.grad is a view into a DDP bucket,
    averaged in place during backward), and with an unused parameter (the batch is not complete when
    DDP copies the averaged buckets into .grad at the end of backward)."""
    import json

    out = run(2, tmp_path, monkeypatch, mode)
    h = logs_by_rank(out)
    local = {}
    for r in (0, 1):
        with open(tmp_path / f"local_grads_{r}.json") as f:
            local[r] = json.load(f)
    for r in (0, 1):
        un = stats_table(h[r][2], "grad_unreduced")
        assert len(un) == 2 * len(local[r]["0"])
        for (step, name, _, _), row in un.items():
            want = local[r][str(step)][name]
            assert abs(row["norm"] - want) <= 1e-5 * want + 1e-7, (r, step, name, row["norm"], want)
    red = stats_table(h[0][2], "grad_reduced")
    assert red[(0, "head.weight", "", 0)]["norm"] != local[0]["0"]["head.weight"]


def test_zero_redundancy_optimizer_each_rank_records_its_shards_adam_state(tmp_path, monkeypatch):
    """torch's ZeroRedundancyOptimizer keeps each parameter's Adam state on one rank (its local
    optimizer): that rank records exp_avg/exp_avg_sq/update/ratio for it, the ranks together cover
    every parameter once, and the values are the local optimizer's."""
    import json

    cfg = {"mv_distribution": True, "ur_distribution": True, "ops": ["norm", "max"]}
    out = run(2, tmp_path, monkeypatch, "zero", cfg)
    h = logs_by_rank(out)
    owned = {}
    for r in (0, 1):
        with open(tmp_path / f"zero_state_{r}.json") as f:
            want = json.load(f)
        ea = stats_table(h[r][2], "exp_avg")
        assert ea and {k[1] for k in ea} == set(want["0"]) == {k[1] for k in stats_table(h[r][2], "ratio")}
        for (step, name, _, _), row in ea.items():
            assert abs(row["norm"] - want[str(step)][name]) <= 1e-5 * want[str(step)][name] + 1e-9
        owned[r] = set(want["0"])
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert len(owned[0] | owned[1]) == 9  # TinyNet's parameters, each on one rank


def test_fsdp2_dtensors_record_each_ranks_local_shard(tmp_path, monkeypatch):
    """FSDP2 (fully_shard) makes parameters, gradients and Adam state DTensors without storage of their
    own: training runs (the statistics kernel was given address 0 and crashed the process before), no
    hook fails, each rank records the statistics of its local shards, and its unreduced gradients are
    its own whole ones, taken before FSDP reduce-scatters them (they were the reduced shards)."""
    import json

    from trainrec.schema.events import HookFailed

    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True, "ur_distribution": True,
           "xy_distribution": True, "ops": ["norm", "max"]}
    out = run(2, tmp_path, monkeypatch, "fsdp2", cfg)
    h = logs_by_rank(out)
    for r in (0, 1):
        ev = h[r][2]
        assert not [e for e in ev if isinstance(e, HookFailed)]
        with open(tmp_path / f"fsdp2_state_{r}.json") as f:
            want = json.load(f)
        par = stats_table(ev, "param")
        assert len(par) == 2 * len(want["0"])
        for (step, name, _, _), row in par.items():
            assert abs(row["norm"] - want[str(step)][name]) <= 1e-5 * want[str(step)][name] + 1e-9, (r, name)
        red = stats_table(ev, "grad_reduced")  # on both ranks, dp_group given: shards, not duplicates
        assert len(red) == 2 * len(want["0"]), (r, len(red))
        for (step, name, _, _), row in red.items():
            w = want[f"grad{step}"][name]
            assert abs(row["norm"] - w) <= 1e-5 * w + 1e-9, (r, name, row["norm"], w)
        un = stats_table(ev, "grad_unreduced")  # this rank's whole gradient, before reduce-scatter
        assert len(un) == 2 * len(want["0"])
        for (step, name, _, _), row in un.items():
            w = want[f"un{step}"][name]
            assert abs(row["norm"] - w) <= 1e-5 * w + 1e-9, (r, name, row["norm"], w)
        for kind in ("exp_avg", "ratio", "actv"):
            assert stats_table(ev, kind), (r, kind)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fsdp1_warns_and_records_each_ranks_shards(tmp_path, monkeypatch):
    """FSDP1 (FullyShardedDataParallel, use_orig_params=True) accumulates gradients in its flat
    parameters, so the parameters' own gradient hooks never fire: a warning says that unreduced rows
    are not recorded, and each rank records its own shard of the reduced gradients (not deduplicated
    by dp_group: they differ by rank), with activations as usual and no hook failing."""
    import json

    from trainrec.schema.events import HookFailed

    cfg = {"wg_distribution": True, "param_distribution": True, "xy_distribution": True, "ops": ["norm", "max"]}
    out = run(2, tmp_path, monkeypatch, "fsdp1", cfg)
    h = logs_by_rank(out)
    for r in (0, 1):
        with open(tmp_path / f"fsdp1_state_{r}.json") as f:
            want = json.load(f)
        assert any("FullyShardedDataParallel (FSDP1)" in m and "grad_unreduced" in m for m in want["warned"])
        ev = h[r][2]
        assert not [e for e in ev if isinstance(e, HookFailed)]
        assert stats_table(ev, "grad_unreduced") == {}
        assert stats_table(ev, "actv") and stats_table(ev, "param")
        red = stats_table(ev, "grad_reduced")
        assert red and {(s, n) for s, n, _, _ in red} == {(s, n) for s in (0, 1) for n in want[f"grad{s}"]}, r
        for (step, name, _, _), row in red.items():
            w = want[f"grad{step}"][name]
            assert abs(row["norm"] - w) <= 1e-5 * w + 1e-9, (r, name, row["norm"], w)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fsdp1_flat_parameters_record_unreduced_gradients_without_a_warning(tmp_path, monkeypatch):
    """FSDP1 with use_orig_params=False: the flat parameter is the module's parameter, its gradient hook
    sees this rank's whole local gradient of the unit before reduce-scatter, so no warning says
    otherwise and each rank's unreduced row is that gradient."""
    import json

    out = run(2, tmp_path, monkeypatch, "fsdp1_flat", {"wg_distribution": True, "ops": ["norm"]})
    h = logs_by_rank(out)
    for r in (0, 1):
        with open(tmp_path / f"fsdp1_flat_state_{r}.json") as f:
            want = json.load(f)
        assert not [m for m in want["warned"] if "FSDP1" in m], want["warned"]
        un = stats_table(h[r][2], "grad_unreduced")
        assert {(s, n) for s, n, _, _ in un} == {(s, "_fsdp_wrapped_module._flat_param") for s in (0, 1)}, sorted(un)
        for (step, _, _, _), row in un.items():
            w = want[f"flat{step}"]
            assert abs(row["norm"] - w) <= 1e-5 * w, (r, step, row["norm"], w)


def test_ddp_gradient_accumulation_with_no_sync_records_each_micro_steps_own_gradient(tmp_path, monkeypatch):
    """Two micro steps, the first under DDP's no_sync(): the unreduced row of each micro step is this
    rank's accumulated .grad at that point (not the average DDP writes after the second)."""
    import json

    out = run(2, tmp_path, monkeypatch, "ddp_acc")
    h = logs_by_rank(out)
    for r in (0, 1):
        with open(tmp_path / f"ddp_acc_{r}.json") as f:
            want = json.load(f)
        un = stats_table(h[r][2], "grad_unreduced")
        assert len(un) == 2 * 2 * 9
        for (step, name, _, micro), row in un.items():
            w = want[f"{step}/{micro}"][name]
            assert abs(row["norm"] - w) <= 1e-5 * w + 1e-7, (r, step, micro, name, row["norm"], w)
