"""Statistics of accelerator tensors with Triton: one read of each tensor for all six, few launches.

A *partials* kernel reads a share of one tensor per program and writes float64 partials (min, max,
sum, sum of squares, zeros, NaNs, elements, scale); a *combine* kernel reduces them to each tensor's
row. Many tensors go in one partials launch per dtype, driven by a table of addresses and sizes
copied without blocking; a hook's few tensors are passed directly. Nothing is read back: rows stay
on the device until the step's one host copy. Adam's update and ratio are measured from the state
pairs in the same pass (``MODE`` 1 and 2). Under ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors (the tests). See docs/gpu.md."""

from __future__ import annotations

import contextlib
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # another accelerator, or no Triton: the torch reductions run
    triton = None

AVAILABLE = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

OPS = ("min", "max", "norm", "mean", "zeros", "nans")
NPART = 8  # columns of a partials row: min, max, sum, sumsq, zeros, nans, elements, scale
BLOCK = 256 if INTERPRET else 2048  # elements per program per loop turn
WARPS = 8
CHUNK = 1 << 16  # a tensor gets a program per this many elements ...
MAX_PROGRAMS = 256  # ... and at most this many
TABLE_COLUMNS = 6  # address, second address (pairs), elements, output row, scale bits, shift bits
DIRECT_MAX = 4  # batches of at most this many tensors skip the table (a hook's inputs or outputs)
_TL_DTYPES = {}
if AVAILABLE:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
SUPPORTED_DTYPES = frozenset(_TL_DTYPES)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free block of memory from ``data_ptr()`` on (contiguous,
    or a permutation of that: transposes, channels-last), so that reading the block flat reads each
    element once. The statistics do not depend on the order."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def supports(t: torch.Tensor) -> bool:
    """Whether the kernels read ``t`` (a float32/bf16/fp16 strided dense tensor that is no negative view)."""
    return (t.dtype in SUPPORTED_DTYPES and t.layout is torch.strided and not t.is_neg()
            and type(t) in (torch.Tensor, torch.nn.Parameter) and dense(t))


def _programs(max_numel: int) -> int:
    return max(1, min(MAX_PROGRAMS, -(-max_numel // CHUNK)))


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


if AVAILABLE:

    @triton.jit
    def _accumulate(p0, p1, n, start, step, thr, shift, MODE: tl.constexpr, TINY: tl.constexpr,
                    BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        """min, max, sum, sum of squares, zeros, NaNs of the blocks at ``start, start + step, ...``; MODE
        0: the values at ``p0``; 1: ``p0 / max(sqrt(p1), TINY)``; 2: ``p0 / (max(sqrt(p1), TINY) + shift)``.
        (A while loop: the interpreter takes no loaded value as a range bound.)"""
        lane = tl.arange(0, BLOCK)
        s = tl.zeros([BLOCK], tl.float32)
        sq = tl.zeros([BLOCK], tl.float32)
        mn = tl.full([BLOCK], float("inf"), tl.float32)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        zc = tl.zeros([BLOCK], tl.int32)
        nc = tl.zeros([BLOCK], tl.int32)
        off = start.to(tl.int64)
        step = step.to(tl.int64)
        while off < n:
            if ALIGNED:
                idx = tl.max_contiguous(tl.multiple_of(off + lane, BLOCK), BLOCK)
            else:
                idx = off + lane
            m = idx < n
            x = tl.load(p0 + idx, mask=m, other=0.0).to(tl.float32)
            if MODE != 0:
                v = tl.load(p1 + idx, mask=m, other=1.0).to(tl.float32)
                d = tl.maximum(tl.sqrt(v), TINY, propagate_nan=tl.PropagateNan.ALL)
                if MODE == 2:
                    d = d + shift
                x = x / d
            nc += ((x != x) & m).to(tl.int32)
            s += x
            sq += x * x
            mn = tl.minimum(mn, tl.where(m, x, float("inf")))
            mx = tl.maximum(mx, tl.where(m, x, float("-inf")))
            zc += (m & (tl.abs(x) < thr)).to(tl.int32)
            off += step
        return tl.min(mn, 0), tl.max(mx, 0), tl.sum(s, 0), tl.sum(sq, 0), tl.sum(zc, 0), tl.sum(nc, 0)

    @triton.jit
    def _partials_of(p0, p1, n, row, part, pid, P, thr, shift, scale, MODE: tl.constexpr, TINY: tl.constexpr,
                     BLOCK: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
        """Program ``pid``'s partials of one tensor of ``n`` elements, into row ``row`` of ``part``: the
        tensor gets ``min(P, ceil(n / CHUNK))`` programs (at least one), the others do nothing."""
        programs = tl.minimum(tl.maximum((n + CHUNK - 1) // CHUNK, 1), P)
        if pid < programs:
            mn, mx, s, sq, zc, nc = _accumulate(p0, p1, n, pid * BLOCK, programs * BLOCK, thr, shift, MODE, TINY,
                                                BLOCK, ALIGNED)
            base = part + (row * P + pid) * 8
            tl.store(base + 0, mn.to(tl.float64))
            tl.store(base + 1, mx.to(tl.float64))
            tl.store(base + 2, s.to(tl.float64))
            tl.store(base + 3, sq.to(tl.float64))
            tl.store(base + 4, zc.to(tl.float64))
            tl.store(base + 5, nc.to(tl.float64))
            tl.store(base + 6, n.to(tl.float64))
            tl.store(base + 7, scale.to(tl.float64))

    @triton.jit
    def _table_partials(table, scale_aux, shift_aux, part, P, eps, DT: tl.constexpr, MODE: tl.constexpr,
                        SCALES: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                        ALIGNED: tl.constexpr):
        """Partials of the tensors of a table (grid: programs x tensors). SCALES 0: none; 1: scale and
        shift as float64 bits in the table; 2: in float32 device arrays, by output row."""
        entry = table + tl.program_id(1) * 6
        a0 = tl.load(entry)
        a1 = tl.load(entry + 1)
        n = tl.load(entry + 2)
        row = tl.load(entry + 3)
        if SCALES == 1:
            scale = tl.load(entry + 4).to(tl.float64, bitcast=True).to(tl.float32)
            shift = tl.load(entry + 5).to(tl.float64, bitcast=True).to(tl.float32)
        elif SCALES == 2:
            scale = tl.load(scale_aux + row).to(tl.float32)
            shift = tl.load(shift_aux + row).to(tl.float32)
        else:
            scale = tl.full((), 1.0, tl.float32)
            shift = tl.full((), 0.0, tl.float32)
        if ALIGNED:
            a0 = tl.multiple_of(a0, 16)
            a1 = tl.multiple_of(a1, 16)
        _partials_of(a0.to(tl.pointer_type(DT)), a1.to(tl.pointer_type(DT)), n, row, part, tl.program_id(0), P,
                     eps / scale, shift, scale, MODE, TINY, BLOCK, CHUNK, ALIGNED)

    @triton.jit
    def _direct_partials(x0, x1, x2, x3, n0, n1, n2, n3, part, P, eps, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        """Partials of up to four tensors passed directly, rows 0-3 (grid: programs x tensors)."""
        pid = tl.program_id(0)
        t = tl.program_id(1)
        one = tl.full((), 1.0, tl.float32)
        zero = tl.full((), 0.0, tl.float32)
        if t == 0:
            _partials_of(x0, x0, tl.full((), n0, tl.int64), 0, part, pid, P, eps, zero, one, 0, 1.0, BLOCK, CHUNK,
                         False)
        elif t == 1:
            _partials_of(x1, x1, tl.full((), n1, tl.int64), 1, part, pid, P, eps, zero, one, 0, 1.0, BLOCK, CHUNK,
                         False)
        elif t == 2:
            _partials_of(x2, x2, tl.full((), n2, tl.int64), 2, part, pid, P, eps, zero, one, 0, 1.0, BLOCK, CHUNK,
                         False)
        else:
            _partials_of(x3, x3, tl.full((), n3, tl.int64), 3, part, pid, P, eps, zero, one, 0, 1.0, BLOCK, CHUNK,
                         False)

    @triton.jit
    def _combine(part, out, P, PB: tl.constexpr, CHUNK: tl.constexpr, NOPS: tl.constexpr, C_MIN: tl.constexpr,
                 C_MAX: tl.constexpr, C_NORM: tl.constexpr, C_MEAN: tl.constexpr, C_ZEROS: tl.constexpr,
                 C_NANS: tl.constexpr):
        """One row of ``out`` per program from its tensor's partials (column -1: op not requested). NaN
        rows for tensors of no elements; min and max NaN where a NaN was counted (as torch's)."""
        r = tl.program_id(0)
        n = tl.load(part + r * P * 8 + 6)
        scale = tl.load(part + r * P * 8 + 7)
        programs = tl.minimum(tl.maximum((n.to(tl.int64) + CHUNK - 1) // CHUNK, 1), P)
        j = tl.arange(0, PB)
        m = j < programs
        base = part + (r * P + j) * 8
        mn = tl.min(tl.load(base + 0, mask=m, other=float("inf")), 0)
        mx = tl.max(tl.load(base + 1, mask=m, other=float("-inf")), 0)
        s = tl.sum(tl.load(base + 2, mask=m, other=0.0), 0)
        sq = tl.sum(tl.load(base + 3, mask=m, other=0.0), 0)
        zc = tl.sum(tl.load(base + 4, mask=m, other=0.0), 0)
        nc = tl.sum(tl.load(base + 5, mask=m, other=0.0), 0)
        empty = n == 0
        n = tl.where(empty, 1.0, n)  # (no 0 / 0 computed for an empty tensor's row, which is NaN anyway)
        nan = float("nan")
        dst = out + r * NOPS
        if C_MIN >= 0:
            tl.store(dst + C_MIN, tl.where(empty | (nc > 0), nan, mn * scale).to(tl.float32))
        if C_MAX >= 0:
            tl.store(dst + C_MAX, tl.where(empty | (nc > 0), nan, mx * scale).to(tl.float32))
        if C_NORM >= 0:
            tl.store(dst + C_NORM, tl.where(empty, nan, tl.sqrt(sq) * scale).to(tl.float32))
        if C_MEAN >= 0:
            tl.store(dst + C_MEAN, tl.where(empty, nan, s / n * scale).to(tl.float32))
        if C_ZEROS >= 0:
            tl.store(dst + C_ZEROS, tl.where(empty, nan, zc / n).to(tl.float32))
        if C_NANS >= 0:
            tl.store(dst + C_NANS, tl.where(empty, nan, nc).to(tl.float32))


class TritonStats:
    """The requested ``ops`` of batches of tensors on one device: ``rows`` (plain values) and
    ``pair_rows`` (Adam's update or ratio from state pairs). Each returns a float32 ``[n, ops]`` tensor
    on the tensors' device; None or empty tensors get NaN rows."""

    def __init__(self, ops: Sequence[str], eps: float) -> None:
        if not AVAILABLE:
            raise RuntimeError("trainrec: the Triton statistics engine needs the triton package")
        self.ops = tuple(ops)
        self.eps = float(eps)
        self._cols = {f"C_{op.upper()}": (self.ops.index(op) if op in self.ops else -1) for op in OPS}
        self._tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # key -> device table

    # ------------------------------------------------------------------ entry points
    def rows(self, tensors: Sequence[torch.Tensor | None], scales: Sequence | None = None) -> torch.Tensor:
        """Rows of ``tensors`` (each supported by :func:`supports`, or None / empty), all on one device."""
        return self._run(tensors, None, scales, None, 0)

    def pair_rows(self, ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], scales: Sequence,
                  shifts: Sequence | None) -> torch.Tensor:
        """Rows of ``scale * m / max(sqrt(v), tiny)`` (ratio, ``shifts`` None) or of
        ``scale * m / (max(sqrt(v), tiny) + shift)`` (update) per pair, without forming either."""
        return self._run(ms, vs, scales, shifts, 1 if shifts is None else 2)

    # ------------------------------------------------------------------ launches
    def _run(self, xs, vs, scales, shifts, mode: int) -> torch.Tensor:
        n = len(xs)
        device = next((t.device for t in xs if t is not None), None)
        nops = len(self.ops)
        if device is None or n == 0:
            return torch.full((n, nops), math.nan, dtype=torch.float32, device=device or "cpu")
        numels = [0 if t is None else t.numel() for t in xs]
        programs = _programs(max(numels))
        part = torch.empty((n, programs, NPART), dtype=torch.float64, device=device)
        out = torch.empty((n, nops), dtype=torch.float32, device=device)
        with _on(device), _quiet():
            if mode == 0 and scales is None and n <= DIRECT_MAX:
                # a hook's tensors: passed directly, one launch (None / empty: the buffer, 0 elements)
                given = [t if k else part for t, k in zip(xs, numels, strict=True)]
                given += [part] * (4 - n)
                sizes = numels + [0] * (4 - n)
                _direct_partials[(programs, n)](*given, *sizes, part, programs, self.eps, BLOCK=BLOCK, CHUNK=CHUNK,
                                                num_warps=WARPS)
            else:
                self._table_launches(xs, vs, numels, scales, shifts, mode, part, programs, device)
            _combine[(n,)](part, out, programs, PB=triton.next_power_of_2(programs), CHUNK=CHUNK, NOPS=nops,
                           num_warps=1, **self._cols)
        return out

    def _table_launches(self, xs, vs, numels, scales, shifts, mode, part, programs, device) -> None:
        by_dtype: dict = {}
        for row, t in enumerate(xs):
            by_dtype.setdefault(None if not numels[row] else t.dtype, []).append(row)
        empty_rows = by_dtype.pop(None, [])
        if not by_dtype:  # all None / empty: one launch of any dtype writes their identity partials
            by_dtype[torch.float32] = []
        # (those rows ride along with the first dtype: the loop over their elements never runs)
        first = next(iter(by_dtype))
        by_dtype[first] = sorted(by_dtype[first] + empty_rows)
        scale_mode, scale_aux, shift_aux = 0, part, part
        if scales is not None:
            if any(isinstance(s, torch.Tensor) for s in scales) or (
                    shifts is not None and any(isinstance(s, torch.Tensor) for s in shifts)):
                scale_mode = 2
                scale_aux = _device_floats(scales, device)
                shift_aux = _device_floats(shifts, device) if shifts is not None else scale_aux
            else:
                scale_mode = 1
        for dtype, rows in by_dtype.items():
            entries, aligned = [], True
            for r in rows:
                t = xs[r]
                a0 = t.data_ptr() if numels[r] else 0
                a1 = vs[r].data_ptr() if (vs is not None and numels[r]) else a0
                aligned = aligned and a0 % 16 == 0 and a1 % 16 == 0
                sc = _f64_bits(scales[r]) if scale_mode == 1 else 0
                sh = _f64_bits(shifts[r]) if scale_mode == 1 and shifts is not None else 0
                entries.extend((a0, a1, numels[r], r, sc, sh))
            table = self._table(tuple(entries), device)
            _table_partials[(programs, len(rows))](table, scale_aux, shift_aux, part, programs, self.eps,
                                                   DT=_TL_DTYPES[dtype], MODE=mode, SCALES=scale_mode,
                                                   TINY=torch.finfo(dtype).tiny, BLOCK=BLOCK, CHUNK=CHUNK,
                                                   ALIGNED=aligned and not INTERPRET, num_warps=WARPS)

    def _table(self, key: tuple, device: torch.device) -> torch.Tensor:
        """The table ``key`` on ``device``: reused while the same tensors are measured again (parameters,
        their gradients and optimizer state keep their memory from step to step), else made from
        pinned memory with a non-blocking copy."""
        hit = self._tables.get(key)
        if hit is not None and hit.device == device:
            self._tables.move_to_end(key)
            return hit
        host = torch.tensor(key, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        table = host.to(device, non_blocking=device.type == "cuda")
        self._tables[key] = table
        while len(self._tables) > 16:
            self._tables.popitem(last=False)
        return table

    def release(self) -> None:
        self._tables.clear()


def _device_floats(values: Sequence, device: torch.device) -> torch.Tensor:
    """Per-row float32 values on ``device`` from floats and 0-d tensors (computed there: never read)."""
    parts = [v.reshape(()).to(device=device, dtype=torch.float32, non_blocking=True) if isinstance(v, torch.Tensor)
             else torch.full((), float(v), dtype=torch.float32, device=device) for v in values]
    return torch.stack(parts)


def _quiet():
    """Under the interpreter, numpy's warnings about inf and NaN arithmetic off: the kernels compute with
    them as a GPU does, on purpose."""
    if INTERPRET:
        import numpy as np

        return np.errstate(all="ignore")
    return contextlib.nullcontext()


class _on:
    """Launches on ``device`` (Triton launches on the current CUDA device)."""

    def __init__(self, device: torch.device) -> None:
        self.ctx = torch.cuda.device(device) if device.type == "cuda" and device.index is not None \
            and device.index != torch.cuda.current_device() else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
