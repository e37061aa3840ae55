"""StatsEngine paths that matter on accelerators, exercised on CPU tensors.

Mixed-dtype / None batches are reassembled in order without an index tensor (no host-to-device copy
inside hooks), and ``host_paths = False`` runs the code a CUDA tensor takes (no CPU fast paths, NaN
counts only when requested) on CPU so its results can be checked against float64 references here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree
from test_stats_engine import OPS, assert_cases_match_float64, close, engine, ref
from torch.utils._python_dispatch import TorchDispatchMode
from trainrec.recorder import torch_stats
from trainrec.recorder.stats import StatsEngine


def same_row(got: list[float], want: list[float]) -> bool:
    return all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("path", ["fused", "torch", "device"])
def test_mixed_dtypes_and_none_keep_their_order(path, monkeypatch):
    eng = engine(OPS, 1e-8, "torch" if path == "device" else path)
    eng.host_paths = path != "device"
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (4, 9), generator=g)
    emb = torch.randn(4, 9, 8, generator=g)
    f64 = torch.randn(30, generator=g, dtype=torch.float64)
    batch = [None, ids, emb, torch.empty(0), f64, emb * 2, None, ids + 1, torch.tensor([1.0, float("nan")])]

    made = []
    real_tensor = torch.tensor

    def spy(*args, **kwargs):  # an index tensor would be built with torch.tensor(list, device=...)
        made.append(kwargs.get("device"))
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", spy)
    rows = eng.compute(batch)
    monkeypatch.setattr(torch, "tensor", real_tensor)
    assert all(d is None for d in made), made
    assert rows.shape == (len(batch), len(OPS))
    for i, t in enumerate(batch):
        want = eng.nan_rows(1)[0].tolist() if t is None or t.numel() == 0 else eng.compute([t])[0].tolist()
        assert same_row(rows[i].tolist(), want), (i, rows[i].tolist(), want)


def test_only_none_and_empty():
    eng = StatsEngine(OPS)
    assert torch.isnan(eng.compute([None, torch.empty(0)])).all()
    assert eng.compute([]).shape == (0, len(OPS))


@pytest.mark.parametrize("eps", [1e-8, 0.25])
def test_device_path_matches_float64_reference(eps):
    eng = StatsEngine(OPS, eps)
    eng.host_paths = False
    assert_cases_match_float64(eng, eps)


@pytest.mark.parametrize("path", ["fused", "torch", "device"])
@pytest.mark.parametrize("ops", [("min", "max", "norm", "mean", "zeros"), ("zeros",), ("norm", "nans")])
def test_nan_counting_passes(path, ops, monkeypatch):
    """NaNs are counted only with "nans"; on CPU only for the tensors whose sum is not finite; the
    one-pass kernel counts them in its single read (no torch.isnan pass at all)."""
    eng = engine(ops, 0.25, "torch" if path == "device" else path)
    eng.host_paths = path != "device"
    host_paths = path == "torch"
    nan = torch.tensor([1.0, float("nan"), 0.1, float("nan")])
    xs = [torch.randn(100), nan, torch.zeros(7)]
    counted = []
    real_isnan = torch.isnan

    def spy(x):
        counted.append(x.numel())
        return real_isnan(x)

    monkeypatch.setattr(torch, "isnan", spy)
    rows = eng.compute(xs)
    monkeypatch.setattr(torch, "isnan", real_isnan)
    if "nans" not in ops or path == "fused":
        assert counted == []
    elif host_paths:
        assert counted == [4]
    else:
        assert sorted(counted) == [4, 7, 100]
    if "nans" in ops:
        assert rows[:, ops.index("nans")].tolist() == [0.0, 2.0, 0.0]
    if "zeros" in ops:
        zeros = rows[:, ops.index("zeros")].tolist()
        assert zeros[1:] == [0.25, 1.0]  # the NaNs are not zeros, 0.1 is


@pytest.mark.parametrize("path", ["torch", "device"])
@pytest.mark.parametrize("eps", [1e-8, 0.25])
def test_tensors_measured_in_parts_match_float64_reference(path, eps, monkeypatch):
    """Above PART_NUMEL elements the torch reductions measure a tensor in parts and combine their rows:
    the same statistics, for every dtype and layout (parts of 64 elements here)."""
    monkeypatch.setattr(torch_stats, "PART_NUMEL", 64)
    eng = engine(OPS, eps, "torch")
    eng.host_paths = path == "torch"
    assert_cases_match_float64(eng, eps)
    x = torch.tensor([0.0, 1e-4, -2e-3, 5.0] * 40)
    got = eng.compute([x], scales=[3.0])[0].tolist()
    want = ref(x * 3.0, eps)
    assert all(close(a, b) for a, b in zip(got, want, strict=True)), (got, want)


@pytest.mark.parametrize("shape_of", ["contiguous", "transposed", "strided slice", "row of a transpose"])
def test_parts_are_views_covering_every_element_once(shape_of):
    base = torch.randn(90, 70)
    x = {"contiguous": base, "transposed": base.t(), "strided slice": base[::2, 3:],
         "row of a transpose": base.t()[None, 5:10, :].transpose(1, 2)}[shape_of]
    parts = torch_stats.parts(x, 100)
    assert all(p.numel() <= 100 for p in parts)
    assert sum(p.numel() for p in parts) == x.numel()
    assert all(p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for p in parts)
    got = torch.cat([p.reshape(-1) for p in parts]).sort().values
    assert torch.equal(got, x.reshape(-1).sort().values)


class Allocations(TorchDispatchMode):
    """The largest tensor an op made with storage of its own (views of its inputs do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor) and a.layout is torch.strided}
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, o.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_device_path_temporaries_are_bounded_by_a_part(dtype, monkeypatch):
    """On the code accelerators take, no temporary of a whole large tensor: the zero count's quotient,
    a float16 tensor's float32 copy and the NaN mask are at most PART_NUMEL elements."""
    monkeypatch.setattr(torch_stats, "PART_NUMEL", 1000)
    eng = StatsEngine(OPS, 1e-3)
    eng.host_paths = False
    big = torch.randn(300, 200).to(dtype)
    big[7, 9] = float("nan")
    xs = [big, big.t(), torch.randn(50).to(dtype)]
    spy = Allocations()
    with spy:
        rows = eng.compute(xs)
    assert 0 < spy.largest <= 1000
    assert rows[:, OPS.index("nans")].tolist() == [1.0, 1.0, 0.0]
    unsplit = StatsEngine(OPS, 1e-3)
    unsplit.host_paths = False
    monkeypatch.setattr(torch_stats, "PART_NUMEL", 1 << 25)
    want = unsplit.compute(xs)
    for got_row, want_row in zip(rows.tolist(), want.tolist(), strict=True):
        assert all(close(a, b, 1e-2 if dtype is not torch.float32 else 1e-4) for a, b in zip(got_row, want_row,
                                                                                             strict=True))


def test_device_path_counts_a_few_zeros_among_more_than_2_24_elements():
    """The zero count of a tensor of more than 2**24 elements is exact before its one rounding to the
    float32 fraction: one zero in 20M elements is 5e-8, not the difference of two float32 counts (0)."""
    eng = StatsEngine(("zeros",), 1e-8)
    eng.host_paths = False
    n = 20_000_001
    x = torch.ones(n, dtype=torch.bfloat16)
    x[12345] = 0
    got = eng.compute([x])[0, 0].item()
    assert got == pytest.approx(1 / n, rel=1e-6)
