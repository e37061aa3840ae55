"""Every event type of the trainrec log, listed in one place (EVENT_TYPES, TAGS).

Events are frozen dataclasses named as past-tense facts (the envelope in :mod:`.envelope`; the flight
recorder's and the API level's in :mod:`.flight_events`). Each has a short, stable ``TAG`` that we own
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

from .envelope import Event, _check_counts, _check_ranks  # noqa: F401 - the envelope, re-exported
from .flight_events import (  # noqa: F401 - listed in EVENT_TYPES, re-exported
    ApiCallsRecorded,
    CollectiveCalled,
    CollectiveCompleted,
    ExceptionRaised,
    StallDetected,
)
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
