"""Real gloo groups and how ranks find each other: monitors made before init_process_group (with and
without an elastic run id), on some ranks only, targets of other pipeline stages, dynamic config
agreement after a late init, and every rank agreeing on a step another rank's inf skipped."""

from __future__ import annotations

import gc
import glob
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
    rank_dirs,
    spawn_and_join,
    stats_table,
    write_config,
)

pytestmark = pytest.mark.dist

TIMEOUT = 120


def _late_init_worker(rank: int, world: int, port: int, cfg_path: str, elastic_id: str) -> None:
    """TrainerMon made before init_process_group (msprobe's documentation does so), rank and world size
    from the environment as torchrun sets them (its TORCHELASTIC_RUN_ID is "none" without --rdzv-id)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID=elastic_id)
    from trainrec.recorder import TrainerMon

    mon = TrainerMon(cfg_path, params_have_main_grad=False)
    init_gloo(rank, world, port)
    try:
        model, _ = make(seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        mon.monitor_gnorm_with_ad(model, optimizer=opt, dp_group=dist.group.WORLD)
        for step in range(2):
            loss_of(ddp, 10 * rank + step).backward()
            opt.step()
            opt.zero_grad()
        mon.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("elastic_id", ["late-init", "none"])
def test_monitor_made_before_init_process_group_still_dedups(tmp_path, monkeypatch, elastic_id):
    """Also without a run id in the environment: the ranks agree on one when torch.distributed is up
    (the empty logs opened before it are replaced), so replay sees one run of two ranks."""
    from trainrec.replay import open_run

    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("TRAINREC_RUN_ID", raising=False)
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"], "format": "csv"})
    spawn_and_join(_late_init_worker, (2, free_port(), cfg, elastic_id), 2, TIMEOUT, "2-process gloo run, late init")
    h = logs_by_rank(out)
    assert len(rank_dirs(out)) == 2  # no directory left of the logs opened before
    assert sorted(h) == [0, 1] and {fo.world_size for _, fo, _ in h.values()} == {2}
    assert len({fo.run_id for _, fo, _ in h.values()}) == 1
    assert open_run(str(out)).ranks == [0, 1]
    for d, _, _ in h.values():  # the live CSV export followed the log it was opened again with
        assert glob.glob(os.path.join(d, "grad_unreduced_*.csv"))
    assert stats_table(h[0][2], "grad_reduced") and stats_table(h[1][2], "grad_unreduced")
    assert stats_table(h[1][2], "grad_reduced") == {}  # rank 1 of dp_group: a duplicate of rank 0's


def _some_ranks_worker(rank: int, world: int, port: int, cfg_path: str) -> None:
    """A monitor on some ranks only: first rank 1's alone, which waits for rank 0's run id a moment
    (shortened here), warns, and takes one of its own; then rank 0's (the other trains unmonitored)."""
    import logging

    from trainrec.recorder import TrainerMon, runinfo

    runinfo.RUN_ID_WAIT_S = 2.0
    warned: list = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("trainrec.recorder.runinfo").addHandler(handler)
    init_gloo(rank, world, port)
    try:
        for owner in (1, 0):
            model, _ = make(seed=0)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            mon = None
            if rank == owner:
                mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
                mon.monitor_gnorm_with_ad(model, optimizer=opt)
            for step in range(2):
                loss_of(ddp, 10 * rank + step).backward()  # DDP's all-reduce: every rank must get here
                opt.step()
                opt.zero_grad()
            if mon is not None:
                mon.close()
            ddp = opt = mon = model = None  # noqa: F841
            gc.collect()
            dist.barrier()
        if rank == 1:
            assert any("rank 0 has made no TrainerMon" in m for m in warned), warned
    finally:
        dist.destroy_process_group()


def test_monitor_on_some_ranks_only_blocks_no_rank(tmp_path, monkeypatch):
    """The run id reaches the other ranks through the process group's store, not a collective: a monitor
    made on rank 1 only, then on rank 0 only, lets DDP training go on, and each records its steps."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("TRAINREC_RUN_ID", raising=False)
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]})
    spawn_and_join(_some_ranks_worker, (2, free_port(), cfg), 2, TIMEOUT, "2-process gloo run, one monitor")
    h = logs_by_rank(out)
    assert sorted(h) == [0, 1] and {fo.world_size for _, fo, _ in h.values()} == {2}
    assert h[0][1].run_id != h[1][1].run_id  # rank 1's monitor waited for rank 0's in vain
    for r in (0, 1):
        assert {k[0] for k in stats_table(h[r][2], "grad_unreduced")} == {0, 1}


def _stage_worker(rank: int, world: int, port: int, cfg_path: str) -> None:
    """Two pipeline-like stages: rank 0 holds the embedding and a layer, rank 1 a layer and the head (each
    trains its own part here; the monitor sees only this rank's modules, as under pipeline parallelism)."""
    from collections import OrderedDict

    init_gloo(rank, world, port)
    try:
        from trainrec.recorder import TrainerMon

        torch.manual_seed(rank)
        first = [("embed", torch.nn.Embedding(16, 8))] if rank == 0 else []
        last = [("head", torch.nn.Linear(8, 4))] if rank == 1 else []
        model = torch.nn.Sequential(OrderedDict([*first, ("layer", torch.nn.Linear(8, 8)), *last]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        for _ in range(2):
            x = torch.randint(0, 16, (4, 3)) if rank == 0 else torch.randn(4, 3, 8)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        mon.close()
    finally:
        dist.destroy_process_group()


def test_targets_of_other_pipeline_stages_do_not_stop_a_rank(tmp_path, monkeypatch):
    """A target that matches nothing on one rank (the first stage's embedding, the last stage's head) is a
    warning there, not a ConfigError that would stop that rank at start-up; each rank records its own."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    cfg = write_config(tmp_path, {"wg_distribution": True, "xy_distribution": True, "ops": ["norm"],
                                  "targets": {"embed": {}, "head": {}}})
    spawn_and_join(_stage_worker, (2, free_port(), cfg), 2, TIMEOUT, "2-process gloo run, pipeline-like stages")
    h = logs_by_rank(out)
    names = {r: {k[1] for k in stats_table(h[r][2], "grad_reduced")} for r in (0, 1)}
    assert names == {0: {"embed.weight"}, 1: {"head.weight", "head.bias"}}
    actv = {r: {k[1] for k in stats_table(h[r][2], "actv")} for r in (0, 1)}
    assert actv == {0: {"embed"}, 1: {"head"}}


def _late_init_dynamic_worker(rank: int, world: int, port: int, cfg_path: str) -> None:
    """Dynamic mode with TrainerMon made before init_process_group: rank 0 switches monitoring on while
    both train; the ranks must agree on the step it applies at, over the group made later."""
    import json
    import time

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="none", DYNAMIC_MONITOR="true")
    from trainrec.recorder import TrainerMon

    mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
    init_gloo(rank, world, port)
    try:
        model, opt = make(seed=0)
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        for step in range(200):
            if step == 10 and rank == 0:
                with open(cfg_path) as f:
                    doc = json.load(f)
                doc["switch"] = True
                with open(cfg_path + ".tmp", "w") as f:
                    json.dump(doc, f)
                os.replace(cfg_path + ".tmp", cfg_path)
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05 if rank == 1 and 8 <= step < 20 else 0.01)  # rank 1 lags while the edit is seen
            if step % 10 == 9:
                dist.barrier()  # the ranks meet now and then, as a data-parallel job's do
        mon.close()
    finally:
        dist.destroy_process_group()


def test_dynamic_mode_ranks_agree_when_the_monitor_is_made_before_init_process_group(tmp_path, monkeypatch):
    from trainrec.schema.events import MonitoringStopped, StepEnded

    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("TRAINREC_RUN_ID", raising=False)
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"], "switch": False, "collect_times": 2})
    spawn_and_join(_late_init_dynamic_worker, (2, free_port(), cfg), 2, TIMEOUT, "2-process gloo run, dynamic")
    h = logs_by_rank(out)
    assert sorted(h) == [0, 1] and len({fo.run_id for _, fo, _ in h.values()}) == 1
    collected = {r: [e.step for e in ev if isinstance(e, StepEnded) and e.collected] for r, (_, _, ev) in h.items()}
    stops = {r: [(e.step, e.reason) for e in ev if isinstance(e, MonitoringStopped)] for r, (_, _, ev) in h.items()}
    assert len(collected[0]) == 2 and collected[0] == collected[1], collected
    assert stops[0] == stops[1] and [r for _, r in stops[0]] == ["collect_times"], stops


@pytest.mark.parametrize("elastic_id", ["late-init", "none"])
def test_monitor_made_before_init_process_group_has_the_stage_of_one_made_after(tmp_path, monkeypatch, elastic_id):
    """Without process_group the stage is the global rank and the group mates the world, as where the
    monitor is made after init_process_group (test_two_ranks_ddp_...): the environment alone gave every
    rank stage 0 and itself as its only mate, and the log kept them, so the same run ranked its
    anomalies in another order depending on where TrainerMon was made. Also where the run id was named
    before torch.distributed was up (TORCHELASTIC_RUN_ID): the empty log is opened again."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("TRAINREC_RUN_ID", raising=False)
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]})
    spawn_and_join(_late_init_worker, (2, free_port(), cfg, elastic_id), 2, TIMEOUT, "2-process gloo run, late init")
    h = logs_by_rank(out)
    assert len(rank_dirs(out)) == 2
    assert {r: (fo.pp_stage, tuple(fo.group_mates)) for r, (_, fo, _) in h.items()} == {0: (0, (0, 1)), 1: (1, (0, 1))}
    assert len({fo.run_id for _, fo, _ in h.values()}) == 1


def _skip_worker(rank: int, world: int, port: int, cfg_path: str, mode: str) -> None:
    """DDP steps of 2 micro steps (the first under no_sync). ``scaler``: a GradScaler, and an inf in rank
    1's loss at step 2: the all-reduced gradients hold it on both ranks and the scaler skips the optimizer
    step on both, though rank 0's own gradients are finite (``scaler0``: at the run's first step, before
    any optimizer step has run). ``sam``: two passes per optimizer step with
    the weights perturbed between them (sharpness-aware minimisation); ``gan``: two passes per step with
    the weights unchanged between them, the first one's gradients dropped (a GAN's discriminator, which
    the generator's pass goes through too): no step is skipped. ``scaler-chain``: two optimizers given as
    a list (one for the embedding, one for the rest), and the inf in rank 1's embedding gradient alone:
    the scaler skips the embedding's optimizer and steps the other (``scaler0-chain``: at the first step)."""
    init_gloo(rank, world, port)
    try:
        from trainrec.recorder import TrainerMon

        model, _ = make(seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        opts = [opt]
        if mode.endswith("-chain"):
            embed = [p for n, p in model.named_parameters() if n.startswith("embed")]
            rest = [p for n, p in model.named_parameters() if not n.startswith("embed")]
            opts = [torch.optim.SGD(embed, lr=1e-2), torch.optim.SGD(rest, lr=1e-2)]
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if mode.startswith("scaler") else None
        inf_step = 0 if mode.startswith("scaler0") else 2
        mon = TrainerMon(cfg_path, params_have_main_grad=False, live_export=False)
        mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opts if len(opts) > 1 else opt,
                                  dp_group=dist.group.WORLD)
        for step in range(5):
            for sam_pass in range(1 if scaler is not None else 2):
                for micro in range(2):
                    loss = loss_of(ddp, 100 * rank + 10 * step + micro)
                    hook = None
                    if scaler is not None:
                        if rank == 1 and step == inf_step and micro == 1:
                            if len(opts) > 1:
                                hook = model.embed.weight.register_hook(lambda g: g * float("inf"))
                            else:
                                loss = loss * float("inf")
                        loss = scaler.scale(loss)
                    if micro == 0:
                        with ddp.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                    if hook is not None:
                        hook.remove()
                if mode == "sam" and sam_pass == 0:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(p.grad, alpha=0.01)  # the ascent step; the next pass's gradients decide
                    opt.zero_grad()
                if mode == "gan" and sam_pass == 0:
                    opt.zero_grad()  # the generator's step: the discriminator's gradients go
            if scaler is not None:
                for o in opts:
                    scaler.step(o)
                scaler.update()
            else:
                opt.step()
            for o in opts:
                o.zero_grad()
        mon.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["scaler", "scaler0", "scaler-chain", "scaler0-chain", "sam", "gan"])
def test_ranks_agree_on_a_step_skipped_for_another_ranks_inf(tmp_path, monkeypatch, mode):
    """A loss scaler skips the optimizer step on the all-reduced gradients: an inf in rank 1's alone
    skips rank 0's step too. Both ranks mark that step skipped and number the later steps alike (rank 0
    took the next step's passes for more passes of the skipped one); passes of one step, with the
    weights changed between them or as many as every step takes, stay one step. With several optimizers
    as one step, one of them skipped and another stepped, the step is skipped (partly) on both ranks."""
    from trainrec.schema.events import StepEnded

    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    cfg = write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]})
    spawn_and_join(_skip_worker, (2, free_port(), cfg, mode), 2, TIMEOUT, f"2-process gloo run, {mode}")
    h = logs_by_rank(out)
    for r in (0, 1):
        ended = [(e.step, e.micro_steps, e.optimizer_skipped) for e in h[r][2] if isinstance(e, StepEnded)]
        if mode.startswith("scaler"):
            skipped = 0 if mode.startswith("scaler0") else 2  # the run's first step: no optimizer step ran before it
            assert ended == [(s, 2, s == skipped) for s in range(5)], (r, ended)
        else:
            assert ended == [(s, 4, False) for s in range(5)], (r, ended)
