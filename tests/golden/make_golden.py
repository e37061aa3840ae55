"""Write the golden logs of format version 1 and their expected decoded content.

Usage (from the repository root)::

    .venv/bin/python tests/golden/make_golden.py               # writes only the scenarios that are missing
    .venv/bin/python tests/golden/make_golden.py --regenerate  # overwrites: a deliberate format decision

Golden logs freeze the on-disk format: once committed they are never regenerated silently, and every
later trainrec must still replay them (``tests/test_golden.py`` does, on every test run). A format
change that breaks them needs a new format version (a new ``v2/`` folder here) and a read-time upgrade,
not a regeneration.

Each scenario is one log file ``v1/<name>.trl`` and one ``v1/<name>.json`` beside it holding what a
reader must get back: the events (every field, bytes as hex, non-finite floats spelled out), the
damage it must report (byte offset and bytes skipped), sequence gaps, torn-tail bytes and whether
the file closed cleanly, or the error it must raise. The expected content is computed from the events
this script encodes and the bytes it damages, never by decoding the file.

All scenarios but one are built byte by byte with ``trainrec.schema.framing`` and ``codec`` (fixed
wall times, run id, host and pid: fully deterministic; records from other writer versions are packed
with msgpack directly, as such a writer would). The ``logwriter`` scenario goes through the real
:class:`LogWriter`; the fields it stamps itself (host, pid, times, versions) are listed under
``masked`` in its expected file and ignored by the comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable

import msgpack
from trainrec.schema import codec, framing
from trainrec.schema.events import (
    DIR_BACKWARD,
    DIR_FORWARD,
    OPS,
    SLOT_INPUT_GRAD,
    SLOT_OUTPUT,
    AnomalyDetected,
    ApiCallsRecorded,
    CollectiveCalled,
    CollectiveCompleted,
    ConfigApplied,
    ConfigChanged,
    ConfigRejected,
    Event,
    ExceptionRaised,
    FileClosed,
    FileOpened,
    HookFailed,
    HooksFired,
    ModuleStructureRecorded,
    MonitoringStopped,
    NamesInterned,
    NamesRepeated,
    RecordsDropped,
    RunResumed,
    StallDetected,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    UnknownEvent,
    WriterFailed,
    pack_array,
)

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION_DIR = os.path.join(HERE, "v1")
RUN_ID = "golden-run-0001"
RANK = 1
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
DIR_NAME = "Nov14_22-13-20-rank1-0badc0de"
MASK = "<masked>"


# ---------------------------------------------------------------------------------------------- JSON form
def value_to_json(v):
    """A decoded field value as JSON: bytes as {"hex": ...}, non-finite floats as {"float": "nan"}."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"hex": bytes(v).hex()}
    if isinstance(v, (tuple, list)):
        return [value_to_json(x) for x in v]
    if isinstance(v, dict):
        return {"map": [[value_to_json(k), value_to_json(x)] for k, x in v.items()]}
    raise TypeError(f"no JSON form for {type(v).__name__}")


def event_to_json(ev: Event) -> dict:
    """``{"type": class name, "fields": {every field, envelope first}}``."""
    fields = {f.name: value_to_json(getattr(ev, f.name)) for f in dataclasses.fields(ev)}
    return {"type": type(ev).__name__, "fields": fields}


# ---------------------------------------------------------------------------------------------- building
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


def every_event() -> Built:
    """One record of every event type, an unknown tag from a newer writer, NaN/inf values, a clean close."""
    g = Builder()
    g.add(header_event())
    g.add(NamesInterned(**env(1, 0), first_id=0, names=("model.layer1", "model.layer2", "model.head")))
    g.add(
        ModuleStructureRecorded(
            **env(2, 0),
            vpp_stage=0,
            names=("", "model", "model.layer1", "model.layer2", "model.head"),
            classes=("Wrapper", "Net", "Linear", "Linear", "Linear"),
            parents=(-1, 0, 1, 1, 1),
            param_counts=(0, 0, 20, 20, 5),
            io_specs={"model.layer1": ("tensor", "tensor"), "model.head": ("tuple[2]", "tensor")},
        )
    )
    g.add(StepBegan(**env(3, 0)))
    g.add(
        HooksFired(
            **env(4, 0, 0.25),
            module_ids=pack_array("I", [0, 1, 2, 2, 1, 0]),
            directions=bytes([DIR_FORWARD] * 3 + [DIR_BACKWARD] * 3),
            call_ids=pack_array("I", range(6)),
            micro_steps=pack_array("H", [0] * 6),
        )
    )
    g.add(stats_actv(5, 0))
    g.add(
        TensorStatsRecorded(
            **env(6, 0, 0.5),
            kind="grad_reduced",
            ops=("norm", "nans"),
            dtype="d",
            name_ids=pack_array("I", [2, 0]),
            values=pack_array("d", [float("nan"), 1.0, float("inf"), 0.0]),
        )
    )
    g.add(
        AnomalyDetected(
            **env(7, 0, 0.75),
            micro_step=1,
            pp_stage=1,
            vpp_stage=0,
            call_id=8,
            tag_name="1:model.head/output_grad_0",
            op="norm",
            value=float("nan"),
            baseline=float("inf"),
            message="norm is nan",
            group_mates=(0, 1),
            rule="NaNInf",
            kind="actv_grad",
            name="model.head",
            slot="output_grad",
        )
    )
    g.add(StepEnded(**env(8, 0, 1.0), duration=1.0, collected=True, micro_steps=2))
    g.add(ConfigChanged(**env(9, 1, 2.0), path="/cfg/monitor.json", content_hash="9f86d081", changed_keys=("ops",)))
    g.add(
        ConfigApplied(
            **env(10, 1, 2.0),
            path="/cfg/monitor.json",
            content_hash="9f86d081",
            config={"ops": ("norm", "min"), "xy_distribution": True, "step_interval": 2, "alert": {"threshold": 0.5}},
            start_step=2,
            reason="dynamic_on",
        )
    )
    g.add(ConfigRejected(**env(11, 1, 2.5), path="/cfg/monitor.json", content_hash="60303ae2", reason="bad ops",
                         keys=("ops",)))
    g.add(RecordsDropped(**env(12, 1, 2.5), count=17))
    g.add(HookFailed(**env(13, 1, 2.5), where="backward hook model.head", error="RuntimeError('x')", count=3))
    g.raw(["zz", 14, RANK, 1, T0 + 3.0, "from a newer writer", {"k": [1, 2]}],
          UnknownEvent(**env(14, 1, 3.0), tag="zz", fields=("from a newer writer", {"k": (1, 2)})))
    g.add(RunResumed(**env(15, 2, 4.0), previous_files=("trainrec-00000.trl",), last_step=1, reason="restart"))
    g.add(MonitoringStopped(**env(16, 2, 4.0), reason="collect_times", collections=2))
    g.add(FileClosed(**env(17, 2, 5.0), records=17, dropped=17, reason="close"))
    return g.b


def compat() -> Built:
    """Records as older and newer writers of format 1 pack them: fields missing at the end take their
    defaults, extra trailing fields are ignored, ints stand for floats, an unknown tag carries a map."""
    g = Builder()
    # Older writer: FileOpened without pp_stage/group_mates; StepEnded without collected/micro_steps.
    old_header = dataclasses.replace(header_event(), pp_stage=0, group_mates=())
    g.raw(["fo", 0, RANK, -1, T0, RUN_ID, 4, "golden-host", 4242, T0, "0.1.0", "2.13.0", 1, 0, DIR_NAME],
          old_header)
    g.raw(["se", 1, RANK, 0, T0, 0.5], StepEnded(**env(1, 0), duration=0.5))
    # Newer writer: two more fields appended to StepBegan and to RecordsDropped.
    g.raw(["sb", 2, RANK, 1, T0, "future", [1, 2, 3]], StepBegan(**env(2, 1)))
    g.raw(["rd", 3, RANK, 1, T0, 4, "future"], RecordsDropped(**env(3, 1), count=4))
    # Integers where floats are declared (wall, duration): decoded as floats.
    g.raw(["se", 4, RANK, 1, 1_700_000_001, 2, False, 1], StepEnded(**env(4, 1, 1.0), duration=2.0))
    g.raw(["ufo", 5, RANK, 2, T0, {"nested": {"a": 1}}, b"\x00\x01"],
          UnknownEvent(**env(5, 2), tag="ufo", fields=({"nested": {"a": 1}}, b"\x00\x01")))
    # (packed as writers before FileClosed.index_offset did: the scenario's bytes are frozen)
    g.raw(["fc", 6, RANK, 2, T0, 6, 0, "close"], FileClosed(**env(6, 2), records=6, reason="close"))
    return g.b


def placeholders() -> Built:
    """TensorStatsRecorded's appended per-row ``placeholders`` column (u8 flags: NaN rows that stand for
    no tensor's values): a record with marked rows, one whose column is empty (no row is one), and the
    same rows as a writer from before the column packed them (nine fields after the envelope), which
    decode with no row marked."""
    g = Builder()
    g.add(header_event())
    g.add(NamesInterned(**env(1, 0), first_id=0, names=("experts.0.weight", "experts.1.weight", "dense.weight")))
    nan = float("nan")
    values = [0.5, 0.0, nan, nan, 2.0, 0.0]
    marked = TensorStatsRecorded(
        **env(2, 1, 0.5),
        kind="grad_unreduced",
        ops=("norm", "nans"),
        dtype="f",
        name_ids=pack_array("I", [0, 1, 2]),
        values=pack_array("f", values),
        call_ids=pack_array("I", [4, 5, 6]),
        placeholders=bytes([0, 1, 0]),
    )
    g.add(marked)
    g.add(dataclasses.replace(marked, seq=3, step=2, values=pack_array("f", [0.5, 0.0, 1.5, 0.0, 2.0, 0.0]),
                              placeholders=b""))
    old = dataclasses.replace(marked, seq=4, step=3, placeholders=b"")
    g.raw(["ts", 4, RANK, 3, T0 + 0.5, "grad_unreduced", ["norm", "nans"], "f", old.name_ids, old.values, b"",
           old.call_ids, b"", b""], old)
    g.add(FileClosed(**env(5, 3, 1.0), records=5, reason="close"))
    return g.b


def flight() -> Built:
    """The post-mortem's records: collective calls (metadata at issue, with pre-call statistics;
    statistics after a call), a stall report with every thread's stack, and the exception that ended
    the recording, before the close at exit."""
    g = Builder()
    g.add(header_event())
    g.add(StepBegan(**env(1, 0)))
    g.add(CollectiveCalled(**env(2, 0, 0.1), op="all_reduce", group="0", group_ranks=(0, 1), group_seq=0,
                           shapes=((4, 8),), dtypes=("float32",), reduce_op="SUM", codeline="train.py[23]",
                           ops=("norm", "max"), pre_values=pack_array("f", [2.0, 1.5])))
    g.add(CollectiveCompleted(**env(3, 0, 0.2), op="all_reduce", group="0", group_seq=0, duration=0.1,
                              ops=("norm", "max"), values=pack_array("f", [4.0, float("inf")])))
    g.add(CollectiveCalled(**env(4, 0, 0.3), op="isend", group="1", group_ranks=(1, 3), group_seq=7,
                           shapes=((2,), ()), dtypes=("bfloat16", "int64"), async_op=True, peer=3))
    g.add(StepEnded(**env(5, 0, 0.4), duration=0.4, collected=True))
    g.add(StallDetected(**env(6, 1, 30.0), elapsed=29.5, median_step=0.4, threshold=20.0, count=2,
                        stacks='Thread 0x00007f00 (most recent call first):\n  File "train.py", line 23 in forward\n',
                        modules=("model", "model.layer1"), hook_module="model.layer1", hook_direction=DIR_BACKWARD,
                        hook_micro_step=1, hook_call_id=5, collective_op="all_gather_into_tensor",
                        collective_group_ranks=(0, 1), collective_seq=9, collective_elapsed=29.0))
    g.add(ExceptionRaised(**env(7, 1, 31.0), error="RuntimeError: bad batch", modules=("model", "model.head"),
                          traceback="Traceback (most recent call last):\nRuntimeError: bad batch\n"))
    g.add(FileClosed(**env(8, 1, 31.0), records=8, reason="exit after an uncaught RuntimeError"))
    return g.b


def api_calls() -> Built:
    """The API level's record: two calls of one forward pass (a linear with its weight and bias, a relu
    with a keyword flag), shapes, dtypes, a number's value, a NaN row of a non-tensor, and stacks."""
    g = Builder()
    g.add(header_event())
    g.add(NamesInterned(**env(1, 0), first_id=0, names=(
        "fc", "Functional.linear.0.forward", "Functional.relu.0.forward", "input.0", "input.1", "input.2",
        "output.0", "input.inplace", "torch.Tensor", "bool", "torch.float32", "",
        "File train.py, line 3, in forward, \n return F.linear(x, w, b)", "File train.py, line 9, in step, \n y = m(x)")))
    g.add(StepBegan(**env(2, 0)))
    nan = float("nan")
    g.add(ApiCallsRecorded(
        **env(3, 0, 0.1), micro_step=1, vpp_stage=0, ops=("min", "max", "mean", "norm"), dtype="f",
        name_ids=pack_array("I", [1, 2]), module_ids=pack_array("I", [0, 0xFFFFFFFF]),
        positions=pack_array("I", [0, 1]), port_counts=pack_array("H", [4, 3]),
        port_ids=pack_array("I", [3, 4, 5, 6, 3, 6, 7]), type_ids=pack_array("I", [8, 8, 8, 8, 8, 8, 9]),
        dtype_ids=pack_array("I", [10, 10, 10, 10, 10, 10, 11]), ndims=bytes([2, 2, 1, 2, 2, 2, 255]),
        dims=pack_array("q", [4, 6, 8, 6, 8, 4, 8, 4, 8, 4, 8]), requires_grad=bytes([0, 1, 1, 1, 1, 1, 2]),
        values=pack_array("f", [-2.0, 2.0, 0.0, 5.0] * 6 + [nan, nan, nan, nan]),
        stack_depths=pack_array("H", [2, 1]), stack_frames=pack_array("I", [12, 13, 13])))
    g.add(StepEnded(**env(4, 0, 0.2), duration=0.2, collected=True))
    g.add(FileClosed(**env(5, 0, 0.3), records=5, reason="close"))
    return g.b


def api_calls_backward() -> Built:
    """The API level's records with the fields added after api_calls: a linear's forward, with the
    module call it nests under and that call's input and output dtype and shape (module_*), then its
    backward record (``direction`` backward), whose ports are the gradient its autograd node took in
    (input.0) and those it handed on (output.0 the bias's, output.2 the transposed weight's; output.1,
    the input's, not computed: no port)."""
    g = Builder()
    g.add(header_event())
    g.add(NamesInterned(**env(1, 0), first_id=0, names=(
        "fc", "Functional.linear.0.forward", "Functional.linear.0.backward", "input.0", "input.1", "input.2",
        "output.0", "output.2", "torch.Tensor", "torch.float32")))
    g.add(StepBegan(**env(2, 0)))
    ops = ("min", "max", "mean", "norm")
    g.add(ApiCallsRecorded(
        **env(3, 0, 0.1), micro_step=0, vpp_stage=0, ops=ops, dtype="f", name_ids=pack_array("I", [1]),
        module_ids=pack_array("I", [0]), positions=pack_array("I", [0]), port_counts=pack_array("H", [4]),
        port_ids=pack_array("I", [3, 4, 5, 6]), type_ids=pack_array("I", [8] * 4), dtype_ids=pack_array("I", [9] * 4),
        ndims=bytes([2, 2, 1, 2]), dims=pack_array("q", [4, 6, 8, 6, 8, 4, 8]), requires_grad=bytes([0, 1, 1, 1]),
        values=pack_array("f", [-2.0, 2.0, 0.0, 5.0] * 4), module_calls=pack_array("I", [0]),
        module_positions=pack_array("I", [1]), module_dtype_ids=pack_array("I", [9, 9]),
        module_ndims=bytes([2, 2]), module_dims=pack_array("q", [4, 6, 4, 8])))
    g.add(ApiCallsRecorded(
        **env(4, 0, 0.2), micro_step=0, vpp_stage=0, ops=ops, dtype="f", name_ids=pack_array("I", [2]),
        module_ids=pack_array("I", [0]), positions=pack_array("I", [2]), port_counts=pack_array("H", [3]),
        port_ids=pack_array("I", [3, 6, 7]), type_ids=pack_array("I", [8] * 3), dtype_ids=pack_array("I", [9] * 3),
        ndims=bytes([2, 1, 2]), dims=pack_array("q", [4, 8, 8, 6, 8]), requires_grad=bytes([0, 0, 0]),
        values=pack_array("f", [-0.5, 0.5, 0.0, 1.0, -1.0, 1.0, 0.25, 1.5, -0.75, 0.75, 0.0, 2.0]),
        direction=DIR_BACKWARD))
    g.add(StepEnded(**env(5, 0, 0.3), duration=0.3, collected=True))
    g.add(FileClosed(**env(6, 0, 0.4), records=6, reason="close"))
    return g.b


def _body(g: Builder, steps: int = 4) -> None:
    g.add(header_event())
    g.add(NamesInterned(**env(1, 0), first_id=0, names=("a", "b", "c")))
    seq = 2
    for step in range(steps):
        g.add(stats_actv(seq, step))
        g.add(StepEnded(**env(seq + 1, step, 1.0 + step), duration=0.1, collected=True))
        seq += 2


def torn_tail() -> Built:
    """The writer was killed in the middle of a frame: its first half is on disk."""
    g = Builder()
    _body(g)
    frame = framing.encode_frame(codec.encode(stats_actv(10, 4)))
    cut = frame[: len(frame) // 2]
    g.b.data += cut
    g.b.pending_bytes = len(cut)
    return g.b


def torn_header() -> Built:
    """The writer was killed after 7 bytes of a frame header."""
    g = Builder()
    _body(g, steps=2)
    cut = framing.encode_frame(codec.encode(StepBegan(**env(6, 2))))[:7]
    g.b.data += cut
    g.b.pending_bytes = len(cut)
    return g.b


def _flip(g: Builder, index: int, byte_in_frame: int, bit: int) -> None:
    start, _length = g.b.frames[index]
    data = bytearray(g.b.data)
    data[start + byte_in_frame] ^= 1 << bit
    g.b.data = bytes(data)


def flipped_payload_bit() -> Built:
    """One bit flipped inside a stats record's payload: that frame, and only that one, is lost."""
    g = Builder()
    _body(g)
    g.add(FileClosed(**env(10, 3, 9.0), records=10, reason="close"))
    k = 4  # the second stats record (seq 4)
    start, length = g.b.frames[k]
    _flip(g, k, framing.FRAME_HEADER_SIZE + 40, 3)
    lost = g.b.events.pop(k)
    g.b.problems.append({"offset": start, "skipped": length})
    g.b.gaps.append({"offset": start + length, "expected": lost.seq, "got": lost.seq + 1})
    return g.b


def flipped_header_bit() -> Built:
    """One bit flipped in a frame header's length: the reader resynchronises at the next frame."""
    g = Builder()
    _body(g)
    g.add(FileClosed(**env(10, 3, 9.0), records=10, reason="close"))
    k = 3  # StepEnded of step 0 (seq 3)
    start, length = g.b.frames[k]
    _flip(g, k, 5, 1)  # the length field
    lost = g.b.events.pop(k)
    g.b.problems.append({"offset": start, "skipped": length})
    g.b.gaps.append({"offset": start + length, "expected": lost.seq, "got": lost.seq + 1})
    return g.b


def reliability() -> Built:
    """A writer of this version: its identity in the header, a damaged name table restored from its copy, a
    duplicated block of frames dropped, and the writer's own note of a failure to write before its close."""
    g = Builder()
    g.add(dataclasses.replace(header_event(), writer_id="0123456789abcdef0123456789abcdef", proc_start=123456,
                              boot_id="6b0c5e4e-0d1f-4a3b-9c2d-1e2f3a4b5c6d"))
    names = ("model.layer1", "model.layer2", "model.head")
    g.add(NamesInterned(**env(1, 0), first_id=0, names=names))
    g.add(NamesRepeated(**env(2, 0), first_id=0, names=names))
    g.add(stats_actv(3, 0))
    g.add(StepEnded(**env(4, 0, 1.0), duration=0.5, collected=True))
    dup_start = len(g.b.data)
    dup = g.b.data[g.b.frames[3][0] :]  # the last two frames again (a copy tool that retried a block)
    g.b.data += dup
    g.add(WriterFailed(**env(5, 0, 2.0), error="OSError(28, 'No space left on device')", first_lost_seq=5,
                       discarded=12, last_step=3))
    g.add(FileClosed(**env(6, 0, 3.0), records=6, reason="close; the writer failed before"))
    start, length = g.b.frames[1]
    _flip(g, 1, framing.FRAME_HEADER_SIZE + 6, 2)  # inside a name: the table's frame is lost, not its copy
    lost = g.b.events.pop(1)
    g.b.events.insert(1, dataclasses.replace(lost, seq=2))  # restored from the copy, under the copy's number
    g.b.problems += [{"offset": start, "skipped": length}, {"offset": dup_start, "skipped": len(dup)}]
    g.b.gaps.append({"offset": start + length, "expected": 1, "got": 2})
    return g.b


def header_only() -> Built:
    """A file whose writer died right after creating it: the file header, no record."""
    return Builder().b


def future_version() -> Built:
    """A file of format version 2: refused with UnsupportedVersionError."""
    g = Builder(version=2)
    g.add(header_event())
    g.b.events = []
    g.b.error = "UnsupportedVersionError"
    return g.b


def not_a_log() -> Built:
    """Bytes that are not a trainrec log (a TensorBoard event file's start): refused with NotALogError."""
    b = Built(data=struct.pack("<Q", 24) + b"\x00" * 20)
    b.error = "NotALogError"
    return b


def logwriter() -> Built:
    """Through the real LogWriter thread: intern, stats, deferred callable, close."""
    from trainrec.recorder.writer import LogWriter  # imports torch: only this scenario needs it

    with tempfile.TemporaryDirectory() as tmp:
        rdir = os.path.join(tmp, DIR_NAME)
        w = LogWriter(rdir, rank=RANK, world_size=4, run_id=RUN_ID, pp_stage=1, group_mates=(0, 1))
        events: list[Event] = [w.header]
        if w.intern(["a", "b", "c"], step=0) != [0, 1, 2]:
            raise RuntimeError("LogWriter.intern did not number a fresh file's names from 0")
        events.append(NamesInterned(**env(1, 0), first_id=0, names=("a", "b", "c")))
        seq = 2
        for step in range(3):
            ev = stats_actv(0, step)  # rows use ids 0, 1, 2: a, b, c
            w.write(ev)
            events.append(dataclasses.replace(ev, seq=seq))
            done = StepEnded(**env(0, step, 1.0 + step), duration=0.25, collected=True)
            w.write(lambda done=done: [done])  # built on the writer thread
            events.append(dataclasses.replace(done, seq=seq + 1))
            seq += 2
        w.intern(["a", "d"], step=3)
        events.append(NamesInterned(**env(seq, 3), first_id=3, names=("d",)))
        w.close()
        events.append(FileClosed(**env(seq + 1, 3), records=seq + 1, dropped=0, reason="close"))
        with open(w.path, "rb") as f:
            data = f.read()
    b = Built(data=data, events=events)
    b.masked = {
        "FileOpened": ["wall", "host", "pid", "start_time", "trainrec_version", "torch_version"],
        "NamesInterned": ["wall"],
        "FileClosed": ["wall"],
    }
    return b


def step_index() -> Built:
    """A file closed with its step index, in FileClosed's appended ``index_*`` fields: per segment, the
    step, offset and seq of its first frame and its lowest step; the name tables' offsets. Step 1's
    segment holds a late record of step 0 and a name table."""
    g = Builder()
    g.add(header_event())
    g.add(NamesInterned(**env(1, -1), first_id=0, names=("a", "b", "c")))
    seq, segments, names = 2, [], [g.b.frames[-1][0]]
    for step in range(3):
        segments.append((step, len(g.b.data), seq))
        g.add(stats_actv(seq, step))
        g.add(StepEnded(**env(seq + 1, step, 1.0 + step), duration=0.1, collected=True))
        seq += 2
        if step == 1:
            names.append(len(g.b.data))
            g.add(NamesInterned(**env(seq, 1), first_id=3, names=("d",)))
            g.add(AnomalyDetected(**env(seq + 1, 0, 1.5), rule="AnomalyTurbulence", op="norm", value=9.0))
            seq += 2
    g.add(FileClosed(**env(seq, 2, 4.0), records=seq, reason="close",
                     index_steps=pack_array("q", [s for s, _, _ in segments]),
                     index_offsets=pack_array("Q", [o for _, o, _ in segments]),
                     index_seqs=pack_array("Q", [q for _, _, q in segments]), index_low_steps=pack_array("q", [0, 0, 2]),
                     index_names=pack_array("Q", names)))
    return g.b


SCENARIOS: dict[str, Callable[[], Built]] = {
    "every_event": every_event,
    "compat": compat,
    "torn_tail": torn_tail,
    "torn_header": torn_header,
    "flipped_payload_bit": flipped_payload_bit,
    "flipped_header_bit": flipped_header_bit,
    "header_only": header_only,
    "future_version": future_version,
    "not_a_log": not_a_log,
    "logwriter": logwriter,
    "placeholders": placeholders,
    "flight": flight,
    "reliability": reliability,
    "api_calls": api_calls,
    "api_calls_backward": api_calls_backward,
    "step_index": step_index,
}


def apply_mask(event_json: dict, masked: dict) -> dict:
    """``event_json`` with the fields listed for its type in ``masked`` replaced by MASK."""
    names = masked.get(event_json["type"], ())
    if not names:
        return event_json
    fields = {k: (MASK if k in names else v) for k, v in event_json["fields"].items()}
    return {"type": event_json["type"], "fields": fields}


def expected_json(name: str, b: Built) -> dict:
    doc = {
        "scenario": name,
        "description": " ".join(SCENARIOS[name].__doc__.split()),
        "log": f"{name}.trl",
        "format_version": framing.FORMAT_VERSION,
    }
    if b.error:
        doc["error"] = b.error
        return doc
    doc.update(
        {
            "events": [apply_mask(event_to_json(e), b.masked) for e in b.events],
            "problems": b.problems,
            "gaps": b.gaps,
            "pending_bytes": b.pending_bytes,
            "closed_cleanly": any(isinstance(e, FileClosed) for e in b.events),
            "masked": b.masked,
        }
    )
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regenerate", action="store_true",
                        help="overwrite existing golden files (a deliberate format decision, never routine)")
    parser.add_argument("--out", default=VERSION_DIR, help="folder to write into (default: %(default)s)")
    parser.add_argument("scenarios", nargs="*", help=f"scenarios to write (default: all of {', '.join(SCENARIOS)})")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}")
    os.makedirs(args.out, exist_ok=True)
    refused = []
    for name in args.scenarios or SCENARIOS:
        paths = [os.path.join(args.out, f"{name}{ext}") for ext in (".trl", ".json")]
        if not args.regenerate and any(os.path.exists(p) for p in paths):
            refused.append(name)
            continue
        built = SCENARIOS[name]()
        tmp = paths[0] + ".tmp"
        with open(tmp, "wb") as f:
            f.write(built.data)
        shutil.move(tmp, paths[0])
        with open(paths[1], "w", encoding="utf-8") as f:
            json.dump(expected_json(name, built), f, indent=1, sort_keys=False)
            f.write("\n")
        print(f"wrote {paths[0]} ({len(built.data)} bytes) and {os.path.basename(paths[1])}")
    if refused:
        print(
            f"not overwritten (golden logs are frozen; pass --regenerate only for a deliberate format "
            f"decision): {', '.join(refused)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
