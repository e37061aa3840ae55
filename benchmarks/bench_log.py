"""Log format speed and size: trainrec's writer thread and reader vs. tensorboardX + EventAccumulator and
orjson JSON lines, on the same statistics.

Workloads (6 ops per tensor: min, max, norm, mean, zeros, nans; float32 values):

* ``steps``: STEPS steps x TENSORS tensors, one ``TensorStatsRecorded`` per step with every per-row
  column a recorder fills for activations (name ids, call ids, slots, micro steps);
* ``wide``: 1 step x WIDE tensors, too quick to time once, so repeated WIDE_REPEAT times in two ways:
  as WIDE_REPEAT steps of one file, and as WIDE_REPEAT separate files of one step each (a whole file
  life each time: create, intern every name, one record, close).

trainrec goes through the real :class:`LogWriter` (training thread hands over, worker thread encodes
and writes; the time runs from creating the writer to ``close()`` returning, i.e. everything flushed
and fsynced) and the real reader (``read_log``, then a numpy view of every record's values; and
``open_run``). Each trainrec figure is the best of REPEAT runs (the machine is shared; the median is
printed as well, and rates per CPU second of the process). The baselines are slow, so they run on a subsample and report per-value rates:
tensorboardX ``SummaryWriter.add_scalar`` per value (tag ``name/op``) on TB_STEPS steps, read back with
TensorBoard's ``EventAccumulator`` (size_guidance 0 = keep every value); orjson JSON lines, one line
per (step, tensor), on JSON_STEPS steps.

The training thread's cost per recorded step is the time spent inside ``writer.write()`` (timed around
each call, the worker running concurrently), plus, separately, building the event from a numpy array
and re-resolving the names with ``intern()`` (all already known).

    .venv/bin/python benchmarks/bench_log.py [--steps 2000] [--tensors 500] [--wide 12000]
        [--wide-repeat 20] [--tb-steps 20] [--json-steps 200] [--repeat 5] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import orjson

OPS = ("min", "max", "norm", "mean", "zeros", "nans")
SUBS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


def tensor_names(n: int) -> list[str]:
    """Names shaped like a decoder stack's modules (about 40 characters)."""
    return [f"model.layers.{i // len(SUBS)}.{SUBS[i % len(SUBS)]}" for i in range(n)]


class Data:
    """The statistics of a workload: values[step] is a (tensors, 6) float32 array."""

    def __init__(self, steps: int, tensors: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.steps = steps
        self.tensors = tensors
        self.names = tensor_names(tensors)
        scale = 10.0 ** rng.integers(-6, 3, (tensors, 1))
        self.values = (rng.standard_normal((steps, tensors, len(OPS))) * scale).astype("<f4")
        self.values[:, :, 4] = np.floor(np.abs(self.values[:, :, 4]) * 100)  # zeros: counts
        self.values[:, :, 5] = 0.0  # nans
        self.call_ids = np.arange(tensors, dtype="<u4").tobytes()
        self.slots = np.full(tensors, 2, dtype="u1").tobytes()  # output
        self.micro_steps = np.zeros(tensors, dtype="<u2").tobytes()

    @property
    def n_values(self) -> int:
        return self.steps * self.tensors * len(OPS)


# ---------------------------------------------------------------------------------------------- trainrec
def trainrec_write(data: Data, rank_dir: str, steps: int | None = None) -> dict:
    from trainrec.recorder.writer import LogWriter
    from trainrec.schema.events import TensorStatsRecorded

    steps = data.steps if steps is None else steps
    put_times = []
    build_times = []
    perf = time.perf_counter
    c0 = time.process_time()
    t0 = perf()
    w = LogWriter(rank_dir, rank=0, world_size=1, run_id="bench")
    ids = w.intern(data.names, step=0)
    id_bytes = np.asarray(ids, dtype="<u4").tobytes()
    for s in range(steps):
        a = perf()
        ev = TensorStatsRecorded(
            rank=0, step=s, wall=time.time(), kind="actv", ops=OPS, dtype="f", name_ids=id_bytes,
            values=data.values[s].tobytes(), micro_steps=data.micro_steps, call_ids=data.call_ids,
            slots=data.slots,
        )
        b = perf()
        w.write(ev)
        c = perf()
        build_times.append(b - a)
        put_times.append(c - b)
    w.close()
    elapsed = perf() - t0
    return {
        "seconds": elapsed,
        "cpu": time.process_time() - c0,
        "bytes": os.path.getsize(w.path),
        "path": w.path,
        "put_us": [t * 1e6 for t in put_times],
        "build_us": [t * 1e6 for t in build_times],
    }


def intern_cost(data: Data, rank_dir: str, rounds: int = 200) -> list[float]:
    """Microseconds per ``intern(all names)`` once every name is known (a recorder re-resolving names)."""
    from trainrec.recorder.writer import LogWriter

    with LogWriter(rank_dir, rank=0, run_id="bench") as w:
        w.intern(data.names)
        out = []
        for _ in range(rounds):
            a = time.perf_counter()
            w.intern(data.names)
            out.append((time.perf_counter() - a) * 1e6)
    return out


def trainrec_read(path: str) -> dict:
    from trainrec.replay.reader import read_log
    from trainrec.schema.events import TensorStatsRecorded

    c0 = time.process_time()
    t0 = time.perf_counter()
    reader, events = read_log(path)
    n = 0
    for ev in events:
        if type(ev) is TensorStatsRecorded:
            v = np.frombuffer(ev.values, dtype="<f4").reshape(len(ev), len(ev.ops))
            n += v.size
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if reader.problems or not reader.closed_cleanly:
        raise RuntimeError(f"{path}: read back with problems {reader.problems}")
    return {"seconds": elapsed, "cpu": cpu, "values": n}


def trainrec_open_run(path: str) -> dict:
    from trainrec.replay.run import open_run
    from trainrec.schema.events import TensorStatsRecorded

    t0 = time.perf_counter()
    run = open_run(path)
    n = 0
    for ev in run.events():
        if type(ev) is TensorStatsRecorded:
            n += np.frombuffer(ev.values, dtype="<f4").size
    return {"seconds": time.perf_counter() - t0, "values": n}


def trainrec_wide(data: Data, base: str, repeat: int) -> tuple[dict, dict]:
    """``repeat`` files of one step each; returns (write, read) totals."""
    total_w = total_r = 0.0
    size = values = 0
    for i in range(repeat):
        rdir = os.path.join(base, f"Nov30_11-13-33-rank{i}-0000beef")
        res = trainrec_write(data, rdir)
        total_w += res["seconds"]
        size += res["bytes"]
        r = trainrec_read(res["path"])
        total_r += r["seconds"]
        values += r["values"]
    return {"seconds": total_w, "bytes": size, "values": values}, {"seconds": total_r, "values": values}


# ---------------------------------------------------------------------------------------------- baselines
def tensorboardx(data: Data, logdir: str, steps: int) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboardX import SummaryWriter

    tags = [f"{name}/{op}" for name in data.names for op in OPS]
    t0 = time.perf_counter()
    w = SummaryWriter(logdir)
    for s in range(steps):
        flat = data.values[s].reshape(-1).tolist()
        for tag, v in zip(tags, flat, strict=True):
            w.add_scalar(tag, v, s)
    w.close()
    write_s = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(logdir, f)) for f in os.listdir(logdir))
    t0 = time.perf_counter()
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    n = sum(len(acc.Scalars(t)) for t in acc.Tags()["scalars"])
    read_s = time.perf_counter() - t0
    values = steps * data.tensors * len(OPS)
    if n != values:
        raise RuntimeError(f"EventAccumulator read {n} values, {values} written")
    return {"seconds": write_s, "bytes": size, "values": values}, {"seconds": read_s, "values": n}


def json_lines(data: Data, path: str, steps: int) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for s in range(steps):
            rows = data.values[s].tolist()
            wall = time.time()
            lines = []
            for i, name in enumerate(data.names):
                r = rows[i]
                lines.append(orjson.dumps({
                    "step": s, "wall": wall, "kind": "actv", "name": name, "call_id": i, "slot": "output",
                    "micro_step": 0, "min": r[0], "max": r[1], "norm": r[2], "mean": r[3], "zeros": r[4],
                    "nans": r[5],
                }))
            lines.append(b"")
            f.write(b"\n".join(lines))
    write_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    n = 0
    loads = orjson.loads
    with open(path, "rb") as f:
        for line in f:
            d = loads(line)
            n += len((d["min"], d["max"], d["norm"], d["mean"], d["zeros"], d["nans"]))
    read_s = time.perf_counter() - t0
    values = steps * data.tensors * len(OPS)
    if n != values:
        raise RuntimeError(f"JSON lines read {n} values, {values} written")
    return {"seconds": write_s, "bytes": size, "values": values}, {"seconds": read_s, "values": n}


# ---------------------------------------------------------------------------------------------- report
def best_and_median(runs: list[float]) -> tuple[float, float]:
    return min(runs), statistics.median(runs)


def fmt_rate(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.1f} M/s"
    return f"{v / 1e3:.1f} k/s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--tensors", type=int, default=500)
    p.add_argument("--wide", type=int, default=12000, help="tensors of the one-step workload")
    p.add_argument("--wide-repeat", type=int, default=20, help="files of the one-step workload")
    p.add_argument("--tb-steps", type=int, default=20, help="steps given to tensorboardX (per-value rates)")
    p.add_argument("--json-steps", type=int, default=200, help="steps given to orjson JSON lines")
    p.add_argument("--repeat", type=int, default=5, help="runs of each trainrec measurement (best is kept)")
    p.add_argument("--dir", default=None, help="where to write (default: a fresh temporary folder)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args(argv)

    base = tempfile.mkdtemp(prefix="bench_log-", dir=args.dir)
    rows: list[tuple[str, str, str, str, str]] = []
    notes: list[str] = []
    try:
        steps = Data(args.steps, args.tensors)
        wide = Data(1, args.wide, seed=1)
        load_before = os.getloadavg()[0]

        # trainrec, steps workload
        writes, reads, runs_read, cpu_w, cpu_r = [], [], [], [], []
        last = None
        for i in range(args.repeat):
            res = trainrec_write(steps, os.path.join(base, f"Nov30_11-13-33-rank0-{i:08x}"))
            writes.append(res["seconds"])
            cpu_w.append(res["cpu"])
            rd = trainrec_read(res["path"])
            reads.append(rd["seconds"])
            cpu_r.append(rd["cpu"])
            runs_read.append(trainrec_open_run(res["path"])["seconds"])
            last = res
        n = steps.n_values
        wb, wm = best_and_median(writes)
        rb, rm = best_and_median(reads)
        ob, om = best_and_median(runs_read)
        label = f"trainrec, {args.steps} steps x {args.tensors} tensors"
        rows.append((label, fmt_rate(n / wb) + f" (median {fmt_rate(n / wm)})", fmt_rate(n / rb)
                     + f" (median {fmt_rate(n / rm)})", f"{last['bytes'] / n:.2f}", f"{n:,}"))
        rows.append(("  same, read with open_run(path).events()", "", fmt_rate(n / ob) + f" (median {fmt_rate(n / om)})",
                     "", ""))
        put = np.array(last["put_us"])
        build = np.array(last["build_us"])
        icost = np.array(intern_cost(steps, os.path.join(base, "Nov30_11-13-33-rank9-0000cafe")))
        per_step = args.tensors * len(OPS)
        notes.append(
            f"{args.steps}-step workload per CPU second of this process (both threads; the machine is shared, "
            f"so wall-clock rates depend on the load): write {fmt_rate(n / min(cpu_w))}, "
            f"read {fmt_rate(n / min(cpu_r))}"
        )
        notes.append(
            f"training thread per recorded step ({per_step:,} values): write() median {np.median(put):.1f} us, "
            f"p99 {np.percentile(put, 99):.1f} us, mean {put.mean():.1f} us, max {put.max():.0f} us; "
            f"building the event from numpy: median {np.median(build):.1f} us; "
            f"intern() of the {args.tensors} known names: median {np.median(icost):.1f} us"
        )

        # trainrec, wide workload: WIDE_REPEAT steps in one file
        wide_steps = Data(args.wide_repeat, args.wide, seed=1)
        ws, rs = [], []
        for i in range(args.repeat):
            res = trainrec_write(wide_steps, os.path.join(base, f"Nov30_11-13-33-rank1-{i:08x}"))
            ws.append(res["seconds"])
            rs.append(trainrec_read(res["path"])["seconds"])
        nw = wide_steps.n_values
        rows.append((f"trainrec, {args.wide_repeat} steps x {args.wide} tensors, one file",
                     fmt_rate(nw / min(ws)) + f" (median {fmt_rate(nw / statistics.median(ws))})",
                     fmt_rate(nw / min(rs)) + f" (median {fmt_rate(nw / statistics.median(rs))})",
                     f"{res['bytes'] / nw:.2f}", f"{nw:,}"))

        # trainrec, wide workload: WIDE_REPEAT files of one step each
        wides_w, wides_r = [], []
        for i in range(args.repeat):
            ww, wr = trainrec_wide(wide, os.path.join(base, f"wide{i}"), args.wide_repeat)
            wides_w.append(ww)
            wides_r.append(wr)
        wbest = min(wides_w, key=lambda r: r["seconds"])
        rbest = min(wides_r, key=lambda r: r["seconds"])
        nv = wbest["values"]
        stats_only = nv * 4 + args.wide * (4 + 4 + 1 + 2) * args.wide_repeat
        rows.append((f"trainrec, 1 step x {args.wide} tensors, {args.wide_repeat} separate files",
                     fmt_rate(nv / wbest["seconds"]), fmt_rate(nv / rbest["seconds"]),
                     f"{wbest['bytes'] / nv:.2f}", f"{nv:,}"))
        notes.append(
            f"1-step files: {wbest['bytes'] / args.wide_repeat / 1024:.0f} KiB each, of which the name table "
            f"(NamesInterned of {args.wide} names, written once per file) is "
            f"{(wbest['bytes'] - stats_only) / args.wide_repeat / 1024:.0f} KiB; the stats record alone is "
            f"{stats_only / nv:.2f} bytes/value; the time per file includes creating it, interning the names and closing it"
        )

        # baselines
        tbw, tbr = tensorboardx(steps, os.path.join(base, "tb"), min(args.tb_steps, args.steps))
        rows.append((f"tensorboardX add_scalar + EventAccumulator, {min(args.tb_steps, args.steps)} steps",
                     fmt_rate(tbw["values"] / tbw["seconds"]), fmt_rate(tbr["values"] / tbr["seconds"]),
                     f"{tbw['bytes'] / tbw['values']:.1f}", f"{tbw['values']:,}"))
        jw, jr = json_lines(steps, os.path.join(base, "stats.jsonl"), min(args.json_steps, args.steps))
        rows.append((f"orjson JSON lines (one line per step x tensor), {min(args.json_steps, args.steps)} steps",
                     fmt_rate(jw["values"] / jw["seconds"]), fmt_rate(jr["values"] / jr["seconds"]),
                     f"{jw['bytes'] / jw['values']:.1f}", f"{jw['values']:,}"))
        notes.append(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    head = ("workload", "write (values/s)", "read (values/s)", "bytes/value", "values")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        print()
        for n_ in notes:
            print(f"- {n_}")
    else:
        widths = [max(len(str(r[i])) for r in (*rows, head)) for i in range(len(head))]
        for r in (head, *rows):
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
        for n_ in notes:
            print(f"* {n_}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
