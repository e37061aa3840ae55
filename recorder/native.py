"""The native API, for users not coming from msprobe.

::

    from trainrec.recorder import record

    with record(model, optimizer, config={"wg_distribution": True, "ops": ["norm", "max"]}) as rec:
        for batch in loader:
            loss = model(batch).loss
            loss.backward()
            optimizer.step()          # steps are detected through the optimizer instance's hooks
            optimizer.zero_grad()
    print(rec.log_path)

``config`` is a dict, a path to a JSON file, a :class:`MonitorConfig` or None
(:data:`DEFAULT_CONFIG`); the keys are the reference's (:mod:`.config`). Without an optimizer, call
``rec.step()`` once per training step, after its backward pass(es) and before the weights change
(without either, every backward pass goes into step 0, with a warning). ``model`` may be a list
of modules (virtual pipeline chunks).
Unlike ``TrainerMon``, a config without ``format`` writes only the log. See docs/python-api.md."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .config import MonitorConfig, parse_config
from .model_args import checked_model
from .optim import chain_of, torch_optimizer_of
from .session import RecordingSession, config_from, dynamic_from_env

DEFAULT_CONFIG = {
    "wg_distribution": True,
    "param_distribution": True,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
}


class Recorder:
    """Records ``model`` (and ``optimizer``) into a trainrec log until :meth:`close`."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        optimizer: torch.optim.Optimizer | list | None = None,  # or a list of them, each over a part
        config: dict | str | os.PathLike | MonitorConfig | None = None,
        output_dir: str | None = None,
        *,
        grad_acc_steps: int = 1,
        start_iteration: int = 0,
        params_have_main_grad: bool = False,
        **unknown,
    ) -> None:
        if unknown:
            name = next(iter(unknown))
            hint = (" (start_step is a config key, the first step collected; the number the first step gets "
                    "is start_iteration)" if name == "start_step" else "")
            raise TypeError(f"record() got an unexpected keyword argument {name!r}{hint}")
        checked_model(model)  # (a TypeError naming it, before anything is made)
        _check_optimizer(optimizer)
        if config is None:
            config, path = parse_config(dict(DEFAULT_CONFIG), "DEFAULT_CONFIG"), None
        else:  # (a file is watched in dynamic mode)
            config, path = config_from(os.fspath(config) if isinstance(config, os.PathLike) else config)
        # the live CSV/TensorBoard export only where the config names a format
        self.session = RecordingSession(config, config_path=path, params_have_main_grad=params_have_main_grad,
                                        output_dir=output_dir, live_export=None, dynamic=dynamic_from_env(),
                                        manual_steps=optimizer is None)  # no optimizer: steps end at step()
        try:
            self.session.install(model, grad_acc_steps=grad_acc_steps, optimizer=optimizer,
                                 start_iteration=start_iteration)
        except BaseException:
            self.session.close()  # a bad config: no log left open, no threads left running
            raise

    @property
    def log_path(self) -> str | None:
        return self.session.log_path

    @property
    def rank_dir(self) -> str | None:
        return self.session.rank_dir

    @property
    def step_count(self) -> int:
        """The current step number."""
        return self.session.step_count

    def step(self) -> None:
        """End the current training step (only needed without an optimizer)."""
        if not self.session.steps.manual:
            raise RuntimeError("steps are detected from the optimizer; do not call step() as well")
        self.session.step()

    def metrics(self, kind: str) -> dict:
        """``{tag: {op: 0-dim tensor}}`` of ``kind`` at the latest collected step."""
        return self.session.metrics(kind)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> Recorder:
        self.session.check_open("with")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.session.close_after(exc_type)


def _check_optimizer(optimizer) -> None:
    """A TypeError where ``optimizer`` is neither None nor a torch optimizer (or what holds one, in
    ``.optimizer``: accelerate's, DeepSpeed's, Megatron's wrappers), nor a list of those: its steps
    could not be hooked (they would never be counted, and :meth:`Recorder.step` is for runs without one)."""
    if optimizer is None:
        return
    members = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not members:
        raise TypeError("optimizer: got an empty list; pass None (and call rec.step() once per training step) "
                        "where there is no optimizer")
    for i, m in enumerate(members):
        if torch_optimizer_of(m) is None and (m is not optimizer or chain_of(m) is None):
            kind = f"the class {m.__name__} (an instance is needed)" if isinstance(m, type) else type(m).__name__
            what = kind if m is optimizer else f"item {i} of the list ({kind})"
            raise TypeError(f"optimizer: {what} is not a torch.optim.Optimizer and holds none (in .optimizer), so "
                            "its steps cannot be hooked: pass optimizer=None and call rec.step() once per "
                            "training step, after its backward pass and before the weights change")


def record(model, optimizer=None, config=None, output_dir: str | None = None, **kwargs) -> Recorder:
    """A :class:`Recorder` to use as a context manager: ``with record(model, opt, cfg) as rec: ...``."""
    return Recorder(model, optimizer, config, output_dir, **kwargs)
