"""Test helper: synthesise per-rank trainrec logs with LogWriter, the way the recorder writes them
(names interned, one stats record per kind per step, record-time anomalies from an AlertEngine)."""

from __future__ import annotations

import os

import numpy as np
from trainrec.recorder.alerts import AlertEngine
from trainrec.recorder.writer import LogWriter
from trainrec.schema import layout
from trainrec.schema.events import SLOT_INPUT, SLOT_OUTPUT, StepEnded, TensorStatsRecorded, pack_array

OPS = ("min", "max", "norm", "mean", "zeros", "nans")


def stats_values(rng, n, base):
    """Plausible (min, max, norm, mean, zeros, nans) rows around per-row magnitudes ``base``."""
    noise = rng.lognormal(0.0, 0.05, size=n)
    b = base * noise
    return np.stack([-b, b, 10 * b, 0.1 * b, np.zeros(n), np.zeros(n)], axis=1)


def stats_record(rank, step, kind, ids, values, micro=None, calls=None, slots=None, dtype="f"):
    return TensorStatsRecorded(
        rank=rank, step=step, kind=kind, ops=OPS, dtype=dtype, name_ids=pack_array("I", ids),
        values=np.asarray(values, dtype="<f4" if dtype == "f" else "<f8").tobytes(),
        micro_steps=b"" if micro is None else np.asarray(micro, "<u2").tobytes(),
        call_ids=b"" if calls is None else np.asarray(calls, "<u4").tobytes(),
        slots=b"" if slots is None else np.asarray(slots, np.uint8).tobytes(),
        vpp_stages=b"",
    )


def write_rank(
    out_dir: str,
    rank: int,
    *,
    steps: int = 30,
    modules: int = 6,
    micro_steps: int = 2,
    pp_stage: int = 0,
    group_mates: tuple = (0, 1),
    run_id: str = "testrun",
    alert: dict | None = None,
    dump_dir: str | None = None,
    inject: tuple[int, int, float] | None = None,
    seed: int = 0,
    stop_after: int | None = None,
) -> str:
    """One rank's log: modules ``layer{i}`` with input/output activations per micro step, activation
    grads, reduced weight grads and params. ``inject=(step, module, factor)`` scales that module's
    output (and everything after it, as a real model would) at that step, on this rank.
    Returns the rank directory."""
    rng = np.random.default_rng(seed + 1000 * rank)
    rank_dir = os.path.join(out_dir, layout.rank_dir_name(rank, suffix=f"{rank:08x}"))
    engine = AlertEngine(alert, rank=rank, pp_stage=pp_stage, group_mates=group_mates,
                         dump_dir=dump_dir) if alert else None
    names = [f"layer{i}" for i in range(modules)]
    pnames = [f"layer{i}.weight" for i in range(modules)]
    base = 1.0 + np.arange(modules)
    with LogWriter(rank_dir, rank=rank, world_size=2, run_id=run_id, pp_stage=pp_stage,
                   group_mates=group_mates) as w:
        ids = w.intern(names + pnames, step=0)
        mids, pids = ids[:modules], ids[modules:]
        for step in range(steps if stop_after is None else stop_after):
            scale = np.ones(modules)
            if inject is not None and inject[0] == step:
                scale[inject[1]:] = inject[2]
            recs = []
            # forward: per micro step, modules in order, input then output (call ids in firing order)
            rows_ids, rows_vals, micro, calls, slots = [], [], [], [], []
            call = 0
            for m in range(micro_steps):
                for i in range(modules):
                    in_scale = scale[i - 1] if i else 1.0
                    for slot, s in ((SLOT_INPUT, in_scale), (SLOT_OUTPUT, scale[i])):
                        rows_ids.append(mids[i])
                        rows_vals.append(stats_values(rng, 1, base[i] * s)[0])
                        micro.append(m)
                        calls.append(call)
                        slots.append(slot)
                        call += 1
                recs.append(("actv", rows_ids, rows_vals, micro, calls, slots))
                rows_ids, rows_vals, micro, calls, slots = [], [], [], [], []
                # backward: modules in reverse, output_grad then input_grad
                for i in reversed(range(modules)):
                    for slot in (4, 3):
                        rows_ids.append(mids[i])
                        rows_vals.append(stats_values(rng, 1, 0.01 * base[i])[0])
                        micro.append(m)
                        calls.append(call)
                        slots.append(slot)
                        call += 1
                recs.append(("actv_grad", rows_ids, rows_vals, micro, calls, slots))
                rows_ids, rows_vals, micro, calls, slots = [], [], [], [], []
            recs.append(("grad_reduced", pids, stats_values(rng, modules, 0.01 * base), None, None, None))
            recs.append(("param", pids, stats_values(rng, modules, base), None, None, None))
            # the recorder batches a kind per step: merge the per-micro records of a kind
            merged: dict[str, list] = {}
            for kind, i_, v_, m_, c_, s_ in recs:
                if kind not in merged:
                    merged[kind] = [list(i_), list(v_), None if m_ is None else list(m_),
                                    None if c_ is None else list(c_), None if s_ is None else list(s_)]
                else:
                    cur = merged[kind]
                    cur[0] += i_
                    cur[1] += v_
                    cur[2] += m_
                    cur[3] += c_
                    cur[4] += s_
            for kind, (i_, v_, m_, c_, s_) in merged.items():
                rec = stats_record(rank, step, kind, i_, np.array(v_), m_, c_, s_)
                w.write(rec)
                if engine is not None:
                    row_names = [(names + pnames)[j] for j in i_]
                    for ev in engine.observe(
                        step=step, kind=kind, ops=OPS, names=row_names, values=np.array(v_, dtype="<f4"),
                        micro_steps=None if m_ is None else np.array(m_, np.uint16),
                        call_ids=None if c_ is None else np.array(c_, np.uint32),
                        slots=None if s_ is None else np.array(s_, np.uint8), vpp_stages=None,
                    ):
                        w.write(ev)
            w.write(StepEnded(rank=rank, step=step, collected=True, micro_steps=micro_steps))
    if engine is not None:
        engine.close()
    return rank_dir


def write_run(out_dir: str, ranks: int = 2, **kw) -> list[str]:
    """``ranks`` rank directories of one run; ``inject_rank`` (default 0) gets ``inject``."""
    inject_rank = kw.pop("inject_rank", 0)
    inject = kw.pop("inject", None)
    return [write_rank(out_dir, r, inject=inject if r == inject_rank else None, **kw) for r in range(ranks)]
