"""What the hooks of one collected step accumulate (:class:`StepState`), and the statistics rows of
a hook's tensors, measured once per step for tensors that repeat (:func:`rows_for`)."""

from __future__ import annotations

import weakref
from array import array
from typing import TYPE_CHECKING

import numpy as np
import torch

from .fused import _PLAIN, local_tensor
from .step_stats import StepStats, gather_device, to_device

if TYPE_CHECKING:
    from .context import RecordingContext


class StepState:
    """What the hooks of one collected step accumulate."""

    __slots__ = ("step", "stats", "call", "mod_ids", "dirs", "call_ids", "micro", "fwd_count", "bwd_count",
                 "grad_count", "pending", "pending_set", "pending_bytes", "pending_lookup", "last_unreduced", "on_first_fire", "memo", "chunk_fwd",
                 "open_calls", "grad_hooks", "leaf_hooks", "bwd_micro", "spilled_parts", "spilled_fires", "written",
                 "nograd_fwd", "chunk_open", "eob_queued", "api_passes")

    def __init__(self, step: int, ops: tuple, on_first_fire=None) -> None:
        self.step = step
        self.on_first_fire = on_first_fire  # called once, at the step's first hook firing
        self.stats = StepStats(ops)
        self.call = 0
        self.mod_ids = array("I")
        self.dirs = array("B")
        self.call_ids = array("I")
        self.micro = array("H")
        self.fwd_count: dict[int, int] = {}
        self.bwd_count: dict[int, int] = {}
        self.grad_count: dict[int, int] = {}
        self.pending: list[tuple] = []  # (param index, micro step, call id, .grad tensor or None)
        self.pending_set: set[int] = set()
        self.pending_bytes = 0  # bytes of the pending gradients queued by the Python hooks
        self.pending_lookup = False  # a pending entry's gradient is looked up when the batch is measured
        self.last_unreduced: dict[int, tuple] = {}  # param index -> (rows tensor, row, grad id, version)
        self.memo: dict[tuple, tuple] = {}  # (ptr, shape, strides, dtype, device, is_neg) -> (weakref, version, rows, row)
        self.chunk_fwd: dict[int, int] = {}  # vpp stage -> forwards of that model chunk (micro steps begun)
        self.open_calls: dict[int, list] = {}  # module id -> GradCall of forwards between pre-hook and hook
        # id(tensor) -> (weakref, version, [(GradCall, slot, name)], hooked in a recomputation,
        # _Once or None)
        self.grad_hooks: dict[int, tuple] = {}
        self.leaf_hooks: list = []  # _Once of leaf tensors hooked in this step, removed at its end
        self.bwd_micro: dict[int, int] = {}  # vpp stage -> micro step of the backward pass running there
        self.spilled_parts = 0  # stats parts and hook firings already written while the step went on
        self.spilled_fires = 0
        self.written = False  # the step's records have gone to the writer (no more spills)
        self.nograd_fwd = False  # a model chunk's forward runs under no_grad: not a micro step, not recorded
        self.chunk_open = False  # between a model chunk's forward pre-hook and its forward hook
        self.eob_queued = False  # the end-of-backward callback of the list hooks is queued (grad_batch.py)
        self.api_passes: dict = {}  # (micro step, vpp stage) -> ApiPass of the API calls' gradients (api_backward.py)

    def micro_of(self, vpp: int, mid: int, counts: dict, grad_acc: int) -> int:
        """The micro step of a module call: its chunk's forward count, so a module called several
        times in one forward (weight sharing) keeps the micro step; the module's own call count
        (``counts``) only when the chunk's forward was not seen (the chunk called by other means)."""
        c = self.chunk_fwd.get(vpp)
        if c:
            return (c - 1) % grad_acc
        n = counts.get(mid, 0)
        counts[mid] = n + 1
        return n % grad_acc

    def fire(self, mod_id: int, direction: int, micro: int) -> int:
        c = self.call
        self.call = c + 1
        if self.on_first_fire is not None:
            cb, self.on_first_fire = self.on_first_fire, None
            cb()
        self.mod_ids.append(mod_id)
        self.dirs.append(direction)
        self.call_ids.append(c)
        self.micro.append(micro)
        return c

    def fire_many(self, mod_ids: list, direction: int, micros: list) -> int:
        """:meth:`fire` for several firings in a row; the first one's call id."""
        c = self.call
        n = len(mod_ids)
        self.call = c + n
        if self.on_first_fire is not None:
            cb, self.on_first_fire = self.on_first_fire, None
            cb()
        self.mod_ids.extend(mod_ids)
        self.dirs.extend(bytes((direction,)) * n)
        self.call_ids.extend(range(c, c + n))
        self.micro.extend(micros)
        return c


MEMO_MIN_NUMEL = 4096


def rows_for(rec: RecordingContext, st: StepState, xs: tuple) -> torch.Tensor | np.ndarray:
    """Stats rows of a hook's tensors (a numpy array on the kernel's path, see ``StatsEngine.rows``).
    A module's output is usually the next one's input, often as another tensor object on the same
    memory: a tensor already measured in this step reuses its row where memory, shape, strides, dtype
    and sign (``is_neg()``) match, the tensor measured then is still alive (its memory cannot have been
    reused) and the version counter shows no in-place change since."""
    memo = st.memo
    n = len(xs)
    todo = []
    keys: list = [None] * n
    found: list | None = None
    for k, x in enumerate(xs):
        if x is not None and x.numel() >= MEMO_MIN_NUMEL:
            if type(x) not in _PLAIN:
                # a DTensor or AsyncCollectiveTensor has no memory of its own (data_ptr() is 0 for all of
                # them): its local tensor's is measured and remembered; another such wrapper, not
                xs = list(xs)
                xs[k] = x = local_tensor(x)
                if type(x) not in _PLAIN:
                    todo.append(k)
                    continue
            key = keys[k] = (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x.is_neg())
            hit = memo.get(key)
            if hit is not None and hit[0]() is not None and hit[1] == x._version:
                if found is None:
                    found = [None] * n
                found[k] = hit[2][hit[3]]
                continue
        todo.append(k)
    if todo:
        new = rec.engine.rows([xs[k] for k in todo])
        for j, k in enumerate(todo):
            if keys[k] is not None:
                x = xs[k]
                memo[keys[k]] = (weakref.ref(x), x._version, new, j)
        if found is None:
            return new
        for j, k in enumerate(todo):
            found[k] = new[j]
    return stack_rows(found)


def stack_rows(rows: list) -> torch.Tensor | np.ndarray:
    """``[len(rows), ops]`` of single rows (numpy rows stay numpy; any tensor among them: a tensor)."""
    if all(isinstance(r, np.ndarray) for r in rows):
        out = np.empty((len(rows), rows[0].shape[-1]), dtype=np.float32)  # np.stack: 4x the Python
        for i, r in enumerate(rows):
            out[i] = r
        return out
    dev = gather_device(r.device for r in rows if isinstance(r, torch.Tensor))
    return torch.stack([to_device(torch.from_numpy(r) if isinstance(r, np.ndarray) else r, dev) for r in rows])
