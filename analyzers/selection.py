"""Which steps and data types an export covers: the user's selection (:class:`StepSet` from
:func:`parse_steps`, data types from :func:`parse_kinds`) and the steps it wrote (:class:`SeenSteps`)."""

from __future__ import annotations

import bisect
import re
from array import array
from collections.abc import Iterable, Iterator

from trainrec.schema.events import CSV_FILE_PREFIX, KINDS

__all__ = ["SeenSteps", "StepSet", "parse_kinds", "parse_steps"]


class StepSet:
    """A set of steps given as ranges, e.g. ``"10-20,30"`` (both ends inclusive; ``"5-"`` open)."""

    def __init__(self, ranges: Iterable[tuple[int, int | None]]) -> None:
        self.ranges = tuple(ranges)

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        return any(lo <= step and (hi is None or step <= hi) for lo, hi in self.ranges)

    def __repr__(self) -> str:
        return f"StepSet({self.text()!r})"

    def text(self) -> str:
        return ",".join(f"{lo}" if lo == hi else f"{lo}-{'' if hi is None else hi}" for lo, hi in self.ranges)


class SeenSteps:
    """The steps an export wrote, in 8 bytes each (a live export runs as long as training does).

    Steps come in increasing order but for a resume's rewind (:meth:`drop_from`), which supersedes
    the steps from one on; an older step added again (an offline export of several files) is inserted
    in order. Iterates in step order."""

    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps = array("q")

    def add(self, step: int) -> None:
        a = self._steps
        if not a or step > a[-1]:
            a.append(step)
            return
        i = bisect.bisect_left(a, step)
        if a[i] != step:
            a.insert(i, step)

    def drop_from(self, step: int) -> None:
        """Forget the steps >= ``step``."""
        del self._steps[bisect.bisect_left(self._steps, step) :]

    def __iter__(self) -> Iterator[int]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        return f"SeenSteps({list(self._steps)!r})"


_RANGE_RE = re.compile(r"^\s*(\d+)\s*(?:([-:])\s*(\d*)\s*)?$")


def parse_steps(text: str, what: str = "step") -> StepSet:
    """Parse ``"10-20,30,40-"`` (``10:20`` is ``10-20``); raises ValueError saying which part is wrong."""
    ranges: list[tuple[int, int | None]] = []
    for part in str(text).split(","):
        m = _RANGE_RE.match(part)
        if not m:
            raise ValueError(f"bad {what} range {part.strip()!r} in {text!r} (expected e.g. '10-20,30')")
        lo = int(m.group(1))
        hi: int | None = lo if not m.group(2) else (int(m.group(3)) if m.group(3) else None)
        if hi is not None and hi < lo:
            raise ValueError(f"bad {what} range {part.strip()!r}: end before start")
        ranges.append((lo, hi))
    return StepSet(ranges)


def parse_kinds(values: Iterable[str] | str | None, valid: Iterable[str] = KINDS) -> tuple[str, ...]:
    """Data types from ``"actv,param"`` (or a list of such strings), in the order given; all when None.

    Raises ValueError naming the unknown type and listing the valid ones.
    """
    valid = tuple(valid)
    if values is None:
        return valid
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for v in values:
        for k in str(v).split(","):
            k = k.strip()
            if not k:
                continue
            if k not in valid:
                # the reference's CSV file prefix of a type ("other" is mg_direction) names it too
                k = next((kind for kind, prefix in CSV_FILE_PREFIX.items() if prefix == k and kind in valid), k)
            if k not in valid:
                aliases = "".join(f" ({p} for {kind})" for kind, p in CSV_FILE_PREFIX.items() if kind in valid)
                raise ValueError(f"unknown data type {k!r}; valid types: {', '.join(valid)}{aliases}")
            if k not in out:
                out.append(k)
    if not out:
        raise ValueError(f"no data type given; valid types: {', '.join(valid)}")
    return tuple(out)
