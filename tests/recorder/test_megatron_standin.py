"""Megatron's mixed-precision optimizers, as far as the monitor reads them: stand-ins with the attribute
layout of Megatron-LM's ``Float16OptimizerWithFloat16Params`` (a whole fp32 master per bf16 parameter,
``float16_groups`` / ``fp32_from_float16_groups``) and ``DistributedOptimizer`` (this rank's fp32 shard
of each parameter in its range, ``model_float16_groups`` / ``shard_fp32_from_float16_groups``), each
wrapping a real torch AdamW over the masters. Megatron itself needs CUDA and is not installed here, so
these check the monitor's side of the contract (the attribute names the reference also reads), not
Megatron: Adam state and reduced gradients are the masters', and under the distributed optimizer only
the parameters with a shard on this rank get them."""

from __future__ import annotations

import pytest
import torch
from trainmon_util import assert_close, events_of, loss_of, make, ref_stats, stats_table, write_config
from trainrec.recorder import TrainerMon
from trainrec.recorder.names import squash_all


class StandInMixedPrecision:
    """``optimizer.step()`` as Megatron does it: the model's bf16 gradients, scaled by ``1 / scale``
    (unscaling), become the masters' fp32 gradients; the torch optimizer steps the masters; the masters
    are copied back into the model. ``sharded``: the masters are the first half of each parameter
    (DistributedOptimizer with this rank holding that range), and the last parameter has none."""

    def __init__(self, params: list[torch.Tensor], sharded: bool, scale: float = 4.0) -> None:
        self.scale = scale
        self.params = params if not sharded else params[:-1]
        self.ranges = [p.numel() // 2 + 1 if sharded else p.numel() for p in self.params]
        masters = [p.detach().reshape(-1)[:k].float().clone() for p, k in zip(self.params, self.ranges, strict=True)]
        if sharded:
            self.model_float16_groups, self.shard_fp32_from_float16_groups = [self.params], [masters]
        else:
            self.float16_groups, self.fp32_from_float16_groups = [self.params], [masters]
        self.masters = masters
        self.optimizer = torch.optim.AdamW(masters, lr=1e-2)

    def step(self) -> None:
        for p, m, k in zip(self.params, self.masters, self.ranges, strict=True):
            m.grad = p.grad.reshape(-1)[:k].float() / self.scale
        self.optimizer.step()
        for p, m, k in zip(self.params, self.masters, self.ranges, strict=True):
            p.data.reshape(-1)[:k].copy_(m)
            m.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("sharded", [False, True], ids=["Float16OptimizerWithFloat16Params", "DistributedOptimizer"])
def test_masters_give_adam_state_and_reduced_gradients(tmp_path, monkeypatch, sharded):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    model, _ = make()
    model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = StandInMixedPrecision(params, sharded)
    cfg = write_config(tmp_path, {"wg_distribution": True, "mv_distribution": True, "ops": ["norm", "min", "max"]})
    mon = TrainerMon(cfg, params_have_main_grad=False,
                     opt_ty="Megatron_DistributedOptimizer" if sharded else "Megatron_Float16OptimizerWithFloat16Params")
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    short = dict(zip([id(p) for p in params], squash_all([n for n, _ in model.named_parameters()]).values(), strict=True))
    want: dict = {}
    for step in range(2):
        loss_of(model, step).backward()
        opt.step()
        want[step] = {}
        for p, m, k in zip(opt.params, opt.masters, opt.ranges, strict=True):
            # reduced: the "main_grad when params_have_main_grad, else .grad" for whole masters
            # (as the reference reads it); the shard's own gradient under the distributed optimizer,
            # where main_grad is reduced only in this rank's range
            reduced = p.grad.reshape(-1)[:k].float() / opt.scale if sharded else p.grad
            want[step][short[id(p)]] = (ref_stats(p.grad), ref_stats(opt.optimizer.state[m]["exp_avg"]),
                                        ref_stats(reduced))
        opt.zero_grad()
    mon.close()
    ev = events_of(tmp_path / "out")
    un, red, ea = stats_table(ev, "grad_unreduced"), stats_table(ev, "grad_reduced"), stats_table(ev, "exp_avg")
    for step, rows in want.items():
        assert {k[1] for k in red if k[0] == step} == set(rows)  # sharded: the last parameter has no shard here
        assert {k[1] for k in ea if k[0] == step} == set(rows)
        assert len({k[1] for k in un if k[0] == step}) == len(params)
        for name, (grad, exp_avg, reduced) in rows.items():
            assert_close(red[(step, name, "", 0)], reduced, rtol=1e-5, what=f"reduced {name}")
            assert_close(ea[(step, name, "", 0)], exp_avg, rtol=1e-5, atol=1e-9, what=f"exp_avg {name}")
            assert_close(un[(step, name, "", 0)], grad, rtol=1e-2, what=f"unreduced {name}")
