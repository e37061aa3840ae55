"""The step boundaries of a recording: a step's begin (collected or not), the optimizer's pre- and
post-step hooks, a micro step's start, and a step's end, which writes what the step recorded. The
step counter and the collection schedule live here; the step's hooks on the model are the
:class:`MonitoredModel`'s, config changes the session's (:class:`StepHost`)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
from trainrec.schema.events import MonitoringStopped, StepBegan, StepEnded

from .attach import StepHooks
from .binding import OptimizerBinding
from .collect import Collection
from .config import MonitorConfig
from .context import RecordingContext
from .handles import HookHandles
from .monitored import MonitoredModel
from .output import Output
from .stats import StatsEngine
from .step_output import StepOutput
from .step_state import StepState
from .steps import StepTracker, rows_non_finite, weak_call

_LIVE_CHECK_S = 5.0  # seconds between looks at the live export process (a waitpid) at step boundaries


class StepHost(Protocol):
    """What the step cycle needs of its session (``RecordingSession``; held weakly): the active config, and a
    config change that the dynamic watcher decided at a step's end, applied."""

    config: MonitorConfig

    def apply_config(self, config: MonitorConfig, step: int, content_hash: str) -> None:
        """``config`` active from step ``step + 1``."""

    def write_api_backward(self, st: StepState) -> None:
        """The step's gradients through the API calls (``api_xy``'s backward), to the log."""


class StepCycle:
    """Where steps begin and end. ``step``: the current step's number; ``monitoring``, ``first_step``
    and ``collections`` (collected steps since the config was applied): the schedule :meth:`collects`
    reads. The selectors' checks at a module's first call (``handles``' group "first call") are removed
    when the first step ends. ``emit`` and ``hook_failed`` are the monitor's."""

    def __init__(self, host: StepHost, handles: HookHandles, rank: int, context: RecordingContext, output: Output,
                 tracker: StepTracker, binding: OptimizerBinding, collection: Collection,
                 monitored: MonitoredModel, step_hooks: StepHooks, step_output: StepOutput,
                 emit: Callable[[object], None], hook_failed: Callable[[str, BaseException], None]) -> None:
        self._host = weakref.proxy(host)
        self._rank = rank
        self._context, self._output, self._tracker, self._binding = context, output, tracker, binding
        self._collection, self._monitored = collection, monitored
        self._step_hooks, self._step_output = step_hooks, step_output
        self._emit, self._hook_failed = emit, hook_failed
        self.step = 0
        self.monitoring = False
        self.first_step = 0
        self.collections = 0
        self._handles = handles
        self._began = False
        self._wall0 = time.time()
        self._live_check_at = 0.0  # when begin() looks at the live export next
        # step(closure): the rows that need the gradients the step applies are taken at its post-step
        # hook (_closure_rows): the step's state at its pre-step hook, whether that call began the step
        # (DeepSpeed: one param group at a time), and mg_direction's momenta before the update
        self._closure_state: StepState | None = None
        self._closure_first = True
        self._closure_momenta: tuple | None = None
        self._mark_began_weakly = weak_call(self.mark_began)  # each collected step's first-firing callback

    def collects(self, step: int) -> bool:
        return self.monitoring and step >= self.first_step and self._host.config.is_collected(step, self.collections)

    def schedule_from(self, step: int) -> None:
        """A config applied after ``step``: monitoring on, its collection counted from the next step."""
        self.collections = 0
        self.first_step = step + 1
        self.monitoring = True

    def begin(self) -> None:
        """A step begins (construction, the previous optimizer post-step, or the first forward after a
        skipped optimizer step): collected or not, its hooks attached or taken off accordingly."""
        ctx = self._context
        self._binding.drop_waiting_hook()
        ctx.step_t0 = time.perf_counter()
        self._wall0 = time.time()
        self._began = False
        live = self._output.live
        if live is not None and ctx.step_t0 >= self._live_check_at:  # the live export died?
            self._live_check_at = ctx.step_t0 + _LIVE_CHECK_S
            try:
                live.check()
            except Exception as exc:  # noqa: BLE001 - monitoring never kills training
                self._hook_failed("checking the live export", exc)
        self._tracker.step_begins()
        collected = self.collects(self.step)
        self._monitored.hooks_for_step(collected)
        if collected:
            cfg = self._host.config
            if ctx.engine.ops != tuple(cfg.ops) or ctx.engine.eps != cfg.eps:
                ctx.engine = StatsEngine(cfg.ops, cfg.eps)  # ops set in the middle of the last step
            ctx.state = StepState(self.step, cfg.ops, self._mark_began_weakly)
        else:
            ctx.state = None
        step_open = self._output.step_open
        if (ctx.state is not None) != step_open.is_set():
            if ctx.state is not None:
                step_open.set()
            else:
                step_open.clear()

    def mark_began(self) -> None:
        """StepBegan is written at the step's first sign of life (a training forward of the model, a hook
        firing, an optimizer step), with the wall time of the step's start, so a run that ends between
        steps has no dangling step."""
        if not self._began:
            self._began = True
            self._emit(StepBegan(rank=self._rank, step=self.step, wall=self._wall0))

    def pre_step(self, opt, args, kwargs) -> None:
        """The optimizer's pre-step hook: the step's reduced gradients, parameters and mg_direction."""
        try:
            self.mark_began()
            # step(closure) (LBFGS always; SGD, Adam... where given one): its passes run after this hook
            closure = self._tracker.optimizer_step_begins(args, kwargs)
            st = self._context.state
            if st is None:
                return
            # a later group of a step made one group at a time (DeepSpeed) adds its gradients' pieces only
            first, _ = self._binding.part_of_step(opt)
            if closure:  # the gradients the step applies are the closure's: taken at the post-step hook
                self._closure_state, self._closure_first = st, first
            momenta = self._collection.pre_step(st, self._host.config, first, closure)
            if closure:
                self._closure_momenta = momenta
        except Exception as exc:  # noqa: BLE001
            self._hook_failed("optimizer pre-step", exc)

    def _closure_rows(self) -> None:
        """At the post-step hook of ``step(closure)``: the rows the pre-step hook takes from the gradients
        where there is no closure (reduced gradients, mg_direction), of the gradients the closure's last
        evaluation left, which the step applied (LBFGS: its last evaluation's; one row set per step,
        however many evaluations it made). mg_direction compares them with the momentum as it was before
        the update (the signs kept at the pre-step hook)."""
        st, momenta = self._closure_state, self._closure_momenta
        self._closure_state = self._closure_momenta = None
        if st is None or st is not self._context.state:
            return
        self._collection.closure_rows(st, self._host.config, self._closure_first, momenta)

    def post_step(self, opt, args, kwargs) -> None:
        """The optimizer's post-step hook: the step ends where this call was its last part."""
        try:
            if self._tracker.closure_ended():
                try:
                    self._closure_rows()
                except Exception as exc:  # noqa: BLE001 - the step still ends
                    self._hook_failed("optimizer post-step (closure)", exc)
            last = self._binding.part_of_step(opt)[1]
            self._binding.stepped(opt)
            if last:  # else the step goes on with the next param group or optimizer
                self.end_step()
        except Exception as exc:  # noqa: BLE001 - the step's bookkeeping never kills training
            self._hook_failed("optimizer post-step", exc)

    def on_micro_step(self) -> None:
        """A training forward of chunk 0 begins: where it shows that the step so far was one whose
        optimizer step never ran (:meth:`StepTracker.forward_begins`), that step ends here, marked so,
        and this forward begins the next (without it, the next step's rows would land in the skipped one)."""
        if not torch.is_grad_enabled():
            return  # no backward follows: not a micro step
        if self._tracker.forward_begins():
            self.end_step(optimizer_skipped=True)
            self._tracker.skipped_step_ended()
        # the step's first sign of life, before any module's hook: a rank that hangs in this forward (a
        # collective inside it) and is killed there leaves the step it was in, not the previous one's end
        self.mark_began()
        if self._tracker.forwards == 1 and self._context.state is not None:
            self._monitored.hook_unfrozen()

    def end_foreign_passes(self) -> None:
        """At a close that is no failure: the run ended after this model's last optimizer step with
        passes inside other optimizers' steps only (the discriminator's in the generator's). They are no
        step of this model's: recorded with a StepEnded that says so (``foreign_passes``), and the step
        count stays that of the training steps."""
        try:
            if not self._tracker.ends_in_foreign_passes():
                return
            st = self._context.state
            self.mark_began()
            if st is not None:
                self._finish_step(st, foreign_passes=True)
            else:
                self._emit(StepEnded(rank=self._rank, step=self.step, wall=time.time(),
                                     duration=time.perf_counter() - self._context.step_t0, collected=False,
                                     micro_steps=self._tracker.grad_acc, foreign_passes=True))
            self._context.state = None
        except Exception as exc:  # noqa: BLE001 - closing never fails on the bookkeeping
            self._hook_failed("passes inside other optimizers' steps at close", exc)

    def end_skipped_last_step(self) -> None:
        """At close: the last step's optimizer step never ran (a loss scaler skipped it) and no forward
        came after it to notice that; it is ended as such a forward would have ended it."""
        try:
            if self._tracker.last_step_skipped():
                self.end_step(optimizer_skipped=True)
        except Exception as exc:  # noqa: BLE001 - closing never fails on the bookkeeping
            self._hook_failed("the skipped step at close", exc)

    def gradients_non_finite(self) -> bool | None:
        """Whether the gradient rows this step recorded so far hold inf or NaN (None: none recorded)."""
        st = self._context.state
        if st is None:
            return None
        self._collection.grad_batch.settle()
        return rows_non_finite(st.stats)

    def write_step(self, st: StepState) -> None:
        """The step's hook firings and statistics, to the log (and to the api metrics)."""
        self._collection.grad_batch.settle()
        for leaf in st.leaf_hooks:  # gradient hooks on leaf tensors outlive backward passes: not this step
            leaf.handle.remove()
        st.leaf_hooks.clear()
        if st.api_passes:  # the gradients through the API calls (api_backward.py)
            try:
                self._host.write_api_backward(st)
            except Exception as exc:  # noqa: BLE001 - the step's other rows are still written
                self._hook_failed("the API calls' gradients", exc)
        self.collections += 1
        self._step_output.write(st)

    def write_unfinished(self) -> None:
        """A step that never ended (an exception, SIGTERM, a NaN check that stopped the run): what it
        recorded is written, with no StepEnded after it, for the post-mortem. Once."""
        st = self._context.state
        if st is not None and not st.written and (st.stats or st.pending or self._step_hooks.fired or len(st.mod_ids)):
            try:
                self.write_step(st)
            except Exception as exc:  # noqa: BLE001
                self._hook_failed("the unfinished step at close", exc)

    def _finish_step(self, st: StepState, optimizer_skipped: bool = False, foreign_passes: bool = False) -> None:
        self.write_step(st)
        self._emit(StepEnded(rank=self._rank, step=st.step, wall=time.time(),
                             duration=time.perf_counter() - self._context.step_t0, collected=True,
                             micro_steps=max([self._tracker.grad_acc, *(st.chunk_fwd or st.fwd_count).values()]),
                             optimizer_skipped=optimizer_skipped, foreign_passes=foreign_passes))

    def end_step(self, optimizer_skipped: bool = False) -> None:
        """The step ends: its Adam rows, what it recorded written, StepEnded; the dynamic watcher polled;
        the next step begins."""
        self._binding.step_ended()
        self._handles.remove("first call")  # the first step ran: selectors are checked by the hooks from now on
        micro = self._tracker.step_ends(optimizer_skipped)
        finished = self.step
        ctx = self._context
        st = ctx.state
        self.mark_began()
        try:
            if st is not None:
                if not optimizer_skipped:
                    try:
                        self._collection.optimizer.optimizer_rows(st, self._host.config)
                    except Exception as exc:  # noqa: BLE001 - the step's other rows are still written
                        self._hook_failed("optimizer state statistics", exc)
                self._finish_step(st, optimizer_skipped)
            else:
                self._emit(StepEnded(rank=self._rank, step=finished, wall=time.time(),
                                     duration=time.perf_counter() - ctx.step_t0, collected=False,
                                     micro_steps=micro, optimizer_skipped=optimizer_skipped))
        except Exception as exc:  # noqa: BLE001
            self._hook_failed("optimizer post-step", exc)
        ctx.state = None
        if st is not None and self.monitoring and self.collections >= self._host.config.collect_times:
            self.stop("collect_times")
        self.step += 1
        watcher = self._output.watcher
        if watcher is not None:
            try:
                update = watcher.poll(finished)
            except Exception as exc:  # noqa: BLE001
                update = None
                self._hook_failed("dynamic config watcher", exc)
            if update is not None:
                if getattr(update, "switch", True):
                    self._host.apply_config(update.config, finished, update.content_hash)
                elif self.monitoring:
                    self.stop("switch_off", notify_watcher=False, step=finished)
        self.begin()

    def stop(self, reason: str, notify_watcher: bool = True, step: int | None = None) -> None:
        """Monitoring ends after ``step`` (default: the current step)."""
        self.monitoring = False
        self._monitored.detach()
        self._emit(MonitoringStopped(rank=self._rank, step=self.step if step is None else step, wall=time.time(),
                                     reason=reason, collections=self.collections))
        if self._output.watcher is not None and notify_watcher:
            try:
                self._output.watcher.collection_finished(self.step)
            except Exception as exc:  # noqa: BLE001
                self._hook_failed("dynamic config watcher", exc)
