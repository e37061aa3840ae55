"""The one-pass statistics kernel (recorder/_fused.c via recorder/fused.py) against float64 torch."""

from __future__ import annotations

import math
import os
import signal
import time

import numpy as np
import pytest
import torch
from test_stats_engine import OPS, close, ref
from trainrec.recorder import adam_update, fused, optim
from trainrec.recorder.stats import StatsEngine

pytestmark = pytest.mark.skipif(not fused.AVAILABLE, reason="the one-pass kernel (recorder/_fused.c) is not built")


@pytest.fixture(autouse=True, params=fused.kernels() or ["none"])
def kernel(request):
    """Every test here runs with each float32 loop this CPU has (the AVX2 one where it can, and the
    auto-vectorised one every other machine runs)."""
    if request.param == "none":
        yield request.param
        return
    with fused.using_kernel(request.param):
        yield request.param


def rows_ref(xs, eps):
    return [ref(x, eps) for x in xs]


def assert_rows(got: torch.Tensor, xs, eps, rtol=1e-5):
    for i, (row, want) in enumerate(zip(got.tolist(), rows_ref(xs, eps), strict=True)):
        for op, a, b in zip(OPS, row, want, strict=True):
            if math.isinf(b):
                assert a == b, (i, op, a, b)
            else:
                assert close(a, b, rtol), f"tensor {i} {op}: {a} vs {b}"


def test_chunks_blocks_and_tails_match_float64():
    """Sizes around the kernel's block (4096) and chunk (262144) edges, split over several threads."""
    g = torch.Generator().manual_seed(1)
    sizes = [1, 7, 4095, 4096, 4097, 262143, 262144, 262145, 3 * 262144 + 11]
    xs = [torch.randn(n, generator=g) * 3 + 0.5 for n in sizes]
    for x in xs:
        x[:: 5] = 0.0
    got = fused.stats(xs, [1e-8] * len(xs), OPS)
    assert got.shape == (len(xs), 6) and got.dtype is torch.float32
    assert_rows(got, xs, 1e-8)


def _thread_runtimes() -> list[str]:
    """The helper-thread runtimes this process can use: POSIX threads, and torch's GNU OpenMP workers
    where torch loaded libgomp (its Linux CPU builds do)."""
    out = ["pthreads"]
    try:
        with fused.using_threads("openmp"):
            out.append("openmp")
    except ValueError:
        pass
    return out


def test_openmp_runtime_is_used_where_torch_loaded_it():
    if "openmp" not in _thread_runtimes():
        pytest.skip("no GNU OpenMP runtime in this process")
    assert fused.threads() == "openmp" and fused.PARALLEL_NUMEL == fused.PARALLEL_NUMEL_OPENMP
    with fused.using_threads("pthreads"):
        assert fused.threads() == "pthreads" and fused.PARALLEL_NUMEL == fused.PARALLEL_NUMEL_PTHREADS
    assert fused.threads() == "openmp"
    with pytest.raises(ValueError, match="expected 'openmp' or 'pthreads'"):
        fused.using_threads("tbb").__enter__()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_uses_its_own_threads(monkeypatch):
    """GNU OpenMP's pool does not survive fork: a child of a process that used it runs the helpers
    as POSIX threads, with the same results."""
    if "openmp" not in _thread_runtimes():
        pytest.skip("no GNU OpenMP runtime in this process")
    monkeypatch.setattr(fused, "_threads", lambda total, at_least=None: 2)
    xs = [torch.randn(3_000_000, generator=torch.Generator().manual_seed(4))]
    want = fused.stats(xs, [1e-8], OPS)  # the parent's pool is started
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if it ran on its own threads and got the same rows
        ok = fused.threads() == "pthreads" and torch.equal(fused.stats(xs, [1e-8], OPS), want)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while True:  # a hung child fails the test (and is killed) instead of hanging the suite
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish in 60 s")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert fused.threads() == "openmp"


def test_results_do_not_depend_on_the_thread_count_or_runtime(monkeypatch):
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(1_000_003, generator=g), torch.randn(70_000, generator=g)]
    ms = [x.clone() for x in xs]
    vs = [x.square() for x in xs]
    codes = fused.op_codes(OPS)
    results, adam_results, hook_results = [], [], []
    for runtime in _thread_runtimes():
        with fused.using_threads(runtime):
            for threads in (1, 2, 3, 8):
                monkeypatch.setattr(fused, "_threads", lambda total, at_least=None, t=threads: t)
                results.append(fused.stats(xs, [1e-8, 1e-8], OPS))
                adam_results.append(fused.adam(ms, vs, [1e-8] * 8, [1e-8, 1e-8], [1.0, 1.0], OPS, True, True))
                out = np.empty((2, len(OPS)), dtype=np.float32)  # the hooks' entry, split from 1 value on
                assert fused._stats_tensors(xs, 1e-8, codes, fused._PLAIN, torch.float32, out, 1, threads)
                hook_results.append(torch.from_numpy(out))
    for r in results[1:] + hook_results:
        assert torch.equal(r, results[0])  # bitwise: chunks are merged in a fixed order
    for r in adam_results[1:]:
        assert torch.equal(r, adam_results[0])


def test_nan_inf_and_all_nan():
    nan, inf = float("nan"), float("inf")
    xs = [torch.tensor([1.0, nan, -3.0, 0.0]), torch.tensor([nan, nan]), torch.tensor([-inf, 2.0, inf]),
          torch.tensor([5.0])]
    got = fused.stats(xs, [0.5] * 4, OPS).tolist()
    mn, mx, norm, mean, zeros, nans = zip(*got, strict=True)
    assert math.isnan(mn[0]) and math.isnan(mx[0]) and nans[0] == 1 and zeros[0] == 0.25
    assert math.isnan(mn[1]) and nans[1] == 2 and zeros[1] == 0.0
    assert mn[2] == -inf and mx[2] == inf and norm[2] == inf and math.isnan(mean[2]) and nans[2] == 0
    assert got[3] == [5.0, 5.0, 5.0, 5.0, 0.0, 0.0]


@pytest.mark.parametrize("n", [5, 16, 17, 33, 4096, 4111, 3 * 4096 + 9, 262144 + 40])
def test_nan_and_inf_anywhere_in_blocks_and_tails(n):
    """NaNs are counted in a block only when its sum is not finite: NaNs in the vector loop and in the
    tail, in several blocks, an infinity without NaN, and finite values whose sum overflows give the
    exact counts; min/max ignore NaN in the kernel (NaN is reported where the count is not zero)."""
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g)
    cases = []
    x = base.clone()
    idx = sorted({0, n // 3, n - 1, min(n - 1, 17), min(n - 1, 4100)})
    x[idx] = float("nan")
    cases.append((x, len(idx)))
    y = base.clone()
    y[n // 2] = float("inf")
    cases.append((y, 0))
    big = torch.full((n,), 3e38)
    big[::2] = 1e38
    cases.append((big, 0))
    zero = base.clone()
    zero[:: 3] = -0.0
    zero[1:: 7] = 1e-9
    cases.append((zero, 0))
    for x, nans in cases:
        got = fused.stats([x], [1e-8], OPS)[0].tolist()
        assert got[5] == nans, (n, got)
        want = ref(x, 1e-8)
        assert got[4] == pytest.approx(want[4], abs=1e-7), (n, got, want)
        if nans:
            assert math.isnan(got[0]) and math.isnan(got[1])
        else:
            finite = x[torch.isfinite(x)]
            assert got[0] == x.min().item() and got[1] == x.max().item(), (got, finite.min(), finite.max())
            if math.isfinite(want[2]) and want[2] < 1e38:
                assert close(got[2], want[2], 1e-5) and close(got[3], want[3], 1e-5), (n, got, want)


def test_dtypes_layouts_and_op_subsets():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 33, generator=g)
    xs = [base.t(), base[::2, 1:], base.to(torch.float16), torch.randint(-3, 4, (50,), generator=g),
          torch.rand(30, generator=g) > 0.5]
    assert_rows(fused.stats(xs, [0.25] * len(xs), OPS), xs, 0.25, rtol=1e-4)
    bf = [base.to(torch.bfloat16), (base * 2).to(torch.bfloat16)]  # all bfloat16: read as bfloat16
    assert_rows(fused.stats(bf, [0.25, 0.25], OPS), bf, 0.25, rtol=1e-4)
    sub = fused.stats([base], [0.25], ("zeros", "max"))
    assert sub.tolist() == [[pytest.approx(ref(base, 0.25)[4]), base.max().item()]]


def test_scales():
    x = torch.tensor([0.0, 1e-4, -2e-3, 5.0])
    got = fused.stats([x], [1e-3 / 3.0], OPS, scales=[3.0])[0].tolist()
    want = ref(x * 3.0, 1e-3)
    assert all(close(a, b) for a, b in zip(got, want, strict=True)), (got, want)


def test_engine_norms_are_bitwise_the_compute_norms():
    """The reduced-gradient reuse compares a recomputed norm with the recorded one for equality."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(n, generator=g) for n in (10, 300_000, 5000)]
    eng = StatsEngine(OPS)
    rows = eng.compute(xs)
    assert torch.equal(eng.norms(xs[1:2]), rows[1:2, OPS.index("norm")])
    assert torch.equal(eng.norms(xs), rows[:, OPS.index("norm")])


def test_engine_norms_of_complex_tensors_are_those_of_compute():
    """A complex gradient (an FFT layer's weight): its norm is the complex tensor's, as compute() gives
    it; a cast kept the real parts, with a torch UserWarning inside the optimizer step hook (under
    warnings as errors, a failed hook and the step's reduced-gradient rows lost)."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.complex(torch.randn(50, generator=g), torch.randn(50, generator=g)), torch.randn(10, generator=g)]
    eng = StatsEngine(OPS)
    rows = eng.compute(xs)
    assert torch.equal(eng.norms(xs), rows[:, OPS.index("norm")])
    assert close(eng.norms(xs[:1]).item(), torch.linalg.vector_norm(xs[0]).item())


def stepped_adam_state(n: int = 5000, zero_rows: bool = True):
    g = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    q = torch.nn.Parameter(torch.randn(40, 7, generator=g))
    opt = torch.optim.AdamW([p, q], lr=1e-2, betas=(0.8, 0.95))
    for k in range(3):
        loss = (p * torch.randn(n, generator=g)).sum() + (q**2).sum() * k
        loss.backward()
        if zero_rows:
            p.grad[:100] = 0.0  # never a gradient: exp_avg_sq stays exactly 0 there
        opt.step()
        opt.zero_grad()
    return opt, [p, q]


@pytest.mark.parametrize("mv,ur", [(True, True), (True, False), (False, True)])
def test_adam_rows_equal_the_torch_path(mv, ur):
    opt, params = stepped_adam_state()
    entries = optim.AdamState(opt, opt).lookup(params)
    eng = StatsEngine(OPS)
    eng.fused = False
    m_rows = eng.compute([e[1] for e in entries])
    v_rows = eng.compute([e[2] for e in entries])
    upd, rat = adam_update.update_and_ratio(entries, eng.compute, True, True)
    got = adam_update.fused_adam_rows(entries, OPS, eng.eps, mv, ur)
    want = (m_rows if mv else None, v_rows if mv else None, upd if ur else None, rat if ur else None)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is None:
            continue
        # min/max/nans/zeros: the quotients are the same float32 values (same IEEE operations)
        for j in (0, 1, 4, 5):
            assert torch.equal(g[:, j], w[:, j]), (OPS[j], g[:, j], w[:, j])
        assert torch.allclose(g[:, 2], w[:, 2], rtol=1e-5, atol=0)  # norm
        # mean: float32 sums of both paths cancel differently; compare relative to the RMS value
        numel = torch.tensor([e[1].numel() for e in entries], dtype=torch.float32)
        assert ((g[:, 3] - w[:, 3]).abs() <= 1e-5 * w[:, 2] / numel.sqrt()).all(), (g[:, 3], w[:, 3])


@pytest.mark.skipif("avx2" not in fused.kernels(), reason="no AVX2 and FMA on this CPU")
@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("want", [(True, False), (False, True), (True, True)])
def test_the_avx2_adam_loop_gives_the_generic_loops_values(want, special):
    """The AVX2 Adam loop (two passes over each run of a block, NaNs counted where a sum is not finite,
    a block with an inf or NaN redone by the generic loop) against the generic loop: the same min, max,
    zero and NaN counts, the quotients being the same IEEE operations; sums within float rounding. Sizes
    around its 16-element steps, 512-element runs, 4096-element blocks and chunks."""
    g = torch.Generator().manual_seed(3)
    sizes = [1, 7, 15, 16, 17, 511, 513, 4095, 4096, 4097, 300_001]
    ms = [torch.randn(n, generator=g) * 1e-3 for n in sizes]
    vs = [torch.rand(n, generator=g) * 1e-6 for n in sizes]
    for m, v in zip(ms, vs, strict=True):
        v[: min(5, v.numel())] = 0.0  # ratio 0 where m is 0 too, else m / FLT_MIN
        m[: min(3, m.numel())] = 0.0
    if special:  # one in each block of the largest: a block with an inf or NaN is redone by the generic loop
        m, v = ms[-1], vs[-1]
        m[100] = float("nan")
        v[5000] = float("inf")
        v[9000], m[9000] = -1.0, 1e-30  # sqrt(-1): NaN, and so are update and ratio
        v[13000], m[13000] = float("nan"), 0.0
        m[17000] = float("inf")
        v[21000] = -0.0  # sqrt(-0.0) is -0.0: FLT_MIN
        ms[5][7], vs[6][8] = float("nan"), float("nan")
    n = len(sizes)
    args = (ms, vs, [1e-8] * 4 * n, [1e-8] * n, [1.0] * n, OPS, *want)
    with fused.using_kernel("generic"):
        want_rows = fused.adam(*args)
    with fused.using_kernel("avx2"):
        got = fused.adam(*args)
    blocks = [k for k, on in ((0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])) if on]
    for k in blocks:
        w, a = want_rows[:, k], got[:, k]
        for j in (0, 1, 4, 5):  # min, max, zeros, nans
            assert torch.equal(w[:, j].nan_to_num(7.0), a[:, j].nan_to_num(7.0)), (k, OPS[j], w[:, j], a[:, j])
        assert torch.allclose(a[:, 2], w[:, 2], rtol=1e-5, equal_nan=True)  # norm
        assert torch.allclose(a[:, 3], w[:, 3], rtol=1e-4, atol=1e-9, equal_nan=True)  # mean
    if special:
        assert (got[-1, blocks, 5] > 0).any()  # the NaNs were counted


def test_adam_nan_in_state_shows_and_zero_v_gives_ratio_zero():
    opt, params = stepped_adam_state()
    st = opt.state[params[0]]
    st["exp_avg"][7] = float("nan")
    entries = optim.AdamState(opt, opt).lookup(params)
    m, v, u, r = adam_update.fused_adam_rows(entries, OPS, 1e-8, True, True)
    nans = OPS.index("nans")
    assert m[0, nans] == 1 and v[0, nans] == 0 and u[0, nans] == 1 and r[0, nans] == 1
    st["exp_avg"][7] = 0.0
    entries = optim.AdamState(opt, opt).lookup(params)
    _, _, _, r = adam_update.fused_adam_rows(entries, OPS, 1e-8, True, True)
    assert r[0, nans] == 0  # v == 0 rows: ratio 0, not 0/0


def test_bad_arguments_are_errors_not_crashes():
    from array import array

    x = torch.ones(4)
    out = torch.empty((1, 2), dtype=torch.float32).numpy()
    addr, numel, one = array("Q", [x.data_ptr()]), array("q", [4]), array("d", [1.0])
    with pytest.raises(ValueError, match="numels"):
        fused._fused.stats(0, addr, array("q", [4, 4]), one, one, b"\x00\x01", out, 1)
    with pytest.raises(ValueError, match="op code"):
        fused._fused.stats(0, addr, numel, one, one, b"\x00\x09", out, 1)
    with pytest.raises(ValueError, match="out"):
        fused._fused.stats(0, addr, numel, one, one, b"\x00\x01\x02", out, 1)
    with pytest.raises(ValueError, match="kind"):
        fused._fused.stats(7, addr, numel, one, one, b"\x00\x01", out, 1)
    with pytest.raises(ValueError, match="address 0"):  # a tensor without storage (DTensor) crashed before
        fused._fused.stats(0, array("Q", [0]), numel, one, one, b"\x00\x01", out, 1)
    with pytest.raises(ValueError, match="address 0"):
        fused._fused.adam(3, array("Q", [0]), addr, numel, array("d", [1.0] * 4), one, one, b"\x00",
                          torch.empty((1, 4, 1), dtype=torch.float32).numpy(), 1)
    fused._fused.stats(0, addr, numel, one, one, b"\x00\x01", out, 1)
    assert out.tolist() == [[1.0, 1.0]]


def test_hook_fast_path_equals_general_path_and_declines_the_rest():
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(8, 32, 64, generator=g), torch.randn(300_000, generator=g)]
    fast = fused.stats_f32(xs, 1e-3, fused.op_codes(OPS))
    assert torch.equal(fast, fused.stats(xs, [1e-3, 1e-3], OPS))
    scaled = fused.stats_f32(xs, 1e-3, fused.op_codes(OPS), [2.0, 0.5])
    assert torch.equal(scaled, fused.stats(xs, [1e-3 / 2.0, 1e-3 / 0.5], OPS, [2.0, 0.5]))
    x = xs[0]
    for other in (x.double(), x.to(torch.bfloat16), torch.ones(3, dtype=torch.int64)):
        assert fused.stats_f32([x, other], 1e-3, fused.op_codes(OPS)) is None
    # None, empty and non-contiguous tensors stay on the fast path, with the general path's results
    eng = StatsEngine(OPS, 1e-3)
    mixed = [None, x, x.transpose(0, 1), torch.empty(0), None]
    general = eng._compute(mixed)
    got = fused.stats_f32(mixed, 1e-3, fused.op_codes(OPS))
    same = [0, 1, 3, 4]
    assert torch.allclose(got[same], general[same], equal_nan=True, rtol=0, atol=0)  # bit for bit
    assert torch.equal(got[1], fast[0]) and all(torch.isnan(got[i]).all() for i in (0, 3, 4))
    assert torch.allclose(got[2], fast[0], rtol=1e-5, atol=1e-6)  # x's block, summed in another order
    sc = fused.stats_f32([None, x, x.transpose(0, 1)], 1e-3, fused.op_codes(OPS), [1.0, 2.0, 0.5])
    assert torch.equal(sc[1:], eng._compute([x, x.transpose(0, 1)], [2.0, 0.5]))


@pytest.mark.skipif(fused._stats_tensors is None, reason="the kernel was built without stats_tensors")
def test_tensor_entry_equals_the_python_loop(monkeypatch):
    """``_fused.stats_tensors`` (the tensors themselves to C) gives what the Python loop over data addresses
    gives, and declines (False, nothing written) what that loop copies, converts or refuses."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 32, 64, generator=g)
    p = torch.nn.Parameter(torch.randn(300_000, generator=g))
    cases = [[x, p], [None, x, torch.empty(0), None], [x, x[:, :, ::2]], [p, x.double()],
             [x, torch.ones(3, dtype=torch.int64)], [torch.empty(0)], []]
    codes = fused.op_codes(OPS)
    fast = [fused.stats_f32(c, 1e-3, codes, numpy=True) for c in cases]
    monkeypatch.setattr(fused, "_stats_tensors", None)
    slow = [fused.stats_f32(c, 1e-3, codes, numpy=True) for c in cases]
    for c, a, b in zip(cases, fast, slow, strict=True):
        assert (a is None) == (b is None), c
        if a is not None:
            assert a.shape == b.shape == (len(c), len(OPS))
            assert (a.tobytes() == b.tobytes()), c  # bit for bit, NaN rows included

    # a permutation of a contiguous block (batch_first attention output, a weight's .t()) is measured
    # where it lies, without the copy the loop makes: the same values, summed in another order
    for perm in (x.transpose(0, 1), x.permute(2, 0, 1), p.detach().view(600, 500).t()):
        assert not perm.is_contiguous()
        got = fused.stats_f32([perm], 1e-3, codes, numpy=True)
        want = fused.stats_f32([perm.contiguous()], 1e-3, codes, numpy=True)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-7), perm.shape

    class Sub(torch.Tensor):
        pass

    out = torch.full((2, len(OPS)), 7.0).numpy()
    args = (1e-3, codes, fused._PLAIN, torch.float32, out, fused.PARALLEL_NUMEL, 1)
    assert fused._fused.stats_tensors([x, x.as_subclass(Sub)], *args) is False
    assert fused._fused.stats_tensors([x, x[:, :, ::2]], *args) is False
    assert (out == 7.0).all()  # declined: nothing written
    assert fused._fused.stats_tensors((x, p), *args) is True and not (out == 7.0).any()
    with pytest.raises(ValueError, match="out"):
        fused._fused.stats_tensors([x], 1e-3, codes, fused._PLAIN, torch.float32, out, 1, 1)
    with pytest.raises(ValueError, match="op code"):
        fused._fused.stats_tensors([x, p], 1e-3, b"\x09", fused._PLAIN, torch.float32, out[:, :1].copy(), 1, 1)
    with pytest.raises(TypeError, match="sequence"):
        fused._fused.stats_tensors(5, *args)


@pytest.mark.skipif(fused._stats_tensors is None, reason="the kernel was built without stats_tensors")
@pytest.mark.parametrize("threads", [1, 3])
def test_fingerprints_are_the_first_min_and_max_elements(monkeypatch, threads):
    """``extremes``: per tensor the memory index of its first min and first max element (torch's argmin
    and argmax), their values, and the sum of its sample's bit patterns (16 elements from every 256th),
    across blocks (4096), chunks (262144) and threads; none for None, empty, NaN or infinite tensors,
    tensors under 64K elements, nor where the general path measured (a scale, a copy)."""
    monkeypatch.setattr(fused, "PARALLEL_NUMEL", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(11)
    sizes = [65536, 65537, 4096 * 17 - 1, 262145, 3 * 262144 + 11]
    xs = [torch.randn(n, generator=g) for n in sizes]
    xs[1][-1] = 9.0  # the max in the last block's tail
    xs[2][4096 * 16 + 5] = -9.0  # the min in the last, short block
    ties = torch.randint(-3, 4, (600_000,), generator=g).float()  # every value many times, in every chunk
    big = torch.randn(700, 900, generator=g)
    nan, inf = torch.randn(70_000, generator=g), torch.randn(70_000, generator=g)
    nan[4500], inf[17] = float("nan"), float("inf")
    cases = xs + [ties, big.t(), None, torch.empty(0), nan, inf, torch.randn(65535, generator=g)]
    ext = np.empty((len(cases), fused.FINGERPRINT_COLUMNS))
    fused.stats_f32(cases, 1e-8, fused.op_codes(OPS), numpy=True, extremes=ext)

    def expected(flat):
        bits = flat.numpy().view(np.uint32).astype(np.uint64)
        runs = [bits[i:i + 16].sum() for i in range(0, len(bits), 256)]
        sample = int(sum(int(r) for r in runs)) & ((1 << 52) - 1)
        return [flat.argmin().item(), flat.argmax().item(), flat.min().item(), flat.max().item(), float(sample)]

    for k, x in enumerate(xs + [ties]):
        assert ext[k].tolist() == expected(x.reshape(-1))
    # the transpose is measured where it lies: indices and sample in memory order
    assert ext[len(xs) + 1].tolist() == expected(big.reshape(-1))
    for k in range(len(xs) + 2, len(cases)):
        assert ext[k, 0] == ext[k, 1] == -1 and np.isnan(ext[k, 2:]).all(), cases[k]
    scaled = np.zeros((2, fused.FINGERPRINT_COLUMNS))
    fused.stats_f32(xs[:2], 1e-8, fused.op_codes(OPS), [2.0, 2.0], numpy=True, extremes=scaled)
    assert (scaled[:, :2] == -1).all()


@pytest.mark.skipif(fused._stats_tensors is None, reason="the kernel was built without stats_tensors")
def test_unchanged_sees_scaling_and_writes_at_the_extremes():
    """:func:`fused.unchanged` reads the two elements back: untouched tensors pass; AMP's unscale (which
    leaves the version counter as it was), any scaling, and a write at an extreme element fail; so do
    tensors without fingerprints and tensors the kernel does not take."""
    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(300, 700, generator=g) for _ in range(6)] + [torch.randn(4, generator=g), None]
    ext = np.empty((len(xs), fused.FINGERPRINT_COLUMNS))
    fused.stats_f32(xs, 1e-8, fused.op_codes(OPS), numpy=True, extremes=ext)
    assert fused.unchanged(xs, ext) == b"\x01" * 6 + b"\x00\x00"  # the small one has no fingerprint
    v = xs[0]._version
    torch._amp_foreach_non_finite_check_and_unscale_([xs[0]], torch.zeros(1), torch.full((1,), 0.5))
    assert xs[0]._version == v  # unseen by the version counter
    xs[1].numpy()[...] *= 1.0000001  # the smallest change float32 keeps
    flat = xs[2].numpy().reshape(-1)
    flat[flat.argmax()] = 0.0
    xs[3].view(-1)[int(ext[3, 0])] = 0.0  # the min
    got = fused.unchanged(xs[:4] + [xs[4].double(), xs[5]], ext[:6])
    assert got == b"\x00\x00\x00\x00\x00\x01"
    assert fused.unchanged([xs[4]], np.full((1, fused.FINGERPRINT_COLUMNS), -1.0)) == b"\x00"
    with pytest.raises(ValueError, match="extremes"):
        fused.unchanged(xs, ext[:2])
    with pytest.raises(ValueError, match="extremes"):  # a row layout of an older build
        fused.unchanged(xs[:2], ext[:2, :4].copy())


@pytest.mark.skipif(not fused.FINGERPRINTS, reason="the kernel was built without fingerprints")
@pytest.mark.parametrize("threads", [1, 2])
def test_unchanged_sees_dense_writes_away_from_the_extremes(monkeypatch, threads):
    """The sample (16 elements from every 256th, one cache line per KiB) catches what the extremes
    miss: a row of 256 zeroed or masked anywhere, a small shift of every element, a single element in a
    sampled line; a lone element outside the sample and away from the extremes is the documented blind
    spot (a write through ``.data`` or numpy: the version counter sees the others)."""
    monkeypatch.setattr(fused, "PARALLEL_NUMEL", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(13)
    xs = [torch.randn(1024, 256, generator=g) for _ in range(5)]
    ext = np.empty((len(xs), fused.FINGERPRINT_COLUMNS))
    fused.stats_f32(xs, 1e-8, fused.op_codes(OPS), numpy=True, extremes=ext)
    assert fused.unchanged(xs, ext) == b"\x01" * len(xs)
    away = {int(ext[k, 0]) // 256 for k in range(len(xs))} | {int(ext[k, 1]) // 256 for k in range(len(xs))}
    row = next(r for r in range(500, 1024) if r not in away)
    xs[0].numpy()[row] = 0.0  # a token's row of an embedding's gradient, through numpy
    flat = xs[1].numpy().reshape(-1)
    flat[1000:1300] = 0.0  # 300 consecutive elements straddling two sampled lines' gaps
    xs[2].numpy()[...] += np.float32(1e-3)  # dense: every element, the extremes shift too
    lone = next(i for i in range(256 * 300 + 3, 256 * 400) if i % 256 >= 16 and i not in ext[3, :2])
    xs[3].numpy().reshape(-1)[lone] = 0.0  # outside the sample
    sampled = next(i for i in range(256 * 300 + 5, 256 * 400, 256) if i not in ext[4, :2])
    xs[4].numpy().reshape(-1)[sampled] *= 2  # inside it
    assert fused.unchanged(xs, ext) == b"\x00\x00\x00\x01\x00"


def _negative_views():
    """Tensors whose memory holds minus their values (``is_neg()``), as public code makes them
    (``z.conj().imag``) and as torch's own ``_neg_view`` does (a contiguous one, which the kernel took,
    and a transpose of one, a permutation of a contiguous block it measured in place)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(300, 70, generator=g) + 0.5  # min, max and mean all change sign when negated
    z = torch.complex(torch.randn(5000, generator=g), torch.randn(5000, generator=g) + 1.0)
    views = [torch._neg_view(x), torch._neg_view(x).t(), z.conj().imag, torch._neg_view(x.to(torch.bfloat16)),
             torch._neg_view(x.half())]
    assert all(v.is_neg() for v in views)
    return x, views


@pytest.mark.skipif(fused._stats_tensors is None, reason="the kernel was built without stats_tensors")
def test_negative_views_are_measured_by_the_torch_path():
    """A negative view (``x.conj().imag``, a gradient a custom backward gave as ``torch._neg_view``) went to
    the kernel, which read its memory, so its min, max and mean came out negated (min and max swapped).
    The kernel's entries decline it, one ``is_neg()`` per tensor, and the engine measures it with torch's
    reductions, also in a batch with tensors of its dtype that are no such view."""
    x, views = _negative_views()
    codes = fused.op_codes(OPS)
    out = np.full((2, len(OPS)), 7.0, dtype=np.float32)
    assert fused._fused.stats_tensors([x, views[0]], 1e-3, codes, fused._PLAIN, torch.float32, out,
                                      fused.PARALLEL_NUMEL, 1) is False
    assert (out == 7.0).all()  # declined: nothing written
    assert fused.stats_f32([x, views[0]], 1e-3, codes) is None
    assert fused.stats_f32([views[1]], 1e-3, codes, [2.0]) is None  # the Python loop (scales) declines too
    assert not any(map(fused.supports, views)) and fused.supports(x)
    eng = StatsEngine(OPS, 1e-3)
    batch = [x, *views, -x]
    assert_rows(torch.as_tensor(eng.rows(batch)), batch, 1e-3, rtol=1e-3)  # (bfloat16 and float16 views)
    assert_rows(eng.compute(views[:2]), views[:2], 1e-3)  # a batch of float32 negative views alone
    assert torch.equal(eng.norms(views[:1]), eng.compute(views[:1])[:, OPS.index("norm")])
    # a fingerprint taken of x is no fingerprint of the negative view of x's memory
    big = torch.randn(300, 700, generator=torch.Generator().manual_seed(22))
    ext = np.empty((1, fused.FINGERPRINT_COLUMNS))
    fused.stats_f32([big], 1e-8, codes, numpy=True, extremes=ext)
    assert fused.unchanged([big], ext) == b"\x01" and fused.unchanged([torch._neg_view(big)], ext) == b"\x00"


@pytest.mark.parametrize(("var", "value"), [("TRAINREC_THREADS", "pthread"), ("TRAINREC_REUSE_UNCHANGED_GRADS", "yes"),
                                            ("TRAINREC_FUSED", "off")])
def test_an_environment_switch_with_a_value_it_does_not_take_is_a_warning(var, value):
    """TRAINREC_THREADS=pthread (for pthreads) or TRAINREC_REUSE_UNCHANGED_GRADS=yes (for 1) were ignored
    without a word: the run went on with the default the user meant to change."""
    import subprocess
    import sys

    env = {**os.environ, var: value}
    proc = subprocess.run([sys.executable, "-c", "import trainrec.recorder.grad_batch"], env=env, capture_output=True,
                          text=True, check=True)
    assert f"trainrec: {var}={value!r} is not one of its values" in proc.stderr
    assert "ignored" in proc.stderr


def test_environment_switches_with_their_values_are_quiet():
    import subprocess
    import sys

    env = {**os.environ, "TRAINREC_THREADS": "pthreads", "TRAINREC_REUSE_UNCHANGED_GRADS": "1", "TRAINREC_FUSED": "1"}
    proc = subprocess.run([sys.executable, "-c", "import trainrec.recorder.grad_batch"], env=env, capture_output=True,
                          text=True, check=True)
    assert "TRAINREC_" not in proc.stderr
