"""Recorder overhead: median step time with no monitor, with trainrec, and with mindstudio-probe's TrainerMon.

The model is the reference's benchmark model (``msprobe-monitor.md``): embedding (4096 x 256),
4 TransformerEncoderLayers (d=256, 4 heads, ff=1024), linear head, 5.3M parameters; AdamW;
batch 8 x 32; CPU. Each (implementation, config) runs in its own process (the reference patches the
optimizer's class), several rounds interleaved so that drifting machine load hits all alike.

Configs (ops: min, max, norm, mean, zeros, nans; format csv):
  a     wg_distribution
  b     everything: xy_distribution + all_xy, wg, param, mv (+ ur for trainrec; the reference fails
        ur with csv, and needs opt_ty="Megatron_FP32Optimizer" for mv on a plain AdamW)
  skip  config b with step_interval=10; the median over the skipped steps only

Besides the table's figure (the median monitored step over the median baseline step), each run and a
last line give the median of the per-step differences (each monitored step minus the baseline step
right after it) over the median baseline step: it cancels load that drifts within a round.

The last line pools the per-step differences of all rounds (each over its round's median baseline
step) and gives their median with a 95% confidence interval from a moving-block bootstrap (blocks of
10 consecutive steps): on a shared machine whose load swings by tens of percent from one step to the
next, the interval says whether a figure like "under 3%" is established or within the noise.

Work the monitor does in the background (trainrec's log writer thread every 0.2 s, its live CSV
export process every 0.5 s) lands in whichever model's step is running then, the baseline's about
half the time, so the paired figures charge about half of it to the baseline. Each run therefore also
prints that work's CPU time per monitored step (threads named ``trainrec-*`` and child processes,
from /proc); on a machine whose cores training keeps busy, it costs up to that much wall time.

``--calibrate`` also runs each config with model A unmonitored (implementation ``none``): its paired
figures are the two identical models' own difference (allocation, cache placement, which one steps
first), a control that every monitored figure includes.

Also printed per run: the minor page faults per step of the monitored and the baseline model. With
glibc's default malloc, whether a step's large temporaries (Adam's, 4 MB each here) reuse free heap
or get fresh pages (trimmed and re-faulted every step, ~1 us per 4 KiB page) depends on the process's
allocation history: the same baseline model takes 0 faults per step in one process and 3,000 in the
next, and any monitor's small allocations can tip it either way. ``--malloc fixed`` runs every worker
with fixed thresholds (GLIBC_TUNABLES below; what jemalloc/tcmalloc also avoid, as PyTorch's CPU
performance guide advises), which takes that lottery out of the comparison.

mindstudio-probe runs in its own venv: ``python3 -m venv benchmarks/.venv-msprobe &&
benchmarks/.venv-msprobe/bin/pip install torch==2.13.0 mindstudio-probe==1.2.1``.

Usage: ``.venv/bin/python benchmarks/bench_recorder.py [--steps 20] [--warmup 3] [--rounds 2] [--malloc fixed]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MSPROBE_PY = os.path.join(HERE, ".venv-msprobe", "bin", "python")
OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
FIXED_MALLOC = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=1073741824"
CONFIGS = {
    "a": {"wg_distribution": True},
    "b": {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
          "mv_distribution": True, "ur_distribution": True},
    "skip": {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
             "mv_distribution": True, "ur_distribution": True, "step_interval": 10},
}


def build_model():
    import torch
    import torch.nn as nn

    class TinyTransformer(nn.Module):
        def __init__(self, vocab=4096, d=256, layers=4, ff=1024, heads=4):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)))

    torch.manual_seed(0)
    return TinyTransformer()


def worker(impl: str, config: str, steps: int, warmup: int, fmt: str) -> dict:
    """Two identical models in one process, stepped alternately: model A is monitored (its optimizer
    is a subclass of its own, so a class-level patch cannot reach model B's), model B is the baseline.
    Pairing the steps cancels the drift of a shared machine's load."""
    import torch

    class MonitoredAdamW(torch.optim.AdamW):
        pass

    model_a, model_b = build_model(), build_model()
    opt_a = MonitoredAdamW(model_a.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-4)
    x = torch.randint(0, 4096, (8, 32))
    y = torch.randint(0, 4096, (8, 32))
    out_dir = tempfile.mkdtemp(prefix=f"bench-{impl}-{config}-")
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    mon = None
    if impl != "none":
        cfg = dict(CONFIGS[config])
        cfg["ops"] = OPS
        cfg["format"] = fmt
        if impl == "msprobe":
            cfg.pop("ur_distribution", None)  # AttributeError 'add_image' with csv in 1.2.1
        path = os.path.join(out_dir, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        if impl == "trainrec":
            from trainrec.recorder import TrainerMon

            mon = TrainerMon(path, params_have_main_grad=False)
        else:
            from msprobe.pytorch.monitor.module_hook import TrainerMon

            mon = TrainerMon(path, params_have_main_grad=False, opt_ty="Megatron_FP32Optimizer")
        mon.monitor_gnorm_with_ad(model_a, grad_acc_steps=1, optimizer=opt_a)

    def step(model, opt):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    mon_t, base_t, mon_f, base_f = [], [], [], []
    for i in range(warmup + steps):
        if i == warmup:
            bg0, t_start = background_cpu_s(), time.perf_counter()
        ta, fa = step(model_a, opt_a)
        tb, fb = step(model_b, opt_b)
        if i >= warmup and (config != "skip" or i % 10 != 0):
            mon_t.append(ta)
            base_t.append(tb)
            mon_f.append(fa)
            base_f.append(fb)
    time.sleep(0.6)  # the writer's and the live export's work for the last steps (0.2 s and 0.5 s intervals)
    bg = background_cpu_s() - bg0
    window = time.perf_counter() - t_start
    if impl == "trainrec" and mon is not None:
        mon.close()
    # also the median of the per-step differences (A's step minus the B step right after it), which
    # cancels drift within the round better than the difference of the two medians
    diffs = [a - b for a, b in zip(mon_t, base_t, strict=True)]
    return {"monitored_s": statistics.median(mon_t), "baseline_s": statistics.median(base_t), "n": len(mon_t),
            "paired_added_s": statistics.median(diffs), "paired_diffs_s": diffs,
            "background_cpu_per_step_s": bg / steps, "window_s": window,
            "torch_threads": torch.get_num_threads(), "monitored_faults": statistics.median(mon_f),
            "baseline_faults": statistics.median(base_f)}


def background_cpu_s() -> float:
    """CPU seconds used so far by the monitor's own threads (named ``trainrec-*``: the log writer, the
    spill thread) and by this process's child processes (trainrec's live export; the reference starts
    none). The paired figure charges such work to whichever model's step it lands in: it runs on its
    own intervals, so about half of it falls in the baseline's steps."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")

    def cpu(stat_path: str) -> float:
        try:
            with open(stat_path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick

    total = sum(cpu(f"/proc/self/task/{t.native_id}/stat") for t in threading.enumerate()
                if t.name.startswith("trainrec") and t.native_id)
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        total += cpu(f"/proc/{pid}/stat")
            except (OSError, IndexError):
                pass
    return total


def block_bootstrap_ci(rounds: list[list[float]], block: int = 10, reps: int = 2000,
                       level: float = 0.95) -> tuple[float, float, float]:
    """Median of the pooled per-step values of all rounds, and a ``level`` confidence interval for it
    from a moving-block bootstrap (blocks of ``block`` consecutive steps of one round, so that load
    lasting several steps is resampled with the steps it hit). Seeded: the same runs give the same
    interval."""
    import random

    pooled = [v for r in rounds for v in r]
    blocks = [r[i:i + block] for r in rounds for i in range(0, max(len(r) - block + 1, 1))]
    rng = random.Random(0)
    need = len(pooled)
    meds = []
    for _ in range(reps):
        sample: list[float] = []
        while len(sample) < need:
            sample.extend(rng.choice(blocks))
        meds.append(statistics.median(sample[:need]))
    meds.sort()
    lo = meds[int((1 - level) / 2 * reps)]
    hi = meds[min(reps - 1, int((1 + level) / 2 * reps))]
    return statistics.median(pooled), lo, hi


def run_worker(python: str, impl: str, config: str, args) -> dict:
    cmd = [python, os.path.abspath(__file__), "--worker", impl, "--config", config, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--format", args.format]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if args.malloc == "fixed":
        env["GLIBC_TUNABLES"] = FIXED_MALLOC
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{impl}/{config} failed:\n{res.stderr[-3000:]}")
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=["none", "trainrec", "msprobe"])
    p.add_argument("--config", default="a", choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--format", default="csv", choices=["csv", "api", "tensorboard"])
    p.add_argument("--configs", default="a,b,skip")
    p.add_argument("--no-msprobe", action="store_true")
    p.add_argument("--calibrate", action="store_true",
                   help="also run each config with no monitor on model A (impl 'none'): the two models' own "
                        "difference, which every paired figure includes")
    p.add_argument("--malloc", default="default", choices=["default", "fixed"],
                   help="fixed: glibc malloc with fixed mmap/trim thresholds in every worker (see the docstring)")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.config, args.steps, args.warmup, args.format)))
        return 0
    have_ms = os.path.exists(MSPROBE_PY) and not args.no_msprobe
    configs = args.configs.split(",")
    added: dict[tuple, list[float]] = {}
    base: dict[tuple, list[float]] = {}
    paired: dict[tuple, list[float]] = {}  # median per-step difference over the median baseline step
    steps_rel: dict[tuple, list[list[float]]] = {}  # each round's per-step differences over its baseline
    background: dict[tuple, list[float]] = {}  # background CPU per monitored step over the baseline step
    for _ in range(args.rounds):
        for cfg in configs:
            runs = ([("trainrec", sys.executable)] + ([("msprobe", MSPROBE_PY)] if have_ms else [])
                    + ([("none", sys.executable)] if args.calibrate else []))
            for impl, py in runs:
                r = run_worker(py, impl, cfg, args)
                added.setdefault((impl, cfg), []).append(r["monitored_s"] / r["baseline_s"] - 1)
                base.setdefault((impl, cfg), []).append(r["baseline_s"])
                paired.setdefault((impl, cfg), []).append(r["paired_added_s"] / r["baseline_s"])
                steps_rel.setdefault((impl, cfg), []).append([d / r["baseline_s"] for d in r["paired_diffs_s"]])
                background.setdefault((impl, cfg), []).append(r["background_cpu_per_step_s"] / r["baseline_s"])
                print(f"  {cfg:5s} {impl:9s} monitored {r['monitored_s'] * 1e3:8.1f} ms  "
                      f"baseline {r['baseline_s'] * 1e3:8.1f} ms  ({100 * added[(impl, cfg)][-1]:+.1f}%; paired "
                      f"{100 * paired[(impl, cfg)][-1]:+.1f}%; background CPU "
                      f"{r['background_cpu_per_step_s'] * 1e3:.2f} ms per step; minor page "
                      f"faults per step {r['monitored_faults']:.0f} / {r['baseline_faults']:.0f})",
                      file=sys.stderr, flush=True)
    print(f"steps={args.steps} warmup={args.warmup} rounds={args.rounds} format={args.format} malloc={args.malloc}")
    print("| config | baseline step | trainrec added | mindstudio-probe 1.2.1 added | trainrec / reference |")
    print("|---|---|---|---|---|")
    for cfg in configs:
        b = statistics.median(base[("trainrec", cfg)])
        tr = statistics.median(added[("trainrec", cfg)])
        row = f"| {cfg} | {b * 1e3:.0f} ms | {100 * tr:+.1f}% |"
        if have_ms:
            ms = statistics.median(added[("msprobe", cfg)])
            row += f" {100 * ms:+.1f}% | {tr / ms:.3f} |" if ms > 0 else f" {100 * ms:+.1f}% | n/a |"
        else:
            row += " n/a | n/a |"
        print(row)
    print("median per-step paired difference over the median baseline step, median over rounds: " + ", ".join(
        f"{cfg} {impl} {100 * statistics.median(v):+.1f}%" for (impl, cfg), v in paired.items()))
    cis = {k: block_bootstrap_ci(v) for k, v in steps_rel.items()}
    print("per-step paired differences of all rounds pooled, median [95% block-bootstrap interval]: " + ", ".join(
        f"{cfg} {impl} {100 * m:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]" for (impl, cfg), (m, lo, hi) in cis.items()))
    print("background CPU (the monitor's threads and child processes) per monitored step over the median baseline "
          "step, median over rounds: " + ", ".join(
              f"{cfg} {impl} {100 * statistics.median(v):.1f}%" for (impl, cfg), v in background.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
