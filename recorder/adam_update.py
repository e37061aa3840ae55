"""Adam's ``update`` and ``ratio`` from the state :class:`.optim.AdamState` finds: bias corrections
folded into per-tensor scales, in chunks (torch), in one pass (the fused CPU kernel) or on the device
(the Triton engine).

``update`` is the bias-corrected Adam direction ``m̂ / (sqrt(v̂) + eps)`` and ``ratio`` is ``m̂ / sqrt(v̂)``,
as the reference defines them, except that ``ratio`` is 0 where ``v̂ == 0`` (``m̂`` is 0 there too: an
embedding row that never got a gradient), where the reference gives 0/0 = NaN and so reports NaNs for
healthy runs. NaN or inf in the state itself still shows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import fused
from .step_stats import gather_device, to_device

# update/ratio temporaries are made for at most this many state elements at a time (64M: 2 x 256 MB
# of float32 temporaries at the peak, enough for the foreach kernels to batch well)
CHUNK_NUMEL = 1 << 26


@torch.no_grad()
def update_and_ratio(entries, compute, want_update: bool, want_ratio: bool, chunk_numel: int = CHUNK_NUMEL):
    """Stats rows of ``update`` and ``ratio`` for ``lookup`` entries, via ``compute(list, scales) -> rows``.

    With ``c = sqrt(1 - b2^t) / (1 - b1^t)``: ``ratio = c * m / sqrt(v)`` and
    ``update = c * m / (sqrt(v) + eps * sqrt(1 - b2^t))``; the bias corrections are per-tensor scales
    of the statistics, not extra passes. ``ratio`` is 0 where ``v == 0`` (``sqrt(v)`` is clamped to the
    dtype's smallest normal number). Tensors go in chunks of at most ``chunk_numel`` elements, so the
    two temporaries add about ``2 * chunk_numel`` elements to the memory peak, not twice the state."""
    if not entries:
        return None, None
    scales, shifts = bias_corrections(entries)
    update_parts, ratio_parts = [], []
    for a, b in _chunks([e[2].numel() for e in entries], chunk_numel):
        # (a complex parameter's state as torch's Adam updates it: its real view, real and imaginary parts)
        ms = [_real_view(fused.local_tensor(e[1])) for e in entries[a:b]]
        vs = [_real_view(fused.local_tensor(e[2])) for e in entries[a:b]]
        denom = torch._foreach_sqrt(vs)
        # 0 -> the dtype's smallest normal, so 0/0 gives ratio 0 where v == 0. Exact elsewhere: for
        # v > 0, sqrt(v) >= sqrt(smallest subnormal), far above it. One in-place pass; NaNs stay.
        torch._foreach_clamp_min_(denom, [torch.finfo(d.dtype).tiny for d in denom])
        quot = torch._foreach_div(ms, denom)
        if want_ratio:
            ratio_parts.append(compute(quot, scales[a:b]))
        if want_update:
            if any(isinstance(s, torch.Tensor) for s in shifts[a:b]):  # computed on the device
                for d, s in zip(denom, shifts[a:b], strict=True):
                    d.add_(s)
            else:
                torch._foreach_add_(denom, shifts[a:b])
            for m, d, q in zip(ms, denom, quot, strict=True):
                torch.div(m, d, out=q)
            update_parts.append(compute(quot, scales[a:b]))
        del denom, quot  # freed before the next chunk's temporaries are made
    return _cat(update_parts), _cat(ratio_parts)


def _real_view(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(x) if x.is_complex() else x


def bias_corrections(entries) -> tuple[list, list]:
    """Per entry: the scale ``c = sqrt(1 - b2^t) / (1 - b1^t)`` of update and ratio, and the shift
    ``eps * sqrt(1 - b2^t)`` added to ``sqrt(v)`` in the update's denominator. Floats where the step
    is a float; where it is a counter tensor (see :meth:`.optim.AdamState.lookup`), 0-d float32 tensors
    computed where it is, without reading it: one batch of kernels per param group and device."""
    scales: list = []
    shifts: list = []
    counters: dict[tuple, list[int]] = {}  # (device, id(group)) -> entries whose step is a tensor
    for k, (_, _, _, step, group) in enumerate(entries):
        if isinstance(step, torch.Tensor):
            counters.setdefault((step.device, id(group)), []).append(k)
            scales.append(None)
            shifts.append(None)
            continue
        b1, b2 = group.get("betas", (0.9, 0.999))
        t = max(step, 1.0)
        sqrt_bc2 = math.sqrt(1.0 - b2**t)
        scales.append(sqrt_bc2 / (1.0 - b1**t))
        shifts.append(float(group.get("eps", 1e-8)) * sqrt_bc2)
    for ks in counters.values():
        group = entries[ks[0]][4]
        b1, b2 = group.get("betas", (0.9, 0.999))
        t = torch.stack([entries[k][3] for k in ks]).to(torch.float32).clamp_(min=1.0)
        # 1 - b^t as -expm1(t * log(b)), log(b) in float64 on the host: float32's 1 - b^t would lose
        # about 4 digits to cancellation where b^t is near 1 (b2 = 0.999, t = 1)
        bc1 = torch.expm1(t * _log(b1, t)).neg_()
        sqrt_bc2 = torch.expm1(t * _log(b2, t)).neg_().sqrt_()
        for k, c, s in zip(ks, (sqrt_bc2 / bc1).unbind(), (sqrt_bc2 * float(group.get("eps", 1e-8))).unbind(),
                           strict=True):
            scales[k], shifts[k] = c, s
    return scales, shifts


def _log(b, like: torch.Tensor):
    """``log(b)`` for a beta (-inf for 0), a float, or a 0-d float32 tensor on ``like``'s device where
    the beta is a tensor (torch's Adam takes tensor betas)."""
    if isinstance(b, torch.Tensor):
        return torch.log(to_device(b, like.device).to(torch.float32))
    return math.log(b) if b > 0 else -math.inf


def fused_adam_rows(entries, ops: Sequence[str], eps: float, want_mv: bool, want_ur: bool):
    """``(exp_avg, exp_avg_sq, update, ratio)`` rows from one read of each state pair with the fused
    kernel (the pairs not wanted are None), or None where the kernel does not take this state (not
    float32 CPU tensors, or the kernel is not built). Values as :func:`update_and_ratio` defines them."""
    ms = [fused.local_tensor(e[1]) for e in entries]
    vs = [fused.local_tensor(e[2]) for e in entries]
    if not fused.AVAILABLE or not fused.adam_supported(ms, vs):
        return None
    scales, shifts = bias_corrections(entries)
    thresholds = []
    for c in scales:
        thresholds += [eps, eps, eps / c, eps / c]
    out = fused.adam(ms, vs, thresholds, shifts, scales, ops, want_mv, want_ur)
    return (out[:, 0] if want_mv else None, out[:, 1] if want_mv else None,
            out[:, 2] if want_ur else None, out[:, 3] if want_ur else None)


def device_update_and_ratio(entries, engine):
    """Rows of update and ratio, as :func:`update_and_ratio` defines them, from the engine's Triton path:
    measured from each state pair as they are formed, without a temporary; None where it does not
    take the pairs (then :func:`update_and_ratio` runs)."""
    ms = [_real_view(fused.local_tensor(e[1])) for e in entries]
    vs = [_real_view(fused.local_tensor(e[2])) for e in entries]
    scales, shifts = bias_corrections(entries)
    ratio = engine.pair_rows(ms, vs, scales, None)
    if ratio is None:
        return None
    return engine.pair_rows(ms, vs, scales, shifts), ratio


def _chunks(numels: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of consecutive tensors with at most ``limit`` elements together (or one tensor)."""
    out = []
    a, total = 0, 0
    for i, n in enumerate(numels):
        if i > a and total + n > limit:
            out.append((a, i))
            a, total = i, 0
        total += n
    if a < len(numels):
        out.append((a, len(numels)))
    return out


def _cat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The chunks' rows, each on its first tensor's device, on one device (a model split over devices)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    dev = gather_device(p.device for p in parts)
    return torch.cat([to_device(p, dev) for p in parts])

