"""DeepSpeed ZeRO stages 1, 2 and 3 on CPU, two real gloo processes (DeepSpeed's CPU accelerator).

ZeRO keeps the fp32 master weights, the reduced gradient and the Adam state in one flat partition
per param group (ZeRO 3: sub-group) and rank, and steps the torch optimizer once per group; ZeRO 3
also partitions the model's parameters themselves. The monitor, given
``optimizer=engine.optimizer.optimizer`` as the reference documents for DeepSpeed, must count one
training step for those calls together, and record each rank's pieces of the reduced gradient and of
the Adam state. Expected values are computed here without the monitor: this rank's own gradients with
a copy of the net, their average over the ranks with an all-reduce, and Adam's first moment from
those averages by its definition (``m = b1 * m + (1 - b1) * g``), cut to the piece DeepSpeed says
this rank holds (ZeRO 1/2: ``param._hp_mapping``; ZeRO 3: the rank's slice of each parameter).

Every variant runs in one spawned group of two processes (``ds_runs``), one after the other, each into
its own directory: starting DeepSpeed in a new pair of processes per variant was most of this file's
time. A variant that fails leaves its traceback there, and fails its own test only.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import traceback

import pytest
import torch
from ranks import free_port
from trainmon_util import (
    assert_close,
    deepspeed_missing,
    logs_by_rank,
    loss_of,
    make,
    ref_stats,
    spawn_and_join,
    stats_table,
    write_config,
)
from trainrec.schema.events import HookFailed, StepEnded

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(deepspeed_missing() is not None, reason=deepspeed_missing() or "")]

TIMEOUT = 300  # the first run builds DeepSpeed's shared-memory comm op (about a minute, then cached)
STEPS = 3
OPS = ["norm", "min", "max", "mean"]


def _zero_job(rank: int, world: int, cfg_path: str, variant: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from trainrec.recorder import TrainerMon
    from trainrec.recorder.names import squash_all

    stage = int(variant[0])
    zero = {"stage": stage}
    if variant.endswith("buckets"):  # several reductions per backward, overlapping it
        zero.update(overlap_comm=True, reduce_bucket_size=100, allgather_bucket_size=100)
    model, _ = make(seed=0)
    local = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    short = squash_all(names)
    # two param groups, as HF's Trainer makes them (weight decay for weights, none for biases)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "zero_optimization": zero})
    mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(engine.module, grad_acc_steps=1, optimizer=ds_opt.optimizer)
    expected: dict = {}
    moment = {n: torch.zeros_like(q) for n, q in local.named_parameters()}
    params = list(engine.module.parameters())
    for step in range(STEPS):
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):  # ZeRO 3: whole for a moment
            local.load_state_dict(engine.module.state_dict())
        local.zero_grad()
        loss_of(local, 10 * rank + step).backward()
        own = {n: q.grad.detach().clone() for n, q in local.named_parameters()}
        avg = {}
        for n, g in own.items():
            g = g.clone()
            dist.all_reduce(g)
            avg[n] = g / world
            moment[n] = 0.9 * moment[n] + 0.1 * avg[n]
        engine.backward(loss_of(engine, 10 * rank + step))
        engine.step()
        exp = expected[step] = {}
        before = dict(local.named_parameters())  # the values the optimizer pre-step saw
        for n, p in engine.module.named_parameters():
            row = exp[short[n]] = {"unreduced": ref_stats(own[n])}
            if stage == 3:  # every parameter is cut into equal slices, one per rank (the last padded)
                k = p.ds_tensor.numel()
                a = rank * k
                k = min(k, p.ds_numel - a)
                row["param"] = ref_stats(before[n].detach().flatten()[a:a + k])
            elif p._hp_mapping is not None:  # the piece of this parameter in this rank's partition
                a, k = p._hp_mapping.lp_fragment_address.start, p._hp_mapping.lp_fragment_address.numel
            else:
                k = 0
            if k > 0:
                row["reduced"] = ref_stats(avg[n].flatten()[a:a + k])
                row["exp_avg"] = ref_stats(moment[n].flatten()[a:a + k])
                row["numel"] = [k, p.numel()]
    mon.close()
    with open(os.path.join(os.path.dirname(cfg_path), f"ds_{rank}.json"), "w") as f:
        json.dump(expected, f)


_JOBS = {"zero": _zero_job}  # (the other two are added below their functions)


ZERO_VARIANTS = ["1", "2", "2-buckets", "3", "3-buckets"]


@pytest.mark.parametrize("variant", ZERO_VARIANTS)
def test_deepspeed_zero_records_each_ranks_pieces_and_counts_one_step_per_training_step(ds_runs, variant):
    run_dir = ds_runs("zero", variant)
    h = logs_by_rank(run_dir / "out")
    assert sorted(h) == [0, 1]
    holders: dict = {}
    for r in (0, 1):
        ev = h[r][2]
        assert not [e for e in ev if isinstance(e, HookFailed)]
        # the torch optimizer stepped twice per training step (one call per param group): one step each
        ends = [e for e in ev if isinstance(e, StepEnded)]
        assert [e.step for e in ends] == list(range(STEPS)) and all(e.collected for e in ends)
        with open(run_dir / f"ds_{r}.json") as f:
            want = {int(k): v for k, v in json.load(f).items()}
        un = stats_table(ev, "grad_unreduced")
        red = stats_table(ev, "grad_reduced")
        ea = stats_table(ev, "exp_avg")
        for step, params in want.items():
            mine = {n for n, row in params.items() if "reduced" in row}
            assert {k[1] for k in red if k[0] == step} == mine, (r, step)
            assert {k[1] for k in ea if k[0] == step} == mine
            assert {k[1] for k in stats_table(ev, "ratio") if k[0] == step} == mine
            par = stats_table(ev, "param")
            assert {k[1] for k in par if k[0] == step} == set(params)
            for name, row in params.items():
                if "param" in row:
                    assert_close(par[(step, name, "", 0)], row["param"], rtol=1e-5, what=f"rank {r} param {name}")
                assert_close(un[(step, name, "", 0)], row["unreduced"], rtol=1e-5, what=f"rank {r} unreduced {name}")
                if name in mine:
                    assert_close(red[(step, name, "", 0)], row["reduced"], rtol=1e-5, atol=1e-7,
                                 what=f"rank {r} reduced {name}")
                    assert_close(ea[(step, name, "", 0)], row["exp_avg"], rtol=1e-5, atol=1e-8,
                                 what=f"rank {r} exp_avg {name}")
                    if step == 0:
                        holders.setdefault(name, []).append(row["numel"])
    # every parameter is held by the ranks together; the pieces add up to the whole parameter
    assert len(holders) == 9
    assert all(sum(k for k, _ in pieces) == pieces[0][1] for pieces in holders.values())
    assert any(len(pieces) == 2 for pieces in holders.values())  # one straddles the two partitions


def _bf16_job(rank: int, world: int, cfg_path: str, how: str) -> None:
    """ZeRO 0 with bf16: DeepSpeed's FP16_UnfusedOptimizer keeps a whole fp32 master per parameter, and
    the torch optimizer's state is keyed by the masters. ``named``: the wrapper is named with the
    reference's set_wrapped_optimizer, the torch optimizer inside it is given; ``accelerate``:
    accelerate's wrapper of DeepSpeed's optimizer is given as it is. The torch optimizer is hooked."""
    import deepspeed
    from trainrec.recorder import TrainerMon
    from trainrec.recorder.names import squash_all

    model, _ = make(seed=0)
    short = squash_all([n for n, _ in model.named_parameters()])
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                                config={"train_micro_batch_size_per_gpu": 4,
                                                        "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}})
    if how == "named":
        TrainerMon.set_wrapped_optimizer(ds_opt)
        given = ds_opt.optimizer
    else:
        from accelerate import Accelerator
        from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

        Accelerator(cpu=True)  # the wrapper needs accelerate's state
        given = DeepSpeedOptimizerWrapper(ds_opt)
    mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(engine if how == "engine" else engine.module, optimizer=given)
    TrainerMon.set_wrapped_optimizer(None)
    expected: dict = {}
    for step in range(2):
        engine.backward(loss_of(engine, 10 * rank + step))
        engine.step()
        # which fp32 tensor of the torch optimizer's state is which parameter: the one that rounds to it
        state = ds_opt.optimizer.state
        expected[step] = {}
        for n, p in engine.module.named_parameters():
            (master,) = [m for m in state if m.shape == p.shape and torch.equal(m.to(p.dtype), p)]
            expected[step][short[n]] = ref_stats(state[master]["exp_avg"])
    mon.close()
    with open(os.path.join(os.path.dirname(cfg_path), f"bf16_{rank}.json"), "w") as f:
        json.dump(expected, f)


_JOBS["bf16"] = _bf16_job
BF16_VARIANTS = ["named", "accelerate"]


@pytest.mark.parametrize("how", BF16_VARIANTS)
def test_deepspeed_bf16_masters_give_the_adam_state(ds_runs, how):
    run_dir = ds_runs("bf16", how)
    h = logs_by_rank(run_dir / "out")
    for r in (0, 1):
        with open(run_dir / f"bf16_{r}.json") as f:
            want = {int(k): v for k, v in json.load(f).items()}
        ea = stats_table(h[r][2], "exp_avg")
        for step, rows in want.items():
            assert {k[1] for k in ea if k[0] == step} == set(rows) == {k[1] for k in stats_table(h[r][2], "ratio")
                                                                      if k[0] == step}
            for name, row in rows.items():
                assert_close(ea[(step, name, "", 0)], row, rtol=1e-5, atol=1e-9, what=f"rank {r} exp_avg {name}")


def _overflow_job(rank: int, world: int, cfg_path: str, variant: str) -> None:
    """fp16 with DeepSpeed's dynamic loss scale, and an inf in rank 1's loss at ``inf_step``: DeepSpeed
    finds the overflow in the reduced gradients (rank 0's own are finite) and skips the step on both
    ranks. ``variant``: the ZeRO stage, then how the monitor knows DeepSpeed's optimizer (``wrapped``:
    the reference's set_wrapped_optimizer; ``given``: it is the ``optimizer`` argument; ``accelerate``:
    accelerate's wrapper of it is; ``engine``: the model given is DeepSpeed's engine, as accelerate's
    prepare() returns it, with the torch optimizer; ``z3``: ZeRO 3's parameters name it; ``inner``: the
    reference's ``optimizer=optimizer.optimizer`` with ``engine.module``, and nothing else: DeepSpeed's gradient
    hooks on the parameters name it), then the steps with the inf (digits)."""
    import deepspeed
    from trainrec.recorder import TrainerMon

    stage, how, inf_step = variant.split("-")
    accel = deepspeed.get_accelerator()
    if not accel.is_fp16_supported():
        # DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fast fp16 kernels (AVX512-FP16 or
        # AMX: not on the AMD EPYC development VM); torch's CPU kernels compute in fp16 everywhere, and
        # this test is about DeepSpeed's loss scaler, not speed
        accel.is_fp16_supported = lambda: True
    model, opt = make(seed=0)
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": int(stage)},
        "fp16": {"enabled": True, "initial_scale_power": 4}})
    if how == "wrapped":
        TrainerMon.set_wrapped_optimizer(ds_opt)
    mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
    if how == "accelerate":  # accelerate's wrapper around DeepSpeed's optimizer, given as it is
        from accelerate import Accelerator
        from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

        Accelerator(cpu=True)  # the wrapper needs accelerate's state
        given = DeepSpeedOptimizerWrapper(ds_opt)
    else:
        given = ds_opt if how == "given" else ds_opt.optimizer
    mon.monitor_gnorm_with_ad(engine if how == "engine" else engine.module, optimizer=given)
    try:
        for step in range(4):
            loss = loss_of(engine, 10 * rank + step)
            if rank == 1 and str(step) in inf_step:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        mon.close()
    finally:
        TrainerMon.set_wrapped_optimizer(None)


_JOBS["overflow"] = _overflow_job
OVERFLOW_VARIANTS = ["2-wrapped-0", "3-z3-0", "1-given-01", "2-accelerate-0", "2-engine-0", "2-wrapped-2",
                     "1-inner-0", "2-inner-02", "0-inner-0"]


@pytest.mark.parametrize("variant", OVERFLOW_VARIANTS)
def test_deepspeed_overflow_of_another_rank_skips_the_step_on_both(ds_runs, variant):
    """DeepSpeed skips the step on every rank when the reduced gradients overflow, though rank 0's own
    gradients are finite: where the monitor knows DeepSpeed's optimizer, its overflow flag says so, also
    at the run's first step (before it, the monitor had no passes per step to go by: rank 0 merged the
    skipped step into the next one and numbered the later steps one less than rank 1)."""
    h = logs_by_rank(ds_runs("overflow", variant) / "out")
    skipped = variant.rsplit("-", 1)[1]
    for r in (0, 1):
        assert not [e for e in h[r][2] if isinstance(e, HookFailed)]
        ended = [(e.step, e.optimizer_skipped) for e in h[r][2] if isinstance(e, StepEnded)]
        assert ended == [(s, str(s) in skipped) for s in range(4)], (r, ended)


def _group(rank: int, world: int, port: int, jobs: list) -> None:
    """One rank of the shared group: DeepSpeed started once, then every job in turn, each recording into
    ``out`` beside its config; a job's exception goes to ``error_{rank}.txt`` there and the next job runs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.environ.pop("DYNAMIC_MONITOR", None)
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    for kind, cfg_path, variant in jobs:
        job_dir = os.path.dirname(cfg_path)
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(job_dir, "out")
        try:
            _JOBS[kind](rank, world, cfg_path, variant)
        except BaseException:  # noqa: BLE001 - reported by the job's own test
            with open(os.path.join(job_dir, f"error_{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
        dist.barrier()
    dist.destroy_process_group()


_CONFIGS = {
    "zero": {"wg_distribution": True, "mv_distribution": True, "ur_distribution": True,
             "param_distribution": True, "ops": OPS},
    "bf16": {"mv_distribution": True, "ur_distribution": True, "ops": OPS},
    "overflow": {"wg_distribution": True, "ops": ["norm"]},
}


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    """Every variant of this file run by one group; returns ``(kind, variant) -> its directory`` as a
    function that fails the calling test where that variant raised on a rank."""
    root = tmp_path_factory.mktemp("deepspeed")
    jobs, dirs = [], {}
    for kind, variants in (("zero", ZERO_VARIANTS), ("bf16", BF16_VARIANTS), ("overflow", OVERFLOW_VARIANTS)):
        for variant in variants:
            d = root / f"{kind}-{variant}"
            d.mkdir()
            jobs.append((kind, write_config(d, _CONFIGS[kind]), variant))
            dirs[kind, variant] = d
    spawn_and_join(_group, (2, free_port(), jobs), 2, TIMEOUT * 4, "the DeepSpeed group")

    def run_of(kind: str, variant: str):
        d = dirs[kind, variant]
        errors = sorted(d.glob("error_*.txt"))
        if errors:
            pytest.fail("\n".join(f"{p.name}:\n{p.read_text()}" for p in errors))
        return d

    return run_of
