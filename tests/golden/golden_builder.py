"""The building blocks of the golden logs (``make_golden.py``): the fixed envelope (rank, run id, wall
times) and file header, a :class:`Builder` that frames records byte by byte while keeping what a reader
must get back (:class:`Built`), and a stats record with every per-row column filled."""

from __future__ import annotations

import dataclasses

import msgpack
from trainrec.schema import codec, framing
from trainrec.schema.events import (
    OPS,
    SLOT_INPUT_GRAD,
    SLOT_OUTPUT,
    Event,
    FileOpened,
    TensorStatsRecorded,
    pack_array,
)

RUN_ID = "golden-run-0001"
RANK = 1
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
DIR_NAME = "Nov14_22-13-20-rank1-0badc0de"


@dataclasses.dataclass
class Built:
    """A scenario's bytes and what a reader must make of them."""

    data: bytes = b""
    events: list = dataclasses.field(default_factory=list)  # Event objects, as a reader returns them
    frames: list = dataclasses.field(default_factory=list)  # (offset, length) of every frame
    problems: list = dataclasses.field(default_factory=list)  # {"offset", "skipped"}
    gaps: list = dataclasses.field(default_factory=list)  # {"offset", "expected", "got"}
    pending_bytes: int = 0
    masked: dict = dataclasses.field(default_factory=dict)
    error: str | None = None


def env(seq: int, step: int, wall_offset: float = 0.0) -> dict:
    return {"seq": seq, "rank": RANK, "step": step, "wall": T0 + wall_offset}


def header_event() -> FileOpened:
    return FileOpened(
        **env(0, -1),
        run_id=RUN_ID,
        world_size=4,
        host="golden-host",
        pid=4242,
        start_time=T0,
        trainrec_version="0.1.0",
        torch_version="2.13.0",
        format_version=1,
        file_index=0,
        dir_name=DIR_NAME,
        pp_stage=1,
        group_mates=(0, 1),
    )


class Builder:
    """Appends frames to a v1 file, keeping the expected events and frame offsets."""

    def __init__(self, version: int = framing.FORMAT_VERSION) -> None:
        self.b = Built(data=framing.encode_file_header(version))

    def add(self, ev: Event, payload: bytes | None = None, expect: Event | None = None) -> None:
        """Frame ``ev`` (or a raw ``payload``, expected to decode to ``expect``)."""
        frame = framing.encode_frame(codec.encode(ev) if payload is None else payload)
        self.b.frames.append((len(self.b.data), len(frame)))
        self.b.data += frame
        self.b.events.append(ev if expect is None else expect)

    def raw(self, ev_fields: list, expect: Event) -> None:
        """A record packed as another writer version would pack it: ``[tag, seq, rank, step, wall, ...]``."""
        self.add(expect, payload=msgpack.packb(ev_fields, use_bin_type=True), expect=expect)


def stats_actv(seq: int, step: int) -> TensorStatsRecorded:
    """Three activation rows with every per-row column filled."""
    values = [-1.5, 2.25, 3.0, 0.125, 0.0, 0.0, -0.5, 0.5, 1.0, 0.0, 1.0, 0.0, 1e-30, 3e38, 7.0, 1.0, 0.0, 0.0]
    return TensorStatsRecorded(
        **env(seq, step, 0.5),
        kind="actv",
        ops=OPS,
        dtype="f",
        name_ids=pack_array("I", [0, 1, 2]),
        values=pack_array("f", values),
        micro_steps=pack_array("H", [0, 1, 1]),
        call_ids=pack_array("I", [3, 7, 8]),
        slots=bytes([SLOT_OUTPUT, SLOT_OUTPUT, SLOT_INPUT_GRAD]),
        vpp_stages=bytes([0, 0, 1]),
    )
