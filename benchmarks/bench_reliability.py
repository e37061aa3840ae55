"""Reliability figures: what a kill -9 loses, what hostile logs cost a reader, what per-step durability costs.

Three parts (``--part kill|memory|durability``, default all), each printing a table:

* ``kill``: a real training (``record()``, a small MLP) killed with SIGKILL at random moments (start-up,
  mid-run, shutdown); per trial the last step training finished (published by the process itself in a
  shared memory page after each step, before anything else), the last step whose StepEnded is in the
  log, the steps lost and the training time lost (wall time between the two steps' ends). Both
  durabilities (``interval``, the default 0.2 s flush interval; ``step``).
* ``memory``: peak resident memory (VmHWM) of ``trainrec check`` and ``trainrec dump`` on each hostile
  file (valid-CRC 64 MiB frames built to expand when decoded, and 64 MiB of tiny valid frames whose
  sequence numbers all go back: tests/replay/test_reliability.py).
* ``durability``: time per training step with ``TRAINREC_DURABILITY`` interval vs step, alternating
  blocks of steps in one process each, median and the median of the paired block differences.

Usage: ``.venv/bin/python benchmarks/bench_reliability.py [--trials 40] [--part kill]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "replay"))

TRAIN = textwrap.dedent("""
    import mmap, os, struct, sys, time
    import torch
    from trainrec.recorder import record
    out, steps, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fd = os.open(progress, os.O_RDWR)
    page = mmap.mmap(fd, 24)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 128)
    with record(model, opt, output_dir=out, config={"wg_distribution": True, "ops": ["norm", "max"]}):
        page[16:24] = struct.pack("<d", time.time())
        for step in range(steps):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            page[:16] = struct.pack("<qd", step, time.time())
""")
PAGE = struct.Struct("<qdd")  # last step finished, when; when training began


def _env(durability: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINREC_RUN_ID", "DYNAMIC_MONITOR")}
    env["TRAINREC_DURABILITY"] = durability
    return env


def _log_end(out: str) -> tuple[int, float]:
    """The last StepEnded (step, wall) in the run's log; (-1, 0.0) when there is none."""
    from trainrec.replay.reader import read_log
    from trainrec.schema import layout
    from trainrec.schema.events import StepEnded

    last = (-1, 0.0)
    for d in os.listdir(out) if os.path.isdir(out) else ():
        for path in layout.list_logs(os.path.join(out, d)):
            for ev in read_log(path)[1]:
                if isinstance(ev, StepEnded) and ev.step > last[0]:
                    last = (ev.step, ev.wall)
    return last


def _phases(trials: int) -> list[str]:
    """A fifth at start-up (before the first step ends), a fifth at shutdown (after the last), the rest mid-run."""
    edge = max(1, trials // 5)
    return ["start-up"] * edge + ["shutdown"] * edge + ["mid-run"] * (trials - 2 * edge)


def kill_trials(trials: int, steps: int, durability: str, seed: int) -> list[dict]:
    """Kill moments are chosen by the training's own progress (robust to a loaded machine): start-up, a
    random time after the process starts, before its first step ends; mid-run, a random step, then a
    random fraction of a millisecond; shutdown, a random time up to 0.3 s after the last step ends."""
    rng = random.Random(seed)
    rows = []
    for i, phase in enumerate(_phases(trials)):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out")
            progress = os.path.join(tmp, "progress")
            with open(progress, "wb") as f:
                f.write(PAGE.pack(-1, 0.0, 0.0))
            fd = os.open(progress, os.O_RDONLY)
            page = mmap.mmap(fd, PAGE.size, prot=mmap.PROT_READ)
            t0 = time.time()
            proc = subprocess.Popen([sys.executable, "-c", TRAIN, out, str(steps), progress], env=_env(durability),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if phase == "start-up":
                time.sleep(rng.uniform(0.2, 2.5))
            else:
                target = steps - 1 if phase == "shutdown" else rng.randrange(steps - 1)
                while PAGE.unpack(page[:])[0] < target and proc.poll() is None:
                    time.sleep(0.0005)
                time.sleep(rng.uniform(0, 0.3) if phase == "shutdown" else rng.uniform(0, 0.001))
            exited = proc.poll() is not None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed = time.time()
            step, wall, began = PAGE.unpack(page[:])
            page.close()
            os.close(fd)
            if step < 0 and phase != "start-up":
                phase += " (before step 0 ended)"
            last, last_wall = _log_end(out)
            lost_ms = 0.0 if step < 0 else (wall - max(last_wall, began)) * 1e3
            rows.append({"trial": i, "phase": phase + (" (exited)" if exited else ""), "kill_s": killed - t0,
                         "finished": step, "logged": last, "steps_lost": max(0, step - last),
                         "time_lost_ms": max(0.0, lost_ms)})
    return rows


def memory(tmp: str) -> list[dict]:
    import test_reliability as corpus
    from hostile_logs import good_log
    from trainrec.schema import framing

    base_path = good_log(os.path.join(tmp, "good"))
    with open(base_path, "rb") as f:
        base = f.read()
    rows = []
    probe = textwrap.dedent("""
        import sys
        from trainrec.tools.cli import main
        rc = main(sys.argv[1:])
        hwm = next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
        print(rc, hwm, file=sys.stderr)
    """)
    for name in (*corpus.HOSTILE, "tiny_frames"):
        path = os.path.join(tmp, f"{name}.trl")
        with open(path, "wb") as f:
            if name == "tiny_frames":  # 64 MiB of valid tiny records, each numbered 5: a gap each
                f.write(framing.encode_file_header() + corpus.tiny_frames(framing.MAX_FRAME // 36))
            else:
                f.write(base + corpus._frame(corpus.hostile_payload(name, framing.MAX_FRAME)))
        for cmd in ("check", "dump"):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", probe, cmd, path], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
            rc, hwm = done.stderr.strip().splitlines()[-1].split()
            rows.append({"file": name, "command": cmd, "exit": int(rc), "peak_mb": int(hwm) / 1024,
                         "seconds": time.perf_counter() - t0})
        os.remove(path)
    return rows


DURABILITY_PROBE = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from trainrec.recorder import record
    out, blocks, per_block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 128)
    times = []
    with record(model, opt, output_dir=out, config={"wg_distribution": True, "ops": ["norm", "max"]}):
        for b in range(blocks):
            t0 = time.perf_counter()
            for _ in range(per_block):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            times.append((time.perf_counter() - t0) / per_block)
    print(json.dumps(times))
""")


def durability_cost(rounds: int, blocks: int, per_block: int) -> dict:
    import json

    per = {"interval": [], "step": []}
    diffs = []
    for _ in range(rounds):
        got = {}
        for mode in ("interval", "step"):
            with tempfile.TemporaryDirectory() as tmp:
                done = subprocess.run([sys.executable, "-c", DURABILITY_PROBE, os.path.join(tmp, "out"), str(blocks),
                                       str(per_block)], env=_env(mode), capture_output=True, text=True, check=True)
            got[mode] = json.loads(done.stdout.strip().splitlines()[-1])[1:]  # (the first block warms up)
            per[mode] += got[mode]
        diffs += [s - i for s, i in zip(got["step"], got["interval"], strict=True)]
    return {"interval_ms": statistics.median(per["interval"]) * 1e3, "step_ms": statistics.median(per["step"]) * 1e3,
            "paired_diff_ms": statistics.median(diffs) * 1e3, "blocks": len(diffs), "steps_per_block": per_block}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("kill", "memory", "durability", "all"), default="all")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--steps", type=int, default=1500, help="steps of each killed training")
    p.add_argument("--seed", type=int, default=35)
    args = p.parse_args()
    if args.part in ("kill", "all"):
        for durability in ("interval", "step"):
            rows = kill_trials(args.trials, args.steps, durability, args.seed)
            print(f"\nkill -9, durability {durability}: {args.trials} trials of {args.steps} steps "
                  "(killed by the training's own progress)")
            print("| trial | phase | killed at s | last step finished | last step in log | steps lost | time lost ms |")
            print("|---|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['trial']} | {r['phase']} | {r['kill_s']:.2f} | {r['finished']} | {r['logged']} | "
                      f"{r['steps_lost']} | {r['time_lost_ms']:.0f} |")
            lost = [r["steps_lost"] for r in rows if r["finished"] >= 0]
            ms = [r["time_lost_ms"] for r in rows if r["finished"] >= 0]
            if lost:
                print(f"steps lost: median {statistics.median(lost)}, max {max(lost)}; time lost ms: median "
                      f"{statistics.median(ms):.0f}, max {max(ms):.0f} (trials with a finished step: {len(lost)})")
    if args.part in ("memory", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            rows = memory(tmp)
        print("\npeak reader memory on the hostile corpus (one valid-CRC 64 MiB frame after a small good log)")
        print("| file | command | exit | peak MB (VmHWM) | seconds |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['file']} | {r['command']} | {r['exit']} | {r['peak_mb']:.0f} | {r['seconds']:.1f} |")
    if args.part in ("durability", "all"):
        r = durability_cost(rounds=3, blocks=6, per_block=200)
        print(f"\nper-step durability: median step {r['interval_ms']:.3f} ms (interval) vs {r['step_ms']:.3f} ms "
              f"(step); paired block difference median {r['paired_diff_ms']:+.3f} ms per step "
              f"({r['blocks']} block pairs of {r['steps_per_block']} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
