"""StatsEngine: each op equals an independent float64 computation, for every dtype and layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from trainrec.recorder import fused
from trainrec.recorder.stats import SMALL_NUMEL, StatsEngine
from trainrec.recorder.step_stats import StatsPart, StepStats, build_stats_events, placeholders
from trainrec.schema.events import unpack_array

OPS = ("min", "max", "norm", "mean", "zeros", "nans")


def ref(t: torch.Tensor, eps: float) -> list[float]:
    d = t.detach().to(torch.float64)
    return [d.min().item(), d.max().item(), d.norm().item(), d.mean().item(),
            (d.abs() < eps).double().mean().item(), float(torch.isnan(d).sum())]


KERNELS = ["fused", "torch"]


def engine(ops, eps: float = 1e-8, kernel: str = "fused") -> StatsEngine:
    """A StatsEngine on the one-pass kernel or on the torch reductions (CPU)."""
    if kernel == "fused" and not fused.AVAILABLE:
        pytest.skip("the one-pass kernel (recorder/_fused.c) is not built")
    eng = StatsEngine(ops, eps)
    eng.fused = kernel == "fused"
    return eng


def close(a: float, b: float, rtol: float = 1e-4) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    return abs(a - b) <= 1e-6 + rtol * abs(b)


def cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 70, generator=g)
    x[x.abs() < 0.3] = 0
    big = torch.randn(SMALL_NUMEL + 5, generator=g) * 1e-9  # runs with the intra-op pool; many |x| < eps
    return [
        ("f32", x),
        ("f32 transposed", x.t()),
        ("f32 slice", x[::3, 5:]),
        ("f32 big", big),
        ("f64", torch.randn(50, generator=g, dtype=torch.float64)),
        ("bf16", torch.randn(1000, generator=g).to(torch.bfloat16)),
        ("f16", torch.randn(1000, generator=g).to(torch.float16)),
        ("int64 tokens", torch.randint(0, 50, (4, 9), generator=g)),
        ("bool", torch.rand(40, generator=g) > 0.5),
        ("scalar", torch.tensor(3.5)),
        ("inf", torch.tensor([1.0, float("inf"), 0.0])),
        ("nan", torch.tensor([1.0, float("nan"), 0.0, float("nan"), 2e-9])),
    ]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("eps", [1e-8, 0.25])
def test_every_op_matches_float64_reference(eps, kernel):
    eng = engine(OPS, eps, kernel)
    rows = assert_cases_match_float64(eng, eps)
    assert rows.dtype is torch.float32 and rows.shape == (len(cases()), 6)


def assert_cases_match_float64(eng: StatsEngine, eps: float) -> torch.Tensor:
    """``eng``'s rows for :func:`cases` equal :func:`ref` (float64) op by op; returns the rows."""
    named = cases()
    rows = eng.compute([t for _, t in named])
    for (name, t), row in zip(named, rows.tolist(), strict=True):
        for op, got, want in zip(OPS, row, ref(t, eps), strict=True):
            if name == "inf" and op in ("norm", "mean", "max"):
                assert got == math.inf, (name, op)
                continue
            rtol = 1e-2 if name in ("bf16", "f16") and op in ("norm", "mean") else 1e-4
            assert close(got, want, rtol), f"{name} {op}: {got} vs {want}"
    return rows


@pytest.mark.parametrize("kernel", KERNELS)
def test_none_and_empty_give_nan_rows_and_only_requested_ops(kernel):
    eng = engine(("max", "zeros"), 1e-8, kernel)
    rows = eng.compute([None, torch.empty(0), torch.tensor([0.0, 2.0])])
    assert torch.isnan(rows[:2]).all()
    assert rows[2].tolist() == [2.0, 0.5]


@pytest.mark.parametrize("kernel", KERNELS)
def test_scales_give_statistics_of_the_scaled_tensor(kernel):
    eng = engine(OPS, 1e-3, kernel)
    x = torch.tensor([0.0, 1e-4, -2e-3, 5.0])
    got = eng.compute([x], scales=[3.0])[0].tolist()
    want = ref(x * 3.0, 1e-3)
    assert all(close(a, b) for a, b in zip(got, want, strict=True)), (got, want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_thread_count_is_restored(kernel):
    before = torch.get_num_threads()
    engine(OPS, kernel=kernel).compute([torch.randn(10), torch.randn(SMALL_NUMEL), torch.randn(10)])
    assert torch.get_num_threads() == before


def test_step_stats_one_host_matrix_and_events_per_kind():
    eng = StatsEngine(("norm", "max"))
    st = StepStats(("norm", "max"))
    st.add(StatsPart("param", eng.compute([torch.ones(4)]), [3], (), (), (), [1]))
    st.add(StatsPart("actv", eng.compute([torch.ones(1), torch.zeros(2)]), [0, 1], (0, 1), (7, 8), (1, 2), (0, 0)))
    st.add(StatsPart("param", eng.compute([torch.full((9,), 2.0)]), [4], (), (), (), [0]))
    hs = st.finish(step=5)
    assert [k for k, _, _ in hs.kinds] == ["actv", "param"]
    import numpy as np

    evs = build_stats_events(hs, rank=2, file_ids=np.array([10, 11, 12, 13, 14], dtype=np.uint32), wall=1.0)
    actv, param = evs
    assert (actv.kind, actv.step, actv.rank, len(actv)) == ("actv", 5, 2, 2)
    assert list(unpack_array("I", actv.name_ids)) == [10, 11]
    assert list(actv.column("call_ids")) == [7, 8] and list(actv.column("slots")) == [1, 2]
    assert list(param.column("call_ids")) == [-1, -1] and list(param.column("vpp_stages")) == [1, 0]
    assert list(param.value_array()) == [2.0, 1.0, 6.0, 2.0]


@pytest.mark.parametrize("kernel", KERNELS)
def test_step_stats_take_the_hooks_numpy_rows_with_tensor_rows(kernel):
    """Module hooks hand the kernel's numpy rows straight to the step (``StatsEngine.rows``); other
    parts are tensors: the step's matrix holds both, in kind order, with the values compute() gives."""
    eng = engine(("norm", "max", "nans"), kernel=kernel)
    xs = [torch.randn(300), torch.full((7,), -2.0)]
    rows = eng.rows([xs[0], None, xs[1]])
    assert isinstance(rows, np.ndarray) == (kernel == "fused")
    st = StepStats(eng.ops)
    st.add(StatsPart("param", eng.compute([torch.ones(4)]), [3], (), (), (), [0]))
    st.add(StatsPart("actv", rows, [0, 1, 2], (0, 0, 0), (1, 1, 2), (1, 2, 1), (0, 0, 0)))
    hs = st.finish(step=1)
    assert [k for k, _, _ in hs.kinds] == ["actv", "param"] and hs.values.dtype is torch.float32
    want = eng.compute([xs[0], None, xs[1]])
    assert torch.allclose(hs.values[:3], want, rtol=0, atol=0, equal_nan=True)  # bit for bit
    assert torch.isnan(hs.values[1]).all() and hs.values[2].tolist() == [np.float32(math.sqrt(28.0)), -2.0, 0.0]
    assert hs.values[3].tolist() == [2.0, 1.0, 0.0]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("kernel", KERNELS)
def test_sparse_tensors_give_the_dense_tensors_statistics(kernel):
    """COO (with repeated indices and dense dims), CSR, all-zero and empty sparse tensors, mixed with
    dense ones, from their stored values alone."""
    eng = engine(OPS, 1e-3, kernel)
    g = torch.Generator().manual_seed(3)

    def coo(idx, vals, size):
        return torch.sparse_coo_tensor(idx, vals, size, check_invariants=True)

    empty_idx = torch.zeros((1, 0), dtype=torch.long)
    xs = [coo([[0, 2, 2]], [1.0, -3.0, 0.5], (5,)),
          torch.randn(7, generator=g),
          coo([[1, 3]], torch.randn(2, 4, generator=g), (6, 4)),
          coo(empty_idx, torch.zeros(0), (3,)),
          torch.randn(4, 5, generator=g).relu().to_sparse_csr(),
          coo(empty_idx, torch.zeros(0), (0,)),
          coo([[0, 1]], [float("nan"), 2.0], (4,))]
    got = eng.compute(xs)
    for i, x in enumerate(xs):
        if x.numel() == 0:
            assert torch.isnan(got[i]).all()
            continue
        for k, (op, want) in enumerate(zip(OPS, ref(x.to_dense(), 1e-3), strict=True)):
            assert close(got[i, k].item(), want, 1e-5), (i, op, got[i, k].item(), want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_complex_tensors_are_measured_by_their_magnitudes(kernel):
    """A complex activation (an FFT layer's): the statistics of |x|, whose norm is the complex tensor's
    own (a cast to float32 kept the real parts only, with a torch warning and no word from us)."""
    eng = engine(OPS, 1e-3, kernel)
    g = torch.Generator().manual_seed(5)
    xs = [torch.complex(torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)),
          torch.tensor([3 + 4j, 0j, complex("nan+1j")], dtype=torch.complex128),
          torch.randn(4, generator=g)]
    got = eng.compute(xs)
    for i, x in enumerate(xs):
        want = ref(x.abs() if x.is_complex() else x, 1e-3)
        for k, op in enumerate(OPS):
            assert close(got[i, k].item(), want[k], 1e-5), (i, op, got[i, k].item(), want[k])
    assert close(got[0, OPS.index("norm")].item(), torch.linalg.vector_norm(xs[0]).item(), 1e-5)


@pytest.mark.parametrize("ops", [OPS, ("norm",), ("nans", "min", "mean")])
def test_combined_part_rows_equal_the_whole_tensors_row(ops):
    """StatsEngine.combine (a large main_grad + .grad measured in parts): the parts' rows give the
    whole tensor's row, NaN in one part included."""
    g = torch.Generator().manual_seed(5)
    eng = StatsEngine(ops, 1e-3)
    x = torch.randn(1000, generator=g)
    x[::9] = 0.0
    for t in (x, torch.cat([x, torch.tensor([float("nan")])])):
        sizes = [300, 300, 300, t.numel() - 900]
        parts = torch.cat([eng.compute([p]) for p in t.split(sizes)])
        got = eng.combine(parts, sizes)[0].tolist()
        want = eng.compute([t])[0].tolist()
        for op, a, b in zip(ops, got, want, strict=True):
            if math.isnan(b):
                assert math.isnan(a), (op, a, b)
            else:
                assert a == pytest.approx(b, rel=1e-5, abs=1e-7), (op, a, b)


@pytest.mark.parametrize("kernel", KERNELS)
def test_norm_of_finite_values_past_float32_range_when_squared_is_not_inf(kernel):
    """An exploding gradient: finite float32 values above 1.8e19, whose squares leave float32's range.
    The norm was inf (nans 0) on both paths, an inf the tensor does not hold; a real inf stays inf."""
    g = torch.Generator().manual_seed(3)
    huge = torch.randn(10_000, generator=g) * 8e19
    mixed = torch.cat([torch.randn(5_000, generator=g), huge[:7]])  # a few huge values among normal ones
    with_inf = torch.cat([huge[:100], torch.tensor([float("inf")])])
    eng = engine(OPS, 1e-8, kernel)
    rows = eng.compute([huge, mixed, with_inf, huge.view(100, 100).t()])
    for t, row in zip([huge, mixed, with_inf, huge.view(100, 100).t()], rows.tolist(), strict=True):
        want = ref(t, 1e-8)
        assert all(a == b if math.isinf(b) else close(a, b) for a, b in zip(row, want, strict=True)), (row, want)
    assert math.isinf(rows[2, OPS.index("norm")])


@pytest.mark.parametrize("kernel", KERNELS)
def test_placeholders_mark_the_nan_rows_of_no_tensor(kernel):
    """The rows of None and empty tensors (and of those the engine failed on, ``failed``) are NaN rows
    that stand for no values: marked, so that a tensor holding NaN is told from them; a batch whose rows
    the kernel gave without a NaN is settled by one check, without a look at each tensor (the torch
    path's rows, which may be on a device, are not read)."""
    eng = engine(OPS, kernel=kernel)
    x, nan = torch.randn(50), torch.full((7,), math.nan)
    batch = [x, None, torch.empty(0, 3), nan]
    rows = eng.rows(batch)
    assert np.isnan(np.asarray(rows)[1:]).any(axis=1).all()
    assert placeholders(batch, rows) == (False, True, True, False)
    assert placeholders(batch) == (False, True, True, False)  # without rows: from the tensors alone
    assert placeholders([x, nan], eng.rows([x, nan])) == ()
    assert placeholders([x, nan], failed=[0]) == (True, False)

    class Untouchable(list):  # the tensors are not looked at where the rows settle it
        def __iter__(self):
            raise AssertionError("looked at each tensor")

    if kernel == "fused":
        assert placeholders(Untouchable([x, x]), eng.rows([x, x])) == ()
