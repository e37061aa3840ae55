"""Hugging Face ``Trainer``: one callback records the run.

::

    from trainrec.integrations.transformers import TrainrecCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TrainrecCallback("monitor_config.json")])

``config`` is what ``trainrec.recorder.record`` takes. At ``on_train_begin`` the callback records the
model and the torch optimizer inside accelerate's ``AcceleratedOptimizer``, with
``gradient_accumulation_steps`` micro steps per step and steps numbered as ``state.global_step``.
``on_save`` leaves ``trainrec-rank{R}.json`` in the checkpoint, naming the rank directory, so a
resumed ``trainer.train`` appends to the same run; ``on_train_end`` closes the log. Importing this
module imports transformers; importing trainrec does not. See docs/integrations.md."""

from __future__ import annotations

import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ._resume import append_target, open_recorder, read_note, run_note, write_note

__all__ = ["TrainrecCallback"]


class TrainrecCallback(TrainerCallback):
    """Records a ``transformers.Trainer`` run into a trainrec log (see the module docstring)."""

    def __init__(self, config=None, *, output_dir: str | None = None) -> None:
        self.config = config
        self.output_dir = output_dir
        self.recorder = None

    @property
    def log_path(self) -> str | None:
        return self.recorder.log_path if self.recorder is not None else None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.recorder is not None:  # train() called again on the same Trainer: a new launch
            self.recorder.close()
        append_to = None
        if state.global_step > 0:  # resumed: the checkpoint the Trainer loaded is that of this step
            ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            append_to = append_target(read_note(ckpt, _rank(args)), ckpt)
        self.recorder = open_recorder(model, optimizer, self.config, self.output_dir,
                                      grad_acc_steps=args.gradient_accumulation_steps,
                                      start_step=state.global_step, append_to=append_to)
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.recorder is not None:
            ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            write_note(ckpt, run_note(self.recorder, state.global_step))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.close()
        return control


def _rank(args) -> int:
    return int(getattr(args, "process_index", 0) or 0)
