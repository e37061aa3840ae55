"""The golden scenarios of intact records: one record of every event type, records as older and newer
writers pack them, the columns and fields appended since (placeholders, the API level's backward
records, the step index), the post-mortem's records, and a file written by the real LogWriter."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from golden_builder import DIR_NAME, RANK, RUN_ID, T0, Builder, Built, env, header_event, stats_actv
from trainrec.schema.events import (
    DIR_BACKWARD,
    DIR_FORWARD,
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
    HookFailed,
    HooksFired,
    ModuleStructureRecorded,
    MonitoringStopped,
    NamesInterned,
    RecordsDropped,
    RunResumed,
    StallDetected,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    UnknownEvent,
    pack_array,
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
