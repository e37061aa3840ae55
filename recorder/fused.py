"""The one-pass CPU statistics kernel (``_fused.c``) behind a small Python face.

:func:`stats` gives the recorder's float32 ``[tensors x ops]`` statistics (min, max, mean, norm,
zeros, nans) from one read of each tensor's memory; :func:`adam` gives those of exp_avg, exp_avg_sq,
update and ratio from one read of each state pair. Figures: benchmarks/RESULTS.md, "Statistics kernel".

The extension is optional (built by ``pip install`` where a C compiler exists). ``AVAILABLE`` says
whether it loaded; ``TRAINREC_FUSED=0`` turns it off (the torch path runs), which is how the tests
check both paths. Tensors without storage of their own (DTensor: :func:`local_tensor` gives their
shard) and negative views (``is_neg()``, whose memory holds minus their values) never reach the
kernel; the C side refuses address 0."""

from __future__ import annotations

import contextlib
import sys
from array import array
from collections.abc import Sequence

import numpy as np
import torch

from . import config

try:
    from . import _fused  # type: ignore[attr-defined]
except ImportError:  # no C compiler at install time: the torch path runs
    _fused = None

AVAILABLE = _fused is not None and config.env_choice("TRAINREC_FUSED", ("1", "0", ""), "1") != "0"

# Statistics calls with fewer values than PARALLEL_NUMEL run on the calling thread only. With more,
# the kernel's helpers run as a parallel region of PyTorch's GNU OpenMP runtime, which pays from 1M
# values. Threads of our own ("pthreads") compete with torch's spinning threads, so there only batches
# of 16M values and more are split (see benchmarks/RESULTS.md, "Recorder overhead").
PARALLEL_NUMEL_OPENMP = 1 << 20
PARALLEL_NUMEL_PTHREADS = 1 << 24
PARALLEL_NUMEL = PARALLEL_NUMEL_PTHREADS  # set below for the runtime in use (_set_parallel_numel)
# Adam state pairs do a sqrt and two divisions per element, so a second thread pays on smaller batches.
ADAM_PARALLEL_NUMEL = 1 << 18
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_stats_tensors = getattr(_fused, "stats_tensors", None) if AVAILABLE else None
# fingerprints (stats_f32's extremes, unchanged()): not in an extension built from older sources, whose
# rows had no sample sum
FINGERPRINT_COLUMNS = 5
FINGERPRINTS = _stats_tensors is not None and getattr(_fused, "FINGERPRINT_COLUMNS", None) == FINGERPRINT_COLUMNS
FINGERPRINT_MIN_NUMEL = 1 << 16  # _fused.c's: smaller tensors get none


def threads() -> str | None:
    """Where the kernel's helper threads run: ``"openmp"`` (the GNU OpenMP workers PyTorch's CPU ops
    use, where the process has them) or ``"pthreads"`` (threads of each call's own); None without the
    kernel. ``TRAINREC_THREADS=pthreads`` chooses the latter at import."""
    return _fused.threads() if AVAILABLE else None


def _set_parallel_numel() -> None:
    global PARALLEL_NUMEL
    PARALLEL_NUMEL = PARALLEL_NUMEL_OPENMP if threads() == "openmp" else PARALLEL_NUMEL_PTHREADS


@contextlib.contextmanager
def _using(setter, name: str):
    """The block with the kernel set to ``name`` by ``setter`` (which returns the previous choice), and
    the threshold for splitting a call that goes with it."""
    prev = setter(name)
    _set_parallel_numel()
    try:
        yield
    finally:
        setter(prev)
        _set_parallel_numel()


def using_threads(name: str):
    """Run the block with the kernel's helpers on ``name`` (``"openmp"`` or ``"pthreads"``), and its
    threshold for splitting a call (tests and benchmarks; not thread-safe)."""
    return _using(_fused.set_threads, name)


if config.env_choice("TRAINREC_THREADS", ("pthreads", "openmp", ""), "") == "pthreads" and AVAILABLE:
    _fused.set_threads("pthreads")
_set_parallel_numel()


def kernel_name() -> str | None:
    """The float32 loops in use (plain statistics and Adam state): ``"avx2"`` (x86-64 CPUs with AVX2 and
    FMA) or ``"generic"`` (the auto-vectorised C loops, everywhere else); None without the kernel."""
    return _fused.kernel() if AVAILABLE else None


def kernels() -> list[str]:
    """The float32 loops this CPU can run, the generic one first."""
    if not AVAILABLE:
        return []
    out = []
    prev = _fused.kernel()
    try:
        for k in ("generic", "avx2"):
            try:
                _fused.set_kernel(k)
                out.append(k)
            except ValueError:
                pass
    finally:
        _fused.set_kernel(prev)
    return out


def using_kernel(name: str):
    """Run the block with float32 loop ``name`` (tests and benchmarks; not thread-safe)."""
    return _using(_fused.set_kernel, name)


def local_tensor(x):
    """``x`` as a plain tensor over its own memory: a DTensor (FSDP2, tensor parallel) gives this rank's
    local shard (its statistics are the shard's); an ``AsyncCollectiveTensor`` (a functional
    collective's result, as RowwiseParallel's output) the result, waited for, also where it is a
    DTensor's local tensor (a redistributed DTensor's: ``use_local_output=False``); other tensors, and
    None, are returned as they are."""
    if x is None or type(x) in _PLAIN:
        return x
    to_local = getattr(x, "to_local", None)
    if to_local is not None:
        x = to_local()
        if type(x) in _PLAIN:
            return x
    collectives = sys.modules.get("torch.distributed._functional_collectives")  # not imported: not in use
    acs = getattr(collectives, "AsyncCollectiveTensor", None)
    return x.wait() if acs is not None and isinstance(x, acs) else x


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`stats` takes ``x`` (a dense CPU tensor of any dtype but float64/complex, and no
    negative view: see :func:`stats_f32`)."""
    return (type(x) in _PLAIN and x.device.type == "cpu" and x.dtype is not torch.float64
            and not x.is_complex() and x.layout is torch.strided and not x.is_neg())


def _threads(total: int, at_least: int | None = None) -> int:
    return torch.get_num_threads() if total >= (PARALLEL_NUMEL if at_least is None else at_least) else 1


def _prepare(xs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Contiguous tensors of one kernel dtype (float32, or bfloat16 when all are bfloat16)."""
    kind = 1 if all(x.dtype is torch.bfloat16 for x in xs) else 0
    want = torch.bfloat16 if kind else torch.float32
    out = []
    for x in xs:
        if x.dtype is not want:
            x = x.to(want)  # float16, ints, bools (token ids, masks); bfloat16 mixed with float32
        if not x.is_contiguous():
            x = x.contiguous()
        out.append(x)
    return out, kind


_OP_CODES = {"min": 0, "max": 1, "mean": 2, "norm": 3, "zeros": 4, "nans": 5}


def op_codes(ops: Sequence[str]) -> bytes:
    """The kernel's op codes for ``ops`` (names as in the monitor config)."""
    return bytes(_OP_CODES[op] for op in ops)


def stats(xs: Sequence[torch.Tensor], eps: Sequence[float], ops: Sequence[str] | bytes,
          scales: Sequence[float] | None = None) -> torch.Tensor:
    """float32 ``[len(xs), len(ops)]`` statistics from one read of each tensor.

    ``eps`` is one zero threshold per tensor (``|x| < eps`` counts as zero). ``scales`` multiply min,
    max, norm and mean (the statistics of ``scale * x``; divide the thresholds by them yourself).
    min and max are NaN where the tensor holds a NaN, as torch's ``aminmax`` gives. The sums run in
    float32 within blocks of 4096 values and in float64 across blocks.
    """
    codes = ops if isinstance(ops, bytes) else op_codes(ops)
    prepared, kind = _prepare(xs)
    numels = array("q", [x.numel() for x in prepared])
    return _run(kind, array("Q", [x.data_ptr() for x in prepared]), numels, sum(numels), array("d", eps),
                scales, codes)


def stats_f32(xs: Sequence[torch.Tensor | None], eps: float, codes: bytes,
              scales: Sequence[float] | None = None, numpy: bool = False,
              extremes: np.ndarray | None = None) -> torch.Tensor | np.ndarray | None:
    """:func:`stats` for the hooks' case, with the least Python per call: float32 CPU tensors; None and
    empty tensors give NaN rows. A non-contiguous tensor is measured where it lies if it is a
    permutation of a contiguous block and no scales are given, else through a contiguous copy. Anything
    else, and a negative view (``x.is_neg()``, whose memory holds minus its values), gives None: the
    caller takes the general path. ``eps``: one threshold (divided by each scale). ``numpy``: the rows
    as the kernel's numpy array. ``extremes``: a float64 ``[len(xs), FINGERPRINT_COLUMNS]`` array
    filled with each tensor's fingerprint for :func:`unchanged` where it was measured in place with
    :data:`FINGERPRINT_MIN_NUMEL` elements or more; rows of -1, -1, NaN, NaN, NaN elsewhere."""
    if extremes is not None:
        no_fingerprints(extremes)  # the kernel overwrites the rows it has fingerprints for
    if scales is None and _stats_tensors is not None:
        # the common case without a Python loop over the tensors (inside training every bytecode counts:
        # the backward's kernels leave the interpreter's own data out of the CPU caches)
        out = np.empty((len(xs), len(codes)), dtype=np.float32)
        args = (xs, eps, codes, _PLAIN, torch.float32, out, PARALLEL_NUMEL, torch.get_num_threads())
        if _stats_tensors(*args, extremes) if extremes is not None and FINGERPRINTS else _stats_tensors(*args):
            return out if numpy else torch.from_numpy(out)
    ptrs = array("Q")
    numels = array("q")
    total = 0
    f32 = torch.float32
    missing: list[int] = []
    copies = []  # contiguous copies, alive until the kernel has read them
    for i, x in enumerate(xs):
        if x is None:
            missing.append(i)
            continue
        if (type(x) not in _PLAIN or x.dtype is not f32 or not x.is_cpu or x.layout is not torch.strided
                or x.is_neg()):
            return None
        k = x.numel()
        if not k:
            missing.append(i)
            continue
        if not x.is_contiguous():
            x = x.contiguous()
            copies.append(x)
        ptrs.append(x.data_ptr())
        numels.append(k)
        total += k
    if missing and scales is not None:
        scales = [s for i, s in enumerate(scales) if i not in missing]
    thresholds = array("d", (eps,)) * len(ptrs) if scales is None else array("d", [eps / s for s in scales])
    rows = _run_np(0, ptrs, numels, total, thresholds, scales, codes)
    if missing:
        out = np.full((len(xs), len(codes)), np.nan, dtype=np.float32)
        present = [i for i in range(len(xs)) if i not in missing]
        if present:
            out[present] = rows
        rows = out
    return rows if numpy else torch.from_numpy(rows)


def no_fingerprints(extremes: np.ndarray) -> None:
    """Fill ``extremes`` (see :func:`stats_f32`) with rows that :func:`unchanged` never accepts."""
    extremes[:, :2] = -1
    extremes[:, 2:] = np.nan


def unchanged(xs: Sequence[torch.Tensor | None], extremes: np.ndarray) -> bytes:
    """Per tensor 1 where it still holds the min and max values :func:`stats_f32` found in it, at the
    elements it found them, and its sample (one 64-byte line in every KiB) adds up to what it did
    (``extremes``, one row per tensor), else 0: two element reads and one line in 16 per tensor.
    A scaling, shift, clip or average changes an extreme (unless it leaves the tensor as it was); any
    write to 256 consecutive elements or more changes the sample. What goes unseen: a write through
    ``.data`` or numpy (autograd's version counter sees the others) to fewer, scattered elements that
    holds neither extreme nor a sampled line."""
    if not FINGERPRINTS:
        return bytes(len(xs))
    return _fused.unchanged(xs, _PLAIN, torch.float32, extremes)


def _run(kind: int, ptrs: array, numels: array, total: int, thresholds: array, scales: Sequence[float] | None,
         codes: bytes) -> torch.Tensor:
    return torch.from_numpy(_run_np(kind, ptrs, numels, total, thresholds, scales, codes))


def _run_np(kind: int, ptrs: array, numels: array, total: int, thresholds: array, scales: Sequence[float] | None,
            codes: bytes) -> np.ndarray:
    n = len(ptrs)
    out = np.empty((n, len(codes)), dtype=np.float32)
    if n:
        factors = array("d", scales) if scales is not None else array("d", (1.0,)) * n
        _fused.stats(kind, ptrs, numels, thresholds, factors, codes, out, _threads(total))
    return out


def adam(ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], eps: Sequence[float], shifts: Sequence[float],
         scales: Sequence[float], ops: Sequence[str] | bytes, want_mv: bool, want_ur: bool) -> torch.Tensor:
    """float32 ``[n, 4, len(ops)]`` statistics of (exp_avg, exp_avg_sq, update, ratio) per state pair,
    from one read of each pair (the blocks not wanted are left unset).

    ``eps``: 4 zero thresholds per pair, flat (already divided by the scale for update and ratio).
    update = scale * m / (max(sqrt(v), FLT_MIN) + shift), ratio = scale * m / max(sqrt(v), FLT_MIN), with
    the quotients computed exactly as torch's float32 sqrt, clamp, add and div give them. float32 only.
    """
    codes = ops if isinstance(ops, bytes) else op_codes(ops)
    n = len(ms)
    out = torch.empty((n, 4, len(codes)), dtype=torch.float32)
    if not n:
        return out
    ms = [m if m.is_contiguous() else m.contiguous() for m in ms]
    vs = [v if v.is_contiguous() else v.contiguous() for v in vs]
    numels = array("q", [m.numel() for m in ms])
    want = (1 if want_mv else 0) | (2 if want_ur else 0)
    _fused.adam(want, array("Q", [m.data_ptr() for m in ms]), array("Q", [v.data_ptr() for v in vs]), numels,
                array("d", eps), array("d", shifts), array("d", scales), codes, out.numpy(),
                _threads(sum(numels), ADAM_PARALLEL_NUMEL))
    return out


def adam_supported(ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> bool:
    return all(
        type(m) in _PLAIN and type(v) in _PLAIN
        and m.device.type == "cpu" and m.dtype is torch.float32 and v.dtype is torch.float32
        and v.device.type == "cpu" and m.shape == v.shape
        for m, v in zip(ms, vs, strict=True)
    )
