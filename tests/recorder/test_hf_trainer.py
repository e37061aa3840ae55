"""accelerate and HF's Trainer for real: an optimizer prepared by accelerate (``AcceleratedOptimizer``,
which subclasses torch's Optimizer without being one), through the native accelerate loop and through
the HF-Trainer callback example with the real ``transformers.Trainer``. Recorded values equal what
independent hooks and the Trainer's own callback events see, with gradient accumulation (and, in the
Trainer, gradient clipping)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from trainmon_util import events_of, loss_of, make, stats_table, write_config
from trainrec.recorder import TrainerMon
from trainrec.recorder.names import squash_all

pytest.importorskip("accelerate")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide singletons (the Trainer makes its own Accelerator)."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_accelerate_prepared_optimizer_with_accumulate(tmp_path, monkeypatch):
    from accelerate import Accelerator

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(*make())
    assert type(opt).__name__ == "AcceleratedOptimizer"
    cfg = write_config(tmp_path, {"wg_distribution": True, "mv_distribution": True, "ops": ["norm"]})
    mon = TrainerMon(cfg, params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    short = squash_all([n for n, _ in model.named_parameters()])
    seen = []  # an independent hook on the torch optimizer inside: the gradients it is about to apply
    opt.optimizer.register_step_pre_hook(
        lambda o, a, k: seen.append({short[n]: float(p.grad.norm()) for n, p in model.named_parameters()}))
    for micro in range(4):  # accelerate skips the inner step (and zero_grad) on the first of each two
        with acc.accumulate(model):
            acc.backward(loss_of(model, micro))
            opt.step()
            opt.zero_grad()
    mon.close()
    ev = events_of(tmp_path / "out")
    red, unred = stats_table(ev, "grad_reduced"), stats_table(ev, "grad_unreduced")
    assert len(seen) == 2 and {k[0] for k in red} == {0, 1} and {k[0] for k in stats_table(ev, "exp_avg")} == {0, 1}
    for step, grads in enumerate(seen):
        for name, norm in grads.items():
            assert red[(step, name, "", 0)]["norm"] == pytest.approx(norm, rel=1e-5)
        assert {k[3] for k in unred if k[0] == step} == {0, 1}


def test_real_hf_trainer_with_accelerate_records_what_the_trainer_sees(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        """Per optimizer step: gradient norms after clipping, right before the optimizer steps
        (``on_pre_optimizer_step``), and exp_avg norms right after it (``on_optimizer_step``)."""

        def __init__(self) -> None:
            self.grads: list[dict] = []
            self.exp_avg: list[dict] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append({n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None})

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            inner = optimizer.optimizer  # accelerate's wrapper holds the torch optimizer
            self.exp_avg.append({n: float(inner.state[p]["exp_avg"].norm()) for n, p in model.named_parameters()
                                 if p in inner.state})

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.syspath_prepend(EXAMPLES)
    sys.modules.pop("hf_trainer_callback", None)
    from hf_trainer_callback import TrainrecCallback, hf_trainer

    cfg = write_config(tmp_path, {"wg_distribution": True, "mv_distribution": True, "xy_distribution": True,
                                  "ops": ["norm", "max"], "format": "csv"})
    cb, snap = TrainrecCallback(cfg), Snapshots()
    trainer = hf_trainer(cb, str(tmp_path / "hf"), steps=3, grad_acc=2, more_callbacks=(snap,))
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"
    ev = events_of(tmp_path / "out")
    short = squash_all([n for n, _ in trainer.model.named_parameters()])
    red, ea = stats_table(ev, "grad_reduced"), stats_table(ev, "exp_avg")
    unred, actv = stats_table(ev, "grad_unreduced"), stats_table(ev, "actv")
    assert len(snap.grads) == len(snap.exp_avg) == 3
    for step in range(3):
        assert snap.grads[step] and snap.exp_avg[step]
        for name, norm in snap.grads[step].items():
            assert red[(step, short[name], "", 0)]["norm"] == pytest.approx(norm, rel=1e-4, abs=1e-7)
        for name, norm in snap.exp_avg[step].items():
            assert ea[(step, short[name], "", 0)]["norm"] == pytest.approx(norm, rel=1e-4, abs=1e-7)
        assert {k[3] for k in unred if k[0] == step} == {0, 1}  # both micro steps
        assert {k[3] for k in actv if k[0] == step} == {0, 1}
    assert max(torch.tensor(list(g.values())).norm().item() for g in snap.grads) <= 1.0 + 1e-4  # clipped
