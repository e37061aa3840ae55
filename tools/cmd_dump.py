"""``trainrec dump RUN [--rank N] [--type T ...] [--kind K ...] [--per-record]``: events as JSON lines.

One JSON object per line (orjson), all ranks merged in execution order (see
:mod:`trainrec.replay.run`), names resolved. Statistics are expanded to one line per (tensor, op)
with ``kind, name, slot, micro_step, call_id, vpp_stage, op, value``; ``--per-record`` prints each
stats record as one line instead, with ``names`` and ``values`` as a list of rows. Packed columns are
lists of numbers; non-finite floats are the strings ``"nan"``, ``"inf"``, ``"-inf"`` (never null).
See :mod:`trainrec.replay.render` for the exact layout.

``--type`` takes tags (``ts``) or class names (``TensorStatsRecorded``, any case), and may repeat.
"""

from __future__ import annotations

import argparse
import sys

import orjson
from trainrec.analyzers.projection import parse_kinds
from trainrec.replay.names import NameResolver
from trainrec.replay.render import event_dict, stat_lines
from trainrec.replay.run import resolve_types
from trainrec.schema.errors import TrainrecError
from trainrec.schema.events import KINDS, TensorStatsRecorded

from .runarg import add_run_arguments, open_run_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "dump",
        help="print events as JSON lines (names resolved, stats one line per tensor and op)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.add_argument("--rank", type=int, action="append", metavar="N", help="only rank N (repeatable)")
    p.add_argument(
        "--type", dest="types", action="append", metavar="T", help="only events of type T: tag or class name (repeatable)"
    )
    p.add_argument("--kind", dest="kinds", action="append", metavar="K", help="only stats of kind K, e.g. actv (repeatable)")
    p.add_argument("--per-record", action="store_true", help="one line per stats record instead of per (tensor, op)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        wanted = resolve_types(args.types) if args.types else None
    except ValueError as exc:
        raise TrainrecError(str(exc)) from None
    r = open_run_from_args(args)
    if args.rank:
        missing = sorted(set(args.rank) - set(r.ranks))
        if missing:
            raise TrainrecError(f"rank(s) {missing} not in run {r.run_id!r} (ranks: {r.ranks})")
    try:
        kinds = set(parse_kinds(args.kinds, valid=KINDS)) if args.kinds else None
    except ValueError as exc:
        raise TrainrecError(f"--kind: {exc}") from None
    resolver = NameResolver()
    write = sys.stdout.buffer.write if hasattr(sys.stdout, "buffer") else None
    dumps = orjson.dumps
    lines: list[bytes] = []

    def flush() -> None:
        data = b"\n".join(lines) + b"\n"
        lines.clear()
        if write is not None:
            write(data)
        else:  # a text stream without a buffer (e.g. captured in tests)
            sys.stdout.write(data.decode())

    for ev in r.events(rank=args.rank):
        resolver.feed(ev)
        t = type(ev)
        if wanted is not None and t not in wanted:
            continue
        if t is TensorStatsRecorded:
            if kinds is not None and ev.kind not in kinds:
                continue
            if not args.per_record:
                lines.extend(stat_lines(ev, resolver.names(ev)))
            else:
                lines.append(dumps(event_dict(ev, resolver)))
        else:
            lines.append(dumps(event_dict(ev, resolver)))
        if len(lines) >= 4096:
            flush()
    if lines:
        flush()
    sys.stdout.flush()
    return 0
