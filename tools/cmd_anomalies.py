"""``trainrec anomalies RUN``: the first anomalies of a run, in execution order across all ranks.

By default it lists the anomalies the recorder detected and wrote to the log (``alert`` config).
With ``--rule`` it re-detects them from the recorded statistics, with any rule and threshold, without
rerunning training::

    trainrec anomalies RUN                                   # recorded anomalies, first 8
    trainrec anomalies RUN -k 20 -s 15-25 -o first.json      # steps 15..25, JSON records to a file
    trainrec anomalies RUN --rule AnomalyTurbulence --threshold 1
    trainrec anomalies RUN --rule NaNInf --rule ZScore --threshold 5 --kinds actv,actv_grad

Order: execution order across ranks (:mod:`trainrec.analyzers.ranking`). Output: a table, or with
``--json`` the reference's anomaly fields plus op, value, baseline, rule, kind, phase. A crashed or
still running run gives what is complete so far.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import orjson
from trainrec.analyzers.anomalies import AnomalyScan, anomaly_records
from trainrec.analyzers.ranking import PHASE_NAMES, phase_of, rank_anomalies
from trainrec.analyzers.selection import StepSet, parse_kinds, parse_steps
from trainrec.replay.discover import format_ranks
from trainrec.replay.run import Run
from trainrec.schema import layout
from trainrec.schema.errors import ConfigError, TrainrecError
from trainrec.schema.events import AnomalyDetected
from trainrec.schema.rule_config import make_rule, rule_arguments
from trainrec.schema.rules import RULES, Rule

from .anomaly_parts import scan_parts
from .partition import add_jobs_arguments, check_engine
from .runarg import add_run_arguments, check_steps, open_run_from_args, steps_outside

__all__ = ["add_parser", "format_table", "parse_step_list", "positive_k", "run", "steps_outside", "write_json"]


# ---------------------------------------------------------------------------------------- arguments
def positive_k(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the top k number must be a positive integer, not {text!r}") from None
    if k <= 0:
        raise argparse.ArgumentTypeError(f"the top k number must be greater than 0, not {k}")
    return k


def parse_step_list(text: str) -> StepSet | None:
    """Steps from ``"[20,21]"`` (the reference's form), ``"20,21"`` or ranges ``"15-25,30"``; None for
    all steps (``""`` or ``"[]"``). Raises ValueError saying what is wrong."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    if not body.strip():
        return None
    return parse_steps(body, "step")


def _steps_arg(text: str) -> StepSet | None:
    try:
        return parse_step_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kinds_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_kinds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rule_arg(text: str) -> str:
    for name in RULES:
        if name.lower() == text.lower():
            return name
    raise argparse.ArgumentTypeError(f"unknown rule {text!r}; known rules: {', '.join(sorted(RULES))}")


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    low = value.strip().lower()
    if low in ("true", "false"):
        return key.strip(), low == "true"
    try:
        num = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: expected a number or true/false, not {value!r}") from None
    return key.strip(), int(num) if num.is_integer() and "." not in value and "e" not in low else num


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "anomalies",
        help="the first anomalies of a run in execution order (recorded, or re-detected with --rule)",
        description=__doc__.split("\n\nOrder:")[0].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.add_argument("-k", "--topk", type=positive_k, default=8, metavar="K", help="how many to show (default 8)")
    p.add_argument("--all", action="store_true", help="show every anomaly (overrides -k)")
    p.add_argument("-s", "--steps", type=_steps_arg, default=None, metavar="STEPS",
                   help="only these steps: '[20,21]', '20,21' or '15-25,30'")
    p.add_argument("-o", "--output", metavar="OUT.json", help="also write the ranked anomalies as JSON records here")
    p.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    add_jobs_arguments(p, engine=True)
    g = p.add_argument_group("re-detection from the recorded statistics")
    g.add_argument("--rule", action="append", type=_rule_arg, metavar="NAME",
                   help=f"re-detect with this rule ({', '.join(sorted(RULES))}); repeatable")
    g.add_argument("--threshold", type=float, help="the rules' threshold (AnomalyTurbulence: relative; ZScore: sigmas)")
    g.add_argument("--window", type=int, help="values in the rules' rolling window")
    g.add_argument("--warmup", type=int, help="values seen before a series can be flagged")
    g.add_argument("--arg", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="any other rule argument, e.g. noise=4 or sudden=false; repeatable")
    g.add_argument("--kinds", type=_kinds_arg, metavar="KINDS", help="re-detect on these stats kinds only, e.g. actv,param")
    p.set_defaults(func=run)


def build_rules(args) -> list[Rule]:
    """Rules from --rule/--threshold/--window/--warmup/--arg; each option goes to the rules that take it."""
    if not args.rule:
        if args.threshold is not None or args.window is not None or args.warmup is not None or args.arg:
            raise ConfigError("--threshold, --window, --warmup and --arg need --rule", key="--rule")
        return []
    given: dict[str, Any] = dict(args.arg)
    for name in ("threshold", "window", "warmup"):
        if getattr(args, name) is not None:
            given[name] = getattr(args, name)
    rules = []
    used: set[str] = set()
    for name in dict.fromkeys(args.rule):
        accepted = rule_arguments(name)
        mine = {k: v for k, v in given.items() if k in accepted}
        used.update(mine)
        rules.append(make_rule(name, mine, key=f"--rule {name}"))
    unused = set(given) - used
    if unused:
        takes = "; ".join(f"{name} takes {', '.join(rule_arguments(name)) or 'no arguments'}"
                          for name in dict.fromkeys(args.rule))
        named = [k for k in ("threshold", "window", "warmup") if k in unused and getattr(args, k) is not None]
        raise ConfigError(f"no chosen rule takes {', '.join(sorted(unused))} ({takes})",
                          key=f"--{named[0]}" if named else "--arg")
    return rules


# ---------------------------------------------------------------------------------------- output
def _num(x: float, missing: bool = False) -> str:
    """A value for the table: NaN is ``nan`` (a NaN found by NaNInf), or ``-`` where it stands for
    nothing (a baseline that does not exist)."""
    if missing and isinstance(x, float) and math.isnan(x):
        return "-"
    return f"{x:.6g}"


def format_table(ranked: Sequence[AnomalyDetected]) -> str:
    """A fixed-width table: #, rank, step, micro, phase, stage, call, op, value, baseline, rule, tag."""
    head = ("#", "rank", "step", "micro", "phase", "stage", "call", "op", "value", "baseline", "rule", "tag")
    rows = [head]
    for i, ev in enumerate(ranked, 1):
        stage = f"{ev.pp_stage}" if ev.vpp_stage == 0 else f"{ev.pp_stage}.{ev.vpp_stage}"
        rows.append((str(i), str(ev.rank), str(ev.step), str(ev.micro_step), PHASE_NAMES[phase_of(ev)], stage,
                     str(ev.call_id) if ev.call_id >= 0 else "-", ev.op or "?", _num(ev.value), _num(ev.baseline, missing=True),
                     ev.rule or "?", ev.tag_name))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head) - 1)]
    right = {0, 1, 2, 3, 5, 6, 8, 9}
    lines = []
    for r in rows:
        cells = [r[c].rjust(widths[c]) if c in right else r[c].ljust(widths[c]) for c in range(len(widths))]
        lines.append("  ".join(cells) + "  " + r[-1])
    return "\n".join(lines)


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` with orjson (NaN/Inf become null), atomically, with the reference's permissions (the
    file 0640, directories it creates 0750); a path that cannot be written is a TrainrecError that names
    it (no temporary file is left behind)."""
    data = orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    parent = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        layout.make_dirs(parent)
    except OSError as exc:
        why = "a file of that name is in the way" if os.path.lexists(parent) else exc.strerror or exc
        raise TrainrecError(f"cannot write {path}: cannot create the directory {parent}: {why}") from exc
    try:
        with open(tmp, "wb", opener=layout.private_opener) as f:
            f.write(data + b"\n")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise TrainrecError(f"cannot write {path}: {exc.strerror or exc}") from exc


# ---------------------------------------------------------------------------------------- command
def _ranks_text(ranks) -> str:
    """``ranks 0-255`` (ranges, not one number per rank)."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + format_ranks(ranks)


def scan_run(run: Run, rules: Sequence[Rule], kinds: Sequence[str] | None = None) -> AnomalyScan:
    scan = AnomalyScan(rules, kinds)
    feed = scan.feed
    for ev in run.events():
        feed(ev)
    return scan


def _steps_read(steps: StepSet | None, rules: Sequence[Rule]):
    """The step ranges to read for ``--steps``: those steps for recorded anomalies; for re-detection
    every step up to the last one asked for (a rule's window holds the values before them)."""
    if steps is None:
        return None
    if not rules:
        return steps.ranges
    ends = [hi for _, hi in steps.ranges]
    return ((0, None if None in ends else max(ends)),)


def run(args) -> int:
    rules = build_rules(args)
    if args.kinds and not rules:
        raise ConfigError("--kinds selects what to re-detect on and needs --rule", key="--kinds")
    engine = check_engine(args)
    r = open_run_from_args(args)
    scan = scan_parts(r, rules, args.kinds, args.jobs, engine, args.cluster, steps=_steps_read(args.steps, rules))
    for _, note in scan.notes:
        print(f"note: {note}", file=sys.stderr)
    if scan.skipped_steps:
        shown = sorted(scan.skipped_steps)
        print(f"note: the optimizer step never ran (inf/NaN gradients) at step(s) "
              f"{', '.join(map(str, shown[:10]))}{', ...' if len(shown) > 10 else ''}", file=sys.stderr)
    where = f"run {r.run_id or args.run}"
    err = check_steps(args.steps, scan.first_step, scan.last_step, where)
    if err:
        print(f"trainrec anomalies: error: {err}", file=sys.stderr)
        return 2
    what = "re-detected with " + ", ".join(map(repr, rules)) if rules else "recorded"
    anomalies = scan.detected if rules else scan.recorded
    ranked = rank_anomalies(anomalies, None if args.all else args.topk, args.steps)
    if not ranked:
        span = "no steps" if scan.first_step is None else f"steps {scan.first_step}..{scan.last_step}"
        sel = f" at steps {args.steps.text()}" if args.steps is not None else ""
        hint = "" if rules else "; re-detect from the statistics with e.g. --rule AnomalyTurbulence --threshold 1"
        more = f" ({len(anomalies)} at other steps)" if anomalies and args.steps is not None else ""
        print(f"no anomalies {what}{sel} in {where} ({span}, {_ranks_text(scan.ranks)}, "
              f"{scan.stats_records} stats records){more}{hint}", file=sys.stderr)
        if args.output:
            write_json(args.output, [])
        if args.json:
            sys.stdout.write("[]\n")
        return 0
    records = anomaly_records(ranked)
    if args.output:
        write_json(args.output, records)
    if args.json:
        sys.stdout.write(orjson.dumps(records, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        total = sum(1 for a in anomalies if args.steps is None or a.step in args.steps)
        print(f"{total} anomalies {what} in {where} (steps {scan.first_step}..{scan.last_step}, "
              f"{_ranks_text(scan.ranks)}); the first {len(ranked)} in execution order:")
        print(format_table(ranked))
    if args.output:
        print(f"wrote {len(records)} anomalies to {args.output}", file=sys.stderr)
    return 0
