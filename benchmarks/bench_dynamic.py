"""What the dynamic-config watcher costs a training step while nothing changes (idle).

Three measurements:

1. ``poll()`` alone, in a tight loop (ns per call), against an empty method call.
2. A small CPU training loop in one process: median step time without a watcher and with one
   (``poll`` at every step end), in interleaved blocks (A B A B ...) so that drift of a shared machine
   hits both alike; the paired per-block difference is the cost, with its spread as the noise.
3. The same loop on several gloo ranks in lockstep (an ``all_reduce`` of the gradients per step, as
   data-parallel training does), in rotating blocks: no ``poll``, ``poll`` of a watcher with its
   agreement rounds at the adaptive interval (the default), and ``poll`` of a watcher with a round at
   every step (``sync_period=0``) to show what the amortisation saves. Both watchers live for the whole
   run (their idle threads are in every block; measurement 2 covers the threads' cost). The time spent
   inside ``poll()`` is also timed directly on every rank.

Usage: ``python benchmarks/bench_dynamic.py [--blocks 12] [--steps 200] [--ranks 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import timeit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from trainrec.recorder.dynamic import DynamicConfigWatcher


def _validate(raw: dict) -> dict:
    return dict(raw)


def _config_file(directory: str) -> str:
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump({"switch": False, "wg_distribution": True, "collect_times": 3}, f, indent=2)
    return path


class _Model:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-3)
        self.x = torch.randn(64, 64)

    def step(self, reduce: bool) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.net(self.x).pow(2).mean().backward()
        if reduce:
            for p in self.net.parameters():
                dist.all_reduce(p.grad)
        self.opt.step()


def _block(
    model: _Model, watcher, start: int, n: int, reduce: bool, polls: list | None = None
) -> tuple[list[float], float]:
    """Run ``n`` steps; per-step times and the total time spent in poll() (each one into ``polls``)."""
    times = []
    in_poll = 0.0
    pc = time.perf_counter
    for step in range(start, start + n):
        t0 = pc()
        model.step(reduce)
        if watcher is not None:
            t1 = pc()
            watcher.poll(step)
            d = pc() - t1
            in_poll += d
            if polls is not None:
                polls.append(d)
        times.append(pc() - t0)
    return times, in_poll


def bench_poll(directory: str) -> dict:
    w = DynamicConfigWatcher(
        _config_file(directory), validate=_validate, emit=lambda e: None, rank=0, writes_back=True
    )
    w.start()
    w.poll(0)  # consumes the initial state
    n = 1_000_000

    class Empty:
        def poll(self, step):
            return None

    e = Empty()
    t_poll = min(timeit.repeat(lambda: w.poll(5), number=n, repeat=5)) / n
    t_empty = min(timeit.repeat(lambda: e.poll(5), number=n, repeat=5)) / n
    w.close()
    return {"poll_ns": t_poll * 1e9, "empty_call_ns": t_empty * 1e9}


def _summary(base: list[list[float]], other: list[list[float]]) -> dict:
    diffs = [statistics.mean(b) - statistics.mean(a) for a, b in zip(base, other, strict=True)]
    a_all = [t for blk in base for t in blk]
    b_all = [t for blk in other for t in blk]
    return {
        "median_base_us": statistics.median(a_all) * 1e6,
        "median_us": statistics.median(b_all) * 1e6,
        "diff_mean_us": statistics.mean(diffs) * 1e6,
        "diff_stdev_us": statistics.stdev(diffs) * 1e6 if len(diffs) > 1 else 0.0,
        "base_block_stdev_us": statistics.stdev(statistics.mean(a) for a in base) * 1e6
        if len(base) > 1
        else 0.0,
    }


def bench_single(directory: str, blocks: int, steps: int) -> dict:
    torch.set_num_threads(1)
    model = _Model()
    path = _config_file(directory)
    base, watched, in_poll, polls, empty_polls = [], [], 0.0, [], []
    step = 0
    _block(model, None, 0, 50, False)  # warm-up
    for _ in range(blocks):
        times, _ = _block(model, _Empty(), step, steps, False, empty_polls)  # no watcher, same timers
        base.append(times)
        step += steps
        w = DynamicConfigWatcher(path, validate=_validate, emit=lambda e: None, rank=0, writes_back=True)
        w.start()
        w.poll(step - 1)  # the initial state (switch false): not part of the idle cost
        time.sleep(0.3)  # let the observer threads finish starting: start-up is not the idle cost
        times, p = _block(model, w, step, steps, False, polls)
        w.close()
        watched.append(times)
        in_poll += p
        step += steps
    out = _summary(base, watched)
    out["in_poll_per_step_us"] = in_poll / (blocks * steps) * 1e6
    for key, ds in (("poll", polls), ("empty", empty_polls)):
        ds.sort()
        out[f"{key}_p50_us"] = ds[len(ds) // 2] * 1e6
        out[f"{key}_p99_us"] = ds[int(len(ds) * 0.99)] * 1e6
        out[f"{key}_max_us"] = ds[-1] * 1e6
        out[f"{key}_over_1ms"] = sum(d > 1e-3 for d in ds)
    return out


class _Empty:
    """Stands in for a watcher: the baseline blocks time an empty call the same way."""

    def poll(self, step: int) -> None:
        return None


def _rank_main(rank: int, world: int, port: int, path: str, blocks: int, steps: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _Model()
    # Both watchers live for the whole run, as in training; a block either polls one of them at
    # every step or polls none (same on every rank, so the collectives stay matched).
    watchers = {
        name: DynamicConfigWatcher(
            path, validate=_validate, emit=lambda e: None, rank=rank, writes_back=rank == 0, **kw
        )
        for name, kw in (("adaptive", {}), ("every_step", {"sync_period": 0.0}))
    }
    for w in watchers.values():
        w.start()
        w.poll(-1)  # first (synchronous) round and the initial state, outside the timing
    _block(model, None, 0, 50, True)
    results: dict = {k: [] for k in ("none", *watchers)}
    in_poll = {k: 0.0 for k in watchers}
    rounds = {k: 0 for k in watchers}
    step = 0
    for _ in range(blocks):
        for name in results:
            w = watchers.get(name)
            dist.barrier()
            before = w._sync.launches if w is not None else 0
            times, p = _block(model, w, step, steps, True)
            results[name].append(times)
            if w is not None:
                rounds[name] += w._sync.launches - before
                in_poll[name] += p
            step += steps
    for w in watchers.values():
        w.close()
    dist.destroy_process_group()
    out = {"rank": rank}
    for name in watchers:
        out[name] = _summary(results["none"], results[name])
        out[name]["in_poll_per_step_us"] = in_poll[name] / (blocks * steps) * 1e6
        out[name]["rounds_per_block"] = rounds[name] / blocks
    q.put(out)


def bench_ranks(directory: str, world: int, blocks: int, steps: int) -> list[dict]:
    path = _config_file(directory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, path, blocks, steps, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    outs = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    return sorted(outs, key=lambda o: o["rank"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=200, help="steps per block")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        p = bench_poll(d)
        print(
            f"poll() idle: {p['poll_ns']:.0f} ns per call (an empty method call: {p['empty_call_ns']:.0f} ns)"
        )
        s = bench_single(d, args.blocks, args.steps)
        print(
            f"1 process, {args.blocks} x {args.steps} steps: median step {s['median_base_us']:.1f} us without, "
            f"{s['median_us']:.1f} us with the watcher; paired difference {s['diff_mean_us']:+.2f} us "
            f"(stdev over blocks {s['diff_stdev_us']:.2f} us; baseline block-to-block stdev "
            f"{s['base_block_stdev_us']:.2f} us); time inside poll() {s['in_poll_per_step_us']:.3f} us/step "
            f"(timed with perf_counter around it: p50 {s['poll_p50_us']:.2f} us, p99 {s['poll_p99_us']:.2f} us, "
            f"max {s['poll_max_us']:.0f} us, {s['poll_over_1ms']} of {args.blocks * args.steps} over 1 ms; "
            f"an empty call in the baseline blocks: p50 {s['empty_p50_us']:.2f} us, p99 {s['empty_p99_us']:.2f} us, "
            f"max {s['empty_max_us']:.0f} us, {s['empty_over_1ms']} over 1 ms)"
        )
        if args.ranks > 1:
            for o in bench_ranks(d, args.ranks, args.blocks, args.steps):
                for name in ("adaptive", "every_step"):
                    r = o[name]
                    print(
                        f"rank {o['rank']}/{args.ranks} gloo, agreement {name}: median step "
                        f"{r['median_base_us']:.1f} us without, {r['median_us']:.1f} us with; paired difference "
                        f"{r['diff_mean_us']:+.2f} us (stdev {r['diff_stdev_us']:.2f}; baseline stdev "
                        f"{r['base_block_stdev_us']:.2f}); inside poll() {r['in_poll_per_step_us']:.2f} us/step; "
                        f"{r['rounds_per_block']:.1f} rounds per {args.steps} steps "
                        f"({r['in_poll_per_step_us'] * args.steps / max(r['rounds_per_block'], 1e-9):.0f} us per round)"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
