"""Which modules and parameters a config selects, resolved once per config.

``targets`` keys name modules (activations) or parameter prefixes (weight grads, params, optimizer
state); :mod:`.names` does squashing and matching. With ``xy_distribution`` and ``all_xy`` (or no
targets) every module is hooked, and modules listed in ``targets`` use their own selectors;
``module_ranks`` limits activations to the listed ranks. A target matching nothing, or a ``tuple[N]``
input selector the ``forward`` cannot take, is a ConfigError before training (docs/config.md,
"Checks at start-up")."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.parameter import UninitializedTensorMixin
from trainrec.schema.errors import ConfigError

from .compile_mode import eager
from .config import MonitorConfig
from .grad_places import sharded_over
from .hooks import ModuleTarget, make_forward_hook, make_grad_hook, make_pre_hook
from .names import module_matches, param_matches, squash, squash_all
from .selectors import make_first_call_check

log = logging.getLogger(__name__)


@dataclass
class ParamInfo:
    name_id: int
    name: str
    vpp: int
    param: torch.Tensor
    full: str
    tp_duplicate: bool = False


def uninitialized(t) -> bool:
    """Whether ``t`` is a lazy module's parameter (or buffer) not made yet (``UninitializedParameter``: a
    ``LazyLinear``'s before its first forward): no size, no memory, no hooks until then. Its first
    forward makes it in place, the same object, a Parameter from then on."""
    return isinstance(t, UninitializedTensorMixin)


_GRAD_SLOTS = frozenset({"input_grad", "output_grad"})
_VALUE_SLOTS = frozenset({"input", "output"})


@dataclass
class Targets:
    modules: list = field(default_factory=list)  # (module, ModuleTarget)
    params: list = field(default_factory=list)  # ParamInfo
    module_short: list = field(default_factory=list)  # per vpp: {full: short}
    forward: bool = True
    backward: bool = True
    made: dict = field(default_factory=dict, repr=False)  # hook functions, made once, reattached per step
    # parameters selected but frozen (requires_grad False) when the targets were chosen: chosen again
    # at the first collected step after one of them is unfrozen (MonitoredModel.hook_unfrozen)
    frozen: list = field(default_factory=list, repr=False)
    # targets keys that match only such parameters, where parameter statistics are on (a warning)
    frozen_only: list = field(default_factory=list)
    # targets key -> the names of the lazy modules' parameters not made yet that it matches, where
    # parameter statistics are on (a warning: recorded from the module's first forward on)
    lazy: dict = field(default_factory=dict)

    def attach(self, ctx) -> list:
        """Module hooks: no full backward hooks (see :mod:`.hooks`), so in-place ops keep working."""
        handles = []
        for k, (module, t) in enumerate(self.modules):
            # (only the slots its targets entry names: ModuleTarget.wants)
            backward = self.backward and not t.wants.isdisjoint(_GRAD_SLOTS)
            forward = self.forward and not t.wants.isdisjoint(_VALUE_SLOTS)
            # (with the keyword arguments: a module called with them only takes its input from them)
            if backward:
                handles.append(module.register_forward_pre_hook(self._hook(ctx, ("pre", k), make_pre_hook, t, forward),
                                                                with_kwargs=True))
            if forward or backward:
                handles.append(module.register_forward_hook(
                    self._hook(ctx, ("fwd", k), make_forward_hook, t, forward, backward), with_kwargs=True))
        return handles

    def grad_hook(self, ctx, index: int, incoming: bool | str):
        """The weight-gradient hook of parameter ``index`` (:func:`.hooks.make_grad_hook`)."""
        return self._hook(ctx, ("grad", index, incoming), make_grad_hook, index, incoming)

    def _hook(self, ctx, key: tuple, make, *args):
        """``make(ctx, *args)`` (``ctx``: the monitor's :class:`~.hook_context.HookContext`), made at the first call and reused when a later collected step attaches
        the hooks again; where the model runs compiled, wrapped for it (:func:`.compile_mode.eager`, not
        free to make)."""
        compiled = ctx.monitored.compiled
        key += (compiled,)
        fn = self.made.get(key)
        if fn is None:
            fn = make(ctx, *args)
            fn = self.made[key] = eager(fn) if compiled else fn
        return fn

    def first_call_checks(self, source: str | None = None, on_reject: Callable | None = None) -> list:
        """Hooks checking the selectors of the modules that have any at their first call (see
        :func:`.selectors.make_first_call_check`); the monitor removes them when the first step ends.
        Made before the monitor's own module hooks, they run before them."""
        handles = []
        for module, t in self.modules:
            if (pre := make_first_call_check(t, source, on_reject, inputs=True)) is not None:
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            if (post := make_first_call_check(t, source, on_reject)) is not None:
                handles.append(module.register_forward_hook(post))
        return handles


def _positional_capacity(module: torch.nn.Module) -> int | None:
    """How many positional arguments ``module.forward`` can take (None: any number, or unknown)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    n = 0
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            n += 1
    return n


def _check_input_selectors(module: torch.nn.Module, full: str, sel: dict, target: str) -> None:
    """A ``tuple[N]`` input selector on a module whose forward cannot take N positional arguments can
    never fit: a ConfigError now, before training. (Fewer arguments than the signature allows may be
    passed as keywords, and outputs are only seen when the module runs: those are checked at the
    first call.)"""
    cap = None
    for key in ("input", "input_grad"):
        s = sel.get(key)
        if s is None or s.is_tensor:
            continue
        if cap is None:
            cap = _positional_capacity(module)
            if cap is None:
                return
        if s.length > cap:
            hint = (f"use 'tensor' or 'tuple[{cap}]:i'" if cap else
                    "its inputs are keyword arguments, which hooks do not see, so leave the selector out")
            raise ConfigError(
                f"expected {s.spec!r} to fit the module's inputs, but {full or type(module).__name__!r} "
                f"({type(module).__name__}) takes at most {cap} positional input(s): "
                f"{hint} (print_struct shows the real structure)",
                f"targets.{target}.{key}",
            )


def _examples(names: list[str], k: int = 6) -> str:
    shown = [n for n in names if n][:k]
    return ", ".join(repr(n) for n in shown) + (", ..." if len(names) > k else "")


def _names_like(modules: list[str], params: list[str]) -> str:
    """What the names a target can match look like (the root module, named '', is left out)."""
    mods = (f"module names look like {_examples(modules)}" if any(modules) else
            "the model has no submodules (a target names a submodule or a parameter)")
    return f"{mods}, " + (f"parameter names like {_examples(params)}" if params else "and no trainable parameters")


def _recorded_module_name(hit: list[str], full: str, short: str, vpp: int, all_xy: bool,
                          shorts: set[str]) -> str:
    """The name a monitored module's activations are recorded under. As in the reference: the
    squashed name, except for a module that a ``targets`` key names by its full name (and by no
    squashed form) without ``all_xy``, which keeps that full name (the documented
    ``language_model.encoder.layers.0`` gives rows ``language_model.encoder.layers.0_0``), unless
    that is another module's squashed name in the chunk (``shorts``: two modules would share rows)."""
    if not hit or all_xy or short == full or full in shorts:
        return short
    if any(t in (short, f"{vpp}:{short}") for t in hit):
        return short
    return full


def _displaced(chunk: torch.nn.Module, name: str, p: torch.Tensor) -> bool:
    """Whether ``p``, listed as ``name`` when the monitor was installed, is one of the local Parameters
    torch's 2-D DDP + TP (``DistributedDataParallel(..., device_mesh=mesh["dp"])``) puts in a DTensor's
    place (its layout in ``_st_info``), which DDP and the optimizer still hold, though the module lists
    it no more: from the first forward on, DDP's pre-hook leaves a plain DTensor attribute there."""
    if not hasattr(p, "_st_info"):
        return False
    path, _, leaf = name.rpartition(".")
    try:
        module = chunk.get_submodule(path)
    except AttributeError:
        return False
    t = module.__dict__.get(leaf)
    return isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)


def build_targets(chunks: list[torch.nn.Module], cfg: MonitorConfig, rank: int,
                  intern: Callable[[str], int], strict: bool = True, installed: list | None = None) -> Targets:
    """The modules and parameters ``cfg`` selects in ``chunks``. A target that matches nothing is a
    ConfigError; not ``strict`` (several ranks), a warning: under pipeline parallelism a rank holds its
    stage's modules only (the embedding on the first, the output layer on the last), and a target of
    another stage matches nothing here (the reference skips such targets silently). ``installed``: each
    chunk's ``{name: parameter}`` of 2-D DDP + TP when the monitor was installed (see :func:`_displaced`)."""
    out = Targets(forward=not cfg.backward_only, backward=not cfg.forward_only)
    targets = {k: v for k, v in cfg.targets.items()}
    everything = cfg.everything
    matched: set[str] = set()
    matched_frozen: set[str] = set()  # targets that matched parameters frozen now
    matched_params: set[str] = set()  # ... and parameters that require grad
    matched_modules: set[str] = set()
    param_stats = cfg.wg_distribution or cfg.param_distribution or cfg.mv_distribution or cfg.ur_distribution
    xy_here = (cfg.xy_distribution or False) and (not cfg.module_ranks or rank in cfg.module_ranks)
    all_modules: list[str] = []
    all_params: list[str] = []
    for vpp, chunk in enumerate(chunks):
        mods = list(chunk.named_modules())
        short = squash_all([n for n, _ in mods], cfg.squash_name)
        shorts = set(short.values())
        out.module_short.append(short)
        all_modules.extend(n for n, _ in mods)
        for full, module in mods:
            s = short[full]
            hit = [t for t in targets if t and module_matches(t, full, s, vpp)]
            matched.update(hit)
            matched_modules.update(hit)
            if not xy_here:
                continue
            if hit or cfg.all_xy or everything:
                sel = dict(targets[hit[0]]) if hit else {}
                if hit:
                    _check_input_selectors(module, full, sel, hit[0])
                name = _recorded_module_name(hit, full, s, vpp, cfg.all_xy, shorts)
                out.modules.append((module, ModuleTarget(intern(name), name, vpp, sel, hit[0] if hit else None)))
        # (frozen ones too: a name keeps its squashed form when its parameter is unfrozen)
        params = list(chunk.named_parameters())
        if installed:
            listed = {n for n, _ in params}
            params += [(n, p) for n, p in installed[vpp].items() if n not in listed and _displaced(chunk, n, p)]
        pshort = squash_all([n for n, _ in params], cfg.squash_name)
        all_params.extend(n for n, _ in params)
        # a parameter shared by several modules (an output layer tied to the embedding) is listed once,
        # under its first name; a target may name it through another one (``lm_head``)
        aliases: dict[int, list[str]] = {}
        for full, p in chunk.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(full)
        for full, p in params:
            s = pshort[full]
            others = [(a, squash(a) if cfg.squash_name else a) for a in aliases.get(id(p), ()) if a != full]
            hit = [t for t in targets if t and (param_matches(t, full, s, vpp)
                                                or any(param_matches(t, a, sa, vpp) for a, sa in others))]
            if not p.requires_grad:
                matched_frozen.update(hit)
                if hit or everything:
                    out.frozen.append(p)
                continue
            matched.update(hit)
            matched_params.update(hit)
            if hit or everything:
                out.params.append(ParamInfo(intern(s), s, vpp, p, full))
            if param_stats and uninitialized(p):
                for t in hit:
                    out.lazy.setdefault(t, []).append(s)
    matched |= matched_frozen
    if param_stats:
        out.frozen_only = [t for t in targets if t and t in matched_frozen and t not in matched_params]
    for t in targets:
        err = None
        if t and t not in matched:
            err = ConfigError(
                f"matches no module and no parameter of the model; {_names_like(all_modules, all_params)} (an "
                "optional '0:' prefix selects the chunk)",
                f"targets.{t}",
            )
        elif t and cfg.xy_distribution and t not in matched_modules and (targets[t] or not (
                param_stats or cfg.mg_direction)):
            # a parameter's name: xy_distribution records modules, and no option here records parameters
            # (or the entry's selectors, which pick module inputs and outputs, fit nothing)
            what = ("has selectors for a module's inputs and outputs" if targets[t] else
                    "is recorded by none of the options on (wg_distribution, param_distribution, "
                    "mv_distribution, ur_distribution, mg_direction)")
            err = ConfigError(
                f"matches no module, only parameters, and {what}; name a module for xy_distribution (module "
                f"names look like {_examples(all_modules)})",
                f"targets.{t}",
            )
        if err is not None:
            if strict:
                raise err
            log.warning("trainrec: rank %d: %s (with pipeline parallelism it may be another stage's; nothing is "
                        "recorded for it on this rank)", rank, err)
    return out


def select_targets(chunks: list, cfg: MonitorConfig, rank: int, intern: Callable[[str], int], *, several_ranks: bool,
                   installed: list, fullgraph: bool, lazy_warned: set, warn_once: Callable[[str, str], None]) -> Targets:
    """:func:`build_targets`, with what the monitor says of the result: a ConfigError where module hooks
    are needed in a model compiled with ``fullgraph=True``, and warnings (once) for targets that match
    only frozen parameters or lazy modules' parameters not made yet (``lazy_warned``: keys said)."""
    # several ranks: a target may be another pipeline stage's (a warning, not an error, there)
    targets = build_targets(chunks, cfg, rank, intern, strict=not several_ranks, installed=installed)
    if fullgraph and (targets.modules or cfg.print_struct):
        key = "xy_distribution" if targets.modules else "print_struct"
        raise ConfigError("the model was compiled with torch.compile(fullgraph=True), and the module hooks "
                          f"that {key} needs are graph breaks inside its compiled forward, which fullgraph "
                          "makes an error: compile it without fullgraph=True, or turn "
                          f"{key} off (weight gradients, parameters and optimizer state are recorded "
                          "either way)", key)
    for key in targets.frozen_only:
        warn_once(f"frozen-{key}", f"trainrec: rank {rank}: targets.{key} matches only parameters that do "
                  "not require grad (frozen); they are recorded from the first collected step after they "
                  "are unfrozen")
    for key, names in targets.lazy.items():
        if key not in lazy_warned:
            lazy_warned.add(key)
            log.warning("trainrec: rank %d: targets.%s names parameters of a lazy module (torch.nn.LazyLinear "
                        "and the like) that its first forward has not made yet (%s): they have no size and "
                        "take no hooks until then; they are recorded from that forward on (the module "
                        "structure record counts them 0)", rank, key, ", ".join(names[:6])
                        + (", ..." if len(names) > 6 else ""))
    return targets


def mark_tp_duplicates(params: list[ParamInfo], tp_group) -> None:
    """Mark the parameters that are another tensor-parallel rank's copy (not this rank's to report): on
    every rank but tp_group's first, those neither Megatron's ``tensor_model_parallel`` nor a DTensor
    sharded over the group."""
    import torch.distributed as dist

    tp_first = dist.get_rank(group=tp_group) == 0
    tp_ranks = dist.get_process_group_ranks(tp_group) if not tp_first else None
    for p in params:
        p.tp_duplicate = not tp_first and not getattr(p.param, "tensor_model_parallel", False) \
            and not sharded_over(p.param, tp_ranks)
