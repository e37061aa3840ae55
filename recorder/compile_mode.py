"""How the recorder's hooks meet torch.compile and autograd: :func:`eager` keeps dynamo out of them,
:func:`in_backward` tells a forward run by a backward pass (activation checkpointing's recomputation)."""

from __future__ import annotations

import torch

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def eager(fn):
    """``fn`` (a hook) as torch.compile should see it: not traced. Module hooks are inlined into the
    graph of a compiled model, and dynamo would otherwise trace the monitor's own code, compile pieces
    of it (seconds on the first collected steps) and recompile them whenever a guard on its
    dictionaries fails, until its recompile limit. ``torch.compiler.disable``: a graph break at the
    hook, which runs as Python on the real tensors, with dynamo off inside it. The wrapper has a cost
    per call, so the monitor uses it only where the model runs compiled (``MonitoredModel.compiled``)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return fn if disable is None else disable(fn)


def _is_compiling_fn():
    compiler = getattr(torch, "compiler", None)
    fn = getattr(compiler, "is_compiling", None)
    if fn is None:  # torch < 2.3
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn if fn is not None else (lambda: False)


is_compiling = _is_compiling_fn()


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a forward here is a recomputation)."""
    return _graph_task_id is not None and _graph_task_id() != -1
