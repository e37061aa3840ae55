"""``trainrec check RUN [--strict] [--json]``: full integrity check of a run's logs.

Reads every frame of every file of the run and reports, per file: damaged regions (byte offset,
what, bytes skipped), frames lost according to the writer's sequence numbers, files that are not
readable logs, and torn tails of files that were not closed cleanly.

Exit status: 0 when clean, 1 when anything was damaged or torn, or a rank of the world size has no
log in the output directory (the report lists it), 2 when RUN cannot be opened at all. Rank
directories there whose logs have no readable header belong to no run that can be told: they are
reported as damage beside the run checked. Files that merely lack their closing record (the writer
was killed right after a flush, or is still writing), and a crashed launch's torn tail where a
resumed launch went on in a later file, are listed as notes (severity unclosed), and fail the check
only with ``--strict``.
"""

from __future__ import annotations

import argparse
import os
import sys

import orjson
from trainrec.replay.summary import findings, summarize

from .progress import reading
from .runarg import add_run_arguments, open_run_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="verify every frame of a run; exit 1 with a report when damaged",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.add_argument("--strict", action="store_true", help="also fail on files that were not closed cleanly")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_ = open_run_from_args(args, notes=False)
    with reading(run_, "check"):
        summary = summarize(run_)
    found = findings(summary)
    failing = {"damage", "torn", "missing"} | ({"unclosed"} if args.strict else set())
    bad = [f for f in found if f.severity in failing]
    files = [f for r in summary.ranks for f in r.files]
    out = sys.stdout
    if args.json:
        report = {
            "run_id": summary.run_id,
            "path": summary.path,
            "ok": not bad,
            "files": len(files),
            "frames_read": sum(f.events for f in files),
            "findings": [f.to_json() for f in found],
        }
        out.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 1 if bad else 0
    out.write(
        f"checked run {summary.run_id or '(no run id)'} at {summary.path}: {len(summary.ranks)} rank(s), "
        f"{len(files)} file(s), {sum(f.events for f in files)} records\n"
    )
    if found:
        width = max(len(os.path.basename(f.path)) for f in found)
        out.write(f"{'SEVERITY':9} {'FILE':{width}} {'OFFSET':>10} {'BYTES SKIPPED':>13} {'FRAMES LOST':>11}  WHAT\n")
        for f in found:
            offset = "-" if f.offset is None else str(f.offset)
            out.write(
                f"{f.severity:9} {os.path.basename(f.path):{width}} {offset:>10} {f.bytes_skipped:>13} "
                f"{f.frames_lost:>11}  {f.what}\n"
            )
        paths = sorted({f.path for f in found})
        out.write("files:\n" + "".join(f"  {p}\n" for p in paths))
    if bad:
        out.write(
            f"FAILED: {len(bad)} finding(s) in {len({f.path for f in bad})} file(s); "
            f"{sum(f.bytes_skipped for f in bad)} bytes skipped, {sum(f.frames_lost for f in bad)} frame(s) lost\n"
        )
        return 1
    out.write("OK" + (f" ({len(found)} note(s))" if found else "") + "\n")
    return 0
