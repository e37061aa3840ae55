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
    """The hooks' view of a recording: the narrow interface every hook maker gets instead of the session
    (its attributes are listed in docs/recorder-internals.md, "What hooks get").

    ``ref`` is a weak reference to this context, what hooks on tensors hold: they sit out of the garbage
    collector's sight, where a strong reference would keep the recording alive; it answers None once
    the monitor is gone, and those hooks then do nothing. The model's hooks hold the context itself,
    which holds its ``owner`` (read by no hook) so that the model keeps its monitor alive."""

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
