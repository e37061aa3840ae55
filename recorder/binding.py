"""Optimizer binding: which optimizer's steps are the model's training steps, and what holds its state.

The torch optimizer found in what the caller gave (a wrapper's ``.optimizer``, Megatron's
ChainedOptimizer, a list of optimizers over parts of the model, DeepSpeed's ZeRO), or, given none, the
first optimizer that steps over the model's parameters (a global step pre-hook until then). Its step
hooks call the monitor back; :meth:`OptimizerBinding.part_of_step` says which of its ``step()`` calls
begin and end a training step.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable

import torch

from . import zero
from .compile_mode import eager
from .handles import HookHandles
from .optim import AdamState, chain_of, holder_of, torch_optimizer_of

log = logging.getLogger(__name__)


class OptimizerBinding:
    """The optimizer a monitor records, and its step hooks.

    ``pre_step``/``post_step``: the callbacks of each bound optimizer's
    step hooks (weak: an optimizer kept elsewhere must not keep a dropped monitor); ``set_wrapped``:
    the mixed-precision wrapper named by ``set_wrapped_optimizer`` now (or None); ``warn_once(key,
    message)``: the monitor's once-only warning.
    """

    def __init__(self, handles: HookHandles, pre_step: Callable, post_step: Callable,
                 set_wrapped: Callable[[], object], warn_once: Callable[[str, str], None]) -> None:
        self._chunks: list = []
        self._pre_step, self._post_step = pre_step, post_step
        self._set_wrapped = set_wrapped
        self._warn_once = warn_once
        self.opt: torch.optim.Optimizer | None = None
        self.wrapped = None  # what holds the optimizer's fp32 masters
        self.adam: AdamState | None = None
        self.chain: list = []  # the torch optimizers of Megatron's ChainedOptimizer, or of a list given
        self.chain_stepped: set[int] = set()  # those of them that stepped in this training step
        self.z3 = None  # DeepSpeed's ZeRO 3 optimizer, where it partitions the model
        self._groups: list = []  # the optimizer's param groups between steps
        self._ds_overflow = None  # DeepSpeed's optimizer around self.opt, where known (zero.overflow_source)
        self.ds_steps: int | None = None  # its steps taken when the last training step ended (zero.steps_taken)
        self._handles: list = handles.group("optimizer")  # the bound optimizers' step hooks
        self._global_handles: list = handles.group("optimizer: waiting")  # the global pre-step hook waiting for one
        self._closed = False

    def bind(self, optimizer, chunks: list) -> None:
        """Bind ``optimizer`` of the model ``chunks`` (None: the one ``set_wrapped_optimizer`` named, else
        the first to step over the model's parameters)."""
        self._chunks = chunks
        set_wrapped = self._set_wrapped()
        wrapped = optimizer if optimizer is not None else (self.wrapped or set_wrapped)
        opt = torch_optimizer_of(wrapped) if wrapped is not None else None
        chain = chain_of(wrapped)
        mapper_chain = chain_of(set_wrapped) if chain is None and opt is not None else None
        if mapper_chain and any(t is opt for _, t in mapper_chain):
            chain = mapper_chain  # a member's torch optimizer given, the chain named by set_wrapped_optimizer
        if chain:
            self.bind_instance(chain[0][1], chain[0][0], chain)
            return
        if wrapped is not None and opt is None:
            log.warning("trainrec: %s is not a torch optimizer and wraps none (.optimizer); waiting for the "
                        "first optimizer that steps over the model's parameters", type(wrapped).__name__)
        if opt is not None:
            self.bind_instance(opt, holder_of(wrapped, opt))
            return
        param_ids = {id(p) for c in self._chunks for p in c.parameters()}
        ref = weakref.ref(self)  # the global registry would keep this binding (and its model) alive for good
        warn_once = self._warn_once

        def pre(o, args, kwargs):
            binding = ref()
            if binding is not None and binding.opt is None and not binding._closed:
                if any(id(p) in param_ids for g in o.param_groups for p in g["params"]):
                    binding.bind_instance(o, o)  # the instance hooks run right after the global ones
                else:
                    warn_once(f"unmatched-opt-{id(o)}", "trainrec: an optimizer without the monitored model's "
                              "parameters stepped; it is not monitored")

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._global_handles.append(register_optimizer_step_pre_hook(pre))

    def bind_instance(self, opt: torch.optim.Optimizer, wrapped, chain: list | None = None) -> None:
        """Hook ``opt`` (``wrapped``: what holds its fp32 masters). ``chain``: the ``(wrapper, torch
        optimizer)`` members of Megatron's ChainedOptimizer, ``opt`` the first's; they step one after
        the other in one training step, after the chain's ``prepare_grads`` readied every member's
        gradients: the step's gradient and parameter rows are taken before the first, it ends after
        the last."""
        self.opt = opt
        self.wrapped = wrapped
        # the reference's set_wrapped_optimizer names the mixed-precision wrapper whose fp32 masters
        # hold the state, also where monitor_gnorm_with_ad got the torch optimizer inside it
        set_wrapped = self._set_wrapped()
        mapper = set_wrapped
        if mapper is None or mapper is wrapped or torch_optimizer_of(mapper) is not opt:
            mapper = wrapped
        self.adam = AdamState(mapper, opt, chain[1:] if chain else ())
        self._groups = list(opt.param_groups)
        chunks = self._chunks
        trained = [p for c in chunks for p in c.parameters() if p.requires_grad]
        if trained and not self.adam.holds_any(trained, getattr(wrapped, "param_groups", None)):
            self._warn_once(f"foreign-opt-{id(opt)}", f"trainrec: the optimizer given ({type(opt).__name__}) steps "
                            "none of the monitored model's parameters: was it made for another model, or for a "
                            "copy of this one? Steps are still counted at its step(), but the weights it changes "
                            "are not those recorded, and no optimizer state is found for them")
        self.z3 = zero.z3_optimizer_of(q for c in chunks for q in c.parameters())
        # (a model chunk that is DeepSpeed's engine, as accelerate's prepare() returns it, names its optimizer;
        # else, where DeepSpeed is loaded, what refers to the optimizer may be DeepSpeed's)
        ds = zero.overflow_source(opt, [holder_of(w, opt) for w in (
            wrapped, set_wrapped, self.z3, *(getattr(c, "optimizer", None) for c in chunks))])
        if ds is None and "deepspeed" in sys.modules and isinstance(opt, torch.optim.Optimizer):
            ds = zero.overflow_source(opt, zero.referrers_of(opt))
        self._ds_overflow = _weak_or_strong(ds) if ds is not None else None
        self.ds_steps = zero.steps_taken(ds) if ds is not None else None
        self.chain = [t for _, t in chain] if chain else []
        for t in self.chain or [opt]:
            self._handles += [t.register_step_pre_hook(eager(self._pre_step)),
                              t.register_step_post_hook(eager(self._post_step))]

    @property
    def waiting(self) -> bool:
        """Whether no optimizer is bound yet and a global pre-step hook waits for the model's."""
        return bool(self._global_handles)

    def owns(self, opt) -> bool:
        """Whether ``opt`` is the bound optimizer or one of its chain."""
        return opt is self.opt or any(opt is t for t in self.chain)

    def deepspeed(self):
        """DeepSpeed's optimizer around the bound one, where known and alive (its ``overflow`` flag)."""
        return self._ds_overflow() if self._ds_overflow is not None else None

    @property
    def deepspeed_known(self) -> bool:
        return self._ds_overflow is not None

    def part_of_step(self, opt) -> tuple[bool, bool]:
        """``(first, last)``: whether this call of the optimizer's step begins and ends the training
        step. DeepSpeed's ZeRO optimizers step the torch optimizer once per param group (ZeRO 1/2, with
        ``param_groups`` cut down to that group for the call) or sub-group (ZeRO 3): those calls
        together are one training step, begun by the first group's and ended by the last group's."""
        if self.chain and any(opt is t for t in self.chain):
            # in whatever order they step: the first to step begins the step, the last one ends it
            return not self.chain_stepped, len(self.chain_stepped | {id(opt)}) == len(self.chain)
        if opt is None or opt is not self.opt:
            return True, True
        if self.z3 is not None:  # ZeRO 3 empties the other sub-groups' params lists instead
            return zero.step_part(opt, self.z3)
        cur, full = opt.param_groups, self._groups
        if cur and len(cur) < len(full) and all(any(g is f for f in full) for g in cur):
            return cur[0] is full[0], cur[-1] is full[-1]
        self._groups = list(cur)  # groups added since (add_param_group)
        return True, True

    def stepped(self, opt) -> None:
        """A member of the chain finished its step in this training step."""
        if self.chain:
            self.chain_stepped.add(id(opt))

    def step_ended(self) -> None:
        """The training step ended: the chain starts over; DeepSpeed's step count is kept to compare."""
        self.chain_stepped.clear()
        if (ds := self.deepspeed()) is not None:
            self.ds_steps = zero.steps_taken(ds)

    def drop_waiting_hook(self) -> None:
        """An optimizer is bound: the global pre-step hook that waited for one goes."""
        if self._global_handles and self.opt is not None:
            for h in self._global_handles:
                h.remove()
            self._global_handles.clear()

    def close(self) -> None:
        """Remove every step hook. Idempotent."""
        self._closed = True
        for handles in (self._handles, self._global_handles):
            for h in handles:
                h.remove()
            handles.clear()


def _weak_or_strong(obj):
    """A weak reference to ``obj``, or where its class allows none, a callable that returns it."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj
