"""Helpers for the replay tests: real logs written by the real LogWriter, and their expected content."""

from __future__ import annotations

import dataclasses
import os
import struct

from trainrec.recorder.writer import LogWriter
from trainrec.schema import framing
from trainrec.schema.events import (
    OPS,
    Event,
    NamesInterned,
    NamesRepeated,
    RunResumed,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    pack_array,
)

STAMP = "Nov30_11-13-33"


def rank_dir(out: str, rank: int, stamp: str = STAMP, suffix: str | None = None) -> str:
    return os.path.join(str(out), f"{stamp}-rank{rank}-{suffix or f'{rank + 0xA0:08x}'}")


def value(step: int, row: int, op: int) -> float:
    """Exactly representable in float32 for the sizes used here."""
    return float(step * 1000 + row * 10 + op)


def stats(rank: int, step: int, ids: list[int], kind: str = "grad_reduced", micro: int | None = None,
          call_base: int | None = None) -> TensorStatsRecorded:
    n = len(ids)
    return TensorStatsRecorded(
        rank=rank,
        step=step,
        wall=1.0 + step,
        kind=kind,
        ops=OPS,
        dtype="f",
        name_ids=pack_array("I", ids),
        values=pack_array("f", [value(step, r, o) for r in range(n) for o in range(len(OPS))]),
        micro_steps=pack_array("H", [micro] * n) if micro else b"",
        call_ids=pack_array("I", [call_base + i for i in range(n)]) if call_base is not None else b"",
        slots=bytes([2] * n) if kind == "actv" else b"",
    )


def write_rank(
    rdir: str,
    *,
    rank: int = 0,
    run_id: str = "run-a",
    steps: range | list[int] = range(5),
    world_size: int = 1,
    names: list[str] | None = None,
    resume_step: int | None = None,
    close: bool = True,
    repeat_names: bool = True,
) -> tuple[str, list[Event]]:
    """Write one log file; returns its path and the events written (before FileClosed); ``repeat_names``:
    the writer's copy of each name table (NamesRepeated), as it makes by default."""
    names = names or [f"layer{i}.weight" for i in range(4)]
    w = LogWriter(rdir, rank=rank, world_size=world_size, run_id=run_id, flush_interval=0.05,
                  repeat_names=repeat_names)
    written: list[Event] = [w.header]
    if resume_step is not None:
        ev = RunResumed(rank=rank, step=resume_step, wall=2.0, last_step=resume_step - 1, reason="test")
        w.write(ev)
        written.append(ev)
    ids = w.intern(names, step=-1)
    written.append(NamesInterned(rank=rank, step=-1, first_id=0, names=tuple(names)))
    if repeat_names:
        written.append(NamesRepeated(rank=rank, step=-1, first_id=0, names=tuple(names)))
    for s in steps:
        for ev in (
            StepBegan(rank=rank, step=s, wall=1.0 + s),
            stats(rank, s, ids),
            StepEnded(rank=rank, step=s, wall=1.5 + s, duration=0.5, collected=True),
        ):
            w.write(ev)
            written.append(ev)
    if close:
        w.close()
    else:
        w.flush(timeout=10)
    return w.path, written


def same(a: Event, b: Event) -> bool:
    """Equal apart from the sequence number and wall time (which the writer assigns)."""
    if type(a) is not type(b):
        return False
    return dataclasses.replace(a, seq=0, wall=0.0) == dataclasses.replace(b, seq=0, wall=0.0)


def frame_spans(data: bytes) -> list[tuple[int, int]]:
    """``(start, end)`` of every frame of an undamaged log's bytes."""
    pos = framing.FILE_HEADER_SIZE
    spans = []
    while pos < len(data):
        _, length, _, _ = struct.unpack_from("<IIII", data, pos)
        end = pos + framing.FRAME_HEADER_SIZE + length
        spans.append((pos, end))
        pos = end
    return spans
