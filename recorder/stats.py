"""Batched tensor statistics, kept on the device until one host copy per step.

:class:`StatsEngine` computes the requested ops (min, max, norm, mean, zeros, nans) of many tensors
at once and returns one float32 ``[rows x ops]`` tensor on the device. Only the requested ops are
computed. Every reduction accumulates in float32 (``sum(dtype=float32)``, ``dot`` / ``vector_norm``
with ``dtype=float32``; float64 tensors reduce in float64); nothing is copied to float64 and nothing is
moved to the host per tensor. ``scales`` gives the statistics of ``c * x`` without materialising it
(used for Adam's bias-corrected update and ratio).

Measured on CPU (the benchmark model's 51 gradients, 5.3M values, idle machine): separate ``norm`` and
``sum`` cost 2.4 + 1.9 ms, ``sum`` + ``dot`` (sum of squares through BLAS) 2.1 ms together; ``zeros``
as ``(x.abs() < eps).sum()`` costs 16-24 ms because it allocates two full-size temporaries, 5.8 ms
with ``abs``/``lt`` written into reusable scratch buffers and ``count_nonzero``, and about half of that
as ``count_nonzero(trunc(x / eps))`` into a scratch buffer, and about half again as
``dot(q, q)`` with ``q = clamp(trunc(x / eps), -1, 1)`` in that buffer (count_nonzero is a slow CPU
kernel, BLAS is not); ``histc`` (one pass, no allocation) 24 ms; ``cat`` + ``segment_reduce`` 168 ms;
``_foreach_norm`` 2.4 ms; numba and ``torch.compile`` single-pass kernels 1.4-1.6 ms per 1M values
against ~1.0 ms for this path. So on CPU each tensor costs ``aminmax`` + ``sum`` + ``dot`` + the
zero count; the per-call columns (mean, norm, zeros) come from one stacked matrix. NaNs are counted
only when ``nans`` is requested. On CPU only for tensors whose sum is not finite, found by one
host-side check of the stacked sums per batch (free, the values are already in host memory). On other
devices that check would be a sync, and eager PyTorch has no sync-free way to skip a kernel, so there
``isnan(x).sum()`` runs for every tensor: one extra read pass per tensor, paid only with ``nans``
(the zero count there needs no NaN fix-up: ``count_nonzero(trunc(x / eps))`` counts a NaN as nonzero).
The sum itself is computed on other devices only for ``mean``.

On CPU the one-pass kernel (``fused.py``, built from ``_fused.c``) replaces all of the above for
every dtype but float64: one read of each tensor gives all six statistics (0.3-0.5 ns per value against
1.5-2 ns for the torch reductions here), NaNs included, with no scratch buffer and no second pass.
The torch reductions remain for float64, for accelerators, and where the kernel is not built
(``StatsEngine.fused = False``, or ``TRAINREC_FUSED=0``).

``StatsEngine.host_paths = False`` makes CPU tensors take the code other devices take (tests use it
to check that code against float64 references on a machine without an accelerator).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from . import config, fused
from .step_stats import gather_device, to_device

log = logging.getLogger(__name__)

# CPU tensors below this many elements get their reductions on the calling thread only: a fork/join of
# the intra-op pool costs more than the work there, and far more when the cores are oversubscribed
# (measured on a loaded 2-core machine: 3 reductions of a 64K tensor took 11 ms with 2 threads,
# 0.16 ms with 1). Switching the thread count costs about 0.3 us. Above it (1 MB of float32) the
# pool's parallelism pays for itself on a machine that is not oversubscribed.
SMALL_NUMEL = 1 << 18
_LOW = (torch.float16, torch.bfloat16)
# The torch reductions measure a tensor of more elements in parts of this many (views): their
# temporaries (the zero count's quotient, a float32 copy of float16, the NaN mask) are at most a part's
# size, 9 bytes per element at worst (~300 MB), whatever the tensor (an LLM's embedding gradient).
PART_NUMEL = 1 << 25
# TRAINREC_STATS_BACKEND: auto (the C kernel for CPU tensors, Triton for CUDA tensors where it is
# installed, torch's reductions for the rest), triton (also CPU tensors under TRITON_INTERPRET=1), torch
# (torch's reductions for every tensor), cpu (the C kernel for CPU tensors, torch's for the others).
BACKENDS = ("auto", "triton", "torch", "cpu")


def stats_backend() -> str:
    return config.env_choice("TRAINREC_STATS_BACKEND", BACKENDS, "auto")


def _as_reducible(x: torch.Tensor, want_zeros: bool) -> torch.Tensor:
    """``x`` in a dtype the reductions take: ints and bools (token ids, masks) as float32, and float16
    as well where zeros are counted (``x / eps`` overflows half); float32/64 and bfloat16 as they are;
    complex numbers as their magnitudes ``|x|`` (the norm is the complex tensor's; a cast would keep
    the real parts only)."""
    if x.is_complex():
        return x.abs()
    if x.dtype is not torch.float32 and x.dtype is not torch.float64 and (
        x.dtype not in _LOW or (x.dtype is torch.float16 and want_zeros)
    ):
        return x.to(torch.float32)
    return x


def _parts(x: torch.Tensor, limit: int) -> list[torch.Tensor]:
    """Views of ``x`` of at most ``limit`` elements each that together hold every element once: a
    contiguous tensor's flat chunks, else slices along dim 0 (split further where one is too long)."""
    n = x.numel()
    if n <= limit:
        return [x]
    if x.is_contiguous():
        return list(x.view(-1).split(limit))
    if x.dim() == 1:
        return list(x.split(limit))
    if x.shape[0] == 1:
        return _parts(x[0], limit)
    per = max(1, limit // (n // x.shape[0]))
    out: list[torch.Tensor] = []
    for piece in x.split(per):
        out.extend(_parts(piece, limit))
    return out


class StatsEngine:
    """Computes ``ops`` for lists of tensors; ``compute(tensors)`` -> float32 ``[len(tensors), len(ops)]``."""

    def __init__(self, ops: Sequence[str], eps: float = 1e-8, backend: str | None = None) -> None:
        self.backend = backend or stats_backend()
        interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        self.ops = tuple(ops)
        self.eps = float(eps)
        self._minmax = "min" in self.ops or "max" in self.ops
        self._mean = "mean" in self.ops
        self._sum = "mean" in self.ops or "nans" in self.ops or "zeros" in self.ops
        self._norm = "norm" in self.ops
        self._zeros = "zeros" in self.ops
        self._nans = "nans" in self.ops
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
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
    def _buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (x.device, x.dtype)
        n = x.numel()
        bufs = self._scratch.get(key)
        if bufs is None or bufs[0].numel() < n:
            size = max(n, 1 << 16) if bufs is None else max(n, 2 * bufs[0].numel())
            bufs = (torch.empty(size, dtype=x.dtype, device=x.device),
                    torch.empty(size, dtype=torch.bool, device=x.device))
            self._scratch[key] = bufs
        return bufs

    def release(self) -> None:
        """Free the scratch buffers (at close)."""
        self._scratch.clear()
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

    @torch.no_grad()
    def combine(self, rows: torch.Tensor, numels: Sequence[int]) -> torch.Tensor:
        """The ``[1, ops]`` row of a tensor from the rows of its consecutive parts (``numels`` elements
        each): what :meth:`compute` gives for the whole, up to float rounding (min/max of the parts,
        NaN where a part has NaN; the norm from the parts' squares; mean and zeros weighted by size;
        NaN counts added). On the rows' device, without a sync."""
        r = rows.to(torch.float32)
        total = float(sum(numels))
        weights = [k / total for k in numels]  # Python scalars: no host-to-device copy
        cols = []
        for k, op in enumerate(self.ops):
            c = r[:, k]
            if op == "min":
                cols.append(c.amin())
            elif op == "max":
                cols.append(c.amax())
            elif op == "norm":
                cols.append(c.square().sum().sqrt())
            elif op in ("mean", "zeros"):
                cols.append(sum(c[i] * w for i, w in enumerate(weights)))
            else:  # nans
                cols.append(c.sum())
        return torch.stack(cols).unsqueeze(0)

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
        compressed): the statistics of the dense tensor each stands for, from its stored values alone
        (no dense copy): the elements not stored are zeros, which count for zeros, mean, min and max."""
        dense = list(tensors)
        sizes: dict[int, tuple[int, int]] = {}  # index -> (elements, elements stored)
        for i, t in enumerate(tensors):
            if t is not None and t.layout is not torch.strided:
                v = t.coalesce().values() if t.layout is torch.sparse_coo else t.values()
                dense[i] = v
                sizes[i] = (t.numel(), v.numel())
        rows = self._compute(dense, scales)
        ops = self.ops
        for i, (numel, stored) in sizes.items():
            if numel == 0:
                continue  # a NaN row, as any empty tensor
            row = rows[i]
            if stored == 0:  # all zeros
                for k, op in enumerate(ops):
                    row[k] = 1.0 if op == "zeros" and self.eps > 0 else 0.0
                continue
            unstored = numel - stored
            for k, op in enumerate(ops):
                if op == "mean":
                    row[k] = row[k] * (stored / numel)
                elif op == "zeros":
                    row[k] = (row[k] * stored + (unstored if self.eps > 0 else 0)) / numel
                elif unstored and op in ("min", "max"):
                    zero = torch.zeros((), dtype=row.dtype, device=row.device)
                    row[k] = torch.minimum(row[k], zero) if op == "min" else torch.maximum(row[k], zero)
        return rows

    def _group(self, xs: list[torch.Tensor], device: torch.device, scales: Sequence[float] | None) -> torch.Tensor:
        """Rows for tensors of one device and dtype.

        Per tensor only the reductions run (aminmax, sum, dot, and the zero count); their scalars go
        into one ``[n, fields]`` matrix and the columns (mean, norm, zeros, scaling) are derived with a
        handful of vectorised ops per call, so a hook measuring two tensors pays for few dispatches.
        A tensor of more than :data:`PART_NUMEL` elements is measured in parts (views, no copy) whose
        rows are combined (:meth:`combine`), so the temporaries of the torch reductions (the zero count's
        quotient, a float32 copy of a float16 tensor, the NaN mask) never exceed a part: no transient
        copy of a whole LLM embedding gradient on an accelerator that training has nearly filled.
        """
        eps = self.eps
        cpu = device.type == "cpu" and self.host_paths
        if cpu and self.fused and fused.supports(xs[0]):
            # one read of each tensor for all six statistics (see fused.py)
            return fused.stats(xs, [eps / s for s in scales] if scales else [eps] * len(xs), self._codes, scales)
        counts = [1] * len(xs)
        if any(x.numel() > PART_NUMEL for x in xs):
            items, item_scales = [], [] if scales else None
            for k, x in enumerate(xs):
                parts = _parts(x, PART_NUMEL)
                counts[k] = len(parts)
                items.extend(parts)
                if scales:
                    item_scales.extend([scales[k]] * len(parts))
            rows = self._rows(items, device, item_scales, cpu)
            out, i = [], 0
            for c in counts:
                out.append(rows[i:i + 1] if c == 1
                           else self.combine(rows[i:i + c], [t.numel() for t in items[i:i + c]]))
                i += c
            return torch.cat(out)
        return self._rows(xs, device, scales, cpu)

    def _rows(self, xs: list[torch.Tensor], device: torch.device, scales: Sequence[float] | None,
              cpu: bool) -> torch.Tensor:
        """:meth:`_group` for tensors of at most :data:`PART_NUMEL` elements, with torch's reductions."""
        eps = self.eps
        minmax, want_norm = self._minmax, self._norm
        want_sum = self._sum if cpu else self._mean  # on CPU the sums also find the rows with NaNs
        want_zeros = self._zeros and eps > 0
        want_nans = self._nans
        flat_vals: list[torch.Tensor] = []
        nan_counts: list[torch.Tensor] = []  # other devices: every tensor's, counted in the loop
        numels = []
        sq_is_norm = []  # True where the "sq" field holds a norm (not a sum of squares)
        threads = torch.get_num_threads() if cpu else 1
        single = False
        scale_t = thresholds = None
        if scales and any(isinstance(s, torch.Tensor) for s in scales):
            # scales computed on the device (Adam's bias corrections from counters kept there): used as
            # operands, never read
            scale_t = torch.stack([to_device(s, device) if isinstance(s, torch.Tensor)
                                   else torch.full((), s, dtype=torch.float32, device=device)
                                   for s in scales]).to(torch.float32)
            thresholds = eps / scale_t
        for k, x in enumerate(xs):
            numel = x.numel()
            want_single = threads > 1 and numel < SMALL_NUMEL
            if want_single != single:
                torch.set_num_threads(1 if want_single else threads)
                single = want_single
            if want_nans and not cpu:
                # no sync-free way to skip it for finite tensors here; counted before any conversion,
                # so no temporary outlives this tensor's turn
                nan_counts.append(torch.isnan(x).sum())
            x = _as_reducible(x, want_zeros)
            numels.append(numel)
            f32 = x.dtype is torch.float32
            fast = cpu and f32
            if fast:
                flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
            if minmax:
                mn, mx = torch.aminmax(x)
                if not f32:
                    mn, mx = mn.float(), mx.float()
                flat_vals.append(mn)
                flat_vals.append(mx)
            f64 = x.dtype is torch.float64
            if want_sum:
                if fast:
                    flat_vals.append(torch.sum(flat))
                else:
                    flat_vals.append(torch.sum(x).float() if f64 else torch.sum(x, dtype=torch.float32))
            if want_norm:
                if fast:
                    flat_vals.append(torch.dot(flat, flat))
                else:
                    flat_vals.append(torch.linalg.vector_norm(x).float() if f64
                                     else torch.linalg.vector_norm(x, dtype=torch.float32))
                sq_is_norm.append(not fast)
            if want_zeros:
                # |x| < eps  <=>  trunc(x / eps) == 0. On CPU the count of the rest is the dot product of
                # trunc(x / eps) clamped to [-1, 1] with itself (BLAS), in a reused buffer: 3 cheap
                # passes, about 2x faster than abs/compare/count_nonzero. Values within an ulp of eps
                # itself may round the other way. A NaN poisons that dot product; such rows (their
                # sum is not finite) are counted exactly afterwards.
                e = (eps / scales[k] if thresholds is None else thresholds[k]) if scales else eps
                # The field holds the count of zeros: the nonzero count subtracted from numel as an integer
                # (int64 on the device path: exact past 2**24 elements, where two float32 counts differ by
                # less than their spacing) and rounded once.
                if fast:
                    vb, _ = self._buffers(x)
                    q = torch.div(flat, e, rounding_mode="trunc", out=vb[:numel])
                    q.clamp_(-1.0, 1.0)
                    flat_vals.append(torch.rsub(torch.dot(q, q), numel))
                else:
                    flat_vals.append(torch.rsub(torch.count_nonzero(torch.div(x, e, rounding_mode="trunc")),
                                                numel).float())
        if single:
            torch.set_num_threads(threads)
        n = len(xs)
        raw = torch.stack(flat_vals).view(n, -1) if flat_vals else None
        numel_t = torch.tensor(numels, dtype=torch.float32)
        if scales and scale_t is None:
            scale_t = torch.tensor(list(scales), dtype=torch.float32)
        if device.type != "cpu":
            numel_t = numel_t.pin_memory().to(device, non_blocking=True)
            if scale_t is not None and scale_t.device != device:
                scale_t = scale_t.pin_memory().to(device, non_blocking=True)
        cols: dict[str, torch.Tensor] = {}
        j = 0
        if minmax:
            cols["min"], cols["max"] = raw[:, 0], raw[:, 1]
            j = 2
        means = None
        if want_sum:
            means = raw[:, j] / numel_t
            cols["mean"] = means
            j += 1
        if want_norm:
            sq = raw[:, j]
            if any(sq_is_norm):
                if all(sq_is_norm):
                    cols["norm"] = sq
                else:
                    is_norm = torch.tensor(sq_is_norm, device=raw.device)
                    cols["norm"] = torch.where(is_norm, sq, sq.clamp(min=0).sqrt())
            else:
                cols["norm"] = sq.sqrt()
            if cpu and bool(torch.isinf(cols["norm"]).any()):
                cols["norm"] = self._unoverflowed_norms(cols["norm"], xs)
            j += 1
        if scale_t is not None:
            for op in ("min", "max", "norm", "mean"):
                if op in cols:
                    cols[op] = cols[op] * scale_t
        bad = self._nonfinite_rows(means) if cpu and (want_nans or want_zeros) else []
        if want_nans:
            if cpu:  # only the rows whose sum is not finite can hold a NaN
                counts = torch.zeros(n, dtype=torch.float32)
                for i in bad:
                    counts[i] = torch.isnan(xs[i]).sum()
                cols["nans"] = counts
            else:
                cols["nans"] = torch.stack(nan_counts).to(torch.float32)
        if self._zeros:
            if want_zeros:
                zeros = raw[:, j] / numel_t
                if cpu and bad:
                    for i in bad:  # a NaN made the fast count NaN: count exactly
                        e = eps / scales[i] if scales else eps
                        zeros[i] = (_as_reducible(xs[i], True).abs() < e).sum() / numels[i]
            else:
                zeros = torch.zeros_like(numel_t)  # |x| < 0 never holds
            cols["zeros"] = zeros
        return torch.stack([cols[op] for op in self.ops], dim=1)

    @staticmethod
    def _unoverflowed_norms(norms: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
        """Norms that came out inf for tensors of finite values past float32's range when squared (an
        exploding gradient): ``max|x| * ||x / max|x|||`` instead (a temporary the size of the tensor, on
        this rare path only). A tensor holding an inf keeps its inf."""
        norms = norms.clone()
        for i in torch.isinf(norms).nonzero().flatten().tolist():
            x = xs[i] if xs[i].is_floating_point() else xs[i].float()
            amax = x.abs().max()
            if torch.isfinite(amax) and amax > 0:
                norms[i] = amax.float() * torch.linalg.vector_norm(x / amax, dtype=torch.float32)
        return norms

    @staticmethod
    def _nonfinite_rows(means: torch.Tensor) -> list[int]:
        """Rows whose sum is not finite (CPU: the values are in host memory, nothing syncs)."""
        if math.isfinite(float(means.sum())):  # one check for the whole batch
            return []
        return torch.nonzero(~torch.isfinite(means)).flatten().tolist()
