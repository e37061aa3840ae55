"""Events of what the monitor says of itself: its config changing, applied or rejected, monitoring
stopping, a hook that failed, records the writer dropped (full queue) or could not write (disk full).
Listed and re-exported by :mod:`.events` with every other event type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .envelope import Event, _check_counts


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
