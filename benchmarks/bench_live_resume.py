"""A resumed launch's live export: with the earlier export's record (``live_export.done``) against without.

The earlier launch: STEPS steps x TENSORS tensors x 6 ops as grad_reduced and param (the run
``bench_export.py`` synthesises), closed, and exported live to CSV (one file per step and kind), which
leaves the record. The resumed launch: a log file beginning with ``RunResumed`` at step STEPS - 5, then
RESUMED steps. The resumed launch's export then runs twice from the same files (a copy of the rank
directory each time): with the record (it reads only the new log file and goes on with the files
there) and with the record removed (it reads every log file from the start and rewrites every file).
Each runs as its own process (``trainrec.tools.live_export`` as a program), timed from start to exit;
its peak memory is that program's own high-water mark (VmHWM). Both must leave the same CSV files.

    .venv/bin/python benchmarks/bench_live_resume.py [--steps 2000] [--tensors 500] [--resumed 10]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_export import KINDS, ROOT, synthesise  # noqa: E402

PY = sys.executable


# the export run as its own program, reporting its peak resident memory (VmHWM: this program's own,
# not the benchmark's that forked it) on stderr as it exits
_RUN = ("import atexit, runpy, sys\n"
        "def peak():\n"
        "    with open('/proc/self/status') as f:\n"
        "        kib = next(int(l.split()[1]) for l in f if l.startswith('VmHWM'))\n"
        "    print('VmHWM', kib, file=sys.stderr)\n"
        "atexit.register(peak)\n"
        "sys.argv = ['live_export'] + sys.argv[1:]\n"
        "runpy.run_module('trainrec.tools.live_export', run_name='__main__')\n")


def export(rank_dir: str) -> tuple[float, int]:
    """Wall seconds and peak resident KiB of one live export run over ``rank_dir`` (closed logs: it
    ends when it has read them)."""
    t0 = time.perf_counter()
    r = subprocess.run([PY, "-c", _RUN, "--format", "csv", "--rank-dir", rank_dir, "--poll-interval", "0.05",
                        "--idle-timeout", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       check=True)
    wall = time.perf_counter() - t0
    lines = r.stderr.splitlines()
    peak = next(int(line.split()[1]) for line in lines if line.startswith("VmHWM"))
    other = [line for line in lines if not line.startswith("VmHWM")]
    if other:
        print("\n".join(other), file=sys.stderr)
    return wall, peak


def resume(rank_dir: str, at: int, steps: int, tensors: int) -> None:
    from trainrec.recorder.writer import LogWriter
    from trainrec.schema.events import OPS, RunResumed, StepBegan, StepEnded, TensorStatsRecorded, pack_array

    rng = np.random.default_rng(1)
    names = [f"layers.{i // 16}.block.sub_{i % 16}.weight" for i in range(tensors)]
    with LogWriter(rank_dir, rank=0, world_size=1, run_id="bench", flush_interval=0.5) as w:
        w.write(RunResumed(rank=0, step=at, wall=5000.0, last_step=at - 1))
        id_bytes = pack_array("I", w.intern(names, step=-1))
        for s in range(at, at + steps):
            w.write(StepBegan(rank=0, step=s, wall=5000.0 + s))
            for kind in KINDS:
                vals = rng.standard_normal((tensors, len(OPS)))
                w.write(TensorStatsRecorded(rank=0, step=s, wall=5000.0 + s, kind=kind, ops=OPS, dtype="f",
                                            name_ids=id_bytes, values=vals.astype("<f4").tobytes()))
            w.write(StepEnded(rank=0, step=s, wall=5000.5 + s, duration=0.5, collected=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--resumed", type=int, default=10)
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench", "live_resume"))
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    run = os.path.join(args.work, "run")
    synthesise(run, args.steps, args.tensors)
    (name,) = os.listdir(run)
    rdir = os.path.join(run, name)
    first, rss0 = export(rdir)
    assert os.path.exists(os.path.join(rdir, "live_export.done")), "the earlier export left no record"
    resume(rdir, args.steps - 5, args.resumed, args.tensors)
    base = os.path.join(args.work, "base")
    shutil.copytree(rdir, base)
    results = {}
    for label, keep in (("with the record", True), ("without the record", False)):
        d = os.path.join(args.work, label.replace(" ", "_"))
        shutil.copytree(base, d)
        if not keep:
            os.remove(os.path.join(d, "live_export.done"))
        results[label] = (*export(d), d)
    (_, _, a), (_, _, b) = results.values()
    files = sorted(n for n in os.listdir(a) if n.endswith(".csv"))
    same = sorted(n for n in os.listdir(b) if n.endswith(".csv")) == files and not filecmp.cmpfiles(
        a, b, files, shallow=False)[1]
    logs = sum(os.path.getsize(os.path.join(base, n)) for n in os.listdir(base) if n.endswith(".trl"))
    print(f"earlier launch: {args.steps} steps x {args.tensors} tensors x 2 kinds; logs {logs / 2**20:.1f} MiB; "
          f"its own live export {first:.2f} s, peak {rss0 / 1024:.0f} MiB; resumed launch: {args.resumed} steps")
    print("| resumed launch's export | wall | peak memory |")
    print("|---|---|---|")
    for label, (wall, rss, _) in results.items():
        print(f"| {label} | {wall:.2f} s | {rss / 1024:.0f} MiB |")
    print(f"same CSV files: {same} ({len(files)} files)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
