"""The envelope every event shares (:class:`Event`: ``seq``, ``rank``, ``step``, ``wall``) and the checks
of fields that several event types hold (rank lists, counts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .vocab import MAX_WORLD_SIZE


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
