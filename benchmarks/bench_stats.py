"""Statistics kernels alone: the one-pass C kernel (recorder/_fused.c) against the torch reductions.

Side by side in one process, on the tensors the recorder benchmark's model gives (bench_recorder.py):
  grads   its 51 gradient-shaped tensors (5.3M values), one batch, as a weight-gradient flush measures them
  actv    64 activation-shaped tensors of 8 x 32 x 256 values, two per call, as module hooks measure them
  adam    exp_avg / exp_avg_sq of those 51 parameters: the statistics of both and of update and ratio
All six ops (min, max, norm, mean, zeros, nans). "torch" is StatsEngine's torch path (``fused = False``,
with every trick in stats.py); "fused" is the kernel on 1 thread and on torch.get_num_threads() threads.
Best of ``--repeat`` runs, in ns per value (per state element for adam), and torch / fused.

Then the same gradient batch as the recorder meets it: the model's own 51 gradients read once right after
each of ``--repeat`` training steps' backward passes (what the end-of-backward flush does; the data has
left the caches while backward went on), median ms per read, torch path and kernel on 1 and N threads.

Usage: ``.venv/bin/python benchmarks/bench_stats.py [--repeat 20]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

OPS = ("min", "max", "norm", "mean", "zeros", "nans")


def best_of(fn, repeat: int) -> float:
    fn()  # warm-up (allocations, scratch buffers)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()

    from bench_recorder import build_model
    from trainrec.recorder import adam_update, fused, optim
    from trainrec.recorder.stats import StatsEngine

    if not fused.AVAILABLE:
        print("the kernel is not built (no C compiler at install time?) or TRAINREC_FUSED=0", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    model = build_model()
    grads = [torch.randn_like(p) for p in model.parameters()]
    actv = [torch.randn(8, 32, 256) for _ in range(64)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    opt.step()
    entries = optim.AdamState(opt, opt).lookup(list(model.parameters()))

    torch_eng = StatsEngine(OPS)
    torch_eng.fused = False
    fused_eng = StatsEngine(OPS)
    threads = torch.get_num_threads()

    def with_threads(n, fn):
        def run():
            old = fused.PARALLEL_NUMEL, fused.ADAM_PARALLEL_NUMEL
            fused.PARALLEL_NUMEL = fused.ADAM_PARALLEL_NUMEL = 0 if n > 1 else 1 << 62
            torch.set_num_threads(n)
            try:
                fn()
            finally:
                torch.set_num_threads(threads)
                fused.PARALLEL_NUMEL, fused.ADAM_PARALLEL_NUMEL = old
        return run

    def torch_adam():
        torch_eng.compute([e[1] for e in entries])
        torch_eng.compute([e[2] for e in entries])
        adam_update.update_and_ratio(entries, torch_eng.compute, True, True)

    def fused_adam():
        adam_update.fused_adam_rows(entries, OPS, 1e-8, True, True)

    def actv_pairs(eng):
        def run():
            for i in range(0, len(actv), 2):
                eng.compute(actv[i:i + 2])
        return run

    cases = [
        ("grads", sum(g.numel() for g in grads), lambda: torch_eng.compute(grads), lambda: fused_eng.compute(grads)),
        ("actv", sum(a.numel() for a in actv), actv_pairs(torch_eng), actv_pairs(fused_eng)),
        ("adam", sum(e[1].numel() for e in entries), torch_adam, fused_adam),
    ]
    print(f"torch {torch.__version__}, {threads} intra-op threads, best of {args.repeat}, "
          f"float32 loop: {fused.kernel_name()}")
    print(f"| case | values | torch ns/value | fused 1 thread | fused {threads} threads | torch / fused |")
    print("|---|---|---|---|---|---|")
    for name, n, t_fn, f_fn in cases:
        t = best_of(t_fn, args.repeat)
        f1 = best_of(with_threads(1, f_fn), args.repeat)
        fn = best_of(with_threads(threads, f_fn), args.repeat)
        print(f"| {name} | {n / 1e6:.2f}M | {t / n * 1e9:.2f} | {f1 / n * 1e9:.2f} | {fn / n * 1e9:.2f} | "
              f"{t / min(f1, fn):.1f}x |")
    # the gradients as the recorder reads them: right after a real backward pass, once per step
    x = torch.randint(0, 4096, (8, 32))
    y = torch.randint(0, 4096, (8, 32))
    fresh = {"torch": [], "fused 1 thread": [], f"fused {threads} threads": []}
    runs = [("torch", lambda gs: torch_eng.compute(gs)),
            ("fused 1 thread", lambda gs: with_threads(1, lambda: fused_eng.compute(gs))()),
            (f"fused {threads} threads", lambda gs: with_threads(threads, lambda: fused_eng.compute(gs))())]
    for i in range(args.repeat + 1):
        for name, fn in runs:
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            gs = [p.grad for p in model.parameters()]
            t = time.perf_counter()
            fn(gs)
            if i:  # the first is a warm-up
                fresh[name].append(time.perf_counter() - t)
            opt.step()
            opt.zero_grad()
    print()
    print(f"the model's gradients right after its backward pass, median of {args.repeat} steps, ms per read:")
    print("| " + " | ".join(fresh) + " |")
    print("|" + "---|" * len(fresh))
    print("| " + " | ".join(f"{statistics.median(v) * 1e3:.2f}" for v in fresh.values()) + " |")
    loops = fused.kernels()
    if len(loops) > 1:
        # the float32 loops against each other on one thread, alternating, on data in the caches (one
        # activation, read again and again) and from memory (the gradient batch, 21 MB)
        print()
        print(f"float32 loops, 1 thread, best of {args.repeat} alternating rounds, ns per value:")
        print("| case | " + " | ".join(loops) + " | ratio |")
        print("|---|" + "---|" * (len(loops) + 1))
        for name, n, fn in (("one activation (in cache)", actv[0].numel(), lambda: fused_eng.compute(actv[:1])),
                            ("gradient batch (from memory)", sum(g.numel() for g in grads),
                             lambda: fused_eng.compute(grads))):
            best = {k: float("inf") for k in loops}
            for _ in range(args.repeat):
                for k in loops:
                    with fused.using_kernel(k):
                        best[k] = min(best[k], best_of(with_threads(1, fn), 3))
            print(f"| {name} | " + " | ".join(f"{best[k] / n * 1e9:.3f}" for k in loops)
                  + f" | {best[loops[0]] / best[loops[-1]]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
