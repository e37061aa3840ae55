"""Decoding one stats record: the codec's full decode (a frozen TensorStatsRecorded) against the columns
path (:func:`trainrec.replay.stats_columns.decode_columns`, a StatsColumns), per record, on records of the
sizes replay meets; one step record, the codec against :mod:`trainrec.replay.step_records` (where that
module exists: the script also runs against older trees); and, given log files, reading them whole with
a LogReader both ways (CPU seconds).

    .venv/bin/python benchmarks/bench_stats_decode.py [LOG ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainrec.replay.reader import LogReader  # noqa: E402
from trainrec.replay.stats_columns import StatsColumns, decode_columns  # noqa: E402
from trainrec.schema import codec  # noqa: E402
from trainrec.schema.events import OPS, StepBegan, StepEnded, TensorStatsRecorded  # noqa: E402

try:
    from trainrec.replay.step_records import decode_record  # noqa: E402
except ImportError:  # (a tree before it)
    decode_record = None


def record(rows: int, slots: bool) -> TensorStatsRecorded:
    rng = np.random.default_rng(rows)
    return TensorStatsRecorded(
        seq=12345, rank=17, step=300, wall=1.7e9, kind="actv" if slots else "grad_reduced", ops=OPS, dtype="f",
        name_ids=np.arange(rows, dtype="<u4").tobytes(), values=rng.random(rows * len(OPS)).astype("<f4").tobytes(),
        call_ids=np.arange(rows, dtype="<u4").tobytes() if slots else b"",
        slots=np.tile(np.array([1, 2], np.uint8), rows // 2).tobytes() if slots else b"",
    )


def per_record(rounds: int) -> None:
    print("per stats record (best of 5 x N, payload as the reader hands it: a memoryview)")
    for rows, slots in ((20, False), (80, True), (500, False), (3000, True)):
        ev = record(rows, slots)
        payload = memoryview(codec.encode(ev))
        assert type(decode_columns(payload)) is StatsColumns and decode_columns(payload).event() == codec.decode(payload)
        n = max(2000, 200_000 // rows)
        for r in range(rounds):
            full = min(timeit.repeat(lambda p=payload: codec.decode(p), number=n, repeat=5)) / n * 1e6
            cols = min(timeit.repeat(lambda p=payload: decode_columns(p), number=n, repeat=5)) / n * 1e6
            print(f"  {rows:5d} rows x 6 ops ({len(payload):6d} bytes), round {r}: codec.decode {full:6.2f} us   "
                  f"decode_columns {cols:6.2f} us   {full / cols:4.1f}x")


def per_step_record(rounds: int) -> None:
    if decode_record is None:
        print("per step record: no trainrec.replay.step_records in this tree")
        return
    print("per step record (best of 5 x N, a memoryview)")
    for ev in (StepBegan(seq=12345, rank=17, step=300, wall=1.7e9),
               StepEnded(seq=12346, rank=17, step=300, wall=1.7e9, duration=0.25, collected=True)):
        payload = memoryview(codec.encode(ev))
        assert decode_record(payload) == codec.decode(payload) == ev
        n = 100_000
        for r in range(rounds):
            full = min(timeit.repeat(lambda p=payload: codec.decode(p), number=n, repeat=5)) / n * 1e6
            fast = min(timeit.repeat(lambda p=payload: decode_record(p), number=n, repeat=5)) / n * 1e6
            print(f"  {type(ev).__name__:10s} ({len(payload):2d} bytes), round {r}: codec.decode {full:5.2f} us   "
                  f"step_records {fast:5.2f} us   {full / fast:4.1f}x")


def read_files(paths: list[str], rounds: int) -> None:
    for r in range(rounds):
        got = {}
        for columnar in (False, True):
            t0 = time.process_time()
            stats = frames = 0
            for path in paths:
                reader = LogReader(path, columnar=columnar)
                for ev in reader:
                    stats += type(ev) is TensorStatsRecorded or type(ev) is StatsColumns
                frames += reader.frames
            got[columnar] = (time.process_time() - t0, stats, frames)
        (a, stats, frames), (b, _, _) = got[False], got[True]
        print(f"  {len(paths)} files, {frames} frames ({stats} stats), round {r}: full decode {a:.3f} CPU-s "
              f"({a / frames * 1e6:.2f} us/frame)   columns {b:.3f} CPU-s ({b / frames * 1e6:.2f} us/frame)   "
              f"{a / b:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="*", help="log files to read whole both ways")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    per_record(a.rounds)
    per_step_record(a.rounds)
    if a.logs:
        print("LogReader over whole files")
        read_files(a.logs, a.rounds)


if __name__ == "__main__":
    main()
