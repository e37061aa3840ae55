"""``TrainerMon``: mindstudio-probe 1.2.1's monitor API, recording into the per-rank trainrec log.

The msprobe face over the recorder's parts (rank identity, output, optimizer binding, step tracker, step
cycle, monitored model, step hooks, name table, collection): its signature and argument checks; its
installation on the model is :mod:`.install`, config application :mod:`.config_apply`; how a step is
recorded, and which part does what: ``docs/recorder-internals.md``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
import weakref

from trainrec.schema import layout
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import (
    KIND_GRAD_REDUCED,
    KIND_GRAD_UNREDUCED,
    KINDS,
    ConfigRejected,
)

from . import api_backward, open_monitors, structure
from .attach import StepHooks
from .binding import OptimizerBinding
from .collect import Collection
from .compile_mode import eager
from .config import MonitorConfig, load_config, parse_config
from .config_apply import apply_config, check_config
from .context import RecordingContext
from .flight import probes_for
from .hook_context import HookContext
from .install import install
from .monitored import MonitoredModel
from .names import NameTable
from .optim import KNOWN_OPT_TYPES
from .output import Output
from .rank_identity import RankIdentity
from .session import HookFailures, warn_once, warn_unrecorded
from .stats import StatsEngine
from .step_cycle import StepCycle
from .step_output import StepOutput, spill_loop
from .step_state import StepState
from .step_stats import StepStats
from .steps import StepTracker, weak_call
from .writer_exit import before_sigterm_close

log = logging.getLogger(__name__)

PRINT_STRUCT_EXIT = "exit after first monitor step when print model struct"


class TrainerMon:
    """Drop-in for ``msprobe.pytorch.monitor.module_hook.TrainerMon`` (1.2.1).

    ``config_file_path`` may also be a config dict or a :class:`MonitorConfig` (native use);
    ``output_dir`` overrides ``$MONITOR_OUTPUT_DIR``; ``live_export=False`` keeps csv/tensorboard
    formats from starting the live projection process; None starts it only where the config names a
    ``format`` itself (the native API's choice: a config without one gets the log alone).
    """

    _wrapped_optimizer = None  # class attribute, as the reference's set_wrapped_optimizer

    def __init__(self, config_file_path, process_group=None, params_have_main_grad: bool = True,
                 opt_ty: str | None = None, *, output_dir: str | None = None, live_export: bool | None = True) -> None:
        if isinstance(config_file_path, MonitorConfig):
            config = config_file_path
        elif isinstance(config_file_path, dict):
            config = parse_config(config_file_path, "config dict")
        else:
            config = load_config(config_file_path)
        self.config_file_path = config_file_path if isinstance(config_file_path, (str, os.PathLike)) else None
        if not isinstance(params_have_main_grad, (bool, int)) or params_have_main_grad not in (0, 1):
            # ("no" would be taken as true: main_grad looked for, where a run has none, .grad used)
            raise ConfigError(f"expected True or False, got {params_have_main_grad!r}", "params_have_main_grad",
                              argument=True)
        self.params_have_main_grad = bool(params_have_main_grad)
        if opt_ty is not None and opt_ty not in KNOWN_OPT_TYPES:
            raise ConfigError(f"unknown optimizer type {opt_ty!r}; expected one of {', '.join(KNOWN_OPT_TYPES)}",
                              "opt_ty", argument=True)
        self.opt_ty = opt_ty
        dynamic = os.environ.get("DYNAMIC_MONITOR", "false").strip().lower()
        if dynamic not in ("true", "false", ""):  # msprobe's test: 'true' turns it on, anything else off
            log.warning("trainrec: DYNAMIC_MONITOR=%r is neither true nor false: dynamic mode is off, as in msprobe "
                        "(only 'true' turns it on); the config applies as it is, from the start",
                        os.environ["DYNAMIC_MONITOR"])
        self.dynamic = dynamic == "true"
        self.identity = RankIdentity(process_group)  # rank, world, pipeline stage, the run id the ranks share
        warn_unrecorded(config, self.world_size, applied=not self.dynamic)
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(f"output_dir: expected a directory path (str or os.PathLike), got "
                            f"{type(output_dir).__name__}")
        self.output_dir = os.fspath(output_dir) if output_dir else layout.output_dir_from_env()
        # the log, the live export, the detector, the config watcher and the probes: closed by close(), or
        # by the output's finalizer where this monitor is dropped without it (with its model)
        self.output = Output(self.rank, self.output_dir, bool(output_dir),
                             live_export if live_export is not None else "format" in config.raw)
        self.failures = HookFailures(weak_call(self._emit))  # counted per place; totals at close
        # what the hooks and the collection parts read: the step's state, the parameters, the engine, the config
        self.context = RecordingContext(StatsEngine(config.ops, config.eps), self.params_have_main_grad,
                                        weak_call(self._hook_failed), config)
        self.name_table = NameTable()
        self.step_output = StepOutput(self.output, self.name_table, self.rank)
        self.step_hooks = StepHooks(weak_call(self._hook_failed), warn_once)
        self._checked: tuple | None = None  # (config, its targets) chosen by _check_config
        self._struct_handles: list = []
        self._chunk_handles: list = []
        cls = type(self)  # (its set_wrapped_optimizer, read at binding time; the class, not this monitor)
        self.binding = OptimizerBinding(weak_call(self._pre_step), weak_call(self._post_step),
                                        lambda: cls._wrapped_optimizer, warn_once)
        self.steps = StepTracker(self.binding, weak_call(self._gradients_non_finite),
                                 self.identity.several_ranks, weak_call(self._hook_failed), warn_once)
        self.output.closed_with(self)  # (at exit, open_monitors closes a live monitor in full)
        self._struct: dict | None = None
        self._closed = False
        self.collection = Collection(self.context, self.binding, self.steps, self.step_hooks)
        # the model's chunks, its targets and the step's hooks on them
        self.monitored = MonitoredModel(self, self.context, self.step_hooks, self.collection.grad_batch, self.identity,
                                        self.name_table, weak_call(self._sync_names), weak_call(self._hook_failed))
        # the step boundaries, the step counter and the collection schedule
        self.cycle = StepCycle(self, self.rank, self.context, self.output, self.steps, self.binding, self.collection,
                               self.monitored, self.step_hooks, self.step_output, weak_call(self._emit),
                               weak_call(self._hook_failed))
        # what the hooks get in the monitor's place (hooks on tensors hold it weakly: hook_context.py)
        self.hooks = HookContext(self, self.context, steps=self.steps, monitored=self.monitored,
                                 on_micro_step=self.cycle.on_micro_step, step_hooks=self.step_hooks,
                                 grad_batch=self.collection.grad_batch, name_table=self.name_table, sync_names=weak_call(self._sync_names),
                                 output=self.output, identity=self.identity, hook_failed=weak_call(self._hook_failed),
                                 materialized=weak_call(self._materialized))
        if self.config.format != "api":
            self._open_output()
        else:
            self.output.make_alerts(self.config, self.pp_stage, self.group_mates)  # says it detects nothing
        if self.dynamic:
            path = self.config_file_path
            self.dynamic = self.output.start_watcher(
                path, validate=lambda raw: parse_config(raw, os.fspath(path)), emit=weak_call(self._emit),
                check=weak_call(self._check_config))
        self.output.probes = probes_for(self)  # collectives, stall watchdog (flight.py)
        open_monitors.add(self)  # closed at exit

    # ------------------------------------------------------------------ output
    def _open_output(self) -> None:
        """Open the log (again, after a config error discarded the empty one): names are announced to the
        new file anew; the spill thread starts once per monitor."""
        ident = self.identity
        ident.run_id = self.output.open(self.config, ident.run_id, ident.world_size, ident.pp_stage, ident.group_mates)
        self.name_table.new_file()
        if self.output.start_spilling(functools.partial(spill_loop, weakref.ref(self))):
            before_sigterm_close(self.cycle.write_unfinished)

    def _config_source(self) -> str | None:
        return os.fspath(self.config_file_path) if self.config_file_path is not None else None

    def _rejected_at_first_call(self, exc: ConfigError) -> None:
        """A selector that does not fit its module's real inputs or outputs, about to be raised out of
        the first forward: the log says so (ConfigRejected), and the monitor closes (its hooks removed,
        its log closed), as where monitor_gnorm_with_ad rejects a config: a notebook that fixes the
        config and makes a new monitor on the same model has that one only."""
        try:
            self._emit(ConfigRejected(rank=self.rank, step=self.cycle.step, wall=time.time(), content_hash="",
                                      path=self._config_source() or "", reason=str(exc),
                                      keys=(exc.key,) if exc.key else ()))
            self._close(f"config rejected: {exc.key}" if exc.key else "config rejected")
        except Exception as err:  # noqa: BLE001 - the config error is what the user must see
            log.debug("trainrec: recording the rejected config failed: %r", err)

    def _emit(self, event) -> None:
        """Hand an event to the log; a failed writer is reported once and never raised into training."""
        if not self.output.emit(event):
            self.cycle.monitoring = False  # nothing reaches the log: the hooks go at the next step's begin

    @property
    def config(self) -> MonitorConfig:
        """The active config (kept in the recording context, where the hooks read it)."""
        return self.context.config

    @config.setter
    def config(self, value: MonitorConfig) -> None:
        self.context.config = value

    # who this process is in the run (msprobe's attributes), kept by the rank identity part
    process_group = property(lambda self: self.identity.process_group)
    rank = property(lambda self: self.identity.rank)
    world_size = property(lambda self: self.identity.world_size)
    pp_stage = property(lambda self: self.identity.pp_stage)
    group_mates = property(lambda self: self.identity.group_mates)
    run_id = property(lambda self: self.identity.run_id)

    @property
    def rank_dir(self) -> str | None:
        """This rank's directory (None for format api)."""
        return self.output.rank_dir

    @property
    def step_count(self) -> int:
        """The current step's number (counted from ``start_iteration``)."""
        return self.cycle.step

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the process's exit closed it): nothing more is recorded."""
        return self._closed

    @property
    def log_path(self) -> str | None:
        w = self.output.writer
        return w.path if w is not None else None

    # ------------------------------------------------------------------ public API
    @property
    def ops(self) -> list[str]:
        return list(self.config.ops)

    @ops.setter
    def ops(self, value) -> None:
        """New ops (validated): from now on where the step in progress has recorded nothing yet, else from
        the next step (a step's rows share one list of ops)."""
        ops = list(value) if isinstance(value, (list, tuple)) else value  # (a str is no list of ops)
        new = parse_config({**self.config.raw, "ops": ops}, "ops")
        self.config = new
        st = self.context.state
        if st is None or not (st.stats or st.pending or self.step_hooks.fired):
            self.context.engine = StatsEngine(new.ops, new.eps)
            if st is not None:
                st.stats = StepStats(new.ops)
        # else the cycle's begin() makes the engine for the new ops when this step has ended

    @classmethod
    def set_wrapped_optimizer(cls, _wrapped_optimizer) -> None:
        """The mixed-precision optimizer of Megatron/DeepSpeed (used when optimizer=None)."""
        cls._wrapped_optimizer = _wrapped_optimizer

    def monitor_gnorm_with_ad(self, model, grad_acc_steps: int = 1, optimizer=None, dp_group=None, tp_group=None,
                              start_iteration: int = 0) -> None:
        """Install the hooks on ``model`` (a module or a list of virtual-pipeline chunks)."""
        install(self, model, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration)

    def _mark_params(self) -> None:
        """A backward ran in this step: a hook on chunk 0's first and last parameters tells the step
        tracker (chosen again once a lazy module's are made, :meth:`_materialized`)."""
        for p in self.steps.mark():
            # a tensor's hooks are out of the garbage collector's sight: a strong reference from one to
            # the monitor (which holds the model) would keep both alive until exit
            self._chunk_handles.append(p.register_post_accumulate_grad_hook(eager(weak_call(self.steps.on_backward))))

    def generate_wgrad_metrics(self) -> tuple[dict, dict]:
        """``(reduced, unreduced)``: ``{tag: {op: 0-dim tensor}}`` of the latest collected step."""
        return self.step_output.metrics(KIND_GRAD_REDUCED), self.step_output.metrics(KIND_GRAD_UNREDUCED)

    def generate_xy_metrics(self) -> tuple[dict, dict]:
        """``(actv, actv_grad)``: ``{tag: {op: 0-dim tensor}}`` of the latest collected step."""
        return self.step_output.metrics("actv"), self.step_output.metrics("actv_grad")

    def generate_metrics(self, kind: str) -> dict:
        """Metrics of any kind (param, exp_avg, exp_avg_sq, update, ratio, ...) of the latest collected step;
        an unknown kind is a ValueError (it would otherwise look like a kind with nothing recorded)."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        return self.step_output.metrics(kind)

    def reload_xy(self, xy_distribution: bool = False) -> None:
        """Switch ``xy_distribution`` and re-select the activation hooks; handles are replaced, never
        stacked. As in the reference, whose signature this is, a call without argument turns it off."""
        cfg = parse_config({**self.config.raw, "xy_distribution": bool(xy_distribution)}, "reload_xy")
        self.config = cfg
        if self.monitored.chunks:
            attached = self.step_hooks.attached
            self.monitored.detach()
            self.monitored.build(cfg)
            if attached:
                self.monitored.attach()

    def close(self) -> None:
        """Remove every hook, stop the watcher, close the log and wait for the live export. Idempotent."""
        self._close("close")

    def _close(self, reason: str) -> None:
        """:meth:`close`, with ``reason`` in the log's FileClosed ("exit..." when the process ends)."""
        if self._closed:
            return
        self.cycle.end_skipped_last_step()
        if reason in ("close", "exit"):  # (after an exception or a signal, a step begun stays open)
            self.cycle.end_foreign_passes()
        self._closed = True
        open_monitors.remove(self)
        self.output.stop_spilling()  # (before the step in progress is written here)
        self.monitored.detach()
        self.cycle.write_unfinished()
        self.binding.close()
        for handles in (self._struct_handles, self._chunk_handles, self.cycle.check_handles):
            for h in handles:
                h.remove()
            handles.clear()
        self.context.state = None
        # (the probes write the exception that ended the recording, if any, to the log)
        self.output.close(reason, before_log_closes=self._emit_failure_totals)
        self.context.engine.release()

    def _emit_failure_totals(self) -> None:
        self.failures.emit_totals(self.rank, self.cycle.step)

    def __enter__(self) -> TrainerMon:
        self._check_open("with")
        return self

    def _check_open(self, what: str) -> None:
        """A closed monitor records nothing more (its log is closed): a step() there would put its hooks
        back on the model, for good, and a with block would record nothing, silently."""
        if self._closed:
            raise RuntimeError(f"{what} on a closed monitor (its log {self.log_path or '(format api)'} is closed): "
                               "make a new one (record(...), or TrainerMon) to record more")

    def __exit__(self, exc_type, exc, tb) -> None:
        # the log says what ended it: an exception out of the with block (a NaN check, a KeyboardInterrupt)
        self._close(f"close after an exception: {exc_type.__name__}" if exc_type is not None else "close")

    # ------------------------------------------------------------------ configuration
    def _check_config(self, config: MonitorConfig) -> int:
        """The dynamic watcher's check before it decides a change (:func:`.config_apply.check_config`)."""
        return check_config(self, config)

    def _apply_config(self, config: MonitorConfig, step: int, content_hash: str, reason: str = "dynamic") -> None:
        """Make ``config`` the active one from step ``step + 1`` (:func:`.config_apply.apply_config`)."""
        apply_config(self, config, step, content_hash, reason)

    # ------------------------------------------------------------------ names and targets
    def _sync_names(self) -> None:
        """Announce new names to the log once (the spill thread writes records too)."""
        self.step_output.sync_names(self.cycle.step)

    def _write_structure(self, vpp: int | None = None) -> None:
        for ev in structure.structure_events(self.monitored.chunks, None, None, self.rank, self.cycle.step, vpp):
            self._emit(ev)

    def _materialized(self, vpp: int) -> None:
        """The end of model chunk ``vpp``'s first training forward, where it had lazy modules' parameters
        not made when the monitor was installed (LazyLinear: made by the module's first forward): its
        structure is recorded again, with their sizes (and the classes the lazy modules became), and on
        chunk 0 the parameters that notice a backward are chosen again (:meth:`_mark_params`). A lazy
        module first run later keeps its 0 there."""
        self.hooks.lazy_chunks.discard(vpp)
        if vpp == 0:
            self._mark_params()
        self._write_structure(vpp)

    # ------------------------------------------------------------------ optimizer binding
    def _bind_optimizer(self, optimizer) -> None:
        if not self.steps.manual:  # (the native Recorder without an optimizer: steps come from step())
            self.binding.bind(optimizer, self.monitored.chunks)

    # ------------------------------------------------------------------ step boundaries
    def _attach_struct_hooks(self) -> None:
        self._struct, self._struct_handles = structure.attach_struct_hooks(self.monitored.chunks, self.monitored.targets)

    def _print_struct_and_exit(self) -> None:
        structure.write_module_struct(self._struct or {}, self.output_dir)
        for ev in structure.structure_events(self.monitored.chunks, self.monitored.targets, self._struct or {}, self.rank, self.cycle.step):
            self._emit(ev)
        self.close()
        raise Exception(PRINT_STRUCT_EXIT)  # noqa: TRY002 - the reference's documented behaviour

    def _pre_step(self, opt, args, kwargs) -> None:
        if self._struct is not None and not self._closed:
            self._print_struct_and_exit()  # raises, as the reference does, to end the run after one step
        self.cycle.pre_step(opt, args, kwargs)

    def _post_step(self, opt, args, kwargs) -> None:
        self.cycle.post_step(opt, args, kwargs)

    def _gradients_non_finite(self) -> bool | None:
        return self.cycle.gradients_non_finite()

    def _write_api_backward(self, st: StepState) -> None:
        """The step's gradients through the API calls, to the log (api_backward.py)."""
        api_backward.write_backward(self.hooks, st)

    def step(self) -> None:
        """End the current step by hand (for loops without a hooked optimizer)."""
        self._check_open("step()")
        self._pre_step(None, (), {})
        self._post_step(None, (), {})

    # ------------------------------------------------------------------ failures
    def _hook_failed(self, where: str, exc: BaseException) -> None:
        self.failures.failed(where, exc, self.rank, self.cycle.step)


# (registered here, after the writers' own exit handler: atexit runs it first, while the logs are open)
atexit.register(open_monitors.close_all_at_exit)
