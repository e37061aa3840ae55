"""torch's reductions of :class:`~trainrec.recorder.stats.StatsEngine` (see its module docstring for
how they are chosen): float64 tensors, accelerator tensors Triton does not take, and CPU tensors where
the C kernel is not built. Also the pieces every path shares: parts of huge tensors and their combined
row, sparse tensors' rows from their stored values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .step_stats import to_device

# CPU tensors below this many elements get their reductions on the calling thread only: a fork/join of
# the intra-op pool costs more than the work there, and far more when the cores are oversubscribed;
# switching the thread count is cheap. Above it (1 MB of float32) the pool's parallelism pays.
SMALL_NUMEL = 1 << 18
_LOW = (torch.float16, torch.bfloat16)
# The torch reductions measure a tensor of more elements in parts of this many (views): their
# temporaries (the zero count's quotient, a float32 copy of float16, the NaN mask) are at most a part's
# size, 9 bytes per element at worst (~300 MB), whatever the tensor (an LLM's embedding gradient).
PART_NUMEL = 1 << 25


def as_reducible(x: torch.Tensor, want_zeros: bool) -> torch.Tensor:
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


def parts(x: torch.Tensor, limit: int) -> list[torch.Tensor]:
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
        return parts(x[0], limit)
    per = max(1, limit // (n // x.shape[0]))
    out: list[torch.Tensor] = []
    for piece in x.split(per):
        out.extend(parts(piece, limit))
    return out


@torch.no_grad()
def combine(rows: torch.Tensor, numels: Sequence[int], ops: Sequence[str]) -> torch.Tensor:
    """The ``[1, ops]`` row of a tensor from the rows of its consecutive parts (``numels`` elements
    each): what :meth:`StatsEngine.compute` gives for the whole, up to float rounding (min/max of the
    parts, NaN where a part has NaN; the norm from the parts' squares; mean and zeros weighted by size;
    NaN counts added). On the rows' device, without a sync."""
    r = rows.to(torch.float32)
    total = float(sum(numels))
    weights = [k / total for k in numels]  # Python scalars: no host-to-device copy
    cols = []
    for k, op in enumerate(ops):
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


def sparse_values(tensors: Sequence[torch.Tensor | None]) -> tuple[list, dict[int, tuple[int, int]]]:
    """The tensors with each sparse one (``nn.Embedding(sparse=True)`` gradients, COO or compressed)
    replaced by its stored values (no dense copy), and index -> (elements, elements stored) of those."""
    dense = list(tensors)
    sizes: dict[int, tuple[int, int]] = {}  # index -> (elements, elements stored)
    for i, t in enumerate(tensors):
        if t is not None and t.layout is not torch.strided:
            v = t.coalesce().values() if t.layout is torch.sparse_coo else t.values()
            dense[i] = v
            sizes[i] = (t.numel(), v.numel())
    return dense, sizes


def fix_sparse_rows(rows: torch.Tensor, sizes: dict[int, tuple[int, int]], ops: Sequence[str],
                    eps: float) -> torch.Tensor:
    """``rows`` of the stored values (:func:`sparse_values`) made the statistics of the dense tensors
    they stand for: the elements not stored are zeros, which count for zeros, mean, min and max."""
    for i, (numel, stored) in sizes.items():
        if numel == 0:
            continue  # a NaN row, as any empty tensor
        row = rows[i]
        if stored == 0:  # all zeros
            for k, op in enumerate(ops):
                row[k] = 1.0 if op == "zeros" and eps > 0 else 0.0
            continue
        unstored = numel - stored
        for k, op in enumerate(ops):
            if op == "mean":
                row[k] = row[k] * (stored / numel)
            elif op == "zeros":
                row[k] = (row[k] * stored + (unstored if eps > 0 else 0)) / numel
            elif unstored and op in ("min", "max"):
                zero = torch.zeros((), dtype=row.dtype, device=row.device)
                row[k] = torch.minimum(row[k], zero) if op == "min" else torch.maximum(row[k], zero)
    return rows


def unoverflowed_norms(norms: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
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


def nonfinite_rows(means: torch.Tensor) -> list[int]:
    """Rows whose sum is not finite (CPU: the values are in host memory, nothing syncs)."""
    if math.isfinite(float(means.sum())):  # one check for the whole batch
        return []
    return torch.nonzero(~torch.isfinite(means)).flatten().tolist()


class TorchReductions:
    """torch's reductions for tensors of one device and dtype, and the scratch buffers of the CPU zero
    count they reuse; :class:`~trainrec.recorder.stats.StatsEngine` sends them what neither the C kernel
    nor the Triton engine takes."""

    def __init__(self, ops: Sequence[str], eps: float) -> None:
        self.ops = tuple(ops)
        self.eps = float(eps)
        self._minmax = "min" in self.ops or "max" in self.ops
        self._mean = "mean" in self.ops
        self._sum = "mean" in self.ops or "nans" in self.ops or "zeros" in self.ops
        self._norm = "norm" in self.ops
        self._zeros = "zeros" in self.ops
        self._nans = "nans" in self.ops
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

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

    def group(self, xs: list[torch.Tensor], device: torch.device, scales: Sequence[float] | None,
              cpu: bool) -> torch.Tensor:
        """Rows for tensors of one device and dtype (``cpu``: the CPU fast paths).

        Per tensor only the reductions run (aminmax, sum, dot, the zero count); their scalars go into one
        ``[n, fields]`` matrix whose columns (mean, norm, zeros, scaling) are derived with a few vectorised
        ops. A tensor of more than :data:`PART_NUMEL` elements is measured in parts (views) whose rows are
        combined (:func:`combine`), so no temporary exceeds a part."""
        counts = [1] * len(xs)
        if any(x.numel() > PART_NUMEL for x in xs):
            items, item_scales = [], [] if scales else None
            for k, x in enumerate(xs):
                pieces = parts(x, PART_NUMEL)
                counts[k] = len(pieces)
                items.extend(pieces)
                if scales:
                    item_scales.extend([scales[k]] * len(pieces))
            rows = self.rows(items, device, item_scales, cpu)
            out, i = [], 0
            for c in counts:
                out.append(rows[i:i + 1] if c == 1
                           else combine(rows[i:i + c], [t.numel() for t in items[i:i + c]], self.ops))
                i += c
            return torch.cat(out)
        return self.rows(xs, device, scales, cpu)

    def rows(self, xs: list[torch.Tensor], device: torch.device, scales: Sequence[float] | None,
             cpu: bool) -> torch.Tensor:
        """:meth:`group` for tensors of at most :data:`PART_NUMEL` elements, with torch's reductions."""
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
            x = as_reducible(x, want_zeros)
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
                # passes, faster than abs/compare/count_nonzero. Values within an ulp of eps
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
                cols["norm"] = unoverflowed_norms(cols["norm"], xs)
            j += 1
        if scale_t is not None:
            for op in ("min", "max", "norm", "mean"):
                if op in cols:
                    cols[op] = cols[op] * scale_t
        bad = nonfinite_rows(means) if cpu and (want_nans or want_zeros) else []
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
                        zeros[i] = (as_reducible(xs[i], True).abs() < e).sum() / numels[i]
            else:
                zeros = torch.zeros_like(numel_t)  # |x| < 0 never holds
            cols["zeros"] = zeros
        return torch.stack([cols[op] for op in self.ops], dim=1)
