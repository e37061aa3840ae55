"""Wire trainrec's TrainerMon into a Hugging Face ``Trainer`` through a ``TrainerCallback``.

The packaged, tested callback is ``trainrec.integrations.transformers.TrainrecCallback`` (a config dict
or path; resumes from checkpoints append to the same run): use that one. This file shows the wiring
it does, with the msprobe-compatible ``TrainerMon``, and runs without transformers (``MiniTrainer``).

With transformers installed::

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TrainrecCallback("monitor_config.json")])

The callback builds the monitor in ``on_train_begin``, where HF's Trainer passes the model and the
optimizer it created (``create_optimizer_and_scheduler`` runs before that event), with
``grad_acc_steps = args.gradient_accumulation_steps`` and ``start_iteration = state.global_step``
(so a resumed run counts on). Steps are detected by trainrec through the optimizer instance's own step
hooks; ``on_train_end`` closes the log. Under DeepSpeed pass the wrapped optimizer's inner
``optimizer.optimizer`` (trainrec follows ``.optimizer`` by itself, so the wrapper also works).

HF's Trainer prepares the optimizer with accelerate, so the callback gets accelerate's
``AcceleratedOptimizer``; trainrec finds the torch optimizer inside it. With ``--hf`` this file runs
the real ``Trainer`` (transformers and accelerate installed; ``pip install transformers accelerate``)
on a tiny GPT-2 built from its config (nothing downloaded), on CPU::

    MONITOR_OUTPUT_DIR=/tmp/hf_demo python examples/hf_trainer_callback.py --hf --steps 10

transformers is not a dependency of trainrec. Without ``--hf`` this file uses ``MiniTrainer``, a
stand-in loop that calls the callback the way HF's Trainer does (same event names, same keyword
arguments, optimizer created before ``on_train_begin``, ``optimizer.step()`` once per
``gradient_accumulation_steps`` micro batches), on a small CPU model::

    MONITOR_OUTPUT_DIR=/tmp/hf_demo python examples/hf_trainer_callback.py --steps 10
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from trainrec.recorder import TrainerMon

try:  # the real base class when transformers is there
    from transformers import TrainerCallback  # type: ignore[import-not-found]
except ImportError:  # a stand-in with the same (no-op) interface

    class TrainerCallback:  # type: ignore[no-redef]
        def on_train_begin(self, args, state, control, **kwargs):
            return control

        def on_step_end(self, args, state, control, **kwargs):
            return control

        def on_train_end(self, args, state, control, **kwargs):
            return control


HERE = os.path.dirname(os.path.abspath(__file__))


class TrainrecCallback(TrainerCallback):
    """Records the run into trainrec's log; ``config_path`` is a reference-format monitor config."""

    def __init__(self, config_path: str, params_have_main_grad: bool = False) -> None:
        self.config_path = config_path
        self.params_have_main_grad = params_have_main_grad
        self.monitor: TrainerMon | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.monitor = TrainerMon(self.config_path, params_have_main_grad=self.params_have_main_grad)
        self.monitor.monitor_gnorm_with_ad(
            model,
            grad_acc_steps=getattr(args, "gradient_accumulation_steps", 1),
            optimizer=optimizer,
            start_iteration=getattr(state, "global_step", 0),
        )
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
        return control


# ---------------------------------------------------------------------- stand-in for transformers.Trainer
@dataclass
class MiniArgs:
    max_steps: int = 10
    gradient_accumulation_steps: int = 2
    learning_rate: float = 1e-3


@dataclass
class MiniState:
    global_step: int = 0


@dataclass
class MiniControl:
    should_training_stop: bool = False


class MiniTrainer:
    """Calls callbacks in HF Trainer's order: on_train_begin (model=, optimizer=, lr_scheduler=, ...),
    per optimizer step on_step_begin / on_step_end, then on_train_end."""

    def __init__(self, model: nn.Module, args: MiniArgs, callbacks: list) -> None:
        self.model, self.args, self.callbacks = model, args, callbacks
        self.state, self.control = MiniState(), MiniControl()

    def _call(self, event: str, **kwargs) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is not None:
                fn(self.args, self.state, self.control, **kwargs)

    def train(self) -> None:
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.args.learning_rate)
        self._call("on_train_begin", model=self.model, optimizer=optimizer, lr_scheduler=None,
                   train_dataloader=None, eval_dataloader=None)
        g = torch.Generator().manual_seed(0)
        for _ in range(self.args.max_steps):
            self._call("on_step_begin", model=self.model, optimizer=optimizer)
            for _ in range(self.args.gradient_accumulation_steps):
                x = torch.randn(16, 32, generator=g)
                loss = (self.model(x) - x.sum(1, keepdim=True)).pow(2).mean()
                (loss / self.args.gradient_accumulation_steps).backward()
            optimizer.step()
            optimizer.zero_grad()
            self.state.global_step += 1
            self._call("on_step_end", model=self.model, optimizer=optimizer)
        self._call("on_train_end", model=self.model, optimizer=optimizer)


# ---------------------------------------------------------------------- the real transformers.Trainer
def hf_trainer(callback: TrainrecCallback, output_dir: str, steps: int, grad_acc: int = 2, seed: int = 0,
               more_callbacks: tuple = ()):
    """HF's ``Trainer`` on CPU with a 2-layer GPT-2 made from its config (no download) and random tokens;
    ``output_dir`` is the Trainer's own (checkpoints are off)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(64):
        ids = torch.randint(0, 64, (16,), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=grad_acc, learning_rate=1e-3, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, seed=seed)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, *more_callbacks])
    trainer.train()
    return trainer


def main() -> int:
    p = argparse.ArgumentParser(description="HF Trainer callback example (a stand-in loop, or the real Trainer with --hf)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--config", default=os.path.join(HERE, "monitor_config.json"))
    p.add_argument("--hf", action="store_true", help="run transformers' Trainer (needs transformers and accelerate)")
    a = p.parse_args()
    cb = TrainrecCallback(a.config)
    if a.hf:  # the packaged callback
        import tempfile

        from trainrec.integrations.transformers import TrainrecCallback as PackagedCallback

        packaged = PackagedCallback(a.config)
        with tempfile.TemporaryDirectory() as tmp:
            hf_trainer(packaged, tmp, a.steps)
        print(f"log: {packaged.log_path}")
        return 0
    else:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        MiniTrainer(model, MiniArgs(max_steps=a.steps), [cb]).train()
    print(f"log: {cb.monitor.log_path if cb.monitor else None}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
