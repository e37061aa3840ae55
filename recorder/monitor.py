"""``TrainerMon``: mindstudio-probe 1.2.1's monitor API, recording into the per-rank trainrec log.

A thin face on :class:`~trainrec.recorder.session.RecordingSession`: msprobe's signature and argument
checks, its attributes and methods, each handed to the session.
"""

from __future__ import annotations

from trainrec.schema.errors import ConfigError
from trainrec.schema.events import KIND_GRAD_REDUCED, KIND_GRAD_UNREDUCED

from .config import MonitorConfig
from .optim import KNOWN_OPT_TYPES
from .session import PRINT_STRUCT_EXIT, RecordingSession, config_from, dynamic_from_env

__all__ = ["PRINT_STRUCT_EXIT", "TrainerMon"]


class TrainerMon:
    """Drop-in for ``msprobe.pytorch.monitor.module_hook.TrainerMon`` (1.2.1).

    ``config_file_path`` may also be a config dict or a :class:`MonitorConfig` (native use);
    ``output_dir`` overrides ``$MONITOR_OUTPUT_DIR``; ``live_export=False`` keeps csv/tensorboard
    formats from starting the live projection process; None starts it only where the config names a
    ``format`` itself. ``session``: the recording this face drives.
    """

    _wrapped_optimizer = None  # class attribute, as the reference's set_wrapped_optimizer

    def __init__(self, config_file_path, process_group=None, params_have_main_grad: bool = True,
                 opt_ty: str | None = None, *, output_dir: str | None = None, live_export: bool | None = True) -> None:
        config, path = config_from(config_file_path)
        if opt_ty is not None and opt_ty not in KNOWN_OPT_TYPES:
            raise ConfigError(f"unknown optimizer type {opt_ty!r}; expected one of {', '.join(KNOWN_OPT_TYPES)}",
                              "opt_ty", argument=True)
        self.opt_ty = opt_ty
        cls = type(self)  # (its set_wrapped_optimizer, read at binding time; the class, not this monitor)
        self.session = RecordingSession(config, config_path=path, process_group=process_group,
                                        params_have_main_grad=params_have_main_grad, output_dir=output_dir,
                                        live_export=live_export, dynamic=dynamic_from_env(),
                                        wrapped_optimizer=lambda: cls._wrapped_optimizer)

    # msprobe's attributes, read from the session
    config_file_path = property(lambda self: self.session.config_path)
    params_have_main_grad = property(lambda self: self.session.params_have_main_grad)
    dynamic = property(lambda self: self.session.dynamic)
    output_dir = property(lambda self: self.session.output_dir)
    process_group = property(lambda self: self.session.process_group)
    rank = property(lambda self: self.session.rank)
    world_size = property(lambda self: self.session.world_size)
    pp_stage = property(lambda self: self.session.pp_stage)
    group_mates = property(lambda self: self.session.group_mates)
    run_id = property(lambda self: self.session.run_id)
    rank_dir = property(lambda self: self.session.rank_dir, doc="This rank's directory (None for format api).")
    step_count = property(lambda self: self.session.step_count, doc="The current step's number.")
    closed = property(lambda self: self.session.closed, doc="Whether close() ran: nothing more is recorded.")
    log_path = property(lambda self: self.session.log_path)

    @property
    def config(self) -> MonitorConfig:
        """The active config."""
        return self.session.config

    @property
    def ops(self) -> list[str]:
        return list(self.session.config.ops)

    @ops.setter
    def ops(self, value) -> None:
        """New ops (validated): from now on where the step in progress has recorded nothing yet, else from
        the next step."""
        self.session.set_ops(value)

    @classmethod
    def set_wrapped_optimizer(cls, _wrapped_optimizer) -> None:
        """The mixed-precision optimizer of Megatron/DeepSpeed (used when optimizer=None)."""
        cls._wrapped_optimizer = _wrapped_optimizer

    def monitor_gnorm_with_ad(self, model, grad_acc_steps: int = 1, optimizer=None, dp_group=None, tp_group=None,
                              start_iteration: int = 0) -> None:
        """Install the hooks on ``model`` (a module or a list of virtual-pipeline chunks)."""
        self.session.install(model, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration)

    def generate_wgrad_metrics(self) -> tuple[dict, dict]:
        """``(reduced, unreduced)``: ``{tag: {op: 0-dim tensor}}`` of the latest collected step."""
        return self.session.metrics(KIND_GRAD_REDUCED), self.session.metrics(KIND_GRAD_UNREDUCED)

    def generate_xy_metrics(self) -> tuple[dict, dict]:
        """``(actv, actv_grad)``: ``{tag: {op: 0-dim tensor}}`` of the latest collected step."""
        return self.session.metrics("actv"), self.session.metrics("actv_grad")

    def generate_metrics(self, kind: str) -> dict:
        """Metrics of any kind (param, exp_avg, exp_avg_sq, update, ratio, ...) of the latest collected step."""
        return self.session.metrics(kind)

    def reload_xy(self, xy_distribution: bool = False) -> None:
        """Switch ``xy_distribution`` and re-select the activation hooks. As in the reference, whose
        signature this is, a call without argument turns it off."""
        self.session.set_xy(xy_distribution)

    def step(self) -> None:
        """End the current step by hand (for loops without a hooked optimizer)."""
        self.session.step()

    def close(self) -> None:
        """Remove every hook, stop the watcher, close the log and wait for the live export. Idempotent."""
        self.session.close()

    def __enter__(self) -> TrainerMon:
        self.session.check_open("with")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.session.close_after(exc_type)
