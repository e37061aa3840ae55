"""``trainrec dump RUN [--rank N] [--type T ...] [--kind K ...] [-s STEPS] [--per-record] [-f]``: events as JSON lines.

One JSON object per line (orjson), all ranks merged in execution order (see
:mod:`trainrec.replay.run`), names resolved. Statistics are expanded to one line per (tensor, op)
with ``kind, name, slot, micro_step, call_id, vpp_stage, op, value``, and ``"placeholder": true``
on a row that stands for no tensor's values (a NaN row the recorder wrote for an absent or empty
tensor, which anomaly detection skips); ``--per-record`` prints each stats record as one line
instead, with ``names``, ``values`` as a list of rows and ``placeholders`` as 0/1 per row (empty
where none is). Packed columns are
lists of numbers; non-finite floats are the strings ``"nan"``, ``"inf"``, ``"-inf"`` (never null).
See :mod:`trainrec.replay.render` for the exact layout.

``--type`` takes tags (``ts``) or class names (``TensorStatsRecorded``, any case), comma separated
or repeated; so does ``--kind``. ``-s``/``--steps 10-20,30`` prints only the events of those steps,
reading only their bytes where a log file has a step index (see docs/scale.md).

``-f``/``--follow``: a live tail of a run being written (:func:`trainrec.replay.follow`): what is
there, then each event as it is written, in the order each rank wrote them (ranks interleaved as
they are read, not merged by execution order); it ends when every rank's log is closed, or its
writer (a process of this host) is gone after a crash, or at Ctrl-C. A run whose every log file
cannot be read (not a log, an unsupported version, no permission) is an error, as without ``-f``;
a directory where no log has appeared yet (or a path not made yet) is waited for, said once on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from trainrec.analyzers.selection import parse_kinds, parse_steps
from trainrec.replay.follow import RunFollower
from trainrec.replay.names import NameResolver
from trainrec.replay.run import resolve_types
from trainrec.schema.errors import TrainrecError
from trainrec.schema.events import KINDS

from .dump_parts import damage_notes, dump_parts, render
from .partition import add_jobs_arguments
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
    p.add_argument("-s", "--steps", type=_steps_arg, default=None, metavar="RANGES",
                   help="only events of these steps, e.g. 10-20,30 (reads only their bytes where logs are indexed)")
    p.add_argument("--per-record", action="store_true", help="one line per stats record instead of per (tensor, op)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing events as the run writes them, until it is closed (or its writer is gone)")
    p.add_argument("--poll-interval", type=float, default=0.5, metavar="S", help="with --follow: seconds between looks")
    add_jobs_arguments(p)
    p.set_defaults(func=run)


def _steps_arg(text: str):
    try:
        return parse_steps(text, "step")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _listed(values: list[str] | None) -> list[str] | None:
    """Repeated and comma-separated values as one list."""
    return None if not values else [v.strip() for arg in values for v in arg.split(",") if v.strip()]


def run(args: argparse.Namespace) -> int:
    try:
        types = _listed(args.types)
        wanted = resolve_types(types) if types else None
    except ValueError as exc:
        raise TrainrecError(str(exc)) from None
    try:
        kinds = set(parse_kinds(args.kinds, valid=KINDS)) if args.kinds else None
    except ValueError as exc:
        raise TrainrecError(f"--kind: {exc}") from None
    r = None
    steps = args.steps.ranges if args.steps is not None else None
    if args.follow:
        if args.time_start or args.time_end:
            raise TrainrecError("--follow takes the run by --run-id (or the latest), not by --time-start/--time-end")
        if args.jobs > 1:
            raise TrainrecError("--follow prints events as they are written, one process; leave out -j")
        if args.poll_interval <= 0:
            raise TrainrecError(f"--poll-interval must be positive, not {args.poll_interval}")
        batches = _followed(args)
    else:
        r = open_run_from_args(args)
        if args.rank:
            missing = sorted(set(args.rank) - set(r.ranks))
            if missing:
                raise TrainrecError(f"rank(s) {missing} not in run {r.run_id!r} (ranks: {r.ranks})")
        batches = iter((r.events(rank=args.rank, steps=steps),))
    ranks = set(args.rank) if args.rank else None
    if r is not None and args.jobs > 1:
        notes = dump_parts(r, sorted(ranks) if ranks else r.ranks, args.jobs, _writer(), wanted, ranks, kinds,
                           args.per_record, steps)
        sys.stdout.flush()
        for note in notes:
            print(f"trainrec dump: note: {note}", file=sys.stderr)
        return 0
    resolver = NameResolver()
    write = _writer()
    lines: list[bytes] = []

    def flush() -> None:
        write(b"\n".join(lines) + b"\n")
        lines.clear()

    for batch in batches:
        for ev in batch:
            resolver.feed(ev)
            got = render(ev, resolver, wanted, ranks, kinds, args.per_record, steps)
            if got:
                lines.extend(got)
                if len(lines) >= 4096:
                    flush()
        if lines:
            flush()
        sys.stdout.flush()  # (following: each poll's events as soon as they are read)
    if r is not None:
        # (what was skipped, is inconsistent or is incomplete: the JSON lines hold only what was read)
        for note in damage_notes(r, sorted(ranks) if ranks else r.ranks):
            print(f"trainrec dump: note: {note}", file=sys.stderr)
    return 0


def _writer():
    """Bytes to stdout (decoded where stdout is a text stream without a buffer, as captured in tests)."""
    if hasattr(sys.stdout, "buffer"):
        return sys.stdout.buffer.write
    return lambda data: sys.stdout.write(data.decode())


def _followed(args: argparse.Namespace):
    """The events of a run being written, one list per poll that found any, until it is closed or
    its writers are gone."""
    follower = RunFollower(args.run, run_id=args.run_id)
    said_waiting = False
    while True:
        events = follower.poll()
        if events:
            yield events
            continue
        if follower.closed:  # (every rank of the run seen)
            missing = sorted(set(args.rank or ()) - set(follower.ranks))
            if missing:
                raise TrainrecError(f"rank(s) {missing} not in run {follower.run_id!r} (ranks: {follower.ranks})")
            return
        err = follower.unfollowable
        if err is not None:
            raise err  # what plain dump says of it (exit 2), instead of waiting forever
        if follower.writers_gone:
            print("trainrec dump: the process writing the run is gone and left its log unclosed (a crash)",
                  file=sys.stderr)
            return
        if not said_waiting and not follower.readers and not follower.file_errors:  # (a mistyped RUN, too)
            if not os.path.exists(args.run):
                what = "does not exist yet"
            else:
                what = f"has no log of run id {args.run_id!r} yet" if args.run_id else "has no trainrec log yet"
            print(f"trainrec dump: waiting for a log: {args.run} {what} (Ctrl-C to stop)", file=sys.stderr)
            said_waiting = True
        time.sleep(args.poll_interval)
