"""Target selectors (``input``, ``output``, ``tuple[N]:i`` ...): what they pick from a module's real
inputs and outputs, how a mismatch is described, and the check at a module's first call."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from trainrec.schema.errors import ConfigError

from .compile_mode import eager
from .config_sections import Selector

if TYPE_CHECKING:
    from .hooks import ModuleTarget


class SelectorMismatch(Exception):
    """A target's selector does not fit the module's real input or output."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"config key {key!r}: {detail}")
        self.key = key
        self.detail = detail


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, (tuple, list)):
        return f"tuple[{len(value)}]"
    return type(value).__name__


def pick(value: Any, sel: Selector | None, key: str) -> Any:
    """What a selector picks from a hook argument, a tensor or not (None: nothing there); raises
    SelectorMismatch where the selector does not fit the argument's structure."""
    if sel is None:  # default: the tensor, or element 0 of a tuple (the reference's struct default)
        if isinstance(value, (tuple, list)):
            return value[0] if value else None
        if isinstance(value, Mapping):  # a dict, or HF's ModelOutput (which indexes as a tuple of its
            # fields that are set): its first value set
            return next((v for v in value.values() if v is not None), None)
        return value
    if sel.is_tensor:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)) and len(value) == 1:
            return value[0]
        raise SelectorMismatch(key, f"expected 'tensor', the module gives {describe(value)}")
    if isinstance(value, torch.Tensor) and sel.length == 1:
        # a tensor as a 1-tuple: the reference's gradient hooks see a module's gradients as a tuple, so
        # its config (and module_struct.json) gives "tuple[1]:0" for the gradient of a tensor output
        return value
    if not isinstance(value, (tuple, list)) or len(value) != sel.length:
        raise SelectorMismatch(key, f"expected tuple[{sel.length}], the module gives {describe(value)}")
    return value[sel.index]


def select(value: Any, sel: Selector | None, key: str) -> torch.Tensor | None:
    """The tensor a selector picks from a hook argument; None (a NaN row) when it is not a tensor."""
    v = pick(value, sel, key)
    return v if isinstance(v, torch.Tensor) else None


# _KWARGS_GONE: the module hooks here are registered with_kwargs, and are also called without the
# keyword arguments: torch's Module._call_impl calls the hooks it listed before the first of them ran,
# and one removed since (the chunk's pre-hook attaches a collected step's hooks anew, for a model found
# compiled at that forward) is no longer known to take them.


def inputs_of(args: tuple, kwargs: dict | None, sel: Selector | None) -> Any:
    """What an input selector picks from: the positional arguments, or, for the default selection of a
    module called with keyword arguments only (HF's decoder layers call their attention as
    ``self_attn(hidden_states=...)``), the keyword arguments, whose first value set it takes.
    Selectors pick from positional arguments only (see :func:`make_first_call_check`)."""
    return kwargs if not args and kwargs and sel is None else args


def _kind_of(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}[{len(value)}]"
    return describe(value)


def found_text(value: Any) -> str:
    """What the default selection looked at in ``value`` and found, for :func:`warn_no_tensor`."""
    if isinstance(value, (tuple, list)):
        return f"{_kind_of(value)}, whose first element is {_kind_of(value[0])}" if value else f"an empty {_kind_of(value)}"
    if isinstance(value, Mapping):
        first = next((v for v in value.values() if v is not None), None)
        return (f"a {type(value).__name__} whose first value set is {_kind_of(first)}" if first is not None
                else f"a {type(value).__name__} with no value set")
    return _kind_of(value)


SLOTS = ("input", "input_grad", "output", "output_grad")


def make_first_call_check(t: ModuleTarget, source: str | None = None,
                          on_reject: Callable[[ConfigError], None] | None = None, inputs: bool = False):
    """Hook installed until the run's first step ends: checks the module's selectors against its real
    inputs and outputs at its first call. A mismatch is a ConfigError out of that forward, at start-up
    (later, in a collected step, it is a HookFailed and training goes on); ``on_reject`` is told first,
    so the log says why the run stopped. With ``inputs``, a forward pre-hook for the ``input`` and
    ``input_grad`` selectors (it runs before the monitor's own pre-hook, which would report a failed
    hook first); else a forward hook for ``output`` and ``output_grad``."""
    sels = [(slot, t.sel[slot]) for slot in SLOTS
            if t.sel.get(slot) is not None and slot.startswith("input") == inputs]
    done = False

    def check(module, value, kwargs=None):
        nonlocal done
        if done:
            return
        done = True
        for slot, sel in sels:
            key = f"targets.{t.key}.{slot}"
            try:
                picked = pick(value, sel, key)
                if picked is not None and not isinstance(picked, torch.Tensor):  # (None: an optional argument)
                    raise SelectorMismatch(key, f"selects {describe(picked)}, not a tensor (a selector picks a "
                                                "tensor at the top level of the module's "
                                                f"{'inputs' if inputs else 'output'})")
            except SelectorMismatch as exc:
                called = ""
                if kwargs and not value:  # selectors pick from positional arguments; HF's models pass
                    # hidden_states= to their attention by keyword
                    called = (f"; it was called with keyword arguments only "
                              f"({', '.join(f'{k}={describe(v)}' for k, v in kwargs.items())}), "
                              "which selectors do not pick from")
                err = ConfigError(f"{exc.detail} (seen at its first call, a {type(module).__name__}, in the run's "
                                  f"first step{called}; print_struct shows the real structure)", exc.key, source)
                if on_reject is not None:
                    on_reject(err)
                raise err from None

    if not sels:
        return None
    if inputs:  # (registered with_kwargs, to say where a module called with keywords only took its input)
        return eager(lambda module, args, kwargs=None: check(module, args, kwargs))  # (see _KWARGS_GONE)
    return eager(lambda module, args, output: check(module, output))
