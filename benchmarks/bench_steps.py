"""``--steps`` through the step index: a narrow step range of a large run, with and without the index.

The run (benchmarks/scale_synth.py, the project's own LogWriter): RANKS x STEPS x 200 tensors x 6 ops;
a copy of it whose logs' FileClosed records carry no index (re-encoded as an older trainrec wrote them:
the rest of every file is byte for byte the same) stands for the same logs without an index, which
replay rebuilds by a scan of the frames. Each command runs as its own process, as a user runs it;
printed per command: wall seconds with the index, without it (the scan), and the ratio, and whether
the outputs are identical:

* ``dump --steps A-B``, ``anomalies -s A-B`` (recorded anomalies), ``anomalies -s A-B --rule ...``
  (re-detection reads every step up to B), ``export csv --steps A-B``;
* ``inspect --quick`` against ``inspect``;
* in-process, without the start-up of a command: ``Run.events(steps=...)`` of the range, its time and
  the bytes the reader read: with the index, rebuilt by the scan, and every file read whole (what a
  damaged file gets, and every file did before the index).

    .venv/bin/python benchmarks/bench_steps.py [--dir /tmp/trainrec-steps] [--ranks 8] [--steps 2000]
        [--first 1500] [--count 10] [--keep]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
TRAINREC = [sys.executable, "-m", "trainrec.tools.cli"]


def strip_indexes(src: str, dst: str) -> None:
    """``dst``: a copy of the run ``src`` whose logs' FileClosed hold no step index."""
    from trainrec.replay.stepindex import load_index
    from trainrec.schema import codec, framing

    shutil.copytree(src, dst)
    for root, _, files in os.walk(dst):
        for name in files:
            path = os.path.join(root, name)
            ix, _ = load_index(path) if name.endswith(".trl") else (None, None)
            if ix is None:
                continue
            with open(path, "r+b") as f:
                f.seek(ix.index_offset)
                data = f.read()
                closed = codec.decode(data[framing.FRAME_HEADER_SIZE:])
                empty = {k: b"" for k in ("index_steps", "index_offsets", "index_seqs", "index_low_steps", "index_names")}
                f.truncate(ix.index_offset)
                f.seek(ix.index_offset)
                f.write(framing.encode_frame(codec.encode(dataclasses.replace(closed, **empty))))


def timed(argv: list[str], out_dir: str | None = None) -> tuple[float, bytes]:
    if out_dir is not None:
        shutil.rmtree(out_dir, ignore_errors=True)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, check=False)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.decode()[-400:]}")
    return wall, r.stdout


def _tree(d: str) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(d):
        for name in files:
            if not name.startswith("."):
                with open(os.path.join(root, name), "rb") as f:
                    out[os.path.relpath(os.path.join(root, name), d)] = f.read()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/trainrec-steps")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--first", type=int, default=1500, help="first step of the range")
    ap.add_argument("--count", type=int, default=10, help="steps in the range")
    ap.add_argument("--keep", action="store_true", help="keep the run (and reuse one already there)")
    a = ap.parse_args()
    from scale_synth import write_rank

    run, old = os.path.join(a.dir, "run"), os.path.join(a.dir, "old")
    if not (a.keep and os.path.isdir(run)):
        shutil.rmtree(a.dir, ignore_errors=True)
        t0 = time.perf_counter()
        for r in range(a.ranks):
            write_rank(run, r, a.ranks, a.steps, 200)
        print(f"wrote {a.ranks} ranks x {a.steps} steps x 200 tensors in {time.perf_counter() - t0:.1f} s")
    if not os.path.isdir(old):
        strip_indexes(run, old)
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(run) for f in fs)
    sel = f"{a.first}-{a.first + a.count - 1}"
    print(f"run {run}: {size / 1e6:.0f} MB; steps {sel} ({a.count} of {a.steps})")
    cases = [
        ("dump --steps", ["dump", "{run}", "--steps", sel], None),
        ("anomalies -s (recorded)", ["anomalies", "{run}", "-s", sel, "--json"], None),
        ("anomalies -s --rule (reads up to the last step)", ["anomalies", "{run}", "-s", sel, "--json", "--rule",
                                                               "AnomalyTurbulence", "--threshold", "0.5", "--all"], None),
        ("export csv --steps", ["export", "csv", "{run}", "-o", "{out}", "--steps", sel], "out"),
        ("inspect --quick (vs inspect on the indexed run)", ["inspect", "{run}", "--quick"], None),
    ]
    from trainrec.replay import stepindex
    from trainrec.replay.run import open_run

    ranges = ((a.first, a.first + a.count - 1),)
    scan = stepindex.scan_index
    for src, what in ((run, "index"), (old, "no index: scan"), (old, "no index: read whole")):
        r = open_run(src)
        if what.endswith("whole"):
            stepindex.scan_index = lambda path: None
        try:
            t0 = time.perf_counter()
            n = sum(1 for _ in r.events(steps=ranges))
            wall = time.perf_counter() - t0
        finally:
            stepindex.scan_index = scan
        read = sum(rd.bytes_read for rd in r.readers.values())
        print(f"Run.events(steps={sel}), {what}: {n} events in {wall:.3f} s, {read / 1e6:.2f} MB read of "
              f"{size / 1e6:.0f} MB ({100 * read / size:.2f}%)")
    print(f"{'command':52} {'index':>8} {'no index':>9} {'ratio':>6}  same output")
    for label, argv, out in cases:
        times, outputs = [], []
        for src in (run, old):
            out_dir = os.path.join(a.dir, f"out-{os.path.basename(src)}") if out else None
            cmd = [x.format(run=src, out=out_dir) for x in argv]
            if label.startswith("inspect") and src == old:
                cmd = ["inspect", run]  # the full inspect, reading every record
            wall, stdout = timed(TRAINREC + cmd, out_dir)
            times.append(wall)
            outputs.append(_tree(out_dir) if out_dir else stdout.replace(old.encode(), run.encode()))
        same = "-" if label.startswith("inspect") else ("yes" if _same(outputs[0], outputs[1]) else "NO")
        print(f"{label:52} {times[0]:7.2f}s {times[1]:8.2f}s {times[1] / times[0]:5.1f}x  {same}")
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)


def _same(a, b) -> bool:
    """Outputs equal, but for FileClosed's index columns in a dump (the file's, not its content's)."""
    if isinstance(a, dict):
        return a == b
    if a == b:
        return True
    import json

    def plain(data: bytes):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("index_")} for line in data.splitlines()]

    try:
        return plain(a) == plain(b)
    except ValueError:
        return False


if __name__ == "__main__":
    main()
