"""The model's module tree: the ModuleStructureRecorded events and ``print_struct``.

At ``monitor_gnorm_with_ad`` one ModuleStructureRecorded per model chunk (module names, classes,
parents, own parameter counts; a chunk with lazy modules is recorded again after its first training
forward). With ``print_struct: true`` every module gets a forward hook describing its inputs,
outputs and their gradients as the reference's ``module_struct.json`` does (``config`` is the
selector to put in ``targets``); at the first optimizer step the file is written, the events are
repeated with those descriptions as ``io_specs``, and the run stops as documented."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
from trainrec.schema import layout
from trainrec.schema.events import ModuleStructureRecorded

from .compile_mode import eager
from .targets import uninitialized

log = logging.getLogger(__name__)


def module_structure(chunk: torch.nn.Module) -> tuple[tuple, tuple, tuple, tuple]:
    """(full names, class names, parent indices, own parameter counts) of a module tree. A lazy module's
    parameters not made yet (``UninitializedParameter``: a ``LazyLinear`` before its first forward) count
    0: their size is not known."""
    names, classes, parents, counts = [], [], [], []
    index: dict[str, int] = {}
    for full, module in chunk.named_modules():
        index[full] = len(names)
        names.append(full)
        classes.append(type(module).__name__)
        parent = full.rsplit(".", 1)[0] if "." in full else ("" if full else None)
        parents.append(index.get(parent, -1) if parent is not None else -1)
        counts.append(sum(0 if uninitialized(p) else p.numel() for p in module.parameters(recurse=False)))
    return tuple(names), tuple(classes), tuple(parents), tuple(counts)


def _key(targets, vpp: int, full: str) -> str:
    short = targets.module_short[vpp] if targets is not None else {}
    return f"{vpp}:{short.get(full, full)}"


def attach_struct_hooks(chunks: list, targets) -> tuple[dict, list]:
    """Hooks on every module that fill ``struct`` (keyed ``"{vpp}:{name}"``); returns (struct, handles)."""
    struct: dict = {}
    handles = []
    for vpp, chunk in enumerate(chunks):
        for full, mod in chunk.named_modules():
            handles.append(mod.register_forward_hook(make_struct_hook(struct, _key(targets, vpp, full))))
    return struct, handles


def write_module_struct(struct: dict, output_dir: str) -> str:
    layout.make_dirs(output_dir)
    path = os.path.join(output_dir, "module_struct.json")
    with open(path, "w", encoding="utf-8", opener=layout.private_opener) as f:
        json.dump(struct, f, indent=2)
    log.info("trainrec: module structure written to %s", path)
    return path


def structure_events(chunks: list, targets, struct: dict | None, rank: int, step: int,
                     only: int | None = None) -> list:
    """One ModuleStructureRecorded per chunk (with io_specs when ``struct`` is given); chunk ``only``'s."""
    out = []
    for vpp, chunk in enumerate(chunks):
        if only is not None and vpp != only:
            continue
        names, classes, parents, counts = module_structure(chunk)
        specs = {n: struct.get(_key(targets, vpp, n), {}) for n in names} if struct is not None else {}
        out.append(ModuleStructureRecorded(rank=rank, step=step, wall=time.time(), vpp_stage=vpp, names=names,
                                           classes=classes, parents=parents, param_counts=counts, io_specs=specs))
    return out


def io_struct(value: Any) -> dict:
    """The reference's module_struct.json description of one hook argument."""
    if isinstance(value, (tuple, list)):
        res: dict = {"config": f"{type(value).__name__}[{len(value)}]"}
        for i, x in enumerate(value):
            res[str(i)] = f"size={tuple(x.shape)}, dtype={x.dtype}" if isinstance(x, torch.Tensor) else f"{type(x)}"
        return res
    if isinstance(value, torch.Tensor):
        return {"config": "tensor", "tensor": f"size={tuple(value.shape)}, dtype={value.dtype}"}
    return {"config": f"{type(value)}"}


def make_struct_hook(struct: dict, key: str):
    """A forward hook that records a module's io structure (print_struct): its inputs and outputs, and
    the gradients a full backward hook would be given, derived from the forward's tensors (same size
    and dtype), so no full backward hook is needed (see :mod:`.hooks`). As torch gives them:
    ``input_grad`` one entry per positional argument (a gradient for each floating-point tensor where any
    argument requires grad, else None); ``output_grad`` one per top-level output element that is a
    tensor requiring grad. Nothing for them where no output requires grad."""

    def fwd(module, args, output):
        entry = struct.setdefault(key, {})
        if "input" not in entry:
            entry["input"] = io_struct(args)
            entry["output"] = io_struct(output)
        if "output_grad" in entry or not torch.is_grad_enabled():
            return
        outs = output if isinstance(output, tuple) else (output,)
        out_req = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
        if not any(out_req):
            return
        in_req = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        entry["input_grad"] = io_struct(tuple(
            a if in_req and isinstance(a, torch.Tensor) and a.is_floating_point() else None for a in args))
        entry["output_grad"] = io_struct(tuple(o if r else None for o, r in zip(outs, out_req, strict=True)))

    return eager(fwd)
