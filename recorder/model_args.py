"""The model and the counting arguments of ``monitor_gnorm_with_ad``: checked (an error naming the
wrong argument, before anything is installed), and the model unwrapped from ``torch.compile``."""

from __future__ import annotations

import operator

import torch
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import MAX_STEP


def compiled_fullgraph(model) -> bool:
    """Whether ``model`` is ``torch.compile(module, fullgraph=True)``'s ``OptimizedModule``."""
    return type(model).__name__ == "OptimizedModule" and bool(getattr(getattr(model, "dynamo_ctx", None),
                                                                       "fullgraph", False))


def checked_model(model) -> list[torch.nn.Module]:
    """``model`` as the list of its chunks; a TypeError naming what it is where it is not a module or a
    non-empty list of them (an AttributeError from deep inside, else)."""
    given = list(model) if isinstance(model, (list, tuple)) else [model]
    wrong = [m for m in given if not isinstance(m, torch.nn.Module)]
    if given and not wrong:
        return given
    bad = wrong[0] if wrong else None
    what = ("an empty list" if not given else type(bad).__name__ if bad is model else
            f"a list holding {type(bad).__name__}")
    hint = " (the model comes first, then the optimizer)" if isinstance(bad, torch.optim.Optimizer) else ""
    raise TypeError(f"model: expected a torch.nn.Module or a list of them (virtual pipeline chunks), got "
                    f"{what}{hint}")


def checked_arguments(grad_acc_steps, start_iteration) -> int:
    """``grad_acc_steps`` as an integer, after both are checked (a ConfigError naming the wrong one)."""
    try:
        first = None if isinstance(start_iteration, bool) else operator.index(start_iteration)
    except TypeError:
        first = None
    if first is None or not 0 <= first < MAX_STEP:
        raise ConfigError(f"expected an integer of 0..{MAX_STEP - 1} (the first step's number), got "
                          f"{start_iteration!r}", "start_iteration", argument=True)
    acc = grad_acc_steps  # an integer; an integral float too (global_batch / dp / micro_batch)
    if isinstance(acc, float) and acc.is_integer():
        acc = int(acc)
    try:
        acc = None if isinstance(acc, bool) else operator.index(acc)
    except TypeError:
        acc = None
    if acc is None or acc < 1:
        raise ConfigError(f"expected an integer >= 1 (micro steps per optimizer step), got {grad_acc_steps!r}",
                          "grad_acc_steps", argument=True)
    return acc


def uncompiled(model):
    """The module ``torch.compile`` wraps (its ``OptimizedModule`` names every submodule
    ``_orig_mod.*``): targets and recorded names stay those of the model the user wrote; the hooks on
    its submodules are part of the compiled forward (see :func:`~trainrec.recorder.compile_mode.eager`)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) and type(model).__name__ == "OptimizedModule" else model
