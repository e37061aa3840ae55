"""The monitored model: its chunks (compiled or not), the targets chosen in it for a config (modules and
parameters), and the step's hooks on them, made again where the model changed under them (compiled
since, parameters unfrozen or frozen since, lazy parameters made since)."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

from trainrec.schema.errors import ConfigError

from . import api_calls
from .attach import StepHooks
from .config import MonitorConfig
from .context import RecordingContext
from .failures import warn_once
from .grad_batch import GradBatch
from .model_args import compiled_fullgraph, uncompiled
from .names import NameTable
from .rank_identity import RankIdentity
from .targets import ParamInfo, Targets, mark_tp_duplicates, select_targets

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_PARAM_REQUIRES_GRAD = operator.attrgetter("param.requires_grad")


class MonitoredModel:
    """``chunks``: the model's chunks (uncompiled); ``compiled``: the model runs under torch.compile
    (hooks are made for it, ``compile_mode.eager``); ``targets``: what is monitored (its parameters are
    ``context.params``; ``context.config`` is the active config). ``owner`` (the monitor, held weakly)
    hands out the hooks' context (its ``hooks``); ``sync_names()`` announces names interned by a selection."""

    def __init__(self, owner, context: RecordingContext, step_hooks: StepHooks, grad_batch: GradBatch,
                 identity: RankIdentity, name_table: NameTable, sync_names: Callable[[], None],
                 hook_failed: Callable[[str, BaseException], None]) -> None:
        self._owner = weakref.ref(owner)
        self._context, self._step_hooks, self._grad_batch = context, step_hooks, grad_batch
        self._identity, self._name_table = identity, name_table
        self._sync_names, self._hook_failed = sync_names, hook_failed
        self.chunks: list = []
        self.compiled = False
        self.fullgraph = False  # a chunk was given as torch.compile(..., fullgraph=True): no graph breaks
        self.installed: list = []  # each chunk's {name: DDP + TP local parameter} when installed
        self.tp_group = None
        self.targets: Targets | None = None
        self._lazy_warned: set[str] = set()  # targets keys warned of for naming such parameters

    def install(self, given: list, tp_group) -> None:
        """The model's chunks as given to ``monitor_gnorm_with_ad`` (compiled ones unwrapped)."""
        self.chunks = [uncompiled(m) for m in given]
        # 2-D DDP + TP's local Parameters, which the module lists no more after its first forward (see
        # targets._displaced); those alone: the others, held for good, might be a model's replaced weights
        self.installed = [{n: p for n, p in c.named_parameters() if hasattr(p, "_st_info")} for c in self.chunks]
        self.fullgraph = any(map(compiled_fullgraph, given))
        self.compiled = any(m is not c for m, c in zip(given, self.chunks, strict=True)) or self.chunks_compiled()
        self.tp_group = tp_group

    def chunks_compiled(self) -> bool:
        """Whether a chunk was compiled in place (``nn.Module.compile()``)."""
        return any(getattr(c, "_compiled_call_impl", None) is not None for c in self.chunks)

    def select(self, cfg: MonitorConfig) -> tuple[Targets, list[ParamInfo]]:
        """Resolve targets and names for ``cfg`` (raises ConfigError before changing anything)."""
        ident = self._identity
        targets = select_targets(self.chunks, cfg, ident.rank, self._name_table.intern,
                                 several_ranks=ident.several_ranks(), installed=self.installed,
                                 fullgraph=self.fullgraph, lazy_warned=self._lazy_warned, warn_once=warn_once)
        self._sync_names()
        if self.tp_group is not None and ident.distributed:
            mark_tp_duplicates(targets.params, self.tp_group)
        return targets, targets.params

    def build(self, cfg: MonitorConfig) -> None:
        """Targets of ``cfg`` chosen and used (raises ConfigError before changing anything)."""
        self.targets, self._context.params = self.select(cfg)

    def retarget(self, targets: Targets, params: list[ParamInfo]) -> None:
        """``targets`` used from now on: the step's hooks, where attached, made again for them."""
        attached = self._step_hooks.attached
        self.detach()
        self.targets, self._context.params = targets, params
        if attached:
            self.attach()

    def hooks_for_step(self, collected: bool) -> None:
        """At a step's begin: the step's hooks on the model where it is ``collected`` (made for the model
        as it runs now: compiled or not, parameters unfrozen since), else taken off."""
        if not self.compiled and self.chunks_compiled():
            self.compiled = True
        if collected:
            self.match_compiled()
            self.hook_unfrozen()
        elif self._step_hooks.attached:
            self.detach()

    def hook_unfrozen(self) -> None:
        """The step's hooks attached, also on parameters frozen when they were attached or chosen that
        require grad now (fine-tuning that unfreezes layers as it goes), and without the parameters
        frozen since they were chosen (an adapter switched off): at a collected step's begin, and again
        at its first forward (layers are unfrozen in the loop, after the last step ended)."""
        t = self.targets
        if t is not None and ((t.frozen and any(map(_REQUIRES_GRAD, t.frozen)))
                              or not all(map(_PARAM_REQUIRES_GRAD, self._context.params))):
            self._select_unfrozen()
        elif self._step_hooks.unfrozen_since():
            self.detach()  # a parameter frozen at attach time was unfrozen: hook it too
        if not self._step_hooks.attached:
            self.attach()

    def _select_unfrozen(self) -> None:
        """A parameter frozen when the targets were chosen now requires grad, or one chosen is frozen now:
        choose them again, so that it is recorded from this step on (fine-tuning that unfreezes layers
        as it goes), or no longer (no parameter or optimizer-state rows of a parameter not trained)."""
        try:
            targets, params = self.select(self._context.config)
        except ConfigError as exc:  # (the same config was accepted before; the model may have changed)
            self._hook_failed("targets of unfrozen parameters", exc)
            self.targets.frozen = [p for p in self.targets.frozen if not p.requires_grad]
            return
        self.detach()
        self.targets, self._context.params = targets, params

    def match_compiled(self) -> None:
        """Attached step hooks made for the other mode (the model was compiled since) are made again."""
        if self._step_hooks.attached and self._step_hooks.compiled != self.compiled:
            self.detach()
            self.attach()

    def attach(self) -> None:
        t, owner = self.targets, self._owner()
        if t is not None and owner is not None:
            cfg, hooks = self._context.config, owner.hooks
            wg = cfg.wg_distribution
            self._step_hooks.attach(hooks, t, self._context.params, self.compiled, self.chunks if wg else None,
                                    wg and self.list_hooks_allowed(), self._context.params_have_main_grad)
            if cfg.api_level:  # the API level (api_calls.py): its hooks, made per attach
                self._step_hooks.handles += api_calls.ApiLevel(hooks).attach(self.chunks, t.modules)

    def list_hooks_allowed(self) -> bool:
        return self._grad_batch.list_hooks_allowed(self._context.config, self.compiled, self._identity.several_ranks())

    def hook_materialized(self) -> None:
        """Lazy modules' parameters made by their first forward: their gradient hooks."""
        self._step_hooks.hook_materialized(self.list_hooks_allowed())

    def detach(self) -> None:
        if self._step_hooks.fired and self._context.state is not None:
            # the list hooks' firings since the last backward pass ended: measured first
            try:
                self._grad_batch.drain_fired(expected=True)  # the hooks go now: no fallback to make
            except Exception as exc:  # noqa: BLE001 - monitoring never kills training
                self._hook_failed("gradient batch", exc)
        self._step_hooks.detach()
