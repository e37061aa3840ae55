"""``RecordingSession``: the recorder's core, which both faces sit on (``TrainerMon``, msprobe's, and
``record()``/``Recorder``, the native one).

It makes the parts (rank identity, output, optimizer binding, step tracker, step cycle, monitored model,
step hooks, name table, collection), owns what they share (event emission, hook failures, the hook
handles of the whole run) and the session's life: installed on a model (:mod:`.install`), configs
applied (:mod:`.config_apply`), steps ended by hand, closed once. Which part does what:
``docs/recorder-internals.md``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable

from trainrec.schema import layout
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import KINDS, ConfigRejected

from . import api_backward, open_monitors, structure
from .attach import StepHooks
from .binding import OptimizerBinding
from .collect import Collection
from .compile_mode import eager
from .config import MonitorConfig, load_config, parse_config
from .config_apply import apply_config, check_config
from .context import RecordingContext
from .failures import HookFailures, warn_once, warn_unrecorded
from .flight import probes_for
from .handles import HookHandles
from .hook_context import HookContext
from .install import install
from .monitored import MonitoredModel
from .names import NameTable
from .output import Output
from .rank_identity import RankIdentity
from .stats import StatsEngine
from .step_cycle import StepCycle
from .step_output import StepOutput, spill_loop
from .step_state import StepState
from .step_stats import StepStats
from .steps import StepTracker, weak_call
from .writer_exit import before_sigterm_close

# (the monitor's logger: its warnings were given there before the core moved out of TrainerMon)
log = logging.getLogger("trainrec.recorder.monitor")

PRINT_STRUCT_EXIT = "exit after first monitor step when print model struct"


def config_from(source) -> tuple[MonitorConfig, str | os.PathLike | None]:
    """A config given as a :class:`MonitorConfig`, a dict or a JSON file's path, and that path (None for
    the others: only a file can be watched in dynamic mode)."""
    if isinstance(source, MonitorConfig):
        return source, None
    if isinstance(source, dict):
        return parse_config(source, "config dict"), None
    return load_config(source), source


def dynamic_from_env() -> bool:
    """``DYNAMIC_MONITOR``, read as msprobe does: 'true' turns dynamic mode on, anything else off."""
    dynamic = os.environ.get("DYNAMIC_MONITOR", "false").strip().lower()
    if dynamic not in ("true", "false", ""):
        log.warning("trainrec: DYNAMIC_MONITOR=%r is neither true nor false: dynamic mode is off, as in msprobe "
                    "(only 'true' turns it on); the config applies as it is, from the start",
                    os.environ["DYNAMIC_MONITOR"])
    return dynamic == "true"


class RecordingSession:
    """One recording: a config, an output directory and (once :meth:`install` ran) a model.

    ``config_path``: the file ``config`` came from (watched where ``dynamic``); ``output_dir`` overrides
    ``$MONITOR_OUTPUT_DIR``; ``live_export``: whether csv/tensorboard formats start the live projection
    process (None: only where the config names a ``format`` itself); ``wrapped_optimizer``: where the
    optimizer to bind comes from when ``install`` gets none; ``manual_steps``: steps end by
    :meth:`step` only (no optimizer hooked)."""

    def __init__(self, config: MonitorConfig, *, config_path: str | os.PathLike | None = None,
                 process_group=None, params_have_main_grad: bool = True, output_dir: str | None = None,
                 live_export: bool | None = True, dynamic: bool = False,
                 wrapped_optimizer: Callable[[], object] = lambda: None, manual_steps: bool = False) -> None:
        if not isinstance(params_have_main_grad, (bool, int)) or params_have_main_grad not in (0, 1):
            # ("no" would be taken as true: main_grad looked for, where a run has none, .grad used)
            raise ConfigError(f"expected True or False, got {params_have_main_grad!r}", "params_have_main_grad",
                              argument=True)
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(f"output_dir: expected a directory path (str or os.PathLike), got "
                            f"{type(output_dir).__name__}")
        self.config_path = config_path
        self.params_have_main_grad = bool(params_have_main_grad)
        self.dynamic = dynamic
        self.identity = RankIdentity(process_group)  # rank, world, pipeline stage, the run id the ranks share
        warn_unrecorded(config, self.world_size, applied=not self.dynamic)
        self.output_dir = os.fspath(output_dir) if output_dir else layout.output_dir_from_env()
        # the log, the live export, the detector, the config watcher and the probes: closed by close(), or
        # by the output's finalizer where this session is dropped without it (with its model)
        self.output = Output(self.rank, self.output_dir, bool(output_dir),
                             live_export if live_export is not None else "format" in config.raw)
        self.failures = HookFailures(weak_call(self.emit))  # counted per place; totals at close
        # what the hooks and the collection parts read: the step's state, the parameters, the engine, the config
        self.context = RecordingContext(StatsEngine(config.ops, config.eps), self.params_have_main_grad,
                                        weak_call(self.hook_failed), config)
        self.name_table = NameTable()
        self.step_output = StepOutput(self.output, self.name_table, self.rank)
        # every hook put on the model, the optimizers and their tensors: "run" (the chunks', the global
        # optimizer post-step, the backward markers), "step" (a collected step's), "optimizer",
        # "first call" (the selectors' checks), "print_struct"
        self.handles = HookHandles()
        self.step_hooks = StepHooks(self.handles, weak_call(self.hook_failed), warn_once)
        self.checked: tuple | None = None  # (config, its targets) chosen by check_config ahead of a switch
        self.binding = OptimizerBinding(self.handles, weak_call(self._pre_step), weak_call(self._post_step),
                                        wrapped_optimizer, warn_once)
        self.steps = StepTracker(self.binding, weak_call(self._gradients_non_finite),
                                 self.identity.several_ranks, weak_call(self.hook_failed), warn_once)
        self.steps.manual = manual_steps
        self.output.closed_with(self)  # (at exit, open_monitors closes a live session in full)
        self.struct: dict | None = None
        self._closed = False
        self.collection = Collection(self.context, self.binding, self.steps, self.step_hooks)
        # the model's chunks, its targets and the step's hooks on them
        self.monitored = MonitoredModel(self, self.context, self.step_hooks, self.collection.grad_batch, self.identity,
                                        self.name_table, weak_call(self.sync_names), weak_call(self.hook_failed))
        # the step boundaries, the step counter and the collection schedule
        self.cycle = StepCycle(self, self.handles, self.rank, self.context, self.output, self.steps, self.binding, self.collection,
                               self.monitored, self.step_hooks, self.step_output, weak_call(self.emit),
                               weak_call(self.hook_failed))
        # what the hooks get in the session's place (hooks on tensors hold it weakly: hook_context.py)
        self.hooks = HookContext(self, self.context, steps=self.steps, monitored=self.monitored,
                                 on_micro_step=self.cycle.on_micro_step, step_hooks=self.step_hooks,
                                 grad_batch=self.collection.grad_batch, name_table=self.name_table,
                                 sync_names=weak_call(self.sync_names), output=self.output, identity=self.identity,
                                 hook_failed=weak_call(self.hook_failed), materialized=weak_call(self.materialized))
        if self.config.format != "api":
            self.open_output()
        else:
            self.output.make_alerts(self.config, self.pp_stage, self.group_mates)  # says it detects nothing
        if self.dynamic:
            path = self.config_path
            self.dynamic = self.output.start_watcher(
                path, validate=lambda raw: parse_config(raw, os.fspath(path)), emit=weak_call(self.emit),
                check=weak_call(self.check_config))
        self.output.probes = probes_for(self)  # collectives, stall watchdog (flight.py)
        open_monitors.add(self)  # closed at exit

    # ------------------------------------------------------------------ what it is
    @property
    def config(self) -> MonitorConfig:
        """The active config (kept in the recording context, where the hooks read it)."""
        return self.context.config

    @config.setter
    def config(self, value: MonitorConfig) -> None:
        self.context.config = value

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

    def config_source(self) -> str | None:
        """The config file's path, for messages and ConfigApplied/ConfigRejected records."""
        return os.fspath(self.config_path) if self.config_path is not None else None

    # ------------------------------------------------------------------ the faces' operations
    def install(self, model, grad_acc_steps: int = 1, optimizer=None, dp_group=None, tp_group=None,
                start_iteration: int = 0) -> None:
        """Put the hooks on ``model`` (a module or a list of virtual-pipeline chunks): :func:`.install.install`."""
        install(self, model, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration)

    def step(self) -> None:
        """End the current step by hand (for loops without a hooked optimizer)."""
        self.check_open("step()")
        self._pre_step(None, (), {})
        self._post_step(None, (), {})

    def metrics(self, kind: str) -> dict:
        """``{tag: {op: 0-dim tensor}}`` of ``kind`` at the latest collected step; an unknown kind is a
        ValueError (it would otherwise look like a kind with nothing recorded)."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        return self.step_output.metrics(kind)

    def set_ops(self, value) -> None:
        """New ops (validated): from now on where the step in progress has recorded nothing yet, else from
        the next step (a step's rows share one list of ops)."""
        ops = list(value) if isinstance(value, (list, tuple)) else value  # (a str is no list of ops)
        new = parse_config({**self.config.raw, "ops": ops}, "ops")
        self.config = new
        state = self.context.state
        if state is None or not (state.stats or state.pending or self.step_hooks.fired):
            self.context.engine = StatsEngine(new.ops, new.eps)
            if state is not None:
                state.stats = StepStats(new.ops)
        # else the cycle's begin() makes the engine for the new ops when this step has ended

    def set_xy(self, xy_distribution: bool) -> None:
        """Switch ``xy_distribution`` and re-select the activation hooks; handles are replaced, never stacked."""
        cfg = parse_config({**self.config.raw, "xy_distribution": bool(xy_distribution)}, "reload_xy")
        self.config = cfg
        if self.monitored.chunks:
            attached = self.step_hooks.attached
            self.monitored.detach()
            self.monitored.build(cfg)
            if attached:
                self.monitored.attach()

    def check_open(self, what: str) -> None:
        """A closed session records nothing more (its log is closed): a step() there would put its hooks
        back on the model, for good, and a with block would record nothing, silently."""
        if self._closed:
            raise RuntimeError(f"{what} on a closed monitor (its log {self.log_path or '(format api)'} is closed): "
                               "make a new one (record(...), or TrainerMon) to record more")

    def close(self, reason: str = "close") -> None:
        """Remove every hook, stop the watcher, close the log (``reason`` in its FileClosed: "exit..." when
        the process ends) and wait for the live export. Idempotent."""
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
        self.handles.remove_all()
        self.context.state = None
        # (the probes write the exception that ended the recording, if any, to the log)
        self.output.close(reason, before_log_closes=self._emit_failure_totals)
        self.context.engine.release()

    def close_after(self, exc_type) -> None:
        """Close at the end of a with block: the log says what ended it (an exception out of the block: a
        NaN check, a KeyboardInterrupt)."""
        self.close(f"close after an exception: {exc_type.__name__}" if exc_type is not None else "close")

    # ------------------------------------------------------------------ for the parts
    def emit(self, event) -> None:
        """Hand an event to the log; a failed writer is reported once and never raised into training."""
        if not self.output.emit(event):
            self.cycle.monitoring = False  # nothing reaches the log: the hooks go at the next step's begin

    def hook_failed(self, where: str, exc: BaseException) -> None:
        self.failures.failed(where, exc, self.rank, self.cycle.step)

    def open_output(self) -> None:
        """Open the log (again, after a config error discarded the empty one): names are announced to the
        new file anew; the spill thread starts once per session."""
        ident = self.identity
        ident.run_id = self.output.open(self.config, ident.run_id, ident.world_size, ident.pp_stage, ident.group_mates)
        self.name_table.new_file()
        if self.output.start_spilling(functools.partial(spill_loop, weakref.ref(self))):
            before_sigterm_close(self.cycle.write_unfinished)

    def sync_names(self) -> None:
        """Announce new names to the log once (the spill thread writes records too)."""
        self.step_output.sync_names(self.cycle.step)

    def check_config(self, config: MonitorConfig) -> int:
        """The dynamic watcher's check before it decides a change (:func:`.config_apply.check_config`)."""
        return check_config(self, config)

    def apply_config(self, config: MonitorConfig, step: int, content_hash: str, reason: str = "dynamic") -> None:
        """Make ``config`` the active one from step ``step + 1`` (:func:`.config_apply.apply_config`)."""
        apply_config(self, config, step, content_hash, reason)

    def rejected_at_first_call(self, exc: ConfigError) -> None:
        """A selector that does not fit its module's real inputs or outputs, about to be raised out of
        the first forward: the log says so (ConfigRejected), and the session closes (its hooks removed,
        its log closed), as where install rejects a config: a notebook that fixes the config and makes a
        new monitor on the same model has that one only."""
        try:
            self.emit(ConfigRejected(rank=self.rank, step=self.cycle.step, wall=time.time(), content_hash="",
                                     path=self.config_source() or "", reason=str(exc),
                                     keys=(exc.key,) if exc.key else ()))
            self.close(f"config rejected: {exc.key}" if exc.key else "config rejected")
        except Exception as err:  # noqa: BLE001 - the config error is what the user must see
            log.debug("trainrec: recording the rejected config failed: %r", err)

    def write_structure(self, vpp: int | None = None) -> None:
        for ev in structure.structure_events(self.monitored.chunks, None, None, self.rank, self.cycle.step, vpp):
            self.emit(ev)

    def mark_params(self) -> None:
        """A backward ran in this step: a hook on chunk 0's first and last parameters tells the step
        tracker (chosen again once a lazy module's are made, :meth:`materialized`)."""
        for p in self.steps.mark():
            # a tensor's hooks are out of the garbage collector's sight: a strong reference from one to
            # the session (which holds the model) would keep both alive until exit
            self.handles.group("run").append(p.register_post_accumulate_grad_hook(eager(weak_call(self.steps.on_backward))))

    def materialized(self, vpp: int) -> None:
        """The end of model chunk ``vpp``'s first training forward, where it had lazy modules' parameters
        not made when the session was installed (LazyLinear: made by the module's first forward): its
        structure is recorded again, with their sizes (and the classes the lazy modules became), and on
        chunk 0 the parameters that notice a backward are chosen again (:meth:`mark_params`). A lazy
        module first run later keeps its 0 there."""
        self.hooks.lazy_chunks.discard(vpp)
        if vpp == 0:
            self.mark_params()
        self.write_structure(vpp)

    def bind_optimizer(self, optimizer) -> None:
        if not self.steps.manual:  # (steps end by step() only: no optimizer to hook)
            self.binding.bind(optimizer, self.monitored.chunks)

    def attach_struct_hooks(self) -> None:
        self.struct, handles = structure.attach_struct_hooks(self.monitored.chunks, self.monitored.targets)
        self.handles.group("print_struct").extend(handles)

    def write_api_backward(self, st: StepState) -> None:
        """The step's gradients through the API calls, to the log (api_backward.py)."""
        api_backward.write_backward(self.hooks, st)

    # ------------------------------------------------------------------ step boundaries (the binding's)
    def _print_struct_and_exit(self) -> None:
        structure.write_module_struct(self.struct or {}, self.output_dir)
        for ev in structure.structure_events(self.monitored.chunks, self.monitored.targets, self.struct or {},
                                             self.rank, self.cycle.step):
            self.emit(ev)
        self.close()
        raise Exception(PRINT_STRUCT_EXIT)  # noqa: TRY002 - the reference's documented behaviour

    def _pre_step(self, opt, args, kwargs) -> None:
        if self.struct is not None and not self._closed:
            self._print_struct_and_exit()  # raises, as the reference does, to end the run after one step
        self.cycle.pre_step(opt, args, kwargs)

    def _post_step(self, opt, args, kwargs) -> None:
        self.cycle.post_step(opt, args, kwargs)

    def _gradients_non_finite(self) -> bool | None:
        return self.cycle.gradients_non_finite()

    def _emit_failure_totals(self) -> None:
        self.failures.emit_totals(self.rank, self.cycle.step)


# (registered here, after the writers' own exit handler: atexit runs it first, while the logs are open)
atexit.register(open_monitors.close_all_at_exit)
