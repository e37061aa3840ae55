"""The ``-j`` workers keep their heap (:func:`trainrec.tools.partition._steady_heap`): a block-sized numpy
temporary allocated and freed again and again is served from the heap, not faulted in anew each time."""

from __future__ import annotations

import platform
import resource

import numpy as np
import pytest
from trainrec.tools.partition import run_parts

BLOCK = 3 << 20  # bytes: about one block's temporary at the scale of the benchmark
HELD = 5  # temporaries alive at once


def faults_of_temporaries(rounds: int) -> int:
    """Minor page faults of ``rounds`` times HELD BLOCK-sized arrays alive at once, written, then freed
    (after a larger one freed: what raises glibc's dynamic thresholds in a process left to them)."""
    np.ones((4 << 20) // 8).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    total = 0.0
    for _ in range(rounds):
        held = [np.ones(BLOCK // 8) for _ in range(HELD)]
        total += sum(float(a.sum()) for a in held)
        del held
    assert total == rounds * HELD * (BLOCK // 8)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_workers_do_not_fault_their_temporaries_in_again():
    rounds = 50
    faults = run_parts(faults_of_temporaries, [(rounds,), (rounds,)], [1, 1], jobs=2, label="test", progress=False)
    pages = BLOCK // resource.getpagesize()
    # without the setting a worker trims its heap after each round and faults every page in again:
    # rounds * HELD * pages; with it, the first round's pages only
    assert all(f < 2 * HELD * pages for f in faults), (faults, pages)
