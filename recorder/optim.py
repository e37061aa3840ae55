"""Finding the torch optimizer behind a wrapper, and its Adam state (``update`` and ``ratio`` from that
state: :mod:`.adam_update`).

The monitor hooks the *instance* of the torch optimizer that steps, never the class. Wrappers
(Megatron's, DeepSpeed's, accelerate's, HF's) are followed through ``.optimizer`` to a
``torch.optim.Optimizer``; ``ZeroRedundancyOptimizer`` through ``.optim``.

Adam state (``exp_avg``, ``exp_avg_sq``, ``step``) is read from that optimizer's ``state``. A step
count kept on the device (fused, capturable Adam) is never read, which would sync: the bias
corrections are then 0-d device tensors. A parameter's state is found directly, through Megatron's
fp32 master copies (same position in ``fp32_from_float16_groups``), in DeepSpeed ZeRO's flat
partitions (:mod:`.zero`, :class:`AdamState`) or in the DistributedOptimizer's shards; each rank
records its own pieces. Parameters without state get no rows, and one warning names the optimizers
that keep no Adam state."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from . import zero

log = logging.getLogger(__name__)

KNOWN_OPT_TYPES = (
    "Megatron_DistributedOptimizer",
    "Megatron_Float16OptimizerWithFloat16Params",
    "Megatron_ChainedDistributedOptimizer",
    "Megatron_ChainedFloat16OptimizerWithFloat16Params",
    "Megatron_FP32Optimizer",
    "DeepSpeedZeroOptimizer_Stage0",
    "DeepSpeedZeroOptimizer_Stage1_or_2",
    "DeepSpeedZeroOptimizer_Stage3",
    "unknown",
)


def torch_optimizer_of(opt) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` instance that steps inside ``opt``: ``opt`` itself, or the innermost
    one found via ``.optimizer``, through wrappers that are not torch optimizers (Megatron's, DeepSpeed's)
    and wrappers that subclass ``Optimizer`` without being one: accelerate's ``AcceleratedOptimizer``
    (what HF's Trainer hands its callbacks) never runs ``Optimizer.__init__`` and has no step hooks of
    its own; it steps what it holds in ``.optimizer`` (under DeepSpeed, DeepSpeed's optimizer, which
    steps the torch optimizer in its own ``.optimizer``)."""
    found = None
    seen = 0
    while opt is not None and seen < 8:
        if isinstance(opt, torch.optim.Optimizer):
            inner = getattr(opt, "optim", None)
            if isinstance(inner, torch.optim.Optimizer):
                # torch.distributed.optim.ZeroRedundancyOptimizer: an Optimizer whose own ``state`` is
                # empty; the local optimizer (``.optim``) steps this rank's shard and holds its state
                return inner
            found = opt
        inner = getattr(opt, "optimizer", None)
        if inner is opt:
            break
        opt = inner
        seen += 1
    return found


def holder_of(wrapped, opt: torch.optim.Optimizer):
    """What holds torch optimizer ``opt`` directly in ``wrapped``'s ``.optimizer`` chain (a mixed-precision
    wrapper, whose fp32 masters and flags are read), past wrappers of it (accelerate's); ``wrapped``
    itself where it is ``opt`` or the chain does not lead to it."""
    w = wrapped
    for _ in range(8):
        inner = getattr(w, "optimizer", None)
        if inner is opt or inner is None or inner is w:
            return w if inner is opt else wrapped
        w = inner
    return wrapped


# (model parameters, their fp32 masters) group attributes of mixed-precision wrappers, in the same
# order: Megatron's Float16OptimizerWithFloat16Params and DeepSpeed's FP16_UnfusedOptimizer (a whole
# fp32 copy per parameter), and Megatron's DistributedOptimizer (this rank's fp32 shard of each
# parameter in its range; for fp32 parameters the shard is a view into the parameter).
_MASTER_GROUPS = (
    ("float16_groups", "fp32_from_float16_groups"),
    ("fp16_groups", "fp32_groups"),  # DeepSpeed's FP16_UnfusedOptimizer (ZeRO 0 with fp16 or bf16)
    ("model_float16_groups", "shard_fp32_from_float16_groups"),
    ("model_fp32_groups", "shard_fp32_groups"),
)


def chain_of(opt) -> list[tuple[object, torch.optim.Optimizer]] | None:
    """``(optimizer, its torch optimizer)`` of each member of Megatron's ``ChainedOptimizer`` (dense and
    expert parameters, or several model parts, each with its own DistributedOptimizer or
    Float16OptimizerWithFloat16Params, stepped one after the other in one training step), or of a list
    or tuple of optimizers that each step part of the model once per training step (Muon for the
    matrices and AdamW for the rest); None where ``opt`` is neither. Members without a torch
    optimizer are left out."""
    members = opt if isinstance(opt, (list, tuple)) else getattr(opt, "chained_optimizers", None)
    if not isinstance(members, (list, tuple)):
        return None
    pairs = [(m, torch_optimizer_of(m)) for m in members]
    return [(m, t) for m, t in pairs if t is not None] or None


OWN_GRAD = object()  # AdamState.reduced_grad: the parameter's own gradient is what the optimizer applies


class AdamState:
    """Maps model parameters to their Adam state in a (possibly wrapped) optimizer."""

    def __init__(self, wrapped, torch_opt: torch.optim.Optimizer, more: Sequence[tuple] = ()) -> None:
        """``more``: further ``(wrapper, torch optimizer)`` pairs stepped in the same training step (the
        members of Megatron's ChainedOptimizer after the first); each parameter is in one of them."""
        self.torch_opt = torch_opt
        self._master: dict[int, torch.Tensor] = {}
        self._shards: set[int] = set()  # model parameters whose master is this rank's shard of it
        self._group_of: dict[int, dict] = {}
        self._opt_of: dict[int, torch.optim.Optimizer] = {}  # id(parameter stepped) -> its optimizer
        # the groups as they are between steps (DeepSpeed cuts param_groups to one group per call of step)
        self._groups = list(torch_opt.param_groups)
        pairs = ((wrapped, torch_opt), *more)
        for w, _ in pairs:
            for model_attr, main_attr in _MASTER_GROUPS:
                model_groups, main_groups = getattr(w, model_attr, None), getattr(w, main_attr, None)
                if model_groups is None or main_groups is None:
                    continue
                for g_model, g_main in zip(model_groups, main_groups, strict=False):
                    for p_model, p_main in zip(g_model, g_main, strict=False):
                        self._master[id(p_model)] = p_main
                        if main_attr.startswith("shard_"):
                            self._shards.add(id(p_model))
        self._opts = [opt for _, opt in pairs]
        self._group_ids: list[set[int]] = []
        self.refresh()
        self._warned = False

    def refresh(self) -> None:
        """Parameter -> (param group, optimizer) maps, made again where an optimizer's groups are not
        the ones mapped: ``load_state_dict`` (a resume after the monitor was installed) gives every
        optimizer new group dicts and a new ``state`` dict, ``add_param_group`` adds a group. A list
        cut down to some of the mapped groups (DeepSpeed, one group per call of ``step``) is kept."""
        current = [{id(g) for g in opt.param_groups} for opt in self._opts]
        if len(current) == len(self._group_ids) and all(
                cur <= known for cur, known in zip(current, self._group_ids, strict=True)):
            return
        self._group_ids = current
        self._group_of.clear()
        self._opt_of.clear()
        for opt in self._opts:
            for group in opt.param_groups:
                for p in group["params"]:
                    self._group_of[id(p)] = group
                    self._opt_of[id(p)] = opt
        if self._opts[0].param_groups:
            self._groups = list(self._opts[0].param_groups)

    def holds_any(self, params: Sequence[torch.Tensor], groups: Sequence[dict] | None = None) -> bool:
        """Whether the optimizer steps any of ``params``: in its param groups (or ``groups``, a wrapper's,
        such as torch's ZeroRedundancyOptimizer's, whose local optimizer holds this rank's shard only),
        through an fp32 master, or in DeepSpeed's partitions."""
        ids = set(self._group_of) | set(self._master)
        ids.update(id(q) for g in groups or () for q in g.get("params", ()))
        return any(id(p) in ids or zero.is_partitioned(p) for p in params)

    def state_param(self, p: torch.Tensor) -> torch.Tensor:
        return self._master.get(id(p), p)

    def reduced_grad(self, p: torch.Tensor):
        """The gradient the optimizer is about to apply to this rank's share of ``p`` (after
        :meth:`refresh`, once per step), where the optimizer keeps its own copy of it: DeepSpeed ZeRO's piece of the flat fp32 gradient (there while it steps
        ``p``'s group), Megatron DistributedOptimizer's fp32 shard gradient (``p``'s own ``main_grad``
        is reduced only in this rank's range); None where this rank has no share of ``p`` or none is
        there now. :data:`OWN_GRAD` where the optimizer applies ``p``'s own gradient."""
        if zero.is_partitioned(p):
            pc = zero.piece_of(p, self._groups)
            return _narrow(pc.flat.grad, pc) if pc is not None else None
        if self._shards:
            if id(p) in self._shards:
                return self._master[id(p)].grad
            # a chain's member without shards steps a whole master, or the parameter itself
            return OWN_GRAD if id(p) in self._master or id(p) in self._group_of else None
        return OWN_GRAD

    def applies_own_grads(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether :meth:`reduced_grad` is :data:`OWN_GRAD` for every one of ``params``, known without a
        call per parameter (no shards of a distributed optimizer, no ZeRO partitions; neither depends on
        :meth:`refresh`); False also where it may not be."""
        return not self._shards and not zero.any_maybe_partitioned(params)

    @property
    def adam_family(self) -> bool:
        """Whether the optimizer is of Adam's family (its param groups have ``betas``: Adam, AdamW,
        NAdam, RAdam, Adamax, fused and DeepSpeed Adams), whose state holds ``exp_avg``."""
        opts = [self.torch_opt, *{id(o): o for o in self._opt_of.values()}.values()]
        return any("betas" in g for o in opts for g in o.param_groups)

    def in_adam_family(self, p: torch.Tensor) -> bool:
        """Whether the optimizer that steps ``p`` (of a list, its own) is of Adam's family."""
        opt = self._opt_of.get(id(self.state_param(p)), self.torch_opt)
        return any("betas" in g for g in opt.param_groups)

    @property
    def stepped(self) -> bool:
        """Whether the optimizer holds any per-parameter state (Adam's or another's: it has stepped)."""
        return bool(self.torch_opt.state) or any(bool(o.state) for o in self._opt_of.values())

    def lookup(self, params: Sequence[torch.Tensor], host_steps: bool = True
               ) -> list[tuple[int, torch.Tensor, torch.Tensor, float | torch.Tensor, dict]]:
        """``(index, exp_avg, exp_avg_sq, step, group)`` for params that have Adam state. ``step`` is a
        float, or the counter tensor itself where it is on an accelerator (fused/capturable Adam: a read
        would sync). ``host_steps=False`` leaves counters on the CPU as tensors too (the accelerators'
        code on CPU, for :attr:`StatsEngine.host_paths` ``= False``, or where the step is not used)."""
        out = []
        self.refresh()
        state = self.torch_opt.state
        missing: dict[int, torch.optim.Optimizer] = {}  # id -> optimizer with a parameter without Adam state
        found: set[int] = set()  # ids of optimizers with a parameter with Adam state
        for i, p in enumerate(params):
            sp = self.state_param(p)
            if zero.is_partitioned(sp):
                pc = zero.piece_of(sp, self._groups)
                if pc is None:
                    continue  # wholly in other ranks' partitions: theirs to record
                st = state.get(pc.flat)
                m = _narrow(st.get("exp_avg"), pc) if st else None
                v = _narrow(st.get("exp_avg_sq"), pc) if st else None
                if m is None or v is None:
                    missing[id(self.torch_opt)] = self.torch_opt
                    continue
                found.add(id(self.torch_opt))
                group = self._groups[pc.group] if pc.group is not None else {}
            else:
                opt = self._opt_of.get(id(sp), self.torch_opt)
                st = opt.state.get(sp)
                if not st or "exp_avg" not in st or "exp_avg_sq" not in st:
                    missing[id(opt)] = opt
                    continue
                found.add(id(opt))
                m, v = st["exp_avg"], st["exp_avg_sq"]
                group = self._group_of.get(id(sp), {})
            step = st.get("step", 0)
            if not isinstance(step, torch.Tensor):
                step = float(step)
            elif host_steps and step.device.type == "cpu":
                step = float(step)  # plain Adam/AdamW: a CPU scalar, read exactly per parameter
            out.append((i, m, v, step, group))
        if missing and not self._warned:
            self._warn_no_adam_state([o for k, o in missing.items() if k not in found])
        return out

    def _warn_no_adam_state(self, opts: list[torch.optim.Optimizer]) -> None:
        """One warning (per run) naming those of ``opts`` (optimizers none of whose monitored parameters
        has Adam state) that have none to give: outside Adam's family (no ``betas``; SGD without
        momentum keeps no state at all), or stepped with state of another kind. An optimizer of Adam's
        family that has not stepped yet is not named."""
        opts = [o for o in opts if o.state or not any("betas" in g for g in o.param_groups)]
        if not opts:
            return
        self._warned = True
        n = len(self._opts)
        names = ", ".join(type(o).__name__ + (f" (optimizer {self._opts.index(o) + 1} of {n})" if n > 1 else "")
                          for o in opts)
        log.warning("trainrec: no Adam state (exp_avg with exp_avg_sq) found for the monitored parameters in %s "
                    "(an optimizer outside Adam's family keeps none, or only part: Adafactor's exp_avg_sq alone); "
                    "mv_distribution, ur_distribution and mg_direction record nothing for them", names)


def _narrow(src: torch.Tensor | None, pc: zero.Piece) -> torch.Tensor | None:
    """``pc``'s piece of ``src``, a tensor laid out as the flat partition ``pc.flat``."""
    if src is None or src.shape != pc.flat.shape:
        return None
    return src.narrow(0, pc.start, pc.count)
