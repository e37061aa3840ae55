"""Price of the recorder's API level (``api_xy``): step time of a small transformer-ish CPU model with no
monitoring, with module inputs and outputs (xy) and with xy plus the API level (forward calls only,
with the gradients through them in backward as by default, and with stacks), paired in one process: every round runs each configuration for the same steps, in a rotating
order; the figures are medians over rounds of each round's median step, and of the ratios of
configurations within each round. Also prints API calls per
step and log bytes per collected step. Prints the figures; nothing is asserted.

    .venv/bin/python benchmarks/bench_api_level.py [--rounds 5] [--steps 20] [--threads 1] [--clock cpu]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from trainrec.recorder import record
from trainrec.replay import open_run
from trainrec.schema.events import DIR_BACKWARD, ApiCallsRecorded

# (no "format": record() writes the log and no CSV or TensorBoard files beside it)
XY = {"xy_distribution": True, "all_xy": True, "ops": ["min", "max", "mean", "norm"]}
CONFIGS = {"none": None, "xy": XY, "xy+api-fwd": {**XY, "api_xy": {"backward": False}},
           "xy+api": {**XY, "api_xy": True}, "xy+api+stack": {**XY, "api_xy": {"stack": True}}}


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads), dim=-1)
        return self.proj(torch.matmul(att, v).transpose(1, 2).reshape(b, t, d))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.att = Attention(d, heads)
        self.up, self.down = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        x = x + self.att(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 128, heads: int = 4, ff: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, ff) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}  # cpu: the training thread's own time


def train(model, opt, batches, n: int, clock=time.perf_counter) -> list[float]:
    times = []
    for i in range(n):
        ids = batches[i % len(batches)]
        t0 = clock()
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(clock() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", default="wall", choices=list(CLOCKS),
                   help="wall time, or the training thread's CPU time (steadier on a shared machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    medians: dict[str, list[float]] = {k: [] for k in CONFIGS}
    logs: dict[str, str] = {}
    names = list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                cfg = CONFIGS[name]
                if cfg is None:
                    train(model, opt, batches, args.warmup)
                    times = train(model, opt, batches, args.steps, CLOCKS[args.clock])
                else:
                    with record(model, opt, cfg, output_dir=os.path.join(tmp, f"{name}{r}")) as rec:
                        train(model, opt, batches, args.warmup)
                        times = train(model, opt, batches, args.steps, CLOCKS[args.clock])
                    logs[name] = rec.log_path
                medians[name].append(statistics.median(times))
        print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, batch 8 x 64 tokens, "
              f"{args.threads} thread(s), {args.rounds} rounds x {args.steps} steps, {args.clock} time")
        base = statistics.median(medians["none"])
        for name in names:
            m = statistics.median(medians[name])
            extra = ""
            if name != "none":
                size = os.path.getsize(logs[name]) if logs.get(name) else 0
                extra = f"  log {size / (args.warmup + args.steps) / 1024:.0f} KiB/step"
            print(f"{name:>13}: {m * 1e3:7.2f} ms/step  ({m / base:.2f}x no monitoring, "
                  f"rounds {', '.join(f'{x * 1e3:.1f}' for x in medians[name])}){extra}")
        # paired: each round's ratio (the load of a shared machine changes between rounds)
        for a, b in (("xy", "none"), ("xy+api", "none"), ("xy+api-fwd", "xy"), ("xy+api", "xy"),
                     ("xy+api", "xy+api-fwd"), ("xy+api+stack", "xy")):
            ratios = [x / y for x, y in zip(medians[a], medians[b], strict=True)]
            print(f"paired {a} / {b}: median {statistics.median(ratios):.2f}x "
                  f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})")
        xy, fwd, api = (statistics.median(medians[k]) for k in ("xy", "xy+api-fwd", "xy+api"))
        print(f"API level over xy: +{(fwd - xy) * 1e3:.2f} ms/step forward only, +{(api - xy) * 1e3:.2f} ms/step "
              f"with backward (+{(api - fwd) * 1e3:.2f} ms/step for the backward)")
        n = {0: 0, DIR_BACKWARD: 0}
        for ev in open_run(os.path.dirname(os.path.dirname(logs["xy+api"]))).events(types=[ApiCallsRecorded]):
            n[ev.direction] += len(ev)
        calls, back = n[0] / (args.warmup + args.steps), n[DIR_BACKWARD] / (args.warmup + args.steps)
        print(f"API calls recorded per step: {calls:.0f} forward (+{(fwd - xy) * 1e6 / max(calls, 1):.1f} us per "
              f"call), {back:.0f} backward (+{(api - fwd) * 1e6 / max(back, 1):.1f} us per call)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
