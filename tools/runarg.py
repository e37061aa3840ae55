"""Shared RUN arguments of the trainrec subcommands.

Every command that reads a run adds them with :func:`add_run_arguments` and opens the run with
:func:`open_run_from_args`::

    RUN                  an output directory (the latest launch by default), a rank directory or a log file
    --run-id PREFIX      choose the launch whose run id starts with PREFIX
    --time-start STAMP   choose by rank-directory time stamp, e.g. Nov30_11-13-33 (inclusive)
    --time-end STAMP     (inclusive)

An ambiguous choice is an error that lists the candidate runs (run id, stamps, ranks).
:func:`check_steps` gives the one answer of every command to a step selection outside the steps the
run recorded.
"""

from __future__ import annotations

import argparse
import sys

from trainrec.analyzers.selection import StepSet
from trainrec.replay.run import Run, open_run


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run",
        metavar="RUN",
        help="output directory (latest launch by default), one rank directory, or one .trl log file",
    )
    parser.add_argument("--run-id", metavar="PREFIX", default=None, help="choose the launch whose run id starts with PREFIX")
    parser.add_argument(
        "--time-start",
        metavar="STAMP",
        default=None,
        help="choose launches whose rank-directory stamp is at or after STAMP (e.g. Nov30_11-13-33)",
    )
    parser.add_argument(
        "--time-end", metavar="STAMP", default=None, help="choose launches whose rank-directory stamp is at or before STAMP"
    )


def open_run_from_args(args: argparse.Namespace, notes: bool = True) -> Run:
    """Open the run the RUN arguments name; raises NotARunError & co. (the CLI prints them, exit 2).
    ``notes``: say on stderr what the output directory lacks (see :func:`note_incomplete`)."""
    run = open_run(
        args.run,
        run_id=getattr(args, "run_id", None),
        time_start=getattr(args, "time_start", None),
        time_end=getattr(args, "time_end", None),
    )
    if notes:
        note_incomplete(run, args.command)
    return run


def note_incomplete(run: Run, command: str) -> None:
    """One line on stderr per rank of the world size with no log in the output directory, per log there
    that belongs to no run (its header unreadable), and where the run id is shared with another launch
    (kept apart): a ranking or export of the ranks that are there says nothing of those that are not
    (inspect and check list them themselves)."""
    if run.missing_ranks:
        ranks = ", ".join(map(str, run.missing_ranks))
        print(f"trainrec {command}: note: rank(s) {ranks} of world size {run.world_size} have no log here; "
              "what follows is of the others", file=sys.stderr)
    if run.info.conflict:
        print(f"trainrec {command}: note: {run.info.conflict}; this is {run.run_id} (trainrec check)", file=sys.stderr)
    for lf in run.unattributed:
        print(f"trainrec {command}: note: {lf.path} is in no run (its header cannot be read; trainrec check)",
              file=sys.stderr)


def steps_outside(steps: StepSet, first: int | None, last: int | None) -> list[str]:
    """The parts of ``steps`` that lie entirely outside ``first..last`` (all of them when nothing was recorded)."""
    out = []
    for lo, hi in steps.ranges:
        part = f"{lo}" if lo == hi else f"{lo}-{'' if hi is None else hi}"
        if first is None or last is None or lo > last or (hi is not None and hi < first):
            out.append(part)
    return out


def check_steps(steps: StepSet | None, first: int | None, last: int | None, where: str) -> str | None:
    """An error text when no requested step was recorded; prints a note for the parts outside."""
    if steps is None:
        return None
    outside = steps_outside(steps, first, last)
    recorded = "nothing was recorded" if first is None else f"the recorded steps are {first}..{last}"
    if len(outside) == len(steps.ranges):
        return f"steps {steps.text()} are outside the recorded range of {where}: {recorded}"
    if outside:
        print(f"note: steps {','.join(outside)} are outside the recorded range ({recorded})", file=sys.stderr)
    return None


def note_damage(run: Run, command: str, ranks=None, used: str = "everything before it is used") -> None:
    """On stderr: the files skipped, the first problems of each file read (file and offset) and torn
    tails, after a command has read ``ranks`` (default all) of ``run``."""
    readers = run.readers_of(run.ranks if ranks is None else ranks)
    for path, err in run.file_errors.items():
        print(f"trainrec {command}: note: skipped {path}: {err}", file=sys.stderr)
    for reader in readers.values():
        for problem in reader.problems[:5]:
            print(f"trainrec {command}: note: {problem}", file=sys.stderr)
        if len(reader.problems) > 5:
            print(f"trainrec {command}: note: ... {len(reader.problems) - 5} more in {reader.path} (trainrec check)",
                  file=sys.stderr)
        if reader.pending_bytes:
            print(f"trainrec {command}: note: {reader.path} ends in an incomplete record ({reader.pending_bytes} "
                  f"bytes: still being written, or the run crashed); {used}", file=sys.stderr)
