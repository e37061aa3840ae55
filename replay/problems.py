"""Damage found in one log file, as the reader records it: :class:`Problem` (path, byte offset, what,
bytes skipped), listed one by one up to :data:`MAX_LISTED` per file and only counted past that."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("trainrec.replay.reader")

__all__ = ["MAX_LISTED", "Problem", "ProblemLog"]

# Problems and gaps listed one by one per file; past that they are only counted (a hostile file of
# millions of tiny damaged frames would otherwise fill memory with their descriptions).
MAX_LISTED = 1000


@dataclass(frozen=True)
class Problem:
    """Damage found in a log file."""

    path: str
    offset: int
    what: str
    skipped: int  # bytes skipped past the damage (0: an inconsistent record, kept)

    def __str__(self) -> str:
        skipped = f"{self.skipped} bytes skipped" if self.skipped else "record kept"
        return f"{self.path} at byte {self.offset}: {self.what} ({skipped})"


class ProblemLog:
    """The problems of one file: ``problems`` (the first MAX_LISTED), then how many more there were and
    their bytes skipped (``unlisted_problems``, ``unlisted_skipped``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.problems: list[Problem] = []
        self.unlisted_problems = 0
        self.unlisted_skipped = 0

    def add(self, offset: int, what: str, skipped: int) -> bool:
        """Record damage; False when it goes on the problem before (one region, read in several parts)."""
        last = self.problems[-1] if self.problems else None
        if last is not None and last.what == what and last.offset + last.skipped == offset:
            # One damaged region read over several chunks or polls is one problem.
            self.problems[-1] = Problem(self.path, last.offset, what, last.skipped + skipped)
            return False
        if len(self.problems) >= MAX_LISTED:
            self.unlisted_problems += 1
            self.unlisted_skipped += skipped
            return True
        p = Problem(self.path, offset, what, skipped)
        self.problems.append(p)
        log.warning("trainrec: %s", p)
        return True
