"""The CSV export's number formatting alone: ``csv_format.value_chars`` on float32 statistics, as the
export renders them (the text the reference's pandas writer gives, after the float32 values are taken
as their shortest decimals where ``ndigits`` goes past float32's precision).

    .venv/bin/python benchmarks/bench_csv_text.py [--values 1000000] [--repeat 5]

Prints ms per million values, best of ``--repeat``, for ndigits 6 (the reference's default) and 12 (its
documented example), on values spread over 10**-3..10**3 (norms, means, extremes of a model's tensors).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from trainrec.analyzers.csv_format import value_chars


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--values", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n = args.values
    v = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
    for nd in (6, 12):
        best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            value_chars(v, nd)
            best = min(best, time.perf_counter() - t)
        print(f"ndigits {nd:2d}: {best * 1e3 / (n / 1e6):.0f} ms per million float32 values (best of {args.repeat})")


if __name__ == "__main__":
    main()
