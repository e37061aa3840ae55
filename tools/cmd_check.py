"""``trainrec check RUN [--all] [--strict] [--json]``: full integrity check of a run's logs.

Reads every frame of every file of the run and reports, per file: damaged regions (byte offset,
what, bytes skipped), frames lost according to the writer's sequence numbers, duplicate frames
(dropped from every replay), files that are not readable logs, torn tails of files that were not
closed cleanly, what a writer said of its own failure to write, and a run id shared by launches that
do not resume one another (kept apart as RUNID, RUNID#2, ...).

RUN an output directory: the latest launch is checked, and the report says which one and how many
other launches are there; ``--all`` checks every launch of the directory.

Exit status: 0 when clean, 1 when anything was damaged, torn or lost, a rank of the world size has no
log in the output directory (the report lists it), or the run id is shared, 2 when RUN cannot be
opened at all. Rank directories there whose logs have no readable header belong to no run that can
be told: they are reported as damage beside the run checked. Files that merely lack their closing
record (the writer was killed, or is still writing), and a crashed launch's torn tail where a resumed
launch went on in a later file, are listed as notes (severity unclosed), and fail the check only with
``--strict``.
"""

from __future__ import annotations

import argparse
import os
import sys

import orjson
from trainrec.replay.integrity import findings
from trainrec.replay.run import Run, open_run
from trainrec.replay.run_select import list_runs
from trainrec.replay.summary import RunSummary
from trainrec.schema import layout
from trainrec.schema.errors import ConfigError

from .partition import add_jobs_arguments, summarize_run
from .runarg import add_run_arguments, open_run_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="verify every frame of a run; exit 1 with a report when damaged",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.add_argument("--all", action="store_true", help="check every launch of the output directory")
    p.add_argument("--strict", action="store_true", help="also fail on files that were not closed cleanly")
    add_jobs_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def _launches(path: str) -> list:
    """The launches of an output directory, oldest first (none for a rank directory or a file)."""
    if not os.path.isdir(path) or layout.list_logs(path):
        return []
    return list_runs(path)


def run(args: argparse.Namespace) -> int:
    if args.all and (args.run_id or args.time_start or args.time_end):
        raise ConfigError("--all checks every launch: it takes no --run-id, --time-start or --time-end", "--all")
    launches = _launches(args.run)
    if args.all and launches:
        runs = [open_run(args.run, run_id=info.run_id) if info.run_id else Run(info, where=args.run)
                for info in launches]
    else:
        runs = [open_run_from_args(args, notes=False)]
    reports = [_check(summarize_run(r, args.jobs, "check"), args.strict) for r in runs]
    failed = any(not rep["ok"] for rep in reports)
    checked = {rep["run_id"] for rep in reports}
    others = [i.run_id or "(no run id)" for i in launches if i.run_id not in checked]
    out = sys.stdout
    if args.json:
        plain = [{k: v for k, v in rep.items() if k not in ("ranks", "failing")} for rep in reports]
        doc = plain[0] if len(plain) == 1 else {"ok": not failed, "launches": plain}
        doc["other_launches"] = others
        out.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 1 if failed else 0
    for rep in reports:
        _write(out, rep)
    if others:
        out.write(f"note: {len(others)} other launch(es) in {args.run} not checked: {', '.join(others[-10:])}"
                  f"{' (the last 10)' if len(others) > 10 else ''}; `trainrec check --all` checks every launch\n")
    if len(reports) > 1:
        bad = [rep["run_id"] or "(no run id)" for rep in reports if not rep["ok"]]
        out.write(f"{len(reports)} launches checked: " + (f"FAILED: {', '.join(bad)}\n" if bad else "all OK\n"))
    return 1 if failed else 0


def _check(summary: RunSummary, strict: bool) -> dict:
    found = findings(summary)
    failing = {"damage", "torn", "missing", "lost", "conflict"} | ({"unclosed"} if strict else set())
    bad = [f for f in found if f.severity in failing]
    files = [f for r in summary.ranks for f in r.files]
    return {
        "run_id": summary.run_id,
        "path": summary.path,
        "ok": not bad,
        "ranks": len(summary.ranks),
        "files": len(files),
        "frames_read": sum(f.events for f in files),
        "findings": [f.to_json() for f in found],
        "failing": [f.to_json() for f in bad],
    }


def _write(out, rep: dict) -> None:
    found, bad = rep["findings"], rep["failing"]
    out.write(
        f"checked run {rep['run_id'] or '(no run id)'} at {rep['path']}: {rep['ranks']} rank(s), "
        f"{rep['files']} file(s), {rep['frames_read']} records\n"
    )
    if found:
        width = max(len(os.path.basename(f["path"])) for f in found)
        out.write(f"{'SEVERITY':9} {'FILE':{width}} {'OFFSET':>10} {'BYTES SKIPPED':>13} {'FRAMES LOST':>11}  WHAT\n")
        for f in found:
            offset = "-" if f["offset"] is None else str(f["offset"])
            out.write(
                f"{f['severity']:9} {os.path.basename(f['path']):{width}} {offset:>10} {f['bytes_skipped']:>13} "
                f"{f['frames_lost']:>11}  {f['what']}\n"
            )
        paths = sorted({f["path"] for f in found})
        out.write("files:\n" + "".join(f"  {p}\n" for p in paths))
    if bad:
        out.write(
            f"FAILED: {len(bad)} finding(s) in {len({f['path'] for f in bad})} file(s); "
            f"{sum(f['bytes_skipped'] for f in bad)} bytes skipped, {sum(f['frames_lost'] for f in bad)} frame(s) lost\n"
        )
    else:
        out.write("OK" + (f" ({len(found)} note(s))" if found else "") + "\n")
