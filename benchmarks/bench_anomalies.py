"""Anomaly ranking and re-detection speed on a synthesised run, vs. the same statistics read from CSV.

The run: STEPS steps x TENSORS tensors x 6 ops on one rank, written with the real LogWriter the way the
recorder writes it: per step one stats record per kind, ``actv`` (TENSORS*2/5 rows: input and output of
TENSORS/5 modules), ``actv_grad`` (the same), ``grad_reduced`` and ``param`` (TENSORS/10 rows each).
Values are log-normal noise around per-tensor magnitudes, with 40 injected jumps (x50) and 5 NaN
tensors. While writing, an AlertEngine (AnomalyTurbulence 0.5) runs on every record, as the recorder
does on its writer thread, and its AnomalyDetected events go into the log. The same statistics are also
written as the reference's CSV files (``{kind}_{step}-{step}.csv``, activations with ``input.*`` and
``output.*`` columns), 4 files per step. Both are written once under ``.bench/anomalies/`` and reused.

Measured (wall clock, and CPU time of this process and its children, warm file cache):

* record-time detection: AlertEngine.observe per step (writer thread, not the training thread);
* ranking the recorded anomalies: open the run, read every event, rank (``trainrec anomalies RUN``);
* re-detection from the log: the same plus AnomalyTurbulence over every statistic
  (``trainrec anomalies RUN --rule AnomalyTurbulence --threshold 0.3``), and with ZScore;
* the same re-detection from the CSV files: pandas ``read_csv`` of every file + the same Detector;
  and the CSV parsing alone with the ``csv`` module.

    .venv/bin/python benchmarks/bench_anomalies.py [--steps 1000] [--tensors 2000]
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import shutil
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OPS = ("min", "max", "norm", "mean", "zeros", "nans")
ALERT = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False}


def layout(tensors: int):
    modules = tensors // 5
    params = (tensors - 4 * modules) // 2
    mods = [f"layers.{i // 8}.block.sub_{i % 8}" for i in range(modules)]
    pars = [f"layers.{i // 4}.block.p{i % 4}.weight" for i in range(params)]
    return mods, pars


def synthesise(run_dir: str, csv_dir: str, steps: int, tensors: int) -> dict:
    from trainrec.recorder.alerts import AlertEngine
    from trainrec.recorder.writer import LogWriter
    from trainrec.schema.events import StepBegan, StepEnded, TensorStatsRecorded

    rng = np.random.default_rng(0)
    mods, pars = layout(tensors)
    m = len(mods)
    # kind -> (row names, slots, csv layout)
    kinds = {
        "actv": ([n for n in mods for _ in (0, 1)], np.tile([1, 2], m).astype(np.uint8)),
        "actv_grad": ([n for n in mods for _ in (0, 1)], np.tile([3, 4], m).astype(np.uint8)),
        "grad_reduced": (pars, None),
        "param": (pars, None),
    }
    base = {k: 10.0 ** rng.uniform(-4, 1, len(v[0])) for k, v in kinds.items()}
    first = min(50, steps // 2)
    inject = {(int(rng.integers(first, steps)), k, int(rng.integers(0, len(kinds[k][0])))): "x50"
              for k in [list(kinds)[i % 4] for i in range(40)]}
    for _ in range(5):
        inject[(int(rng.integers(first, steps)), "actv", int(rng.integers(0, 2 * m)))] = "nan"
    engine = AlertEngine(ALERT, rank=0, pp_stage=0, group_mates=(0,), dump_dir=None)
    rdir = os.path.join(run_dir, "Dec03_21-34-40-rank0-0000bench")
    os.makedirs(csv_dir, exist_ok=True)
    detect_time = 0.0
    found = 0
    with LogWriter(rdir, rank=0, world_size=1, run_id="bench", flush_interval=0.5, queue_size=64) as w:
        ids = {k: np.asarray(w.intern(v[0], step=-1), dtype="<u4") for k, v in kinds.items()}
        for s in range(steps):
            w.write(StepBegan(rank=0, step=s, wall=1000.0 + s))
            for kind, (names, slots) in kinds.items():
                b = base[kind] * rng.lognormal(0, 0.05, len(names))
                vals = np.stack([-b, b, 30 * b, 0.01 * b * rng.standard_normal(len(names)),
                                 np.full(len(names), 0.01), np.zeros(len(names))], axis=1)
                for (st, k, row), what in inject.items():
                    if st == s and k == kind:
                        if what == "x50":
                            vals[row, :4] *= 50
                        else:
                            vals[row, :5] = np.nan
                            vals[row, 5] = 100
                vals = vals.astype("<f4")
                call_ids = np.arange(len(names), dtype="<u4") if kind.startswith("actv") else None
                w.write(TensorStatsRecorded(
                    rank=0, step=s, wall=1000.0 + s, kind=kind, ops=OPS, dtype="f", name_ids=ids[kind].tobytes(),
                    values=vals.tobytes(), call_ids=b"" if call_ids is None else call_ids.tobytes(),
                    slots=b"" if slots is None else slots.tobytes()))
                t0 = time.perf_counter()
                evs = engine.observe(step=s, kind=kind, ops=OPS, names=names, values=vals, call_ids=call_ids,
                                     slots=slots)
                detect_time += time.perf_counter() - t0
                found += len(evs)
                for ev in evs:
                    w.write(ev)
                write_csv(csv_dir, kind, s, names, slots, vals)
            w.write(StepEnded(rank=0, step=s, wall=1000.5 + s, duration=0.5, collected=True))
    engine.close()
    return {"record_detect_s": detect_time, "recorded": found, "injected": len(inject)}


def write_csv(csv_dir: str, kind: str, step: int, names, slots, vals) -> None:
    """The reference's CSV layout of one kind at one step (values as text, full float32 precision)."""
    path = os.path.join(csv_dir, f"{kind}_{step}-{step}.csv")
    with open(path, "w", newline="") as f:
        wr = csv.writer(f)
        if kind in ("actv", "actv_grad"):
            a, b = ("input", "output") if kind == "actv" else ("input_grad", "output_grad")
            wr.writerow(["vpp_stage", "module_name", "step", *[f"{a}.{op}" for op in OPS],
                         *[f"{b}.{op}" for op in OPS]])
            for i in range(0, len(names), 2):
                wr.writerow([0, f"{names[i]}_0", step, *vals[i].tolist(), *vals[i + 1].tolist()])
        else:
            wr.writerow(["vpp_stage", "param_name", "step", *OPS])
            for i, n in enumerate(names):
                wr.writerow([0, n, step, *vals[i].tolist()])


def redetect_from_csv(csv_dir: str, rules) -> int:
    """pandas.read_csv of every file, in step order, fed to the same Detector."""
    import pandas as pd
    from trainrec.schema.detector import Detector

    det = Detector(rules)
    pat = re.compile(r"^(.*)_(\d+)-\d+\.csv$")
    files = []
    for path in glob.glob(os.path.join(csv_dir, "*.csv")):
        m = pat.match(os.path.basename(path))
        files.append((int(m.group(2)), m.group(1), path))
    found = 0
    order = {"actv": 0, "actv_grad": 1, "grad_reduced": 2, "param": 3}
    for step, kind, path in sorted(files, key=lambda t: (t[0], order[t[1]])):
        df = pd.read_csv(path)
        if kind in ("actv", "actv_grad"):
            vals = df.iloc[:, 3:].to_numpy(dtype=np.float64).reshape(-1, len(OPS))
            names = [n.rsplit("_", 1)[0] for n in df["module_name"] for _ in (0, 1)]
            slots = np.tile([1, 2] if kind == "actv" else [3, 4], len(df))
        else:
            vals = df.iloc[:, 3:].to_numpy(dtype=np.float64)
            names = df["param_name"].tolist()
            slots = None
        found += len(det.observe(rank=0, step=step, kind=kind, ops=OPS, names=names, values=vals, slots=slots))
    return found


def parse_csv_only(csv_dir: str) -> int:
    n = 0
    for path in glob.glob(os.path.join(csv_dir, "*.csv")):
        with open(path, newline="") as f:
            rows = csv.reader(f)
            next(rows)
            for row in rows:
                [float(x) for x in row[3:]]
                n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--dir", default=os.path.join(ROOT, ".bench", "anomalies"))
    ap.add_argument("--fresh", action="store_true", help="synthesise again even if the data exists")
    args = ap.parse_args()
    import logging

    logging.getLogger("trainrec").setLevel(logging.ERROR)  # the AlertEngine's alerts are not the point here

    from trainrec.analyzers.anomalies import AnomalyScan
    from trainrec.analyzers.ranking import rank_anomalies
    from trainrec.replay.run import open_run
    from trainrec.schema.rules import AnomalyTurbulence, ZScore

    tag = f"{args.steps}x{args.tensors}"
    run_dir = os.path.join(args.dir, f"run-{tag}")
    csv_dir = os.path.join(args.dir, f"csv-{tag}")
    if args.fresh or not os.path.isdir(run_dir) or not os.path.isdir(csv_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(csv_dir, ignore_errors=True)
        t0 = time.perf_counter()
        info = synthesise(run_dir, csv_dir, args.steps, args.tensors)
        print(f"synthesised in {time.perf_counter() - t0:.1f} s: {info['injected']} injected, "
              f"{info['recorded']} anomalies recorded")
        print(f"record-time detection (writer thread): {info['record_detect_s']:.2f} s total, "
              f"{1000 * info['record_detect_s'] / args.steps:.2f} ms per step of {args.tensors} tensors x 6 ops")
    log_bytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(run_dir, "*", "*.trl")))
    csv_files = glob.glob(os.path.join(csv_dir, "*.csv"))
    csv_bytes = sum(os.path.getsize(p) for p in csv_files)
    values = args.steps * args.tensors * len(OPS)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"run: {args.steps} steps x {args.tensors} tensors x {len(OPS)} ops = {values / 1e6:.0f} M values; "
          f"log {log_bytes / 1e6:.0f} MB, CSV {len(csv_files)} files {csv_bytes / 1e6:.0f} MB")

    import resource

    def cpu_now():
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def timed(label, fn):
        t0, c0 = time.perf_counter(), cpu_now()
        out = fn()
        dt, cpu = time.perf_counter() - t0, cpu_now() - c0
        print(f"{label:<52} {dt:7.2f} s wall {cpu:7.2f} s CPU   {out}")
        sys.stdout.flush()
        return dt

    def rank_recorded():
        s = AnomalyScan().feed_all(open_run(run_dir).events())
        top = rank_anomalies(s.anomalies, k=8)
        return f"{len(s.anomalies)} anomalies, first at step {top[0].step}"

    def redetect(rule):
        def fn():
            s = AnomalyScan([rule]).feed_all(open_run(run_dir).events())
            top = rank_anomalies(s.anomalies, k=8)
            return f"{len(s.anomalies)} anomalies, first at step {top[0].step if top else '-'}"
        return fn

    def read_only():
        n = sum(1 for _ in open_run(run_dir).events())
        return f"{n} events"

    timed("read the log (every event decoded)", read_only)
    timed("rank recorded anomalies (trainrec anomalies RUN)", rank_recorded)
    timed("re-detect AnomalyTurbulence 0.3 from the log", redetect(AnomalyTurbulence(0.3)))
    timed("re-detect ZScore 5 from the log", redetect(ZScore(5)))
    import subprocess

    cmd = [sys.executable, "-m", "trainrec.tools.cli", "anomalies", run_dir, "--rule", "AnomalyTurbulence",
           "--threshold", "0.3", "-k", "8"]
    timed("trainrec anomalies RUN --rule AnomalyTurbulence --threshold 0.3 (process)",
          lambda: subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout.splitlines()[0][:40])
    timed("re-detect AnomalyTurbulence 0.3 from CSV (pandas)",
          lambda: f"{redetect_from_csv(csv_dir, [AnomalyTurbulence(0.3)])} anomalies")
    timed("parse the CSV only (csv module, float())", lambda: f"{parse_csv_only(csv_dir)} rows")


if __name__ == "__main__":
    main()
