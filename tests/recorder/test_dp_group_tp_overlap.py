"""``dp_group`` over a tensor-parallel model whose DTensors live on the ``tp`` slice of a 2x2 mesh
only (4 real gloo processes): the dp dimension, or every rank, which overlaps the DTensors' mesh in
part. The gradients are averaged over dp by the training loop (as Megatron's own DDP would), so ranks
2 and 3 hold the same shards as ranks 0 and 1. The worker is test_ddp_tensor_parallel.py's."""

from __future__ import annotations

import pytest
from test_ddp_tensor_parallel import NAMES, STEPS, TP_REPLICATED, _check_values, _run
from trainmon_util import stats_table


@pytest.fixture(scope="module", params=["dp_dim", "world"])
def tp_dp_run(tmp_path_factory, request):
    return _run(tmp_path_factory, request.param)


def test_tp_shards_reduced_over_dp_kept_once_per_dp_group(tp_dp_run):
    """Tensor parallelism over pairs, gradients averaged over the dp dimension by the loop: ranks 2
    and 3 hold the same shards as ranks 0 and 1, whether ``dp_group`` is the dp dimension (the
    reference keeps dp rank 0's alone) or every rank (the README's rule: a shard held by several ranks
    of the group is kept by the first of them), so only ranks 0 and 1 record reduced gradients, each its
    own tp shard, the tp-replicated bias rank 0 alone. (Ranks 2 and 3 recorded the sharded ones too: a
    DTensor's shard was taken for this rank's alone whatever dimension it was sharded over.)"""
    run, want = tp_dp_run
    assert run.ranks == [0, 1, 2, 3]
    for r in run.ranks:
        table = stats_table(run.events(r), "grad_reduced")
        w = want[r]
        assert set(w["types"].values()) == {"DTensor"}
        keep = set() if w["dp"] else NAMES - (TP_REPLICATED if w["tp"] else set())
        for step in range(STEPS):
            assert {k[1] for k in table if k[0] == step} == keep, (r, step, sorted(k[1] for k in table))
        assert {k[1] for k in stats_table(run.events(r), "grad_unreduced")} == NAMES
    _check_values(run, want, "grad_reduced", "reduced")
    _check_values(run, want, "grad_unreduced", "unreduced")
    _check_values(run, want, "param", "param")
    for name in NAMES:  # the reduced shards of ranks 0 and 2 are one
        assert want[0]["steps"][0]["reduced"][name] == want[2]["steps"][0]["reduced"][name]
