"""Export speed: `trainrec export csv|tb` on a synthesised run, vs. the reference's csv2tensorboard_by_step.

The run: STEPS steps x TENSORS tensors x 6 ops, recorded with the real LogWriter as two kinds
(grad_reduced and param), so 2 x STEPS x TENSORS x 6 values. It is written once under
``.bench/export/`` and reused.

Measured (wall clock, each as its own process, so start-up is included):

* ``trainrec export tb`` and ``trainrec export csv``, with 1 and with 2 processes;
* our ``csv2tensorboard_by_step`` on the CSV export (the reference's format), 1 and 2 processes;
* the reference's ``csv2tensorboard_by_step`` (mindstudio-probe 1.2.1, in ``benchmarks/.venv-msprobe``:
  ``python3 -m venv benchmarks/.venv-msprobe && benchmarks/.venv-msprobe/bin/pip install torch==2.13.0
  mindstudio-probe==1.2.1``) on the first REF_STEPS steps of the same CSV, extrapolated per value to
  the whole run (it writes one add_scalar per value and takes far too long on the full run). The
  reference's start-up (importing torch and msprobe) is measured separately and not extrapolated.

    .venv/bin/python benchmarks/bench_export.py [--steps 1000] [--tensors 2000] [--ref-steps 10]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
REF_PY = os.path.join(ROOT, "benchmarks", ".venv-msprobe", "bin", "python")
KINDS = ("grad_reduced", "param")


def synthesise(run_dir: str, steps: int, tensors: int) -> None:
    from trainrec.recorder.writer import LogWriter
    from trainrec.schema.events import OPS, StepBegan, StepEnded, TensorStatsRecorded, pack_array

    rdir = os.path.join(run_dir, "Dec03_21-34-40-rank0-0000bench")
    rng = np.random.default_rng(0)
    names = [f"layers.{i // 16}.block.sub_{i % 16}.weight" for i in range(tensors)]
    with LogWriter(rdir, rank=0, world_size=1, run_id="bench", flush_interval=0.5, queue_size=64) as w:
        ids = w.intern(names, step=-1)
        id_bytes = pack_array("I", ids)
        for s in range(steps):
            w.write(StepBegan(rank=0, step=s, wall=1000.0 + s))
            for kind in KINDS:
                vals = (rng.standard_normal((tensors, len(OPS))) * 10.0 ** rng.integers(-6, 3, (tensors, 1)))
                w.write(TensorStatsRecorded(rank=0, step=s, wall=1000.0 + s, kind=kind, ops=OPS, dtype="f",
                                            name_ids=id_bytes, values=vals.astype("<f4").tobytes()))
            w.write(StepEnded(rank=0, step=s, wall=1000.5 + s, duration=0.5, collected=True))


CPU: dict[str, float] = {}
PARTS: dict[str, list[float]] = {}
_PART_RE = re.compile(r"^part \d+: .*: ([0-9.]+) s wall, ([0-9.]+) s CPU$", re.M)


def timed(cmd: list[str], env: dict | None = None, label: str = "") -> float:
    """Wall seconds of a command; its CPU seconds (children included) go to CPU[label], and the CPU
    seconds of each export part (``trainrec -v export`` logs them) to PARTS[label]."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU[label] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    PARTS[label] = [float(m.group(2)) for m in _PART_RE.finditer(r.stderr)]
    return wall


def du(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--ref-steps", type=int, default=10, help="steps given to the reference (extrapolated)")
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench", "export"))
    ap.add_argument("--skip-reference", action="store_true")
    args = ap.parse_args()
    values = 2 * args.steps * args.tensors * 6
    run_dir = os.path.join(args.work, f"run-{args.steps}x{args.tensors}")
    if not os.path.isdir(run_dir):
        t = time.perf_counter()
        synthesise(run_dir, args.steps, args.tensors)
        print(f"synthesised {run_dir} in {time.perf_counter() - t:.1f} s")
    log_mb = du(run_dir) / 1e6
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print(f"run: {args.steps} steps x {args.tensors} tensors x 6 ops x {len(KINDS)} kinds = {values:,} values; "
          f"log {log_mb:.0f} MB")
    trainrec = [PY, "-m", "trainrec.tools.cli", "-v"]
    rows = []

    def out(name: str) -> str:
        p = os.path.join(args.work, name)
        shutil.rmtree(p, ignore_errors=True)
        return p

    for fmt in ("tb", "csv"):
        for j in (1, 2):
            o = out(f"{fmt}-j{j}")
            label = f"trainrec export {fmt} -j {j}"
            sec = timed([*trainrec, "export", fmt, run_dir, "-o", o, "-j", str(j)], label=label)
            rows.append((label, sec, values, du(o)))
            parts = PARTS[label]
            print(f"  {label:<40} {sec:8.2f} s wall {CPU[label]:8.2f} s CPU  {values / sec / 1e6:6.2f} M values/s"
                  f"  {du(o) / 1e6:7.0f} MB; parts' CPU {' + '.join(f'{p:.2f}' for p in parts)} s")
            if fmt == "tb":
                shutil.rmtree(o)  # ~1.5 GB each
    csv_dir = os.path.join(args.work, "csv-j1")
    for j in (1, 2):
        o = out(f"csv2tb-ours-j{j}")
        code = ("import sys; from trainrec.tools.csv2tb import csv2tensorboard_by_step as c; "
                f"c({csv_dir!r}, None, None, process_num={j}, output_dirpath={o!r}, data_type_list=list({KINDS!r}))")
        label = f"our csv2tensorboard_by_step, {j} proc"
        sec = timed([PY, "-c", code], label=label)
        rows.append((label, sec, values, du(o)))
        print(f"  {label:<40} {sec:8.2f} s wall {CPU[label]:8.2f} s CPU  {values / sec / 1e6:6.2f} M values/s")
        shutil.rmtree(o)
    if not args.skip_reference:
        if not os.path.exists(REF_PY):
            print(f"reference venv missing ({REF_PY}); see the module docstring", file=sys.stderr)
            return 1
        # The first REF_STEPS steps of the same CSV, in the reference's directory layout.
        sub = out("ref-monitor")
        src = os.path.join(csv_dir, os.listdir(csv_dir)[0] if os.listdir(csv_dir)[0] != ".trainrec-export.json"
                           else sorted(os.listdir(csv_dir))[1])
        dst = os.path.join(sub, os.path.basename(src))
        os.makedirs(dst)
        for kind in KINDS:
            for s in range(args.ref_steps):
                shutil.copy(os.path.join(src, f"{kind}_{s}-{s}.csv"), dst)
        ref_values = 2 * args.ref_steps * args.tensors * 6
        startup = timed([REF_PY, "-c", "from msprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step"],
                        label="ref start-up")
        o = out("ref-tb")
        code = ("from msprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step as c; "
                f"c({sub!r}, None, None, process_num=1, output_dirpath={o!r}, data_type_list=list({KINDS!r}))")
        sec = timed([REF_PY, "-c", code], label="ref")
        work = max(sec - startup, 1e-9)
        per_value = work / ref_values
        full = startup + per_value * values
        print(f"  reference csv2tensorboard_by_step on {args.ref_steps} steps ({ref_values:,} values): {sec:.1f} s "
              f"(start-up {startup:.1f} s) -> {per_value * 1e6:.1f} us/value -> whole run ~{full:.0f} s "
              f"(extrapolated) = {values / (per_value * values) / 1e6:.3f} M values/s")
        rows.append(("reference csv2tensorboard_by_step (extrapolated)", full, values, 0))
        ours_tb = next(r[1] for r in rows if r[0] == "trainrec export tb -j 1")
        ref_cpu = max(CPU["ref"] - CPU["ref start-up"], 1e-9) / ref_values
        ours_cpu = CPU["trainrec export tb -j 1"] / values
        print(f"  reference CPU {CPU['ref']:.1f} s (start-up {CPU['ref start-up']:.1f} s) for {sec:.1f} s wall -> "
              f"{ref_cpu * 1e6:.1f} us CPU/value; trainrec export tb: {ours_cpu * 1e6:.3f} us CPU/value "
              f"(start-up included) -> {ref_cpu / ours_cpu:.0f}x less CPU")
        print(f"  speed-up of trainrec export tb -j 1 over the reference: {full / ours_tb:.0f}x")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
