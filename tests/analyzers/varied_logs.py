"""Test helper: runs that exercise every path of the columnar re-detection, written with LogWriter.

Per rank, per step: ``actv`` (modules with input and output slots, two micro steps, call ids, one module
called twice per micro step), ``grad_reduced`` (random placeholder rows, a whole-placeholder record),
``param`` (NaN and Inf values, a ``nans`` count rising, float64 records on some steps, a tensor added
half-way: a layout change), ``exp_avg`` (its ops change half-way: the record-time Detector's path).
Jumps of x20 at random. Rank 1 resumes at step ``steps // 2 + 2`` from a second file, superseding the
first file's steps from there; rank 2 ends in a torn record.
"""

from __future__ import annotations

import os

import numpy as np
from trainrec.recorder.writer import LogWriter
from trainrec.schema import framing
from trainrec.schema.events import RunResumed, StepBegan, StepEnded, TensorStatsRecorded

OPS = ("min", "max", "norm", "mean", "zeros", "nans")
STAMP = "Dec04_10-00-00"


def _values(rng, base: np.ndarray, jump: float) -> np.ndarray:
    b = base * rng.lognormal(0.0, 0.08, size=len(base))
    b = b * np.where(rng.random(len(base)) < jump, 20.0, 1.0)
    return np.stack([-b, b, 10 * b, 0.1 * b * rng.standard_normal(len(base)),
                     np.full(len(base), 0.01), np.zeros(len(base))], axis=1)


def _record(rank, step, kind, ids, vals, *, ops=OPS, dtype="f", micro=None, calls=None, slots=None, holes=None):
    return TensorStatsRecorded(
        rank=rank, step=step, wall=100.0 + step, kind=kind, ops=ops, dtype=dtype,
        name_ids=np.asarray(ids, "<u4").tobytes(),
        values=np.asarray(vals, "<f4" if dtype == "f" else "<f8").tobytes(),
        micro_steps=b"" if micro is None else np.asarray(micro, "<u2").tobytes(),
        call_ids=b"" if calls is None else np.asarray(calls, "<u4").tobytes(),
        slots=b"" if slots is None else np.asarray(slots, np.uint8).tobytes(),
        placeholders=b"" if holes is None else np.asarray(holes, np.uint8).tobytes(),
    )


def _write_steps(w: LogWriter, rank: int, steps: range, rng, total_steps: int, jump: float) -> None:
    mods = [f"layer{i}" for i in range(5)] + ["layer1"]  # layer1 is called twice per micro step
    pars = [f"layer{i}.weight" for i in range(6)]
    extra = ["late.bias"]
    ids_m = w.intern(mods[:5], step=-1) + [None]
    ids_m[5] = ids_m[1]
    ids_p = w.intern(pars, step=-1)
    ids_x = w.intern(extra, step=-1)
    base_m = 10.0 ** rng.uniform(-3, 1, 2 * len(mods) * 2)
    base_p = 10.0 ** rng.uniform(-3, 1, len(pars) + 1)
    for s in steps:
        w.write(StepBegan(rank=rank, step=s, wall=100.0 + s))
        rows = len(mods) * 2 * 2  # (input, output) x 2 micro steps
        ids = [i for _ in range(2) for i in ids_m for _ in range(2)]
        micro = [m for m in range(2) for _ in range(2 * len(mods))]
        slots = [1, 2] * (rows // 2)
        calls = list(range(rows))
        w.write(_record(rank, s, "actv", ids, _values(rng, base_m, jump), micro=micro, calls=calls, slots=slots))
        holes = (rng.random(len(pars)) < 0.15).astype(np.uint8)
        gvals = _values(rng, base_p[: len(pars)], jump)
        gvals[holes.astype(bool)] = np.nan
        if s % 7 == 3:
            holes[:] = 1
            gvals[:] = np.nan
        w.write(_record(rank, s, "grad_reduced", ids_p, gvals, holes=holes))
        late = s >= total_steps // 2
        pids = ids_p + (ids_x if late else [])
        pvals = _values(rng, base_p[: len(pids)], jump)
        if rng.random() < 0.2:
            r = int(rng.integers(0, len(pids)))
            pvals[r, :5] = np.nan if rng.random() < 0.7 else np.inf
            pvals[r, 5] = 3
        w.write(_record(rank, s, "param", pids, pvals, dtype="d" if s % 5 == 1 else "f"))
        ops = OPS if s < total_steps // 2 else ("norm", "min", "max")
        evals = _values(rng, base_p[: len(pars)], jump)[:, [OPS.index(o) for o in ops]]
        w.write(_record(rank, s, "exp_avg", ids_p, evals, ops=ops))
        w.write(StepEnded(rank=rank, step=s, wall=100.5 + s, duration=0.5, collected=True,
                          optimizer_skipped=s % 11 == 10))


def write_varied_run(out: str, ranks: int = 3, steps: int = 40, seed: int = 0, jump: float = 0.02) -> str:
    """The run described in the module docstring, under ``out``; returns ``out``."""
    for rank in range(ranks):
        rng = np.random.default_rng(seed * 100 + rank)
        rdir = os.path.join(out, f"{STAMP}-rank{rank}-{rank + 0xB0:08x}")
        with LogWriter(rdir, rank=rank, world_size=ranks, run_id="varied", flush_interval=0.05) as w:
            _write_steps(w, rank, range(steps), rng, steps, jump)
        if rank == 1:
            resume = steps // 2 + 2
            with LogWriter(rdir, rank=rank, world_size=ranks, run_id="varied", flush_interval=0.05) as w:
                w.write(RunResumed(rank=rank, step=resume, wall=500.0, last_step=resume - 1, reason="test"))
                _write_steps(w, rank, range(resume, steps + 5), rng, steps, jump)
        if rank == 2:
            path = sorted(os.path.join(rdir, f) for f in os.listdir(rdir))[-1]
            with open(path, "ab") as f:
                f.write(framing.FRAME_MAGIC_BYTES + b"\x00\x10")  # a frame that never finished
    return out
