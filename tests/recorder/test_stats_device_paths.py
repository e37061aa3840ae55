"""StatsEngine paths that matter on accelerators, exercised on CPU tensors.

Mixed-dtype / None batches are reassembled in order without an index tensor (no host-to-device copy
inside hooks), and ``host_paths = False`` runs the code a CUDA tensor takes (no CPU fast paths, NaN
counts only when requested) on CPU so its results can be checked against float64 references here.
"""

from __future__ import annotations

import math

import torch
from test_stats_engine import OPS
from trainrec.recorder.stats import StatsEngine


def same_row(got: list[float], want: list[float]) -> bool:
    return all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, want, strict=True))


def test_mixed_dtypes_and_none_keep_their_order(monkeypatch):
    eng = StatsEngine(OPS, 1e-8)
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
