"""``trainrec postmortem RUN [--json]``: how each rank of a run ended, where it was, what it waited for.

Works on a finished, crashed or still-running run. Per rank: how it ended (closed cleanly, exception,
SIGTERM, killed with a torn or untorn tail, still running), the last completed step, the last hook that
fired (module, forward or backward, micro step, call id), the last collective call and its sequence
number on its process group (with ``cc_distribution``), the last stall the watchdog reported
(``stall_watchdog``), the exception that ended it, the last anomaly and the config in force. Across
ranks: the ranks behind, collective desyncs, the ranks blocked in a collective and the ranks they wait
for, and a verdict. ``--json`` prints it as one JSON object (the schema is
:meth:`trainrec.analyzers.postmortem.Report.to_json`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap

import orjson
from trainrec.analyzers.postmortem import Report, postmortem

from .runarg import add_run_arguments, open_run_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "postmortem",
        help="after a crash or hang: per rank how it ended and where it was, what the ranks waited for",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = postmortem(open_run_from_args(args))
    if args.json:
        sys.stdout.write(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(render(report))
    return 0


def _hook(h: dict | None) -> str:
    if not h:
        return "-"
    return f"{h['module']} {h['direction'][:3]} m{h['micro_step']} #{h['call_id']} (step {h['step']})"


def _collective(c: dict | None) -> str:
    if not c:
        return "-"
    return f"{c['op']} #{c['seq']} {c['group_ranks']} (step {c['step']})"


def _stall(s: dict | None) -> str:
    if not s:
        return "-"
    where = f" in {s['collective_op']} #{s['collective_seq']}" if s["collective_op"] else ""
    mod = f" {s['modules'][-1]}" if s["modules"] else ""
    return f"step {s['step']} {s['elapsed']:.0f}s{where}{mod}"


def render(r: Report) -> str:
    header = ("rank", "ending", "done", "step", "last hook", "last collective", "stall", "exception / anomaly")
    rows = []
    for s in r.ranks:
        exc = s.exception["error"] if s.exception else ""
        if s.exception and s.exception["modules"]:
            exc += f" (in {s.exception['modules'][-1]})"
        if not exc and s.last_anomaly:
            a = s.last_anomaly
            exc = f"anomaly step {a['step']} {a['tag_name']} {a['op']}"
        rows.append((str(s.rank), s.ending, "-" if s.last_completed_step is None else str(s.last_completed_step),
                     str(s.current_step), _hook(s.last_hook), _collective(s.last_collective), _stall(s.last_stall),
                     (exc[:60] + "...") if len(exc) > 63 else exc or "-"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    for s in r.ranks:
        if s.ending_detail:
            lines.append(f"rank {s.rank}: {s.ending_detail}")
        if s.config is not None:
            on = sorted(k for k, v in s.config.items() if v not in (False, None, [], {}, 0))
            lines.append(f"rank {s.rank}: config in force: {', '.join(on) or '(defaults)'}"
                         + (f"; monitoring stopped at {s.monitoring_stopped}" if s.monitoring_stopped else ""))
    for d in r.desyncs:
        calls = "; ".join(f"rank {k}: {v['op']} {v['shapes']}" for k, v in d["calls"].items())
        lines.append(f"DESYNC on group {d['group_ranks']} at call #{d['seq']}: {calls}")
    for w in r.waits:
        lines.append(f"group {w['group_ranks']}: ranks {w['ahead']} reached {w['op']} #{w['seq']}, ranks "
                     f"{w['behind']} did not (their last: {w['behind_seqs']})")
    lines.append("")
    lines.extend(textwrap.wrap("verdict: " + r.verdict, width=100))
    return "\n".join(lines) + "\n"
