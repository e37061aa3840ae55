"""Replay at scale: inspect, anomalies (re-detection), export and dump of a large synthetic run, with
and without ``-j``, against a plain numpy rolling pass over the same values held in memory.

The run (benchmarks/scale_synth.py, the project's own LogWriter): RANKS x STEPS x 200 tensors x 6 ops,
by default 256 x 400 (123 M values, one injected x50 jump). Each command runs as its own process, as a
user runs it; printed per command: wall seconds, statistics values per second, and the peak resident
memory of the largest process (``ru_maxrss`` of the command and its waited-for workers).

* ``inspect``, ``check``: every rank read;
* ``anomalies --rule AnomalyTurbulence --threshold 0.5``: the columnar re-detection, -j 1 and -j 2, and
  with ``--engine dask -j 2`` (a local cluster of worker processes, started by the command); also the
  record-by-record AnomalyScan over the merged stream (what ``anomalies`` did before, in-process);
* ``export csv`` and ``dump``: on the first IO_RANKS ranks only (CSV and JSON text are their cost:
  102,400 CSV files or 10 GB of JSON for the whole run), -j 1 and -j 2;
* the numpy floor: per (rank, kind), the values as a (steps, series x ops) float64 array in memory,
  ``sliding_window_view(x, 16, axis=0)`` min and max (the window's extremes the rule needs first) and
  one comparison; timed on SAMPLE ranks, as values per second;
* the projection to 1,000 ranks x 10,000 steps: two ranks of 10,000 steps, re-detected with -j 1; the
  per-rank time times 1,000 ranks over 2 processes (and that rank's peak memory, the bound of one process).

    .venv/bin/python benchmarks/bench_scale.py [--dir /tmp/trainrec-scale] [--ranks 256] [--steps 400]
        [--keep] [--skip-before] [--skip-dask] [--skip-io] [--only-floor]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TRAINREC = [sys.executable, "-m", "trainrec.tools.cli"]
TENSORS = 200
OPS = 6

_MEASURE = r"""
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
wall = time.perf_counter() - t0
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": r.returncode, "wall": wall, "cpu": use.ru_utime + use.ru_stime, "rss_mb": use.ru_maxrss / 1024,
                  "err": r.stderr.decode()[-400:]}))
"""


def measure(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, *argv], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    if got["rc"] != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({got['rc']}): {got['err']}")
    return got


def line(label: str, got: dict, values: int) -> None:
    print(f"  {label:<50} {got['wall']:6.1f} s {values / got['wall'] / 1e6:6.1f} M/s   CPU {got['cpu']:6.1f} s "
          f"{values / got['cpu'] / 1e6:6.1f} M/CPU-s  {got['rss_mb']:5.0f} MB", flush=True)


def synthesise(path: str, ranks: int, steps: int) -> None:
    if os.path.isdir(path) and len(os.listdir(path)) == ranks:
        print(f"reusing {path}")
        return
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scale_synth.py"), path, "--ranks", str(ranks),
                    "--steps", str(steps)], check=True)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    print(f"synthesised {ranks} ranks x {steps} steps x {TENSORS} tensors x {OPS} ops: {size / 1e6:.0f} MB in "
          f"{time.perf_counter() - t0:.0f} s")


def numpy_floor(path: str, sample: int, window: int = 16) -> tuple[float, float]:
    """Values per second of the plain numpy rolling pass, and of the re-detection's rules
    (``vector_rules`` on the same blocks), over values held in memory."""
    from numpy.lib.stride_tricks import sliding_window_view
    from trainrec.analyzers.series_block import SeriesBlock
    from trainrec.analyzers.vector_rules import block_flags
    from trainrec.replay.run import open_run
    from trainrec.schema.events import TensorStatsRecorded
    from trainrec.schema.rule_config import make_rule

    run = open_run(path)
    floor = rules = 0.0
    values = 0
    for rank in run.ranks[:sample]:
        blocks: dict[str, list[np.ndarray]] = {}
        ops: dict[str, tuple] = {}
        for ev in run.events(rank=rank):
            if type(ev) is TensorStatsRecorded:
                blocks.setdefault(ev.kind, []).append(np.frombuffer(ev.values, "<f4").reshape(len(ev), len(ev.ops)))
                ops[ev.kind] = ev.ops
        arrays = {k: np.stack(v) for k, v in blocks.items()}
        t0 = time.perf_counter()
        for x32 in arrays.values():
            x = x32.astype(np.float64).reshape(len(x32), -1)
            win = sliding_window_view(x, window, axis=0)
            lo, hi = win.min(axis=-1), win.max(axis=-1)
            _ = np.maximum(x[window - 1 :] - lo, hi - x[window - 1 :]) > 0.5 * np.abs(lo)
        t1 = time.perf_counter()
        for kind, x32 in arrays.items():
            rule = make_rule("AnomalyTurbulence", {"threshold": 0.5})
            block_flags(rule, SeriesBlock(x32.astype(np.float64), np.zeros(x32.shape[:2], bool), ops[kind], x32))
        t2 = time.perf_counter()
        floor += t1 - t0
        rules += t2 - t1
        values += sum(x.size for x in arrays.values())
    return values / floor, values / rules


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/trainrec-scale")
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--io-ranks", type=int, default=16, help="ranks exported and dumped")
    ap.add_argument("--sample", type=int, default=32, help="ranks of the numpy floor")
    ap.add_argument("--keep", action="store_true", help="keep the synthesised logs")
    ap.add_argument("--skip-before", action="store_true", help="skip the record-by-record scan (slow)")
    ap.add_argument("--skip-dask", action="store_true")
    ap.add_argument("--skip-io", action="store_true", help="skip export csv and dump")
    ap.add_argument("--only-floor", action="store_true", help="only the in-memory figures (after synthesising)")
    a = ap.parse_args()
    run_dir = os.path.join(a.dir, "run")
    values = a.ranks * a.steps * TENSORS * OPS
    io_values = min(a.io_ranks, a.ranks) * a.steps * TENSORS * OPS
    try:
        synthesise(run_dir, a.ranks, a.steps)
        print(f"{values / 1e6:.1f} M values; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; "
              "per command: wall, values/s, CPU seconds (all its processes), values per CPU-second, peak RSS "
              "of its largest process")
        floor, rules = numpy_floor(run_dir, a.sample)
        print(f"  {'numpy floor: rolling min/max, values in memory':<50} {'':8} {floor / 1e6:6.1f} M/s (one process, "
              "CPU-bound)", flush=True)
        print(f"  {'the rules of the re-detection, values in memory':<50} {'':8} {rules / 1e6:6.1f} M/s (one process, "
              "CPU-bound)", flush=True)
        if a.only_floor:
            return
        rule = ["--rule", "AnomalyTurbulence", "--threshold", "0.5"]
        for jobs in ("1", "2"):
            line(f"inspect -j {jobs}", measure([*TRAINREC, "inspect", run_dir, "-j", jobs]), values)
        line("check -j 2", measure([*TRAINREC, "check", run_dir, "-j", "2"]), values)
        for jobs in ("1", "2"):
            line(f"anomalies {' '.join(rule)} -j {jobs}", measure([*TRAINREC, "anomalies", run_dir, *rule, "-j", jobs]),
                 values)
        if not a.skip_dask:
            line("anomalies ... --engine dask -j 2 (local cluster)",
                 measure([*TRAINREC, "anomalies", run_dir, *rule, "--engine", "dask", "-j", "2"]), values)
        if not a.skip_before:
            before = ("from trainrec.analyzers.anomalies import AnomalyScan; from trainrec.replay.run import open_run;"
                      "from trainrec.schema.rule_config import make_rule; import sys;"
                      "AnomalyScan([make_rule('AnomalyTurbulence', {'threshold': 0.5})]).feed_all(open_run(sys.argv[1]).events())")
            line("record-by-record AnomalyScan (before)", measure([sys.executable, "-c", before, run_dir]), values)
        sel = f"0-{min(a.io_ranks, a.ranks) - 1}"
        ranks_args = [x for r in range(min(a.io_ranks, a.ranks)) for x in ("--rank", str(r))]
        for jobs in () if a.skip_io else ("1", "2"):
            out = os.path.join(a.dir, f"csv{jobs}")
            shutil.rmtree(out, ignore_errors=True)
            line(f"export csv --ranks {sel} -j {jobs}",
                 measure([*TRAINREC, "export", "csv", run_dir, "-o", out, "--ranks", sel, "-j", jobs]), io_values)
            shutil.rmtree(out, ignore_errors=True)
        for jobs in () if a.skip_io else ("1", "2"):
            line(f"dump (ranks {sel}) -j {jobs}", measure([*TRAINREC, "dump", run_dir, *ranks_args, "-j", jobs]),
                 io_values)
        # projection: two ranks of 10,000 steps, per-rank time scaled to 1,000 ranks on 2 processes
        long_dir = os.path.join(a.dir, "long")
        synthesise(long_dir, 2, 10_000)
        long_values = 2 * 10_000 * TENSORS * OPS
        got = measure([*TRAINREC, "anomalies", long_dir, *rule, "-j", "1"])
        line("anomalies, 2 ranks x 10,000 steps -j 1", got, long_values)
        total = got["wall"] / 2 * 1000 / 2
        print(f"  projected 1,000 ranks x 10,000 steps (12 G values) with -j 2: {total / 60:.0f} min "
              f"(one process holds one rank: {got['rss_mb']:.0f} MB peak)")
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
