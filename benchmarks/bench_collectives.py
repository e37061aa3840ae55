"""Cost of recording collectives (``cc_distribution``), metadata mode and statistics mode, on CPU.

Two figures, in one gloo process group of world size 1 (every call goes through gloo, and the
recorder's events go to a real log through the real writer thread):

* per call: the median time of ``all_reduce`` of a small tensor (and of an ``all_gather`` into a list),
  with the wrappers installed and without, over many calls, in alternating blocks;
* per step: the recorder benchmark's CPU model (``bench_recorder.build_model``, AdamW, batch 8 x 32)
  whose training step all-reduces every gradient by hand after its backward (51 calls per step, as a
  hand-written data-parallel loop does; DDP's own collectives are issued from C++ and never seen),
  stepped with and without collective recording, alternately, paired step by step: the median of
  the per-step differences over the median step. The recorded step's time includes waiting for the
  log writer to write its events (``flush``), so the writer thread's work is charged to it in full.

Usage: ``.venv/bin/python benchmarks/bench_collectives.py [--calls 2000] [--steps 30] [--mode metadata|stats]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _recorder(mode: str, writer):
    from trainrec.recorder.collectives import CollectiveRecorder

    options = {"enable": True, "cc_metadata_only": mode == "metadata"}
    return CollectiveRecorder(options, rank=0, emit=writer.write, step=lambda: 0, collecting=lambda: True,
                              ops=("min", "max", "norm", "mean", "zeros", "nans"))


def per_call(writer, mode: str, calls: int, block: int = 100) -> dict:
    import torch
    import torch.distributed as dist

    x = torch.ones(16)
    outs = [torch.empty(16)]
    results = {}
    for name, call in (("all_reduce", lambda: dist.all_reduce(x)), ("all_gather", lambda: dist.all_gather(outs, x))):
        base, rec_t = [], []
        for _ in range(calls // block):
            for timed in (base, rec_t):
                rec = None
                if timed is rec_t:
                    rec = _recorder(mode, writer)
                    rec.install()
                for _ in range(block):
                    t0 = time.perf_counter()
                    call()
                    timed.append(time.perf_counter() - t0)
                if rec is not None:
                    rec.close()
        results[name] = (statistics.median(base), statistics.median(rec_t))
    return results


def per_step(writer, mode: str, steps: int, warmup: int = 3) -> tuple[float, float, int]:
    import torch
    import torch.distributed as dist
    from bench_recorder import build_model

    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 4096, (8, 32))
    y = torch.randint(0, 4096, (8, 32))
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        for p in params:
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        writer.flush()  # the writer thread's work for the step's events (none for the baseline), timed
        return time.perf_counter() - t0

    base, diffs = [], []
    for i in range(warmup + steps):
        if i % 2:  # (which one runs first alternates: neither gets the other's warm caches every time)
            tb = step()
        rec = _recorder(mode, writer)
        rec.install()
        tm = step()
        rec.close()
        if not i % 2:
            tb = step()
        if i >= warmup:
            base.append(tb)
            diffs.append(tm - tb)
    return statistics.median(base), statistics.median(diffs), len(params)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--mode", choices=("metadata", "stats"), default="metadata")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    from trainrec.recorder.writer import LogWriter

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    out = tempfile.mkdtemp(prefix="bench-collectives-")
    writer = LogWriter(out, rank=0, world_size=1, run_id="bench")
    try:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, mode {args.mode}")
        calls = per_call(writer, args.mode, args.calls)
        for name, (b, m) in calls.items():
            print(f"per call  {name:11s} baseline {b * 1e6:7.1f} us  recorded {m * 1e6:7.1f} us  "
                  f"added {(m - b) * 1e6:6.1f} us")
        step_s, diff_s, n = per_step(writer, args.mode, args.steps)
        print(f"per step  ({n} all_reduce calls) baseline {step_s * 1e3:.1f} ms  added {diff_s * 1e3:+.2f} ms "
              f"= {100 * diff_s / step_s:+.2f}% (median of {args.steps} paired differences)")
        added = n * (calls["all_reduce"][1] - calls["all_reduce"][0])
        print(f"per step  from the per-call figure: {n} x added = {added * 1e3:.2f} ms = "
              f"{100 * added / step_s:.2f}% of the median baseline step")
    finally:
        writer.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
