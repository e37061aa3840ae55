"""Synthesise the scale benchmark's run: RANKS ranks x STEPS steps x TENSORS tensors x 6 ops, written
with the project's own LogWriter, one process per rank directory as the recorder would.

Per step and rank, four stats records: ``actv`` and ``actv_grad`` (TENSORS*2/5 rows each: input and
output of TENSORS/5 modules, call ids in hook order), ``grad_reduced`` and ``param`` (TENSORS/10 rows
each). Values are log-normal noise around per-tensor magnitudes; one x50 jump is injected on rank
RANKS//2 at step STEPS*3/4 (the anomaly a re-detection must rank first).

    .venv/bin/python benchmarks/scale_synth.py OUT [--ranks 256] [--steps 400] [--tensors 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OPS = ("min", "max", "norm", "mean", "zeros", "nans")
STAMP = "Dec04_12-00-00"


def kinds_layout(tensors: int) -> dict[str, tuple[list[str], np.ndarray | None]]:
    modules = tensors // 5
    params = (tensors - 4 * modules) // 2
    mods = [f"layers.{i // 8}.block.sub_{i % 8}" for i in range(modules)]
    pars = [f"layers.{i // 4}.block.p{i % 4}.weight" for i in range(params)]
    pair = np.tile(np.array([1, 2], np.uint8), modules)
    return {
        "actv": ([n for n in mods for _ in (0, 1)], pair),
        "actv_grad": ([n for n in mods for _ in (0, 1)], pair + 2),
        "grad_reduced": (pars, None),
        "param": (pars, None),
    }


def write_rank(out: str, rank: int, world: int, steps: int, tensors: int, first_step: int = 0) -> None:
    from trainrec.recorder.writer import LogWriter
    from trainrec.schema.events import StepBegan, StepEnded, TensorStatsRecorded

    rng = np.random.default_rng(rank)
    kinds = kinds_layout(tensors)
    rdir = os.path.join(out, f"{STAMP}-rank{rank}-{rank:08x}")
    inject = (world // 2, first_step + steps * 3 // 4)
    with LogWriter(rdir, rank=rank, world_size=world, run_id="scale", flush_interval=1.0, queue_size=256) as w:
        ids = {k: np.asarray(w.intern(v[0], step=-1), dtype="<u4").tobytes() for k, v in kinds.items()}
        series = {}
        for kind, (names, _) in kinds.items():
            b = 10.0 ** rng.uniform(-4, 1, len(names))
            b = b[None, :] * rng.lognormal(0, 0.05, (steps, len(names)))
            vals = np.stack([-b, b, 30 * b, 0.01 * b * rng.standard_normal(b.shape), np.full(b.shape, 0.01),
                             np.zeros(b.shape)], axis=2).astype("<f4")
            series[kind] = vals
        series["actv"][inject[1] - first_step, 7, :4] *= 50 if rank == inject[0] else 1
        calls = {k: np.arange(len(v[0]), dtype="<u4").tobytes() for k, v in kinds.items() if k.startswith("actv")}
        for i in range(steps):
            s = first_step + i
            w.write(StepBegan(rank=rank, step=s, wall=1000.0 + s))
            for kind, (_, slots) in kinds.items():
                w.write(TensorStatsRecorded(
                    rank=rank, step=s, wall=1000.0 + s, kind=kind, ops=OPS, dtype="f", name_ids=ids[kind],
                    values=series[kind][i].tobytes(), call_ids=calls.get(kind, b""),
                    slots=b"" if slots is None else slots.tobytes()))
            w.write(StepEnded(rank=rank, step=s, wall=1000.5 + s, duration=0.5, collected=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--first-rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    world = a.world or a.ranks
    for r in range(a.first_rank, a.first_rank + a.ranks):
        write_rank(a.out, r, world, a.steps, a.tensors)
    print(f"wrote {a.ranks} ranks x {a.steps} steps x {a.tensors} tensors to {a.out} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
