"""Shared RUN arguments of the trainrec subcommands.

Every command that reads a run adds them with :func:`add_run_arguments` and opens the run with
:func:`open_run_from_args`::

    RUN                  an output directory (the latest launch by default), a rank directory or a log file
    --run-id PREFIX      choose the launch whose run id starts with PREFIX
    --time-start STAMP   choose by rank-directory time stamp, e.g. Nov30_11-13-33 (inclusive)
    --time-end STAMP     (inclusive)

An ambiguous choice is an error that lists the candidate runs (run id, stamps, ranks).
"""

from __future__ import annotations

import argparse

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


def open_run_from_args(args: argparse.Namespace) -> Run:
    """Open the run the RUN arguments name; raises NotARunError & co. (the CLI prints them, exit 2)."""
    return open_run(
        args.run,
        run_id=getattr(args, "run_id", None),
        time_start=getattr(args, "time_start", None),
        time_end=getattr(args, "time_end", None),
    )
