"""Events of what the training steps did: the model's module tree, the hooks that fired, a step's begin
and end, the statistics of its tensors (columnar) and the anomalies a rule flagged in them. Listed and
re-exported by :mod:`.events` with every other event type."""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import ClassVar

from .envelope import Event, _check_ranks
from .vocab import _DIR_BYTES, _FLAG_BYTES, _SLOT_BYTES, MAX_MICRO_STEPS, SLOTS, unpack_array


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

    - ``values``: row-major ``len(name_ids) x len(ops)`` matrix of ``dtype`` ('f' float32, 'd' float64);
    - ``micro_steps`` (u16), ``call_ids`` (u32), ``slots`` (u8, see SLOTS), ``vpp_stages`` (u8): per row,
      empty when every row has 0;
    - ``placeholders`` (u8 flag per row; appended later, empty in older records and when no row is one):
      1 where the row is a NaN row standing for no tensor's values (absent ``.grad``, an empty tensor,
      an unhooked slot, a tensor the engine failed on), not a tensor holding NaN. Anomaly detection skips
      such rows; exports write them as NaN."""

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
        if self.slots and self.slots.translate(None, _SLOT_BYTES):  # (C-level, no Python loop over the bytes)
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
