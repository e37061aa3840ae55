"""Every event type of the trainrec log, in one place.

Events are frozen dataclasses named as past-tense facts. Each has a short, stable ``TAG`` that we own
(never a class name) and shares the envelope of :class:`Event`: ``rank``, ``seq`` (per-file sequence
number assigned by the writer), ``step`` and ``wall`` (seconds since the epoch).

On the wire an event is the msgpack array ``[tag, seq, rank, step, wall, *fields]`` with the fields in
declaration order (see :mod:`trainrec.schema.codec`). Schemas grow by appending fields with defaults
at the end of a class; a reader fills missing trailing fields with their defaults and ignores extra
ones written by a newer writer. Removing or retyping a field needs a new tag or format version plus an
upgrade in the codec.

Statistics travel columnar (:class:`TensorStatsRecorded`): one record per (step, kind) holds packed
arrays of interned name ids, micro steps, call ids and slots, plus a ``rows x len(ops)`` float matrix.
Names are interned once per file by :class:`NamesInterned`.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .vocab import (  # noqa: F401 - the vocabulary the events are written in, re-exported
    _DIR_BYTES,
    _FLAG_BYTES,
    _LITTLE,
    _SLOT_BYTES,
    CSV_FILE_PREFIX,
    DIR_BACKWARD,
    DIR_FORWARD,
    KIND_ACTV,
    KIND_ACTV_GRAD,
    KIND_EXP_AVG,
    KIND_EXP_AVG_SQ,
    KIND_GRAD_REDUCED,
    KIND_GRAD_UNREDUCED,
    KIND_MG_DIRECTION,
    KIND_PARAM,
    KIND_RATIO,
    KIND_UPDATE,
    KINDS,
    MAX_MICRO_STEPS,
    MAX_NAME_ID,
    MAX_STEP,
    MAX_WORLD_SIZE,
    OPS,
    SLOT_INPUT,
    SLOT_INPUT_GRAD,
    SLOT_NONE,
    SLOT_OUTPUT,
    SLOT_OUTPUT_GRAD,
    SLOTS,
    pack_array,
    unpack_array,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Envelope shared by every event."""

    TAG: ClassVar[str] = ""
    seq: int = -1
    rank: int = -1
    step: int = -1
    wall: float = 0.0

    def check(self) -> str | None:
        """What is inconsistent about the record's own fields, or None (see the subclasses)."""
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class FileOpened(Event):
    """First record of every log file: who wrote it and with what."""

    TAG: ClassVar[str] = "fo"
    run_id: str = ""
    world_size: int = 1
    host: str = ""
    pid: int = 0
    start_time: float = 0.0
    trainrec_version: str = ""
    torch_version: str = ""
    format_version: int = 1
    file_index: int = 0
    dir_name: str = ""
    pp_stage: int = 0
    group_mates: tuple = ()
    # The writer's identity (appended later; "" and 0 in an older writer's file): a random nonce no
    # other writer shares, and the process's start time (clock ticks since boot) and boot id, which
    # tell the writer from a later process that got its pid (see trainrec.schema.procid).
    writer_id: str = ""
    proc_start: int = 0
    boot_id: str = ""

    def check(self) -> str | None:
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            return f"world size {self.world_size} is outside 1..{MAX_WORLD_SIZE}"
        if not 0 <= self.pp_stage < MAX_WORLD_SIZE:
            return f"pipeline stage {self.pp_stage} is outside 0..{MAX_WORLD_SIZE - 1}"
        if self.file_index < 0:
            return f"file index {self.file_index} is negative"
        return _check_ranks(self.group_mates, "group_mates")


def _check_ranks(ranks: tuple, label: str) -> str | None:
    """A list of ranks (group mates): ints of 0..MAX_WORLD_SIZE-1, at most MAX_WORLD_SIZE of them."""
    if len(ranks) > MAX_WORLD_SIZE:
        return f"{label} lists {len(ranks)} ranks, more than {MAX_WORLD_SIZE}"
    for r in ranks:
        if type(r) is not int or not 0 <= r < MAX_WORLD_SIZE:
            return f"{label} holds {r!r}, not a rank (an int of 0..{MAX_WORLD_SIZE - 1})"
    return None


def _check_counts(event: Event, *labels: str) -> str | None:
    for label in labels:
        if getattr(event, label) < 0:
            return f"{label} {getattr(event, label)} is negative"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class FileClosed(Event):
    """Last record of a cleanly closed file.

    The ``index_*`` fields (appended later: empty in older writers' files) are the file's step index.
    Segment ``k`` starts at byte ``index_offsets[k]`` with the frame of sequence number ``index_seqs[k]``,
    the first whose step ``index_steps[k]`` is above every step before it; it runs to the next segment
    (the last one to this record), none of its frames has a higher step, and ``index_low_steps[k]`` is
    the lowest step >= 0 among them. ``index_names``: the offsets of the frames of name tables. Packed
    little-endian, 'q' (steps) and 'Q' (offsets, seqs). Untrusted: replay checks it against the file
    (:mod:`trainrec.replay.stepindex`) and reads the whole file where it does not fit."""

    TAG: ClassVar[str] = "fc"
    records: int = 0
    dropped: int = 0
    reason: str = "close"
    index_steps: bytes = b""
    index_offsets: bytes = b""
    index_seqs: bytes = b""
    index_low_steps: bytes = b""
    index_names: bytes = b""

    def check(self) -> str | None:
        return _check_counts(self, "records", "dropped")


@dataclass(frozen=True, slots=True, kw_only=True)
class NamesInterned(Event):
    """Assigns ids ``first_id, first_id+1, ...`` to ``names``, for the rest of this file."""

    TAG: ClassVar[str] = "nm"
    first_id: int = 0
    names: tuple = ()

    def check(self) -> str | None:
        if not 0 <= self.first_id <= MAX_NAME_ID:
            return f"first name id {self.first_id} is outside 0..{MAX_NAME_ID} (ids are u32)"
        if self.first_id + len(self.names) > MAX_NAME_ID + 1:
            return f"{len(self.names)} names from id {self.first_id} run past the last u32 id"
        for n in self.names:
            if type(n) is not str:
                return f"a name is {type(n).__name__} {n!r}, not a string"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class NamesRepeated(Event):
    """A copy of an earlier NamesInterned of the same file (same ``first_id`` and ``names``), in a frame
    of its own: where the original's frame was damaged, its names are still known. A reader takes from
    it only ids it has not been given yet."""

    TAG: ClassVar[str] = "nr"
    first_id: int = 0
    names: tuple = ()

    def check(self) -> str | None:
        return NamesInterned.check(self)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleStructureRecorded(Event):
    """The model's module tree: one entry per module, parents as indices (-1 for the root)."""

    TAG: ClassVar[str] = "ms"
    vpp_stage: int = 0
    names: tuple = ()
    classes: tuple = ()
    parents: tuple = ()
    param_counts: tuple = ()
    io_specs: dict = field(default_factory=dict)

    def check(self) -> str | None:
        n = len(self.names)
        for label in ("classes", "parents", "param_counts"):
            k = len(getattr(self, label))
            if k and k != n:
                return f"{label} has {k} entries for {n} modules"
        for x in self.names + self.classes:
            if type(x) is not str:
                return f"a module name or class is {type(x).__name__} {x!r}, not a string"
        for p in self.parents:
            if type(p) is not int or not -1 <= p < n:
                return f"parent {p!r} is not a module index (-1..{n - 1})"
        for c in self.param_counts:
            if type(c) is not int or c < 0:
                return f"parameter count {c!r} is not a count"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class HooksFired(Event):
    """Every hook firing of a step, columnar: packed u32 module name ids, u8 directions
    (DIR_FORWARD/DIR_BACKWARD), u32 call ids (execution order) and u16 micro steps."""

    TAG: ClassVar[str] = "hf"
    module_ids: bytes = b""
    directions: bytes = b""
    call_ids: bytes = b""
    micro_steps: bytes = b""

    def check(self) -> str | None:
        n, rest = divmod(len(self.module_ids), 4)
        if rest:
            return "module_ids is not a whole number of u32"
        for arr, size, label in ((self.directions, 1, "directions"), (self.call_ids, 4, "call_ids"),
                                 (self.micro_steps, 2, "micro_steps")):
            if len(arr) != n * size:
                return f"{label} has {len(arr) / size:g} entries for {n} hook firings"
        if self.directions and self.directions.translate(None, _DIR_BYTES):  # (C-level, as slots)
            return f"direction {max(self.directions)} is neither forward (0) nor backward (1)"
        return None

    def rows(self):
        """Iterate ``(module_id, direction, call_id, micro_step)``."""
        return zip(
            unpack_array("I", self.module_ids),
            self.directions,
            unpack_array("I", self.call_ids),
            unpack_array("H", self.micro_steps), strict=False,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepBegan(Event):
    TAG: ClassVar[str] = "sb"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEnded(Event):
    """A training step ended. ``optimizer_skipped``: its optimizer step never ran (``GradScaler`` or
    DeepSpeed found inf/NaN gradients and skipped it); the recorder saw the next step's first forward
    with the gradients cleared instead. ``foreign_passes``: no training step, but what the run left
    after its last one when it ended: passes of the model inside other optimizers' steps only (a GAN's
    discriminator in the generator's step, which comes second), with nothing of a step of its own after
    them; its records are those passes', and replay counts no step for it."""

    TAG: ClassVar[str] = "se"
    duration: float = 0.0
    collected: bool = False
    micro_steps: int = 1
    optimizer_skipped: bool = False
    foreign_passes: bool = False

    def check(self) -> str | None:
        if not 0 <= self.micro_steps <= MAX_MICRO_STEPS:
            return f"micro step count {self.micro_steps} is outside 0..{MAX_MICRO_STEPS}"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorStatsRecorded(Event):
    """Statistics of many tensors of one kind at one step, columnar.

    ``values`` is a row-major ``len(name_ids) x len(ops)`` matrix of ``dtype`` ('f' float32 or 'd'
    float64) values. The per-row arrays ``micro_steps`` (u16), ``call_ids`` (u32), ``slots`` (u8, see
    SLOTS) and ``vpp_stages`` (u8) are empty when every row has 0 (``call_ids``: unknown).

    ``placeholders`` (u8, 0 or 1; appended later, so a record of an older writer has none): 1 where the
    row stands for no tensor's values, a NaN row the recorder wrote for a tensor it did not measure (a
    parameter whose ``.grad`` is None that step, a tensor of no elements, the unhooked slot of an
    activation gradient pair, a tensor the statistics engine failed on), as opposed to a tensor that
    holds NaN. Empty when no row is one (and in every record of an older writer, which did not mark
    them). Anomaly detection skips such rows; exports write them as the NaN they are.
    """

    TAG: ClassVar[str] = "ts"
    kind: str = ""
    ops: tuple = ()
    dtype: str = "f"
    name_ids: bytes = b""
    values: bytes = b""
    micro_steps: bytes = b""
    call_ids: bytes = b""
    slots: bytes = b""
    vpp_stages: bytes = b""
    placeholders: bytes = b""

    def __len__(self) -> int:
        return len(self.name_ids) // 4

    def check(self) -> str | None:
        """Return what is inconsistent about the arrays, or None when they fit together."""
        if self.dtype not in ("f", "d"):
            return f"unknown value dtype {self.dtype!r}"
        for op in self.ops:
            if type(op) is not str or not op:
                return f"op {op!r} is not a name"
        if len(set(self.ops)) != len(self.ops):
            return f"ops {list(self.ops)} repeat a name"
        n = len(self.name_ids)
        if n % 4:
            return "name_ids is not a whole number of u32"
        n //= 4
        item = 4 if self.dtype == "f" else 8
        if len(self.values) != n * len(self.ops) * item:
            return f"{len(self.values)} value bytes for {n} rows x {len(self.ops)} ops"
        for arr, size, label in (
            (self.micro_steps, 2, "micro_steps"),
            (self.call_ids, 4, "call_ids"),
            (self.slots, 1, "slots"),
            (self.vpp_stages, 1, "vpp_stages"),
            (self.placeholders, 1, "placeholders"),
        ):
            if arr and len(arr) != n * size:
                return f"{label} has {len(arr) // size} entries for {n} rows"
        if self.slots and self.slots.translate(None, _SLOT_BYTES):  # (C-level: a Python max took 0.2 ms per 12,000)
            return f"slot {max(self.slots)} is not a known slot (0..{len(SLOTS) - 1})"
        if self.placeholders and self.placeholders.translate(None, _FLAG_BYTES):
            return f"placeholder flag {max(self.placeholders)} is neither 0 nor 1"
        return None

    def column(self, name: str) -> array.array:
        """A per-row column as an array, zero-filled when absent (call_ids: -1 when absent)."""
        n = len(self)
        if name == "name_ids":
            return unpack_array("I", self.name_ids)
        if name == "micro_steps":
            return unpack_array("H", self.micro_steps) if self.micro_steps else array.array("H", bytes(2 * n))
        if name == "call_ids":
            return unpack_array("I", self.call_ids) if self.call_ids else array.array("i", [-1]) * n
        if name == "slots":
            return array.array("B", self.slots) if self.slots else array.array("B", bytes(n))
        if name == "vpp_stages":
            return array.array("B", self.vpp_stages) if self.vpp_stages else array.array("B", bytes(n))
        if name == "placeholders":
            return array.array("B", self.placeholders) if self.placeholders else array.array("B", bytes(n))
        raise KeyError(name)

    def value_array(self) -> array.array:
        """All values, row-major, as a flat array."""
        return unpack_array(self.dtype, self.values)


@dataclass(frozen=True, slots=True, kw_only=True)
class AnomalyDetected(Event):
    """A rule flagged a statistic. Carries what the reference's anomaly JSON carries, plus op/value."""

    TAG: ClassVar[str] = "an"
    micro_step: int = 0
    pp_stage: int = 0
    vpp_stage: int = 0
    call_id: int = -1
    tag_name: str = ""
    op: str = ""
    value: float = 0.0
    baseline: float = 0.0
    message: str = ""
    group_mates: tuple = ()
    rule: str = ""
    kind: str = ""
    name: str = ""
    slot: str = ""

    def check(self) -> str | None:
        return _check_ranks(self.group_mates, "group_mates")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigChanged(Event):
    """The monitor saw its config file change (not yet applied)."""

    TAG: ClassVar[str] = "cc"
    path: str = ""
    content_hash: str = ""
    changed_keys: tuple = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigApplied(Event):
    """A config took effect; monitoring collects from ``start_step`` on."""

    TAG: ClassVar[str] = "ca"
    path: str = ""
    content_hash: str = ""
    config: dict = field(default_factory=dict)
    start_step: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigRejected(Event):
    """A config change was invalid and did not take effect."""

    TAG: ClassVar[str] = "cr"
    path: str = ""
    content_hash: str = ""
    reason: str = ""
    keys: tuple = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitoringStopped(Event):
    """Monitoring stopped (collect_times reached, switch off, error)."""

    TAG: ClassVar[str] = "mx"
    reason: str = ""
    collections: int = 0

    def check(self) -> str | None:
        return _check_counts(self, "collections")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResumed(Event):
    """Training resumed into an existing run; this file continues it from ``step``."""

    TAG: ClassVar[str] = "rr"
    previous_files: tuple = ()
    last_step: int = -1
    reason: str = ""

    def check(self) -> str | None:
        if not -1 <= self.last_step < MAX_STEP:
            return f"last step {self.last_step} is outside -1..{MAX_STEP - 1}"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordsDropped(Event):
    """The writer's queue was full and ``count`` records were dropped (drop policy)."""

    TAG: ClassVar[str] = "rd"
    count: int = 0

    def check(self) -> str | None:
        return _check_counts(self, "count")


@dataclass(frozen=True, slots=True, kw_only=True)
class WriterFailed(Event):
    """The writer could not write to this file (disk full, file too large, removed): everything handed
    over from the frame with sequence number ``first_lost_seq`` on was never written, ``discarded``
    records (and deferred batches) in all, up to step ``last_step``. Written when the disk allows, at
    the failure or at close; its own ``seq`` is the one it would have had, had nothing been lost."""

    TAG: ClassVar[str] = "wf"
    error: str = ""
    first_lost_seq: int = 0
    discarded: int = 0
    last_step: int = -1

    def check(self) -> str | None:
        return _check_counts(self, "first_lost_seq", "discarded")


@dataclass(frozen=True, slots=True, kw_only=True)
class HookFailed(Event):
    """An exception inside a monitoring hook, caught so that training goes on."""

    TAG: ClassVar[str] = "hx"
    where: str = ""
    error: str = ""
    count: int = 1

    def check(self) -> str | None:
        return _check_counts(self, "count")


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCalled(Event):
    """A ``torch.distributed`` collective or point-to-point call issued on this rank (``cc_distribution``),
    written when it is issued (``wall``), before it can block.

    ``group`` is the process group's name and ``group_ranks`` its global ranks in group order;
    ``group_seq`` numbers this rank's recorded calls on that group from 0 (ranks that agree on the calls
    agree on the numbers). ``shapes`` and ``dtypes`` describe the tensor arguments in call order (a list
    argument's tensors in place), ``peer`` is the global rank of ``src``/``dst`` where the call has one
    (-1 otherwise), ``reduce_op`` the reduction's name where it has one. ``codeline`` is the user's call
    site (``file.py[23]``) where the config asked for call sites. ``pre_values``: the statistics of the
    tensors before the call (``cc_pre_hook``), a row-major float32 ``len(shapes) x len(ops)`` matrix,
    empty where not taken; those after it are in :class:`CollectiveCompleted`."""

    TAG: ClassVar[str] = "co"
    op: str = ""
    group: str = ""
    group_ranks: tuple = ()
    group_seq: int = 0
    shapes: tuple = ()
    dtypes: tuple = ()
    async_op: bool = False
    peer: int = -1
    reduce_op: str = ""
    codeline: str = ""
    ops: tuple = ()
    pre_values: bytes = b""

    def check(self) -> str | None:
        if self.group_seq < 0:
            return f"group_seq {self.group_seq} is negative"
        if not -1 <= self.peer < MAX_WORLD_SIZE:
            return f"peer {self.peer} is outside -1..{MAX_WORLD_SIZE - 1}"
        if len(self.dtypes) != len(self.shapes):
            return f"{len(self.dtypes)} dtypes for {len(self.shapes)} shapes"
        for shape in self.shapes:
            if not isinstance(shape, (tuple, list)) or any(type(d) is not int or d < 0 for d in shape):
                return f"shape {shape!r} is not a list of sizes"
        if self.pre_values and len(self.pre_values) != 4 * len(self.shapes) * len(self.ops):
            return f"pre_values holds {len(self.pre_values)} bytes for {len(self.shapes)} tensors x {len(self.ops)} ops"
        return _check_ranks(self.group_ranks, "group_ranks")


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCompleted(Event):
    """A synchronous collective call of :class:`CollectiveCalled` (same ``group`` and ``group_seq``)
    returned after ``duration`` seconds; ``values`` are the statistics of its tensors then (row-major
    float32 ``tensors x len(ops)``). Written in ``cc_distribution``'s statistics mode only."""

    TAG: ClassVar[str] = "cd"
    op: str = ""
    group: str = ""
    group_seq: int = 0
    duration: float = 0.0
    ops: tuple = ()
    values: bytes = b""

    def check(self) -> str | None:
        if self.group_seq < 0:
            return f"group_seq {self.group_seq} is negative"
        if self.ops and len(self.values) % (4 * len(self.ops)):
            return f"values holds {len(self.values)} bytes, not whole rows of {len(self.ops)} float32"
        return None

@dataclass(frozen=True, slots=True, kw_only=True)
class StallDetected(Event):
    """The stall watchdog found the current step running for ``elapsed`` seconds, past ``threshold``
    (a multiple of ``median_step``, the median of the recent steps, or a floor); ``count`` numbers the
    reports of this stall (it is reported again while it lasts).

    ``stacks`` is every thread's Python stack as :mod:`faulthandler` prints it; ``modules`` the model's
    modules whose forward is on the main thread's stack, outermost first. The last hook that fired
    (``hook_module`` empty where none has in this step; ``hook_direction`` DIR_FORWARD/DIR_BACKWARD) and
    the collective call in flight (``collective_op`` empty where none is; its ``collective_seq`` on
    ``collective_group_ranks``, for ``collective_elapsed`` seconds) are what the recorder knew then."""

    TAG: ClassVar[str] = "sl"
    elapsed: float = 0.0
    median_step: float = 0.0
    threshold: float = 0.0
    count: int = 1
    stacks: str = ""
    modules: tuple = ()
    hook_module: str = ""
    hook_direction: int = DIR_FORWARD
    hook_micro_step: int = 0
    hook_call_id: int = -1
    collective_op: str = ""
    collective_group_ranks: tuple = ()
    collective_seq: int = -1
    collective_elapsed: float = 0.0

    def check(self) -> str | None:
        if self.hook_direction not in (DIR_FORWARD, DIR_BACKWARD):
            return f"direction {self.hook_direction} is neither forward (0) nor backward (1)"
        return _check_ranks(self.collective_group_ranks, "collective_group_ranks") or _check_counts(self, "count")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExceptionRaised(Event):
    """An exception ended the recording (uncaught, or out of the monitor's ``with`` block): its type and
    message (``error``), the model's modules whose forward it came out of (``modules``, outermost
    first, empty where it came from none) and its traceback as Python prints it (the last lines kept)."""

    TAG: ClassVar[str] = "xr"
    error: str = ""
    modules: tuple = ()
    traceback: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiCallsRecorded(Event):
    """The API calls (torch functions, tensor methods) of one forward pass of a model chunk, recorded at
    the opt-in API level (``api_xy``), columnar. Per call: ``name_ids`` (u32, interned names as the
    reference gives them, ``Functional.linear.0.forward``), ``module_ids`` (u32, the innermost
    monitored module whose forward it ran in; 0xFFFFFFFF none), ``positions`` (u32, the step's hook
    firings before it: the enclosing module's forward firing is its first one with a call id at or
    after that) and ``port_counts`` (u16). Per port (calls' ports one after the other, positional
    inputs, outputs, keyword inputs): ``port_ids`` (u32, ``input.0``, ``output.0``, ``input.inplace``),
    ``type_ids`` and ``dtype_ids`` (u32, ``torch.Tensor``/``int``/..., ``torch.float32`` or ""),
    ``ndims`` (u8, 255: no shape) with the shapes' dims one after the other in ``dims`` (i64),
    ``requires_grad`` (u8: 0, 1, 2 not a tensor) and a row of ``values`` (``ops`` columns, ``dtype``;
    a number's value as its statistics, NaN for other non-tensors). Where stacks were asked for,
    ``stack_depths`` (u16 per call) and ``stack_frames`` (u32, interned frame lines, innermost first,
    the calls' one after the other); else both empty."""

    TAG: ClassVar[str] = "ap"
    micro_step: int = 0
    vpp_stage: int = 0
    ops: tuple = ()
    dtype: str = "f"
    name_ids: bytes = b""
    module_ids: bytes = b""
    positions: bytes = b""
    port_counts: bytes = b""
    port_ids: bytes = b""
    type_ids: bytes = b""
    dtype_ids: bytes = b""
    ndims: bytes = b""
    dims: bytes = b""
    requires_grad: bytes = b""
    values: bytes = b""
    stack_depths: bytes = b""
    stack_frames: bytes = b""

    def __len__(self) -> int:
        return len(self.name_ids) // 4

    def check(self) -> str | None:
        if self.dtype not in ("f", "d"):
            return f"unknown value dtype {self.dtype!r}"
        n, rest = divmod(len(self.name_ids), 4)
        if rest:
            return "name_ids is not a whole number of u32"
        for arr, size, label in ((self.module_ids, 4, "module_ids"), (self.positions, 4, "positions"),
                                 (self.port_counts, 2, "port_counts")):
            if len(arr) != n * size:
                return f"{label} has {len(arr) / size:g} entries for {n} calls"
        if self.stack_depths and len(self.stack_depths) != n * 2:
            return f"stack_depths has {len(self.stack_depths) / 2:g} entries for {n} calls"
        frames = sum(unpack_array("H", self.stack_depths)) if self.stack_depths else 0
        if len(self.stack_frames) != frames * 4:
            return f"stack_frames has {len(self.stack_frames) / 4:g} entries for {frames} frames"
        ports = sum(unpack_array("H", self.port_counts))
        for arr, size, label in ((self.port_ids, 4, "port_ids"), (self.type_ids, 4, "type_ids"),
                                 (self.dtype_ids, 4, "dtype_ids"), (self.ndims, 1, "ndims"),
                                 (self.requires_grad, 1, "requires_grad")):
            if len(arr) != ports * size:
                return f"{label} has {len(arr) / size:g} entries for {ports} ports"
        dims = sum(d for d in self.ndims if d != 255)
        if len(self.dims) != dims * 8:
            return f"dims has {len(self.dims) / 8:g} entries for {dims} dimensions"
        item = 4 if self.dtype == "f" else 8
        if len(self.values) != ports * len(self.ops) * item:
            return f"{len(self.values)} value bytes for {ports} ports x {len(self.ops)} ops"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownEvent(Event):
    """A record with a tag this reader does not know (written by a newer trainrec). Skip it."""

    TAG: ClassVar[str] = "?"
    tag: str = ""
    fields: tuple = ()


EVENT_TYPES: tuple[type[Event], ...] = (
    FileOpened,
    FileClosed,
    NamesInterned,
    ModuleStructureRecorded,
    HooksFired,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    AnomalyDetected,
    ConfigChanged,
    ConfigApplied,
    ConfigRejected,
    MonitoringStopped,
    RunResumed,
    RecordsDropped,
    HookFailed,
    CollectiveCalled,
    CollectiveCompleted,
    StallDetected,
    ExceptionRaised,
    NamesRepeated,
    WriterFailed,
    ApiCallsRecorded,
)

TAGS: dict[str, type[Event]] = {cls.TAG: cls for cls in EVENT_TYPES}
if len(TAGS) != len(EVENT_TYPES):  # pragma: no cover - guards against a copy-paste tag
    raise RuntimeError("duplicate event tag")


def event_name(cls_or_event: Any) -> str:
    """Short lowercase name used by `dump --type`: the tag or the class name both select it."""
    cls = cls_or_event if isinstance(cls_or_event, type) else type(cls_or_event)
    return cls.__name__
