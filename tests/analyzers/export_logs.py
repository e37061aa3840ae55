"""Helpers for the export tests: real logs written by the real LogWriter, and what they hold.

``write_rank_log`` records a small synthetic training (activations with input/output slots and
micro steps, activation grads, weight grads, params, optimizer states) with values that exercise the
number formats (NaN, -0.0, tiny and large magnitudes), and returns the expected statistics keyed
``(kind, step, vpp, name, micro, slot) -> float32 values per op``.
"""

from __future__ import annotations

import os

import numpy as np
from trainrec.recorder.writer import LogWriter
from trainrec.schema.events import (
    OPS,
    AnomalyDetected,
    ConfigApplied,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    pack_array,
)

STAMP = "Nov30_11-13-33"
MODULES = ["embed", "0.self_attn", "0.mlp", "head", "weird,name"]
PARAMS = ["embed.weight", "0.self_attn.in_proj.weight", "0.mlp.fc1.bias", "head.weight", 'quote"d.bias']


def rank_dir(out, rank: int, stamp: str = STAMP, suffix: str | None = None) -> str:
    return os.path.join(str(out), f"{stamp}-rank{rank}-{suffix or f'{rank + 0xB0:08x}'}")


def make_values(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    v = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-7, 6, (n, k))
    v = v.astype(np.float32)
    v[rng.random((n, k)) < 0.05] = np.nan
    v[rng.random((n, k)) < 0.05] = np.float32(-1e-9)
    v[rng.random((n, k)) < 0.05] = 0.0
    return v


def stats_record(rank, step, kind, ids, values, *, micro=None, slots=None, vpp=None, wall=None):
    return TensorStatsRecorded(
        rank=rank,
        step=step,
        wall=wall if wall is not None else 1000.0 + step,
        kind=kind,
        ops=OPS,
        dtype="f",
        name_ids=pack_array("I", ids),
        values=np.ascontiguousarray(values, dtype="<f4").tobytes(),
        micro_steps=pack_array("H", micro) if micro is not None else b"",
        slots=bytes(slots) if slots is not None else b"",
        vpp_stages=bytes(vpp) if vpp is not None else b"",
    )


def write_rank_log(
    rdir: str,
    *,
    rank: int = 0,
    steps=range(4),
    micro_steps: int = 2,
    seed: int = 0,
    run_id: str = "run-x",
    kinds=("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq"),
    close: bool = True,
    anomalies: bool = True,
    writer: LogWriter | None = None,
):
    """Write one rank's log; returns (expected stats, the writer)."""
    rng = np.random.default_rng(seed + 1000 * rank)
    w = writer or LogWriter(rdir, rank=rank, world_size=1, run_id=run_id, flush_interval=0.02)
    mod_ids = w.intern(MODULES, step=-1)
    par_ids = w.intern(PARAMS, step=-1)
    expected: dict = {}
    w.write(ConfigApplied(rank=rank, step=min(steps, default=0), wall=999.0, path="cfg.json", content_hash="abc",
                          start_step=0, reason="start"))
    for s in steps:
        w.write(StepBegan(rank=rank, step=s, wall=1000.0 + s))
        for kind in kinds:
            if kind in ("actv", "actv_grad"):
                sl = (1, 2) if kind == "actv" else (3, 4)
                # one record per micro step, rows per module: input then output
                for m in range(micro_steps):
                    ids, micro, slots, vpp = [], [], [], []
                    for i, mid in enumerate(mod_ids):
                        for slot in sl:
                            if kind == "actv_grad" and i == 0 and slot == 3:
                                continue  # the embedding has no input grad: that side stays nan
                            ids.append(mid)
                            micro.append(m)
                            slots.append(slot)
                            vpp.append(0 if i < 3 else 1)
                    vals = make_values(rng, len(ids), len(OPS))
                    w.write(stats_record(rank, s, kind, ids, vals, micro=micro, slots=slots, vpp=vpp))
                    for j in range(len(ids)):
                        expected[(kind, s, vpp[j], MODULES[mod_ids.index(ids[j])], micro[j], slots[j])] = vals[j]
            else:
                vals = make_values(rng, len(par_ids), len(OPS))
                vpp = [0, 0, 0, 1, 1]
                w.write(stats_record(rank, s, kind, par_ids, vals, vpp=vpp))
                for j, pid in enumerate(par_ids):
                    expected[(kind, s, vpp[j], PARAMS[pid - len(MODULES)], 0, 0)] = vals[j]
        if anomalies and s == 2:
            w.write(AnomalyDetected(rank=rank, step=s, wall=1000.5 + s, tag_name=f"0:embed.weight/rank{rank}/post_grad",
                                    op="norm", value=5.0, baseline=1.0, message="jump", rule="AnomalyTurbulence",
                                    kind="grad_reduced", name="embed.weight"))
        w.write(StepEnded(rank=rank, step=s, wall=1000.9 + s, duration=0.9, collected=True))
    if close:
        w.close()
    else:
        w.flush()
    return expected, w
