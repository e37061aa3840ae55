"""Logs with hostile records: every frame's CRC checks out, but a record says something absurd.

:func:`good_log` writes a small real log with the LogWriter; :func:`rewrite` re-frames it after
changing the wire form (``[tag, seq, rank, step, wall, *fields]``) of chosen records.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import msgpack
from trainrec.recorder.writer import LogWriter
from trainrec.schema import framing
from trainrec.schema.events import (
    OPS,
    ConfigApplied,
    HooksFired,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    pack_array,
)

STAMP = "Nov30_11-13-33"
NAMES = ["embed.weight", "head.bias"]
F = 5  # index of the first field in a wire list


def good_log(out: str, rank: int = 0, steps: int = 3, config: dict | None = None) -> str:
    """An output directory holding one closed log of ``steps`` steps; returns the log's path."""
    w = LogWriter(os.path.join(out, f"{STAMP}-rank{rank}-0000beef"), rank=rank, world_size=1, run_id="hostile",
                  flush_interval=0.01, repeat_names=False)  # (one name table: a damaged one is not restored)
    ids = w.intern(NAMES)
    w.write(ConfigApplied(rank=rank, step=0, config=config or {"ops": list(OPS)}, start_step=0))
    for s in range(steps):
        w.write(StepBegan(rank=rank, step=s))
        w.write(HooksFired(rank=rank, step=s, module_ids=pack_array("I", ids), directions=bytes([0, 1]),
                           call_ids=pack_array("I", [0, 1]), micro_steps=pack_array("H", [0, 0])))
        for kind, slots in (("actv", bytes([1, 2])), ("grad_reduced", b"")):
            w.write(TensorStatsRecorded(rank=rank, step=s, kind=kind, ops=OPS, dtype="f",
                                        name_ids=pack_array("I", ids),
                                        values=pack_array("f", [float(s * 100 + i) for i in range(2 * len(OPS))]),
                                        slots=slots, call_ids=pack_array("I", [5, 6]) if slots else b""))
        w.write(StepEnded(rank=rank, step=s, duration=0.1, collected=True))
    w.close()
    return w.path


def frames(path: str) -> tuple[bytes, list[list]]:
    """The file header and the wire lists of every frame of an undamaged log."""
    with open(path, "rb") as f:
        data = f.read()
    pos, out = framing.FILE_HEADER_SIZE, []
    while pos < len(data):
        _, length, _, _ = struct.unpack_from("<IIII", data, pos)
        start = pos + framing.FRAME_HEADER_SIZE
        out.append(list(msgpack.unpackb(data[start : start + length], raw=False, strict_map_key=False)))
        pos = start + length
    return data[: framing.FILE_HEADER_SIZE], out


def write_frames(path: str, head: bytes, wires: list[list]) -> list[int]:
    """Write the log again from wire lists, with valid CRCs; returns each frame's offset."""
    offsets, body, pos = [], [], len(head)
    for w in wires:
        frame = framing.encode_frame(msgpack.packb(w, use_bin_type=True))
        offsets.append(pos)
        body.append(frame)
        pos += len(frame)
    with open(path, "wb") as f:
        f.write(head + b"".join(body))
    return offsets


def rewrite(path: str, tag: str, change, which: int = 0) -> int:
    """Apply ``change(wire)`` to the ``which``-th record of ``tag``; returns that frame's offset."""
    head, wires = frames(path)
    k = [i for i, w in enumerate(wires) if w[0] == tag][which]
    change(wires[k])
    return write_frames(path, head, wires)[k]


def mutated(payload: bytes, rng) -> bytes:
    """``payload`` with one to three bytes flipped, dropped or repeated, or cut short: a damaged record."""
    p = bytearray(payload)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(p))
        how = rng.random()
        if how < 0.6:
            p[i] ^= 1 << rng.randrange(8)
        elif how < 0.75:
            del p[i]
        elif how < 0.9:
            p[i:i] = p[i : i + rng.randint(1, 8)]
        else:
            del p[i:]
            break
    return bytes(p)


def damaged_copies(path: str, out: str, rng, trials: int = 40) -> Iterator[str]:
    """Copies of the log ``path`` in ``out`` with one to four bits flipped after the file header, every
    third one also cut short by up to 200 bytes."""
    with open(path, "rb") as f:
        data = f.read()
    for trial in range(trials):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(framing.FILE_HEADER_SIZE, len(damaged))] ^= 1 << rng.randrange(8)
        cut = len(damaged) - rng.randrange(0, 200) if trial % 3 == 0 else len(damaged)
        bad = os.path.join(out, f"bad{trial}.trl")
        with open(bad, "wb") as f:
            f.write(damaged[:cut])
        yield bad
