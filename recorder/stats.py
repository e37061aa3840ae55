"""Batched tensor statistics, kept on the device until one host copy per step.

:class:`StatsEngine` computes the requested ops (min, max, norm, mean, zeros, nans) of many tensors
at once and returns one float32 ``[rows x ops]`` tensor on the device. Reductions accumulate in
float32 (float64 tensors in float64); nothing goes to the host per tensor. ``scales`` gives the
statistics of ``c * x`` without making it (Adam's bias-corrected update and ratio). NaNs are counted
only with ``nans``, and on the torch CPU path only for tensors whose sum is not finite.

It chooses per batch between the one-pass C kernel (:mod:`.fused`: CPU, every dtype but float64),
the Triton engine (:mod:`.device_stats`) and torch's reductions (:mod:`.torch_stats`: float64,
accelerators without Triton, ``TRAINREC_FUSED=0``). The alternatives measured are in
benchmarks/RESULTS.md, "Statistics kernel". ``StatsEngine.host_paths = False`` makes CPU tensors
take the other devices' code (how tests check it without an accelerator)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from . import config, fused, torch_stats
from .step_stats import gather_device, to_device
from .torch_stats import SMALL_NUMEL, TorchReductions

log = logging.getLogger(__name__)

# TRAINREC_STATS_BACKEND: auto (the C kernel for CPU tensors, Triton for CUDA tensors where it is
# installed, torch's reductions for the rest), triton (also CPU tensors under TRITON_INTERPRET=1), torch
# (torch's reductions for every tensor), cpu (the C kernel for CPU tensors, torch's for the others).
BACKENDS = ("auto", "triton", "torch", "cpu")


def stats_backend() -> str:
    return config.env_choice("TRAINREC_STATS_BACKEND", BACKENDS, "auto")


class StatsEngine:
    """Computes ``ops`` for lists of tensors; ``compute(tensors)`` -> float32 ``[len(tensors), len(ops)]``."""

    def __init__(self, ops: Sequence[str], eps: float = 1e-8, backend: str | None = None) -> None:
        self.backend = backend or stats_backend()
        interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        self.ops = tuple(ops)
        self.eps = float(eps)
        self._torch = TorchReductions(self.ops, self.eps)  # the reductions neither kernel takes
        # CPU tensors use the CPU fast paths; False: the other devices' code (also under the Triton
        # interpreter, where CPU tensors stand in for CUDA tensors)
        self.host_paths = not (self.backend == "triton" and interpreting)
        # CPU tensors go through the one-pass kernel (fused.py)
        self.fused = fused.AVAILABLE and self.backend != "torch" and not (self.backend == "triton" and interpreting)
        self._codes = fused.op_codes(self.ops)
        # device types whose tensors go to the Triton engine (device_stats.py, imported at the first one)
        self.triton_devices: frozenset = frozenset()
        if self.backend in ("auto", "triton"):
            self.triton_devices = frozenset(("cuda", "cpu") if self.backend == "triton" and interpreting else ("cuda",))
        self._triton = None

    # ------------------------------------------------------------------ helpers
    def release(self) -> None:
        """Free the scratch buffers (at close)."""
        self._torch.release()
        if self._triton is not None:
            self._triton.release()

    # ------------------------------------------------------------------ the Triton engine
    def _device_engine(self):
        """The Triton engine, made at the first tensor for it; None where Triton is not installed."""
        if self._triton is None:
            from . import device_stats

            if not device_stats.AVAILABLE:
                if self.backend == "triton":
                    log.warning("trainrec: TRAINREC_STATS_BACKEND=triton, but triton is not installed: "
                                "torch's reductions measure accelerator tensors")
                self.triton_devices = frozenset()
                return None
            self._triton = device_stats.TritonStats(self.ops, self.eps)
        return self._triton

    def _triton_failed(self, exc: Exception) -> None:
        """One warning, then torch's reductions for the rest of the run (a GPU Triton cannot compile for)."""
        cause = f" (caused by {exc.__cause__!r})" if exc.__cause__ is not None else ""
        log.warning("trainrec: the Triton statistics engine failed (%s: %s%s); torch's reductions measure "
                    "accelerator tensors from now on", type(exc).__name__, exc, cause)
        self.triton_devices = frozenset()

    def _engine_for(self, tensors: Sequence[torch.Tensor | None]):
        """The Triton engine where the tensors (None aside; at least one) are all on one device it takes,
        else None (a model split over devices: each device's group goes on its own)."""
        if not self.triton_devices:
            return None
        device = next((t.device for t in tensors if t is not None), None)
        if device is None or device.type not in self.triton_devices:
            return None
        if any(t is not None and t.device != device for t in tensors):
            return None
        return self._device_engine()

    def _device_rows(self, tensors: Sequence[torch.Tensor | None], scales: Sequence | None) -> torch.Tensor | None:
        """Rows of ``tensors`` from the Triton engine, where all are on one device it takes (None: not
        taken). Tensors its kernels do not read (integer ids, float64, strided views with gaps) are
        measured by torch's reductions and their rows put in place."""
        eng = self._engine_for(tensors)
        if eng is None:
            return None
        device = next(t.device for t in tensors if t is not None)
        from .device_stats import supports

        xs = list(tensors)
        odd = [i for i, t in enumerate(xs) if t is not None and t.numel() and not supports(t)]
        for i in odd:
            xs[i] = None
        try:
            rows = eng.rows(xs, scales or None)
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            self._triton_failed(exc)
            return None
        for i in odd:
            rows[i:i + 1] = self._group([tensors[i]], device, [scales[i]] if scales else None)
        return rows

    def pair_rows(self, ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], scales: Sequence,
                  shifts: Sequence | None) -> torch.Tensor | None:
        """Adam's ratio (``shifts`` None) or update rows from the state pairs on the Triton engine (see
        :meth:`device_stats.TritonStats.pair_rows`); None where it does not take them all."""
        eng = self._engine_for([*ms, *vs])
        if eng is None:
            return None
        from .device_stats import supports

        if not all(m.dtype == v.dtype and m.shape == v.shape and m.stride() == v.stride() and supports(m)
                   and supports(v) for m, v in zip(ms, vs, strict=True)):
            return None
        try:
            return eng.pair_rows(ms, vs, scales, shifts)
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            self._triton_failed(exc)
            return None

    def nan_rows(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.full((n, len(self.ops)), math.nan, dtype=torch.float32, device=device)

    def combine(self, rows: torch.Tensor, numels: Sequence[int]) -> torch.Tensor:
        """The ``[1, ops]`` row of a tensor from the rows of its consecutive parts (``numels`` elements
        each): see :func:`torch_stats.combine`."""
        return torch_stats.combine(rows, numels, self.ops)

    # ------------------------------------------------------------------ main entry
    @torch.no_grad()
    def norms(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The ``norm`` column :meth:`compute` gives for ``xs``, computed the same way (bitwise equal
        for unchanged tensors on CPU): a cheap fingerprint of a tensor already measured."""
        xs = [fused.local_tensor(x) for x in xs]
        cpu = self.host_paths and all(x.device.type == "cpu" for x in xs)
        if cpu and self.fused and all(fused.supports(x) for x in xs):
            # the same kernel as compute(), whose results do not depend on the batch: bitwise equal
            return fused.stats(xs, [self.eps] * len(xs), b"\x03")[:, 0]
        threads = torch.get_num_threads() if cpu else 1
        single = False
        vals, is_norm = [], []
        for x in xs:
            if x.is_complex():  # its magnitudes, as compute() measures it (a cast kept the real parts, warning)
                x = x.abs()
            want_single = threads > 1 and x.numel() < SMALL_NUMEL
            if want_single != single:
                torch.set_num_threads(1 if want_single else threads)
                single = want_single
            if cpu and x.dtype is torch.float32:
                flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
                vals.append(torch.dot(flat, flat))
                is_norm.append(False)
            else:
                vals.append(torch.linalg.vector_norm(x).float() if x.dtype is torch.float64
                            else torch.linalg.vector_norm(x.float() if not x.is_floating_point() else x,
                                                          dtype=torch.float32))
                is_norm.append(True)
        if single:
            torch.set_num_threads(threads)
        sq = torch.stack(vals)
        if not any(is_norm):
            return sq.sqrt()
        if all(is_norm):
            return sq
        return torch.where(torch.tensor(is_norm, device=sq.device), sq, sq.clamp(min=0).sqrt())

    def compute(self, tensors: Sequence[torch.Tensor | None], scales: Sequence[float] | None = None) -> torch.Tensor:
        """Statistics of each tensor (None or empty -> a NaN row), on the first tensor's device.

        ``scales`` (positive, one per tensor) gives the statistics of ``scale * tensor`` without
        materialising it: min/max/norm/mean are scaled and zeros uses ``eps / scale``. A scale is a float
        or a 0-d tensor (Adam's bias corrections computed on the device), which is used as an operand
        and never read back.
        """
        rows = self.rows(tensors, scales)
        return torch.from_numpy(rows) if isinstance(rows, np.ndarray) else rows

    def rows(self, tensors: Sequence[torch.Tensor | None], scales: Sequence[float] | None = None,
             extremes: np.ndarray | None = None) -> torch.Tensor | np.ndarray:
        """:meth:`compute` as the hooks want it: on the kernel's path the numpy array it wrote (a hook
        makes no tensor per call; :meth:`StepStats.finish` makes one of the step's rows), else a tensor.
        ``extremes``: filled with the tensors' fingerprints (:func:`fused.stats_f32`), where the kernel
        gives them."""
        if self.fused and self.host_paths:
            # the hooks' common case, kept lean (it runs for every monitored call): float32 CPU tensors
            # straight to the one-pass kernel, which reads memory and records no autograd
            rows = fused.stats_f32(tensors, self.eps, self._codes, scales, numpy=True, extremes=extremes)
            if rows is not None:
                return rows
        elif extremes is not None:  # (stats_f32 sets them either way)
            fused.no_fingerprints(extremes)
        # DTensors (FSDP2, tensor parallel): the statistics of this rank's local shard
        return self._compute([fused.local_tensor(t) for t in tensors], scales)

    @torch.no_grad()
    def _compute(self, tensors: Sequence[torch.Tensor | None], scales: Sequence[float] | None = None) -> torch.Tensor:
        if any(t is not None and t.layout is not torch.strided for t in tensors):
            return self._with_sparse(tensors, scales)
        if self.triton_devices:
            rows = self._device_rows(tensors, scales)
            if rows is not None:
                return rows
        n = len(tensors)
        device = gather_device(t.device for t in tensors if t is not None)
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            if t is None or t.numel() == 0:
                continue
            # (negative views apart: the one-pass kernel, chosen per group, must not read their memory)
            groups.setdefault((t.device, t.dtype, t.is_neg()), []).append(i)
        if len(groups) == 1 and sum(len(v) for v in groups.values()) == n:
            (key, idx), = groups.items()
            return self._group(list(tensors), key[0], scales)
        # Several dtypes/devices, or None/empty tensors (an Embedding's int64 ids and float output, a
        # kwargs-only module, int targets): compute each group, then concatenate runs of consecutive
        # rows in the original order. No index tensor is built, so nothing is copied host-to-device.
        owner: list = [None] * n
        pos = [0] * n
        results = {}
        for key, idx in groups.items():
            rows = self._group([tensors[i] for i in idx], key[0], [scales[i] for i in idx] if scales else None)
            results[key] = to_device(rows, device)
            for k, i in enumerate(idx):
                owner[i], pos[i] = key, k
        pieces = []
        i = 0
        while i < n:
            key = owner[i]
            j = i + 1
            while j < n and owner[j] == key:
                j += 1
            # consecutive indices of one group have consecutive positions in it
            pieces.append(self.nan_rows(j - i, device) if key is None else results[key][pos[i]:pos[i] + j - i])
            i = j
        if not pieces:
            return self.nan_rows(0, device)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def _with_sparse(self, tensors: Sequence[torch.Tensor | None], scales: Sequence[float] | None) -> torch.Tensor:
        """Rows where some tensors are sparse (``nn.Embedding(sparse=True)`` gradients, COO or
        compressed): the statistics of the dense tensor each stands for, from its stored values alone."""
        dense, sizes = torch_stats.sparse_values(tensors)
        return torch_stats.fix_sparse_rows(self._compute(dense, scales), sizes, self.ops, self.eps)

    def _group(self, xs: list[torch.Tensor], device: torch.device, scales: Sequence[float] | None) -> torch.Tensor:
        """Rows for tensors of one device and dtype: the one-pass kernel where it takes them (CPU),
        else torch's reductions (:meth:`TorchReductions.group`)."""
        cpu = device.type == "cpu" and self.host_paths
        if cpu and self.fused and fused.supports(xs[0]):
            # one read of each tensor for all six statistics (see fused.py)
            return fused.stats(xs, [self.eps / s for s in scales] if scales else [self.eps] * len(xs), self._codes,
                               scales)
        return self._torch.group(xs, device, scales, cpu)
