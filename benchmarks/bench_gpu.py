"""Recorder overhead on a GPU: the model and method of ``shared/reference/gpu.md``.

Model: decoder-style transformer (``nn.TransformerEncoder``, ``norm_first``, causal), d=1024, 16 heads,
ff=4096, 24 layers, vocab 32,000, embedding + linear head: 367.9 M parameters in 291 tensors. bf16
autocast, fp32 weights, ``AdamW(fused=True)``, batch 8 x 1,024 tokens.

Two identical models in one process, stepped alternately (A monitored by ``record()``, B the
baseline), each step timed between ``sync()``. Added time = median of (A step - B
step) over the median B step. Also printed, measured in the same run:
  - the one-read limit: a single ``sum`` over one flat fp32 buffer as large as all gradients;
  - the statistics engine alone on the 291 gradients (six ops), Triton and torch backends;
  - kernel launches per step (profiler: monitored minus baseline) and added peak memory;
  - whether ``torch.cuda.set_sync_debug_mode("error")`` stays quiet through monitored steps.

Configs (ops: all six unless named; format csv as in gpu.md):
  a       wg_distribution
  a_norm  wg_distribution, ops norm only
  b       xy_distribution + all_xy, wg, param, mv
  b_ur    b + ur_distribution
``--backends triton,torch`` runs each config with each statistics backend (TRAINREC_STATS_BACKEND);
``--torch-configs a`` (the default) runs those on the torch backend as well, for before and after.

Usage: ``python benchmarks/bench_gpu.py [--steps 30] [--warmup 5] [--configs a,a_norm,b,b_ur] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
CONFIGS = {
    "a": {"wg_distribution": True},
    "a_norm": {"wg_distribution": True, "ops": ["norm"]},
    "b": {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
          "mv_distribution": True},
    "b_ur": {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
             "mv_distribution": True, "ur_distribution": True},
}
CUDA = torch.cuda.is_available()
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, ff: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x, mask):
        return self.head(self.body(self.embed(x), mask=mask, is_causal=True))


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.dev = torch.device("cuda" if CUDA else "cpu")
        g = torch.Generator(device=self.dev).manual_seed(0)
        self.tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=self.dev, generator=g)
        self.targets = torch.randint(0, args.vocab, (args.batch, args.seq), device=self.dev, generator=g)
        self.mask = nn.Transformer.generate_square_subsequent_mask(args.seq, device=self.dev)

    def model(self):
        a = self.args
        torch.manual_seed(0)
        m = LM(a.vocab, a.d, a.heads, a.ff, a.layers).to(self.dev)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    def step(self, model, opt) -> None:
        with torch.autocast(self.dev.type, dtype=torch.bfloat16):
            logits = model(self.tokens, self.mask)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), self.targets.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(self, model, opt) -> float:
        sync()
        t0 = time.perf_counter()
        self.step(model, opt)
        sync()
        return time.perf_counter() - t0

    def launches(self, model, opt) -> int:
        from torch.profiler import ProfilerActivity, profile

        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            self.step(model, opt)
            sync()
        return sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)

    def peak(self, model, opt) -> int:
        if not CUDA:
            return 0
        sync()
        torch.cuda.reset_peak_memory_stats()
        self.step(model, opt)
        sync()
        return torch.cuda.max_memory_allocated()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def cuda_ms(fn, repeat: int = 20) -> float:
    """Milliseconds per call of ``fn`` (CUDA events; wall time where there is no GPU: a smoke test)."""
    fn()
    sync()
    if not CUDA:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    sync()
    return start.elapsed_time(end) / repeat


def limits(bench: Bench, model, opt, results: dict) -> None:
    """The one-read limit and the engine alone on the model's gradients."""
    from trainrec.recorder import device_stats
    from trainrec.recorder.stats import StatsEngine

    bench.step(model, opt)  # (Adam state made)
    with torch.autocast(bench.dev.type, dtype=torch.bfloat16):
        logits = model(bench.tokens, bench.mask)
    F.cross_entropy(logits.float().view(-1, logits.shape[-1]), bench.targets.view(-1)).backward()
    grads = [p.grad for p in model.parameters()]
    total = sum(g.numel() for g in grads)
    flat = torch.empty(total, device=bench.dev)
    one_read = cuda_ms(flat.sum)
    flat = None
    tri = StatsEngine(OPS, 1e-8, backend="triton")
    want = StatsEngine(OPS, 1e-8, backend="torch").compute(grads)
    got = tri.compute(grads)
    err = ((got - want).abs() / (want.abs() + 1e-6)).nan_to_num(0).max().item()
    engine = cuda_ms(lambda: tri.compute(grads))
    torch_ms = cuda_ms(lambda: StatsEngine(OPS, 1e-8, backend="torch").compute(grads), repeat=3)
    foreach = cuda_ms(lambda: torch._foreach_norm(grads))

    sweep = {}
    saved = device_stats.BLOCK, device_stats.WARPS, device_stats.CHUNK
    settings = [(block, warps, 1 << 16) for block in (1024, 2048, 4096) for warps in (4, 8)]
    settings += [(2048, 8, 1 << 15), (2048, 8, 1 << 17)]
    for block, warps, chunk in settings:
        device_stats.BLOCK, device_stats.WARPS, device_stats.CHUNK = block, warps, chunk
        eng = StatsEngine(OPS, 1e-8, backend="triton")
        sweep[f"block={block} warps={warps} chunk={chunk}"] = round(cuda_ms(lambda e=eng: e.compute(grads)), 4)
    device_stats.BLOCK, device_stats.WARPS, device_stats.CHUNK = saved
    # a hook's call: the host time of measuring one activation-sized tensor (launches are asynchronous)
    act = torch.randn(bench.args.batch, bench.args.seq, bench.args.d, device=bench.dev, dtype=torch.bfloat16)
    tri.rows([act])
    sync()
    t0 = time.perf_counter()
    for _ in range(200):
        tri.rows([act])
    host_us = (time.perf_counter() - t0) / 200 * 1e6
    sync()
    act_ms = cuda_ms(lambda: tri.rows([act]))
    act_read = cuda_ms(lambda: act.sum())
    results["limits"] = {
        "gradient values": total, "gradient tensors": len(grads),
        "one read of all gradient values, ms": round(one_read, 4),
        "triton engine, six ops of all gradients, ms": round(engine, 4),
        "torch backend, same, ms": round(torch_ms, 3),
        "torch._foreach_norm, ms": round(foreach, 4),
        "max relative difference triton vs torch": err,
        "block/warps/chunk sweep, ms": sweep,
        "activation 8x1024x1024 bf16: host us per hook call": round(host_us, 1),
        "activation: device ms (engine)": round(act_ms, 4), "activation: one read, ms": round(act_read, 4),
    }
    for p in model.parameters():
        p.grad = None
    print(json.dumps(results["limits"], indent=1), flush=True)


def paired(bench: Bench, name: str, backend: str, base, results: dict) -> None:
    from trainrec.recorder import record

    args = bench.args
    os.environ["TRAINREC_STATS_BACKEND"] = backend
    cfg = dict(CONFIGS[name])
    cfg.setdefault("ops", OPS)
    cfg["format"] = "csv"
    model, opt = bench.model()
    with tempfile.TemporaryDirectory() as out, record(model, opt, cfg, output_dir=out):
        for _ in range(args.warmup):
            bench.step(model, opt)
            bench.step(*base)
        diffs, base_times = [], []
        for _ in range(args.steps):
            a = bench.timed(model, opt)
            b = bench.timed(*base)
            diffs.append(a - b)
            base_times.append(b)
        launches = bench.launches(model, opt) - bench.launches(*base)
        peak = bench.peak(model, opt) - bench.peak(*base)
    med = statistics.median(base_times)
    row = {"config": name, "backend": backend, "baseline step ms": round(med * 1e3, 2),
           "added ms": round(statistics.median(diffs) * 1e3, 3),
           "added %": round(100 * statistics.median(diffs) / med, 2),
           "added launches per step": launches, "added peak MiB": round(peak / 2**20, 1)}
    results["paired"].append(row)
    print(json.dumps(row), flush=True)
    del model, opt
    if CUDA:
        torch.cuda.empty_cache()


def sync_check(bench: Bench, base, results: dict) -> None:
    """Monitored steps (config b_ur, triton) under set_sync_debug_mode("error"); the baseline first."""
    from trainrec.recorder import record

    os.environ["TRAINREC_STATS_BACKEND"] = "triton"
    verdict = {}
    for who in ("baseline", "monitored"):
        model, opt = base if who == "baseline" else bench.model()
        cfg = dict(CONFIGS["b_ur"], ops=OPS, format="csv")
        with tempfile.TemporaryDirectory() as out:
            rec = record(model, opt, cfg, output_dir=out) if who == "monitored" else None
            try:
                for _ in range(2):  # (warm-up: kernels compiled, state made)
                    bench.step(model, opt)
                sync()
                if CUDA:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    for _ in range(3):
                        bench.step(model, opt)
                    verdict[who] = "quiet"
                except RuntimeError as exc:
                    verdict[who] = f"synchronised: {exc}"
                finally:
                    if CUDA:
                        torch.cuda.set_sync_debug_mode(0)
                sync()
            finally:
                if rec is not None:
                    rec.close()
    results["sync debug"] = verdict
    print(json.dumps(verdict), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--configs", default="a,a_norm,b,b_ur")
    p.add_argument("--backends", default="triton")
    p.add_argument("--torch-configs", default="a", help="configs also run on the torch backend (before/after)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ff", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--skip-limits", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    bench = Bench(args)
    results: dict = {"device": torch.cuda.get_device_name() if CUDA else "cpu (smoke test)", "torch": torch.__version__, "paired": []}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    print(json.dumps({k: v for k, v in results.items() if k != "paired"}), flush=True)
    base = bench.model()
    if not args.skip_limits:
        limits(bench, *base, results)
    for name in args.configs.split(","):
        for backend in args.backends.split(","):
            paired(bench, name, backend, base, results)
    for name in filter(None, args.torch_configs.split(",")):
        if "torch" not in args.backends.split(","):
            paired(bench, name, "torch", base, results)
    sync_check(bench, base, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
