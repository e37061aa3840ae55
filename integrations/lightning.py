"""Lightning's ``Trainer``: one callback records the run (``lightning`` or ``pytorch_lightning``).

::

    from trainrec.integrations.lightning import TrainrecCallback

    trainer = lightning.Trainer(callbacks=[TrainrecCallback({"wg_distribution": True})])

``config`` is what ``trainrec.recorder.record`` takes. Recording starts at ``on_train_start``
(optimizers made, a checkpoint restored) and ends at ``on_train_end`` or an exception; the rank
directory goes into the callback's ``state_dict`` so a resumed ``fit`` appends to the same run.
The callback is ``lightning``'s, or ``pytorch_lightning``'s where only that package was imported
first; importing trainrec imports neither. Details: docs/integrations.md."""

from __future__ import annotations

import importlib
import sys

from ._resume import append_target, open_recorder, run_note


def _callback_base():
    """Lightning's ``Callback`` of the package the program uses: ``pytorch_lightning`` where it is
    imported and ``lightning`` is not (its Trainer accepts only its own callbacks), else ``lightning``
    where installed, else ``pytorch_lightning``."""
    if "pytorch_lightning" in sys.modules and "lightning" not in sys.modules:
        order = ("pytorch_lightning.callbacks", "lightning.pytorch.callbacks")
    else:
        order = ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks")
    for name in order:
        try:
            return importlib.import_module(name).Callback
        except ImportError:
            continue
    raise ImportError("trainrec.integrations.lightning needs lightning (or pytorch_lightning): pip install lightning")


Callback = _callback_base()

__all__ = ["TrainrecCallback"]


class TrainrecCallback(Callback):
    """Records a Lightning ``Trainer`` run into a trainrec log (see the module docstring)."""

    def __init__(self, config=None, *, output_dir: str | None = None) -> None:
        self.config = config
        self.output_dir = output_dir
        self.recorder = None
        self._restored: dict | None = None

    @property
    def log_path(self) -> str | None:
        return self.recorder.log_path if self.recorder is not None else None

    def on_train_start(self, trainer, pl_module) -> None:
        if self.recorder is not None:
            self.recorder.close()
        optimizers = list(trainer.optimizers)
        step = _optimizer_steps(trainer)
        append_to = None
        if self._restored is not None and step > 0:
            append_to = append_target(self._restored, "the checkpoint Lightning restored")
        self.recorder = open_recorder(pl_module, optimizers[0] if len(optimizers) == 1 else (optimizers or None),
                                      self.config, self.output_dir,
                                      grad_acc_steps=trainer.accumulate_grad_batches, start_step=step,
                                      append_to=append_to)

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()

    def state_dict(self) -> dict:
        """Saved in Lightning's checkpoints: the run's rank directory and the step."""
        if self.recorder is None:
            return {}
        return run_note(self.recorder, self.recorder.step_count)

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored = dict(state_dict) if state_dict else None

    def _close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


def _optimizer_steps(trainer) -> int:
    """Optimizer steps done (restored from a checkpoint): ``global_step`` counts them in automatic
    optimization; in manual optimization it counts every optimizer's steps, so it is divided by the
    number of optimizers (each steps once per training step)."""
    n = max(1, len(trainer.optimizers))
    return int(trainer.global_step) // n
