"""Real multi-process runs for the tests: ranks of a gloo group started as separate Python processes."""

from __future__ import annotations

import os


def free_port() -> int:
    """A TCP port free on this machine now, for a spawned gloo group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_scripts(script: str, args: list[str], world: int, tmp_dir, timeout: float) -> list[str]:
    """Run ``python -c script *args`` as ranks 0..world-1 of a gloo group (MASTER_ADDR/PORT, RANK,
    WORLD_SIZE in their environment) and return each rank's stdout. A rank that exits non-zero, or
    a group that does not finish within ``timeout`` seconds, fails the test with every rank's exit
    status and stderr tail. Output goes to files in ``tmp_dir``, not pipes: no rank can stall on a
    full pipe while another waits for it in a collective, and nothing is left open when the test ends."""
    import subprocess
    import sys
    import time

    import pytest

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    paths = [(os.path.join(tmp_dir, f"rank{r}.out"), os.path.join(tmp_dir, f"rank{r}.err")) for r in range(world)]
    procs = []
    try:
        for r, (out_path, err_path) in enumerate(paths):
            with open(out_path, "w") as out, open(err_path, "w") as err:
                procs.append(subprocess.Popen([sys.executable, "-c", script, *args], env=dict(env, RANK=str(r)),
                                              stdout=out, stderr=err))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)

    def read(path: str) -> str:
        with open(path, errors="replace") as f:
            return f.read()

    if any(p.returncode for p in procs):
        report = "\n".join(
            f"rank {r}: exit status {p.returncode}\n{read(err)[-3000:]}" for r, (p, (_, err)) in enumerate(zip(procs, paths, strict=True))
        )
        pytest.fail(f"a rank failed or did not finish in {timeout} s:\n{report}")
    return [read(o) for o, _ in paths]
