"""What is wrong with a run's files, the data behind ``trainrec check``: :func:`findings` turns the
per-file reader state of a :class:`~trainrec.replay.summary.RunSummary` into a list of
:class:`Finding`, of severity ``damage``, ``torn``, ``unclosed``, ``lost`` or ``conflict`` (what
each means: ``docs/reliability.md``, "What check reports"). Pure: nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from .summary import RunSummary

__all__ = ["Finding", "findings"]


@dataclass(frozen=True)
class Finding:
    """One thing ``check`` reports: where, what, and how much was lost."""

    severity: str  # "damage", "torn", "unclosed", "missing" (a rank of the world size has no log)
    path: str
    offset: int | None
    what: str
    bytes_skipped: int = 0
    frames_lost: int = 0

    def to_json(self) -> dict:
        return {
            "severity": self.severity,
            "path": self.path,
            "offset": self.offset,
            "what": self.what,
            "bytes_skipped": self.bytes_skipped,
            "frames_lost": self.frames_lost,
        }


def findings(summary: RunSummary) -> list[Finding]:
    """Everything wrong with the run's files, in rank and file order, then by offset."""
    out: list[Finding] = []
    for rs in summary.ranks:
        for fs in rs.files:
            found: list[Finding] = []
            if fs.error is not None:
                found.append(Finding("damage", fs.path, None, fs.error))
                out.extend(found)
                continue
            if not fs.first_record_is_header:
                found.append(Finding("damage", fs.path, None, "first record is not FileOpened (header lost)"))
            for p in fs.problems:
                found.append(Finding("damage", fs.path, p.offset, p.what, bytes_skipped=p.skipped))
            for g in fs.gaps:
                what = g.describe() if g.most is not None or g.got < g.expected else (
                    f"sequence numbers jump from {g.expected - 1} to {g.got}")
                found.append(Finding("damage", fs.path, g.offset, what, frames_lost=g.lost))
            if fs.torn_bytes:
                if fs.closed_cleanly:
                    found.append(
                        Finding("damage", fs.path, fs.end_offset,
                                f"{fs.torn_bytes} bytes after the FileClosed record", bytes_skipped=fs.torn_bytes)
                    )
                elif fs is not rs.files[-1]:
                    # a crash's last incomplete frame, and a resumed launch went on in a later file
                    found.append(
                        Finding("unclosed", fs.path, fs.end_offset,
                                f"not closed cleanly; torn tail of {fs.torn_bytes} bytes (an incomplete frame); a "
                                "resumed launch continues the rank in a later file", bytes_skipped=fs.torn_bytes)
                    )
                else:
                    found.append(
                        Finding("torn", fs.path, fs.end_offset,
                                f"not closed cleanly; torn tail of {fs.torn_bytes} bytes (an incomplete frame)",
                                bytes_skipped=fs.torn_bytes)
                    )
            elif fs.format_version is None and fs.size == 0 and fs.events == 0:
                found.append(
                    Finding("unclosed", fs.path, 0,
                            "empty file: no file header and nothing recorded (its writer died before writing, "
                            "or is starting)")
                )
            elif not fs.closed_cleanly and not fs.failure:
                why = {True: f"still being written, pid {fs.writer_pid}",
                       False: f"its writer, pid {fs.writer_pid}, is gone: killed or crashed",
                       None: "writer killed, or still writing"}[fs.writer_running]
                found.append(Finding("unclosed", fs.path, fs.end_offset,
                                     f"not closed cleanly ({why}); the file ends on a frame boundary, but what its "
                                     "writer had not written out yet (up to one flush interval) cannot be known"))
            if any(fs.unlisted):
                n, skipped, gaps, lost = fs.unlisted
                found.append(Finding("damage", fs.path, None, f"{n} more damaged region(s) and {gaps} more sequence "
                                     "gap(s), not listed one by one", bytes_skipped=skipped, frames_lost=lost))
            if fs.duplicates:
                found.append(Finding("damage", fs.path, None, f"{fs.duplicates} duplicate frame(s) dropped from replay"))
            if fs.failure:
                found.append(Finding("lost", fs.path, fs.end_offset, fs.failure))
            found.sort(key=lambda f: (f.offset is not None, f.offset or 0))
            out.extend(found)
    if summary.conflict:
        out.append(Finding("conflict", summary.path, None, summary.conflict))
    for path, why in summary.unattributed:
        out.append(Finding("damage", path, None, f"{why}; no run can be told for it, so it is in none"))
    if summary.missing_ranks:
        ranks = ", ".join(map(str, summary.missing_ranks))
        out.append(Finding("missing", summary.path, None, f"rank{'s' if len(summary.missing_ranks) > 1 else ''} "
                           f"{ranks} of world size {summary.world_size}: no log of this run found"))
    return out
