"""Megatron's mixed-precision optimizers, as far as the monitor reads them: stand-ins with the attribute
layout of Megatron-LM's ``Float16OptimizerWithFloat16Params`` (a whole fp32 master per bf16 parameter,
``float16_groups`` / ``fp32_from_float16_groups``) and ``DistributedOptimizer`` (this rank's fp32 shard
of each parameter in its range, ``model_float16_groups`` / ``shard_fp32_from_float16_groups``), each
wrapping a real torch AdamW over the masters. Megatron itself needs CUDA and is not installed here, so
these check the monitor's side of the contract (the attribute names the reference also reads), not
Megatron: Adam state and reduced gradients are the masters', and under the distributed optimizer only
the parameters with a shard on this rank get them. ``ChainedOptimizer`` (one such optimizer per part of
the model, stepped one after the other) is one training step with every member's state."""

from __future__ import annotations

import pytest
import torch
from trainmon_util import assert_close, events_of, loss_of, make, ref_stats, stats_table, write_config
from trainrec.recorder import TrainerMon
from trainrec.recorder.names import squash_all
from trainrec.schema import StepEnded


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

    def prepare_grads(self) -> None:
        for p, m, k in zip(self.params, self.masters, self.ranges, strict=True):
            m.grad = p.grad.reshape(-1)[:k].float() / self.scale

    def step_with_ready_grads(self) -> None:
        self.optimizer.step()
        for p, m, k in zip(self.params, self.masters, self.ranges, strict=True):
            p.data.reshape(-1)[:k].copy_(m)
            m.grad = None

    def step(self) -> None:
        self.prepare_grads()
        self.step_with_ready_grads()

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


class StandInChained:
    """Megatron's ``ChainedOptimizer`` (dense and expert parameters, each part with its own optimizer):
    ``prepare_grads`` of every member (their fp32 gradients ready), then each member's step in turn."""

    def __init__(self, members: list[StandInMixedPrecision]) -> None:
        self.chained_optimizers = members

    @property
    def param_groups(self) -> list[dict]:
        return [g for m in self.chained_optimizers for g in m.optimizer.param_groups]

    def step(self) -> None:
        for m in self.chained_optimizers:
            m.prepare_grads()
        for m in self.chained_optimizers:
            m.step_with_ready_grads()

    def zero_grad(self) -> None:
        for m in self.chained_optimizers:
            m.zero_grad()


@pytest.mark.parametrize("given", ["chain", "member"], ids=["optimizer=chain", "member+set_wrapped_optimizer"])
def test_chained_optimizer_is_one_step_with_every_members_state(tmp_path, monkeypatch, given):
    """Two members (a distributed optimizer over most parameters, a mixed-precision one over the last
    layer) step one after the other: one training step, Adam state and reduced gradients of both,
    each parameter's row once. Given as the chain, or as the first member's torch optimizer with the
    chain named by ``set_wrapped_optimizer`` (the reference's opt_ty Megatron_Chained*)."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    monkeypatch.setattr(TrainerMon, "_wrapped_optimizer", None)
    model, _ = make()
    model.to(torch.bfloat16)
    params = list(model.parameters())
    dense, expert = StandInMixedPrecision(params[:-2], sharded=True), StandInMixedPrecision(params[-2:], sharded=False)
    chain = StandInChained([dense, expert])
    cfg = write_config(tmp_path, {"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
                                  "ops": ["norm", "min", "max"]})
    mon = TrainerMon(cfg, params_have_main_grad=False, opt_ty="Megatron_ChainedDistributedOptimizer")
    if given == "chain":
        mon.monitor_gnorm_with_ad(model, optimizer=chain)
    else:
        TrainerMon.set_wrapped_optimizer(chain)
        mon.monitor_gnorm_with_ad(model, optimizer=dense.optimizer)
    short = dict(zip([id(p) for p in params], squash_all([n for n, _ in model.named_parameters()]).values(), strict=True))
    want: dict = {}
    for step in range(3):
        loss_of(model, step).backward()
        want[step] = {}
        for member in chain.chained_optimizers:
            for p, k in zip(member.params, member.ranges, strict=True):
                want[step][short[id(p)]] = {"reduced": ref_stats(p.grad.reshape(-1)[:k].float() / member.scale
                                                                 if member is dense else p.grad),
                                            "param": ref_stats(p)}
        chain.step()
        for member in chain.chained_optimizers:
            for p, m in zip(member.params, member.masters, strict=True):
                want[step][short[id(p)]]["exp_avg"] = ref_stats(member.optimizer.state[m]["exp_avg"])
        chain.zero_grad()
    mon.close()
    ev = events_of(tmp_path / "out")
    assert [e.step for e in ev if isinstance(e, StepEnded)] == [0, 1, 2]
    for kind in ("grad_reduced", "exp_avg", "param"):
        rows = [(e.step, n) for e in ev if getattr(e, "kind", None) == kind for n in range(len(e.name_ids) // 4)]
        table = stats_table(ev, kind)
        assert len(rows) == len(table), f"{kind}: a parameter recorded twice in a step"
        for step, by_name in want.items():
            got = {k[1]: v for k, v in table.items() if k[0] == step}
            if kind == "param":
                assert set(got) == {short[id(p)] for p in params}
            else:  # the dense member's last parameter has no shard on this rank (sharded stand-in)
                assert set(got) == set(by_name), (kind, step)
            for name, want_rows in by_name.items():
                if kind == "param":
                    assert_close(got[name], want_rows["param"], rtol=1e-2, what=f"param {name}")
                else:
                    w = want_rows["reduced" if kind == "grad_reduced" else "exp_avg"]
                    assert_close(got[name], w, rtol=1e-5, atol=1e-9, what=f"{kind} {name} step {step}")
