"""Gloo ranks that fail in the ways the post-mortem must explain, started as real processes.

:data:`SCRIPT` is one rank (``python -c SCRIPT SCENARIO OUT_DIR``; RANK, WORLD_SIZE, MASTER_ADDR/PORT
in its environment): a small model whose ``sync`` module all-reduces a copy of its input in every
forward, recorded with collectives (metadata mode) and the stall watchdog on. At ``BAD_STEP`` the last
rank misbehaves as SCENARIO says: ``hang`` sleeps before its all_reduce, ``raise`` raises in the
forward, ``desync`` calls all_gather instead; ``run`` (the kill -9 trials) trains on. Each rank prints
``call SEQ STEP`` before each all_reduce (SEQ: its call number on the world group) and ``done STEP``
after each optimizer step, flushed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from ranks import free_port

BAD_STEP = 3

SCRIPT = textwrap.dedent("""
    import os, sys, time, collections, torch, torch.distributed as dist
    scenario, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from trainrec.recorder import record
    BAD_STEP = @BAD_STEP@
    calls = [0]

    class Sync(torch.nn.Module):
        step = 0
        def forward(self, x):
            y = x.detach().clone()
            bad = self.step == BAD_STEP and rank == world - 1
            if bad and scenario == "hang":
                print("sleeping", flush=True)
                time.sleep(3600)
            if bad and scenario == "raise":
                raise RuntimeError(f"bad batch on rank {rank}")
            print(f"call {calls[0]} {self.step}", flush=True)
            calls[0] += 1
            if bad and scenario == "desync":
                dist.all_gather([torch.empty_like(y) for _ in range(world)], y)
            else:
                dist.all_reduce(y)
            return x + 0 * y

    torch.manual_seed(0)
    sync = Sync()
    model = torch.nn.Sequential(collections.OrderedDict(embed=torch.nn.Linear(8, 8), sync=sync,
                                                        head=torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"xy_distribution": True, "wg_distribution": True,
           "cc_distribution": {"enable": True, "cc_metadata_only": True},
           "stall_watchdog": {"factor": 20, "min_seconds": 2.0}}
    with record(model, opt, cfg, output_dir=out):
        for step in range(100000):
            sync.step = step
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            print(f"done {step}", flush=True)
            if scenario == "run":
                time.sleep(0.01)
            elif step >= BAD_STEP + 20:
                break
""").replace("@BAD_STEP@", str(BAD_STEP))


class Ranks:
    """The processes of one gloo group running :data:`SCRIPT`; stdout of each in a file."""

    def __init__(self, scenario: str, world: int, tmp_dir, out_dir) -> None:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
        self.paths = [os.path.join(str(tmp_dir), f"{scenario}-rank{r}.{k}") for r in range(world) for k in ("out", "err")]
        self.procs = []
        self.killed_first: int | None = None  # (the kill -9 trials: the rank they killed first)
        for r in range(world):
            with open(self.paths[2 * r], "w") as out, open(self.paths[2 * r + 1], "w") as err:
                self.procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, scenario, str(out_dir)],
                                                   env=dict(env, RANK=str(r)), stdout=out, stderr=err))

    def output(self, r: int) -> str:
        with open(self.paths[2 * r], errors="replace") as f:
            return f.read()

    def stderr(self, r: int) -> str:
        with open(self.paths[2 * r + 1], errors="replace") as f:
            return f.read()

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(
                    f"rank {r} (exit {p.poll()}):\n{self.output(r)[-500:]}\n{self.stderr(r)[-2000:]}"
                    for r, p in enumerate(self.procs)))
            time.sleep(0.1)

    def wait_exit(self, r: int, timeout: float) -> bool:
        """Whether rank ``r`` exits within ``timeout`` seconds."""
        try:
            self.procs[r].wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self, order=None) -> None:
        """SIGKILL every rank still running (in ``order``), and reap them."""
        for r in (order if order is not None else range(len(self.procs))):
            if self.procs[r].poll() is None:
                self.procs[r].kill()
        for p in self.procs:
            p.wait(30)

    def last(self, r: int, word: str, field: int = 1) -> int | None:
        """The number after the last ``word`` line rank ``r`` printed (``done STEP``, ``call SEQ STEP``:
        ``field`` 2 for the call's step)."""
        nums = [int(line.split()[field]) for line in self.output(r).splitlines() if line.startswith(word + " ")]
        return nums[-1] if nums else None
