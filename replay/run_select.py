"""Choosing a run on disk: the runs of an output directory (:func:`list_runs`), one picked by run id or
time range (:func:`select_run`), and what a RUN argument names (:func:`find_run`: an output directory, a
rank directory or a log file). How files group into runs is :mod:`trainrec.replay.discover`'s.
"""

from __future__ import annotations

import itertools
import logging
import os
import re

from trainrec.schema import layout
from trainrec.schema.errors import NotARunError, UnsupportedVersionError

from .discover import LogFile, RunInfo, group_runs, scan_file, scan_rank_dir, stamp_key_or_none

log = logging.getLogger(__name__)

__all__ = ["find_run", "list_runs", "rank_dirs_in", "select_run"]


def rank_dirs_in(output_dir: str) -> list[str]:
    """Subdirectories of ``output_dir`` that hold trainrec log files, in name order."""
    try:
        entries = sorted(os.scandir(output_dir), key=lambda e: e.name)
    except OSError as exc:
        raise NotARunError(f"cannot list directory ({exc.strerror or exc})", output_dir) from None
    out = []
    for e in entries:
        try:
            if e.is_dir() and layout.list_logs(e.path):
                out.append(e.path)
        except OSError:
            continue
    return out


def list_runs(output_dir: str) -> list[RunInfo]:
    """Every run (launch) in an output directory, oldest first."""
    return group_runs([scan_rank_dir(d) for d in rank_dirs_in(output_dir)])


def select_run(
    runs: list[RunInfo],
    where: str,
    run_id: str | None = None,
    time_start: str | None = None,
    time_end: str | None = None,
) -> RunInfo:
    """Pick one run: by run id prefix and/or an inclusive stamp range; the latest when neither is given.

    A run is in the time range when any of its rank directories' stamps is. Raises NotARunError
    listing the candidates when nothing or more than one run matches.
    """
    if not runs:
        raise NotARunError("no trainrec runs found", where)
    lo = _parse_stamp_arg(time_start, "--time-start")
    hi = _parse_stamp_arg(time_end, "--time-end")
    if lo is not None and hi is not None and lo > hi:
        raise NotARunError(f"time range {time_start}..{time_end} is empty (start after end)", where)
    cands = runs
    if run_id is not None:
        exact = [r for r in cands if r.run_id == run_id]
        cands = exact or [r for r in cands if r.run_id.startswith(run_id)]
    if lo is not None or hi is not None:

        def in_range(r: RunInfo) -> bool:
            for s in r.stamps:
                k = stamp_key_or_none(s)
                if k is not None and (lo is None or k >= lo) and (hi is None or k <= hi):
                    return True
            return False

        cands = [r for r in cands if in_range(r)]
    selecting = run_id is not None or lo is not None or hi is not None
    if not cands:
        what = _selection_text(run_id, time_start, time_end)
        raise NotARunError(f"no run matches {what}; runs found:\n{_listing(runs)}", where)
    if len(cands) > 1 and selecting:
        what = _selection_text(run_id, time_start, time_end)
        raise NotARunError(
            f"{len(cands)} runs match {what}; choose one with --run-id:\n{_listing(cands)}", where
        )
    if len(cands) > 1:
        log.info("%d runs in %s; using the latest, %s (choose another with --run-id)", len(cands), where,
                 cands[-1].run_id)
    return cands[-1]


def _selection_text(run_id: str | None, time_start: str | None, time_end: str | None) -> str:
    parts = []
    if run_id is not None:
        parts.append(f"run id {run_id!r}")
    if time_start is not None and time_end is not None:
        parts.append(f"time range {time_start}..{time_end}")
    elif time_start is not None:
        parts.append(f"time range from {time_start} on")
    elif time_end is not None:
        parts.append(f"time range up to {time_end}")
    return " and ".join(parts)


def _listing(runs: list[RunInfo]) -> str:
    return "\n".join("  " + r.describe() for r in runs)


def _parse_stamp_arg(value: str | None, option: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    key = stamp_key_or_none(value)
    if key is None:
        raise NotARunError(f"{option} {value!r} is not a time stamp like Nov30_11-13-33")
    return key


def _reference_output_hint(path: str) -> str:
    """What to say where ``path`` holds no log but files of another tool: rank*/anomaly.json (the
    alert dump), a trainrec export, or the reference's CSV or TensorBoard files (in it or in its rank
    directories: msprobe's own output, most likely)."""

    def entries(d: str) -> list[os.DirEntry]:
        try:
            with os.scandir(d) as it:
                return list(itertools.islice(it, 1000))
        except OSError:
            return []

    here = entries(path)
    if any(re.fullmatch(r"rank\d+", e.name) and os.path.isfile(os.path.join(e.path, "anomaly.json")) for e in here):
        return ("; it holds anomaly.json files: python -m trainrec.tools.anomaly_analyse -d DIR ranks those; the "
                "trainrec commands take the directory the training wrote to")
    if any(e.name == layout.EXPORT_MARKER for e in here):
        return "; it is the output of trainrec export, not a run: give the directory the training wrote to"
    rank_dirs = [e.path for e in here if layout.parse_rank_dir(e.name) is not None and e.is_dir()][:20]
    if not any(e.name.endswith(".csv") or e.name.startswith("events.out.tfevents")
               for d in [path, *rank_dirs] for e in (here if d == path else entries(d))):
        return ""
    return ("; it holds the reference's CSV or TensorBoard files and no trainrec log (msprobe's output?): "
            "trainrec reads its own logs; trainrec.tools.csv2tb converts those CSV files to TensorBoard")


def find_run(
    path: str, run_id: str | None = None, time_start: str | None = None, time_end: str | None = None
) -> RunInfo:
    """Resolve RUN: an output directory, one rank directory, or one log file."""
    if not os.path.exists(path):
        raise NotARunError("no such file or directory", path)
    if os.path.isfile(path):
        lf = scan_file(os.path.abspath(path))
        if lf.error is not None:
            raise lf.error
        # empty, or cut inside its file header (which starts as it should): as in a rank directory, a
        # run with nothing recorded, which check notes (empty) or reports (a torn header)
        info = RunInfo(run_id=lf.run_id or "", files={lf.rank: [lf]})
        if run_id is not None and not info.run_id.startswith(run_id):
            raise NotARunError(f"the log belongs to run {info.run_id!r}, not {run_id!r}", path)
        return info
    if not os.path.isdir(path):
        raise NotARunError("neither a directory nor a log file", path)
    path = os.path.abspath(path)
    unattributed: list[LogFile] | None = None  # None: not an output directory, or nothing readable there
    if layout.list_logs(path):
        runs = group_runs([scan_rank_dir(path)])
    else:
        runs = list_runs(path)
        if not runs:
            raise NotARunError(
                "no trainrec logs here: expected an output directory with rank directories like "
                "Nov30_11-13-33-rank0-4700973a/, one rank directory, or a trainrec-00000.trl file"
                + _reference_output_hint(path),
                path,
            )
        # rank directories with no readable header (a damaged or empty first file) group as runs of
        # their own, of no id: never chosen while a readable run is there, reported beside it instead
        readable = [r for r in runs if any(f.header is not None for f in r.all_files)]
        if readable:
            unattributed = [f for r in runs if not any(r is k for k in readable) for f in r.all_files]
            runs = readable
    info = select_run(runs, path, run_id, time_start, time_end)
    if unattributed is not None:
        info.whole, info.unattributed = True, unattributed
    for lf in info.all_files:
        if isinstance(lf.error, UnsupportedVersionError):
            raise lf.error
    errors = [lf.error for lf in info.all_files if lf.error is not None]
    if errors and len(errors) == len(info.all_files):
        raise errors[0]  # nothing of this run can be read: say why
    return info
