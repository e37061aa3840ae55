"""What a recording's hooks read and call, in one object the monitor makes and hands to them in its
place: the hooks (``hooks.py``, ``chunk_hooks.py``, the API level's) see these parts and callbacks, not
the monitor's other state."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .attach import StepHooks
    from .context import RecordingContext
    from .grad_batch import GradBatch
    from .monitored import MonitoredModel
    from .names import NameTable
    from .output import Output
    from .rank_identity import RankIdentity
    from .steps import StepTracker


class HookContext:
    """The hooks' view of a recording.

    ``recording``: the :class:`~trainrec.recorder.context.RecordingContext` (the collected step's
    ``state``, ``params``, ``engine``, the active ``config``); ``grad_acc``: micro steps per step (the
    step tracker's, ``steps``);
    ``hook_failed(where, exc)``: a failure inside a hook reported (training goes on);
    ``monitored``: the :class:`~trainrec.recorder.monitored.MonitoredModel` (``compiled``,
    ``match_compiled()``, ``hook_materialized()``); ``on_micro_step()``: the step cycle's, at chunk 0's
    training forward; ``step_hooks``: the :class:`~trainrec.recorder.attach.StepHooks` (the list hooks'
    ``fired`` and ``list_handles``, the FSDP2 and lazy parameters waiting); ``grad_batch``: the
    :class:`~trainrec.recorder.grad_batch.GradBatch`; ``name_table`` and ``sync_names()``: names interned,
    and announced to the log; ``output`` (its ``writer``) and ``identity`` (its ``rank``): where the API
    level's records go; ``no_tensor_warned``: name ids of modules warned of finding no tensor;
    ``lazy_chunks``: chunks whose lazy modules' parameters are not made yet, ``materialized(vpp)`` once
    they are.

    ``ref``: a weak reference to this context, what hooks on tensors hold (out of the garbage
    collector's sight, a strong reference there would keep the recording alive): it answers None once
    the monitor is gone, and those hooks do nothing then. The model's hooks hold the context itself,
    which holds its ``owner`` (read by no hook) so that the model keeps its monitor alive, as it always did.
    """

    __slots__ = ("__weakref__", "_owner", "grad_batch", "hook_failed", "identity", "lazy_chunks",
                 "materialized", "monitored", "name_table", "no_tensor_warned", "on_micro_step", "output", "recording",
                 "ref", "step_hooks", "steps", "sync_names")

    def __init__(self, owner, recording: RecordingContext, *, steps: StepTracker, monitored: MonitoredModel,
                 on_micro_step: Callable[[], None], step_hooks: StepHooks, grad_batch: GradBatch,
                 name_table: NameTable, sync_names: Callable[[], None], output: Output, identity: RankIdentity,
                 hook_failed: Callable[[str, BaseException], None], materialized: Callable[[int], None]) -> None:
        self._owner = owner
        self.recording = recording
        self.steps = steps
        self.hook_failed = hook_failed
        self.monitored = monitored
        self.on_micro_step = on_micro_step
        self.step_hooks = step_hooks
        self.grad_batch = grad_batch
        self.name_table = name_table
        self.sync_names = sync_names
        self.output = output
        self.identity = identity
        self.no_tensor_warned: set[int] = set()
        self.lazy_chunks: set[int] = set()
        self.materialized = materialized
        self.ref = weakref.ref(self)

    @property
    def grad_acc(self) -> int:
        return self.steps.grad_acc
