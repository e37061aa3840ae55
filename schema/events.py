"""Every event type of the trainrec log, listed in one place (EVENT_TYPES, TAGS).

Events are frozen dataclasses named as past-tense facts, defined by concern in :mod:`.file_events`,
:mod:`.step_events`, :mod:`.monitor_events` and :mod:`.flight_events`. Each has a short, stable
``TAG`` that we own (never a class name) and the envelope of :class:`Event` (:mod:`.envelope`):
``rank``, ``seq`` (per-file, assigned by the writer), ``step`` and ``wall`` (seconds since the epoch).

On the wire an event is ``[tag, seq, rank, step, wall, *fields]`` (:mod:`trainrec.schema.codec`).
Schemas grow by appending fields with defaults; a reader fills missing trailing fields and ignores
extra ones. Removing or retyping a field needs a new tag or format version plus a codec upgrade.
Statistics travel columnar (:class:`TensorStatsRecorded`), names interned once per file
(:class:`NamesInterned`). See docs/log-format.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .envelope import Event
from .file_events import (  # noqa: F401 - listed in EVENT_TYPES, re-exported
    FileClosed,
    FileOpened,
    NamesInterned,
    NamesRepeated,
    RunResumed,
)
from .flight_events import (  # noqa: F401 - listed in EVENT_TYPES, re-exported
    ApiCallsRecorded,
    CollectiveCalled,
    CollectiveCompleted,
    ExceptionRaised,
    StallDetected,
)
from .monitor_events import (  # noqa: F401 - listed in EVENT_TYPES, re-exported
    ConfigApplied,
    ConfigChanged,
    ConfigRejected,
    HookFailed,
    MonitoringStopped,
    RecordsDropped,
    WriterFailed,
)
from .step_events import (  # noqa: F401 - listed in EVENT_TYPES, re-exported
    AnomalyDetected,
    HooksFired,
    ModuleStructureRecorded,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
)
from .vocab import (  # noqa: F401 - the vocabulary the events are written in, re-exported
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
