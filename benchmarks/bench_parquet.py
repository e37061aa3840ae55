"""Parquet export speed: `trainrec export parquet` on the export benchmark's synthesised run.

The run is bench_export's (STEPS steps x TENSORS tensors x 6 ops, two kinds, float32; written once
under ``.bench/export/`` and reused). Measured: the whole command as its own process (start-up, pyarrow
import and writing included), and the export itself in this process, per codec; values/s is exported
values (2 x STEPS x TENSORS x 6) over wall seconds. Then DuckDB reads the dataset back and sums a column.

    .venv/bin/python benchmarks/bench_parquet.py [--steps 1000] [--tensors 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time

from bench_export import synthesise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench", "export"))
    args = ap.parse_args()
    run_dir = os.path.join(args.work, f"run-{args.steps}x{args.tensors}")
    if not os.path.isdir(run_dir):
        synthesise(run_dir, args.steps, args.tensors)
    values = 2 * args.steps * args.tensors * 6
    log_mb = _size(run_dir) / 1e6
    print(f"run: {values / 1e6:.1f} M values, log {log_mb:.0f} MB")
    out = os.path.join(args.work, "parquet-out")
    trainrec = [sys.executable, "-m", "trainrec.tools.cli"]
    for codec in ("snappy", "none", "zstd"):
        best = cpu = None
        for _ in range(args.repeat):
            shutil.rmtree(out, ignore_errors=True)
            c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run([*trainrec, "export", "parquet", run_dir, "-o", out, "--compression", codec],
                           check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            used = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
            best = wall if best is None else min(best, wall)
            cpu = used if cpu is None else min(cpu, used)
        print(f"trainrec export parquet --compression {codec}: {best:.2f} s wall, {cpu:.2f} s CPU (process, best of "
              f"{args.repeat}), {values / best / 1e6:.1f} M values/s, {_size(out) / 1e6:.0f} MB")
    from trainrec.replay import open_run
    from trainrec.tools.export_parquet import export_parquet

    best = cpu = None
    for _ in range(args.repeat):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        t0, c0 = time.perf_counter(), time.process_time()
        sink, _ = export_parquet(open_run(run_dir), out)
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        best = wall if best is None else min(best, wall)
        cpu = used if cpu is None else min(cpu, used)
    print(f"export_parquet() in process, snappy: {best:.2f} s wall, {cpu:.2f} s CPU, "
          f"{sink.values / best / 1e6:.1f} M values/s ({sink.values / cpu / 1e6:.1f} M per CPU second)")
    try:
        import duckdb
    except ImportError:
        return 0
    t0 = time.perf_counter()
    rows = duckdb.sql(f"select count(*), sum(norm) from read_parquet('{out}/**/*.parquet', hive_partitioning=true)").fetchall()
    print(f"duckdb count + sum(norm) over the dataset: {time.perf_counter() - t0:.2f} s ({rows[0][0]} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
