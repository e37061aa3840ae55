"""Per-step attachment: the hooks a collected step puts on the model, and takes off again.

Module hooks come from the targets; each monitored parameter gets a weight-gradient hook: a Python
hook, or where nothing else touches gradients inside the backward pass, a "list hook" (the bound
``append`` of :attr:`StepHooks.fired`: no Python frame runs in the backward pass for it; the
collector drains the list at the end of the pass). Parameters that cannot take a hook yet wait:
frozen ones (until unfrozen), a lazy module's (until its first forward makes them) and FSDP2's (until
it makes the unsharded parameter, where this rank's own gradient accumulates).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import fsdp, zero
from .fused import local_tensor
from .handles import HookHandles
from .targets import ParamInfo, Targets, uninitialized

log = logging.getLogger(__name__)


class StepHooks:
    """The hooks of the steps collected, on the model.

    ``hook_failed(where, exc)`` and ``warn_once(key, message)``: the monitor's. ``hooks`` (the
    :class:`~.hook_context.HookContext` given to :meth:`attach`, held weakly) is what the hooks get.
    """

    def __init__(self, handles: HookHandles, hook_failed: Callable[[str, BaseException], None],
                 warn_once: Callable[[str, str], None]) -> None:
        self._hook_failed = hook_failed
        self._warn_once = warn_once
        self.handles: list = handles.group("step")  # every hook of the step (list hooks included)
        self.compiled = False  # whether the attached hooks were made for a compiled model
        self.frozen: list[int] = []  # monitored parameters without a gradient hook: frozen when attached
        self.fsdp2_waiting: list = []  # (index, FSDPParam) whose unsharded parameter FSDP2 has not made yet
        self.lazy_waiting: list[int] = []  # monitored parameters of lazy modules not made yet
        # the list hooks: firings in order, the hooked parameters' indices by id, their handles (also in
        # handles), and whether a fallback made them Python hooks for good
        self.fired: list = []
        self.list_hooked: dict[int, int] = {}
        self.list_handles: list = handles.group("step: list hooks")
        self.list_hooks_off = False
        self._hooks = lambda: None
        self._targets: Targets | None = None
        self._params: list[ParamInfo] = []
        self._main_grad = False

    @property
    def attached(self) -> bool:
        return bool(self.handles)

    def attach(self, hooks, targets: Targets, params: list[ParamInfo], compiled: bool, grad_hooks_of: list | None,
               fast: bool, main_grad: bool) -> None:
        """Module hooks of ``targets``, and where ``grad_hooks_of`` (the model's chunks) is given, the
        weight-gradient hooks of ``params`` (``fast``: list hooks allowed; ``main_grad``: a parameter's
        Megatron main_grad is measured instead of ``.grad``, which takes a Python hook)."""
        self._hooks, self._targets, self._params, self._main_grad = hooks.ref, targets, params, main_grad
        self.compiled = compiled
        self.handles[:] = targets.attach(hooks)
        self.frozen = []
        self.fsdp2_waiting = []
        self.lazy_waiting = []
        self.list_hooked = {}
        self.list_handles.clear()
        if grad_hooks_of is None:
            return
        sharded, unreadable = fsdp.fsdp2_params(grad_hooks_of)
        if unreadable:
            self._warn_once("fsdp2", "trainrec: the state of an FSDP2 (fully_shard) module could not be read in "
                            "this torch version: its parameters' unreduced gradients are not recorded (reduced "
                            "gradients, parameters and Adam state are, as this rank's shards)")
        for i, p in enumerate(params):
            if not p.param.requires_grad:
                # frozen since the targets were chosen (fine-tuning schedules): torch refuses a
                # gradient hook on it; hooked again at a collected step after it is unfrozen
                self.frozen.append(i)
                continue
            fsdp_param = sharded.get(id(p.param))
            if fsdp_param is not None or (unreadable and local_tensor(p.param) is not p.param):  # a DTensor
                # FSDP2: the hook goes on the unsharded parameter, where this rank's own gradient is
                # accumulated (the sharded one's hooks get the reduced shard), once it exists
                if fsdp_param is not None:
                    self.fsdp2_waiting.append((i, fsdp_param))
                continue
            if uninitialized(p.param):
                # a lazy module's, not made yet (torch refuses a hook on it): hooked at the end of the
                # model chunk's forward that makes it, before its backward (hook_materialized)
                self.lazy_waiting.append(i)
                continue
            self._hook_grad(i, fast)
        if self.fsdp2_waiting:
            self.hook_fsdp2()

    def unfrozen_since(self) -> bool:
        """Whether a parameter frozen when the hooks were attached requires grad now."""
        return bool(self.handles and self.frozen
                    and any(self._params[i].param.requires_grad for i in self.frozen))

    def _hook_grad(self, i: int, fast: bool) -> None:
        """The weight-gradient hook of monitored parameter ``i`` (``fast``: the list hooks allowed)."""
        p, t = self._params[i], self._targets
        try:
            if zero.is_partitioned(p.param):
                # DeepSpeed's own post-accumulate-grad hook (registered first, so run first) moves
                # the gradient into its buckets, where it is reduced while backward goes on
                h = p.param.register_hook(t.grad_hook(self._hooks(), i, incoming=True))
            elif fast and not (self._main_grad and getattr(p.param, "main_grad", None) is not None):
                h = p.param.register_post_accumulate_grad_hook(self.fired.append)
                self.list_hooked[id(p.param)] = i
                self.list_handles.append(h)
            else:
                h = p.param.register_post_accumulate_grad_hook(t.grad_hook(self._hooks(), i, incoming=False))
        except RuntimeError as exc:  # one parameter's hook never costs the others theirs
            self._hook_failed(f"weight-gradient hook of {p.name!r}", exc)
            return
        self.handles.append(h)

    def hook_materialized(self, fast: bool) -> None:
        """Weight-gradient hooks on the lazy modules' parameters made by now (at the end of a model chunk's
        forward, before its backward: the forward that makes one runs its module)."""
        waiting = []
        for i in self.lazy_waiting:
            if uninitialized(self._params[i].param):
                waiting.append(i)
            else:
                self._hook_grad(i, fast)
        self.lazy_waiting = waiting

    def hook_fsdp2(self) -> None:
        """Gradient hooks on the FSDP2 unsharded parameters that exist by now (made at a module's first
        all-gather: the first forward ends with every one of them made)."""
        waiting = []
        for i, fsdp_param in self.fsdp2_waiting:
            u = fsdp.unsharded_param(fsdp_param)
            if u is None:
                waiting.append((i, fsdp_param))
                continue
            try:
                self.handles.append(u.register_post_accumulate_grad_hook(
                    self._targets.grad_hook(self._hooks(), i, incoming="unsharded")))
            except RuntimeError as exc:
                self._hook_failed(f"weight-gradient hook of {self._params[i].name!r}", exc)
        self.fsdp2_waiting = waiting

    def python_hooks_from_now(self, why: str) -> None:
        """The monitored parameters' list hooks become Python hooks, for the rest of the run."""
        if self.list_hooks_off:
            return
        self.list_hooks_off = True
        log.debug("trainrec: weight-gradient hooks in Python from now on: %s", why)
        for h in self.list_handles:
            h.remove()
        self.list_handles.clear()
        t = self._targets
        for i in sorted(set(self.list_hooked.values())):
            try:
                self.handles.append(self._params[i].param.register_post_accumulate_grad_hook(
                    t.grad_hook(self._hooks(), i, incoming=False)))
            except RuntimeError as exc:
                self._hook_failed(f"weight-gradient hook of {self._params[i].name!r}", exc)
        self.list_hooked = {}

    def detach(self) -> None:
        """Remove every hook of the step (the list hooks' firings not drained are dropped)."""
        self.fired.clear()
        self.list_handles.clear()  # (removed with the others below)
        for h in self.handles:
            h.remove()
        self.handles.clear()
