"""``trainrec inspect RUN [--json]``: what a run contains, per rank and per file.

Shows the format version, run id, ranks and world size; per rank its directories, files (size,
closed cleanly or torn tail, damage found), steps recorded with the first and last step, event
counts by type, statistics and anomalies; then the output directory's other launches, if any (the
last 10). ``--json`` prints the run as one JSON object (the schema is
:meth:`trainrec.replay.summary.RunSummary.to_json`).

Where a run has more than 8 ranks, ranks that read alike (but for their directories and file sizes)
share one entry; ``--per-rank`` lists every rank.

``--quick``: only the steps and record counts, per rank and file, from each file's header and closing
record (its step index) without reading its records; a file not closed, or closed by an older
trainrec, is scanned without decoding its records, or read whole where it is damaged (said per file).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence

import orjson
from trainrec.replay.discover import format_ranks
from trainrec.replay.run_select import list_runs
from trainrec.replay.summary import FileSummary, RankSummary, RunSummary
from trainrec.schema import layout

from .partition import add_jobs_arguments, quick_run, summarize_run
from .runarg import add_run_arguments, open_run_from_args

GROUP_OVER = 8  # more ranks than this: ranks that read alike share one entry
_FILE_SIZE = re.compile(r"^(  \S+)  (\d+) bytes  ")  # a file's line: "  trainrec-00000.trl  2755240 bytes  ..."


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="summarise a run: ranks, files, steps, event counts, torn tails, damage",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    add_jobs_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--quick", action="store_true",
                   help="steps and record counts only, from the logs' step indexes (files without one are scanned)")
    p.add_argument("--per-rank", action="store_true",
                   help=f"one entry per rank, also where more than {GROUP_OVER} ranks read alike")
    p.set_defaults(func=run)


def _quick(args: argparse.Namespace) -> int:
    r = open_run_from_args(args, notes=False)
    ranks = quick_run(r, args.jobs)
    if args.json:
        doc = {"path": r.where, "run_id": r.run_id, "format_versions": r.format_versions, "world_size": r.world_size,
               "ranks": [q.rank for q in ranks], "per_rank": [q.to_json() for q in ranks],
               "missing_ranks": r.missing_ranks}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    lines = [f"run {r.run_id or '(no run id)'}  at {r.where}",
             f"format version {', '.join(map(str, r.format_versions)) or '?'}  world size {r.world_size}  "
             f"ranks {format_ranks([q.rank for q in ranks])}"]
    lines += ranks_text(ranks, _quick_rank_lines, lambda q: [], args.per_rank)
    if r.missing_ranks:
        lines.append(f"missing: rank(s) {format_ranks(r.missing_ranks)} of world size {r.world_size} have no log here")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _quick_rank_lines(q) -> list[str]:
    span = f"{len(q.steps)} steps ({q.steps[0]}..{q.steps[-1]})" if q.steps else "no steps"
    lines = [f"rank {q.rank}: {span}, {q.records} records"]
    for f in q.files:
        state = f"closed cleanly ({f.close_reason})" if f.closed_cleanly else "NOT closed"
        if f.torn_bytes:
            state += f", {f.torn_bytes} stray bytes after it" if f.closed_cleanly else f", torn tail {f.torn_bytes} bytes"
        if f.damage:
            state += f"; DAMAGE: {f.damage} region(s)"
        fsteps = f"steps {f.steps[0]}..{f.steps[-1]}" if f.steps else "no steps"
        lines.append(f"  {os.path.basename(f.path)}  {f.size} bytes  {f.records} records  {fsteps}  {state}  "
                     f"[{f.error or f.source}]")
    return lines


def ranks_text(ranks: Sequence, lines_of: Callable[[object], list[str]], dirs_of: Callable[[object], list[str]],
               per_rank: bool = False) -> list[str]:
    """Each rank's lines (``lines_of``: the first is "rank N: ..."; "  dir ..." lines are its
    directories, ``dirs_of``). Over GROUP_OVER ranks (and not ``per_rank``), ranks whose lines are the
    same but for the rank number, directories and file sizes share one entry, at its first rank's place:
    "ranks 0-255 (256 alike), each: ...", their directories' first and last, each file's size range."""
    entries = [(r, lines_of(r)) for r in ranks]
    if per_rank or len(entries) <= GROUP_OVER:
        return [line for _, lines in entries for line in lines]
    groups: dict[tuple, list] = {}
    for r, lines in entries:
        head = lines[0].split(": ", 1)[1]
        body = tuple(_FILE_SIZE.sub(r"\1  {size} bytes  ", line) for line in lines[1:] if not line.startswith("  dir "))
        groups.setdefault((head, body), []).append((r, lines))
    out: list[str] = []
    for (head, body), members in groups.items():
        if len(members) == 1:
            out += members[0][1]
            continue
        out.append(f"ranks {format_ranks([r.rank for r, _ in members])} ({len(members)} alike), each: {head}")
        dirs = [d for r, _ in members for d in dirs_of(r)]
        if dirs:
            out.append(f"  dirs {dirs[0]} .. {dirs[-1]}" if len(dirs) > 1 else f"  dir {dirs[0]}")
        file_lines = [[line for line in lines[1:] if _FILE_SIZE.match(line)] for _, lines in members]
        k = 0
        for line in body:
            if "  {size} bytes  " in line:
                sizes = [int(_FILE_SIZE.match(lines[k]).group(2)) for lines in file_lines]
                size = str(sizes[0]) if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
                line = line.replace("{size}", size)
                k += 1
            out.append(line)
    return out


def run(args: argparse.Namespace) -> int:
    if args.quick:
        return _quick(args)
    summary = summarize_run(open_run_from_args(args, notes=False), args.jobs, "inspect")
    out = sys.stdout
    if args.json:
        out.write(orjson.dumps(summary.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    out.write(render(summary, args.per_rank))
    if summary.conflict:
        out.write(f"WRITERS KEPT APART: {summary.conflict}\n")
    others = _other_launches(args.run, summary.run_id)
    if others:
        out.write("other launches here (choose one with --run-id PREFIX):\n"
                  + "".join(f"  {r.describe()}\n" for r in others[-10:]))
    return 0


def _other_launches(path: str, run_id: str | None) -> list:
    """The launches of an output directory besides the one shown (none for a rank directory or a file)."""
    if not os.path.isdir(path) or layout.list_logs(path):
        return []
    return [r for r in list_runs(path) if r.run_id and r.run_id != run_id]


def _file_state(f: FileSummary) -> str:
    if f.error is not None:
        return f"UNREADABLE: {f.error}"
    if f.closed_cleanly:
        state = f"closed cleanly ({f.close_reason})"
        if f.torn_bytes:
            state += f", {f.torn_bytes} stray bytes after it"
    elif f.torn_bytes:
        state = f"NOT closed, torn tail {f.torn_bytes} bytes"
    elif f.writer_running:
        state = f"not closed: still being written (pid {f.writer_pid})"
    elif f.writer_running is False:
        state = f"not closed: its writer (pid {f.writer_pid}) is gone (killed, or crashed after a flush)"
    else:
        state = "not closed (killed after a flush, or still being written)"
    if f.problems:
        state += f"; DAMAGE: {len(f.problems)} region(s), {sum(p.skipped for p in f.problems)} bytes skipped"
    if f.lost_frames:
        state += f", {f.lost_frames} frame(s) lost"
    if f.resume_step is not None:
        state += f"; resumes at step {f.resume_step}"
    if f.superseded:
        state += f"; {f.superseded} record(s) superseded by a resume"
    return state


def _rank_lines(r: RankSummary) -> list[str]:
    steps = (
        f"{len(r.steps)} steps ({r.first_step}..{r.last_step}), {len(r.stats_steps)} with stats"
        if r.steps
        else "no steps"
    )
    lines = [f"rank {r.rank}: {steps}, {r.stat_values} stat values, {r.anomalies} anomalies"]
    if r.skipped_steps:
        shown = ", ".join(map(str, r.skipped_steps[:10])) + (", ..." if len(r.skipped_steps) > 10 else "")
        lines.append(f"  optimizer step skipped (inf/NaN gradients) at {len(r.skipped_steps)} step(s): {shown}")
    if r.unended:
        shown = ", ".join(map(str, r.unended[:10])) + (", ..." if len(r.unended) > 10 else "")
        last = r.files[-1] if r.files else None
        if last and last.closed_cleanly:
            why = f"its log was closed in the middle of it: {last.close_reason}"
        elif last and last.writer_running is not None:
            why = "the process is still in it" if last.writer_running else "the process stopped in the middle of it"
        else:
            why = "the process stopped in the middle of it, or is still in it"
        lines.append(f"  step(s) {shown} began and did not end ({why})")
    if r.foreign_passes:
        lines.append(f"  then, as step {', '.join(map(str, r.foreign_passes))}: passes inside other optimizers' steps "
                     "after the last step (a GAN's discriminator in the generator's step), not a step")
    for d in r.dirs:
        lines.append(f"  dir {d}")
    for f in r.files:
        lines.append(f"  {os.path.basename(f.path)}  {f.size} bytes  {f.events} events  {_file_state(f)}")
    if r.counts:
        lines.append("  events: " + ", ".join(f"{k} {v}" for k, v in sorted(r.counts.items())))
    extra = []
    if r.dropped_records:
        extra.append(f"{r.dropped_records} records dropped by the writer (queue full)")
    if r.hook_failures:
        extra.append(f"{r.hook_failures} hook failures")
    if extra:
        lines.append("  note: " + "; ".join(extra))
    lines.extend(f"  {n}" for n in r.notes)
    return lines


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    return ("rank " if len(ranks) == 1 else "ranks ") + format_ranks(ranks)


def render(s: RunSummary, per_rank: bool = False) -> str:
    versions = ", ".join(map(str, s.format_versions)) or "?"
    lines = [
        f"run {s.run_id or '(no run id)'}  at {s.path}",
        f"format version {versions}  world size {s.world_size}  ranks {format_ranks([r.rank for r in s.ranks])}",
    ]
    lines += ranks_text(s.ranks, _rank_lines, lambda r: r.dirs, per_rank)
    if s.missing_ranks:
        lines.append(f"missing: rank(s) {format_ranks(s.missing_ranks)} of world size {s.world_size} have no log here")
    for path, why in s.unattributed:
        lines.append(f"unreadable, in no run: {path}: {why}")
    torn = [r.rank for r in s.ranks if any(f.torn_bytes and not f.closed_cleanly for f in r.files)]
    damaged = [r.rank for r in s.ranks if any(f.problems or f.gaps or f.error for f in r.files)]
    lines.append(
        f"anomalies: {s.anomalies}   torn tails: {_ranks_text(torn)}   "
        f"damage: {_ranks_text(damaged) + ' (see trainrec check)' if damaged else 'none'}"
    )
    return "\n".join(lines) + "\n"
