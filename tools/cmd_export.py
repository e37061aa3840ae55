"""``trainrec export csv|tb RUN -o DIR``: the reference's CSV files or TensorBoard events, from the log
(``export parquet``: :mod:`trainrec.tools.export_parquet`).

Output layout (per rank, the run's own rank directory names)::

    DIR/.trainrec-export.json                          what was exported, from where (marks DIR as ours)
    DIR/Nov30_11-13-33-rank0-4700973a/actv_0-0.csv      csv: {type}_{start}-{end}.csv per type per window
    DIR/Nov30_11-13-33-rank0-4700973a/events.out.tfevents.{time}.{host}[.{part}]   tb

Selection: ``--types`` (default: all), ``--steps 10-20,30``, ``--ranks 0,2-3``, and runs by
``--run-id`` or by the reference's time-stamped directory names ``--time-start/--time-end`` (both
inclusive; every run with a rank directory in the range is exported). Without either, the latest run.

``-j N`` exports with N processes, across ranks and, when there are fewer ranks than processes,
across data types (then TensorBoard gets one event file per part in the rank's directory, which
TensorBoard reads as one run). The CSV files are byte-identical to a serial export; the TensorBoard
scalars, steps and wall times are identical. A progress bar goes to stderr when it is a terminal.

An output directory that exists and is not empty is refused; ``--force`` replaces it only when it
holds a previous trainrec export. Logs still being written, torn tails and damaged records are
exported as far as they are complete, and said so on stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import logging
import os
import sys
import threading
import time

from trainrec.analyzers.selection import StepSet, parse_kinds, parse_steps
from trainrec.replay.discover import format_ranks
from trainrec.replay.run import Run
from trainrec.schema.errors import TrainrecError
from trainrec.schema.events import KINDS

from .export_output import _remove_output, prepare_output
from .export_parquet import add_parquet_parser
from .export_plan import FROM_RUN, plan_tasks, select_runs
from .export_task import ExportTask, TaskResult, run_task
from .partition import ENGINES, check_engine, pool_context, positive_int, run_parts
from .progress import Progress
from .runarg import add_run_arguments, check_steps, note_incomplete

log = logging.getLogger(__name__)

FORMATS = {"csv": "CSV files", "tb": "TensorBoard event files"}


# ---------------------------------------------------------------------------------------- arguments
def _types_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_kinds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _steps_arg(what: str):
    def parse(text: str) -> StepSet:
        try:
            return parse_steps(text, what)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _ndigits(text: str) -> int | None:
    if text.lower() in ("full", "none"):
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of decimals or 'full', not {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"--ndigits must be >= 0 (or 'full'), not {n}")
    return n


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write the reference's CSV files or TensorBoard events from a run's log",
        description=__doc__.split("\n\n")[0],
    )
    fsub = p.add_subparsers(dest="export_format", metavar="FORMAT")
    fsub.required = True
    for fmt, what in FORMATS.items():
        q = fsub.add_parser(fmt, help=f"export {what}", description=f"Export {what} from a run's log.\n\n"
                            + __doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
        add_run_arguments(q)
        q.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write (must not exist or be empty)")
        q.add_argument("--types", type=_types_arg, action="append", metavar="TYPES",
                       help=f"data types, comma separated (default all: {','.join(KINDS)})")
        q.add_argument("--steps", type=_steps_arg("step"), metavar="RANGES", help="steps to export, e.g. 10-20,30")
        q.add_argument("--ranks", type=_steps_arg("rank"), metavar="RANGES", help="ranks to export, e.g. 0,2-3")
        q.add_argument("-j", "--process-num", type=positive_int, default=1, metavar="N", help="processes (default 1)")
        q.add_argument("--engine", choices=ENGINES, default="local",
                       help="where the parts run: local processes (-j), or a Dask cluster (the dask extra)")
        q.add_argument("--cluster", metavar="ADDRESS", default=None,
                       help="the Dask scheduler to use (e.g. tcp://host:8786; implies --engine dask; the workers must "
                            "see the run and the output directory at the same paths)")
        q.add_argument("--force", action="store_true", help="replace DIR when it holds a previous trainrec export")
        if fmt == "csv":
            q.add_argument("--ndigits", type=_ndigits, default=FROM_RUN, metavar="N",
                           help="decimals, rounded as the reference rounds them ('full': no rounding; default: "
                                "the run's config, as its live export wrote them, else 6)")
            q.add_argument("--step-count-per-record", type=positive_int, default=FROM_RUN, metavar="M",
                           help="steps per CSV file (default: the run's config, else 1)")
        q.set_defaults(func=run)
    add_parquet_parser(fsub, _types_arg, _steps_arg)




# ---------------------------------------------------------------------------------------- execution
_queue = None


def _init_worker(q) -> None:
    global _queue
    _queue = q


def _worker(task: ExportTask) -> TaskResult:
    q = _queue
    return run_task(task, (lambda n: q.put(n)) if q is not None else None)


def execute(tasks: list[ExportTask], jobs: int, progress: Progress, engine: str = "local",
            cluster: str | None = None) -> list[TaskResult]:
    tasks = sorted(tasks, key=lambda t: -t.log_bytes)
    results: list[TaskResult] = []
    if engine == "dask":
        done = run_parts(run_task, [(t, None) for t in tasks], [t.log_bytes for t in tasks], jobs, progress.label,
                         engine=engine, cluster=cluster, progress=progress.enabled)
        return sorted(done, key=lambda r: r.task_id)
    if jobs <= 1 or len(tasks) <= 1:
        for t in tasks:
            results.append(run_task(t, progress.advance))
            progress.advance(task_done=True)
        return sorted(results, key=lambda r: r.task_id)
    ctx = pool_context()
    q = ctx.Queue() if progress.enabled else None
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            try:
                n = q.get(timeout=0.1)
            except Exception:  # queue.Empty, or the queue closed at shutdown
                continue
            progress.advance(n)

    drainer = threading.Thread(target=drain, daemon=True) if q is not None else None
    if drainer is not None:
        drainer.start()
    try:
        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx,
                                    initializer=_init_worker, initargs=(q,)) as pool:
            futures = [pool.submit(_worker, t) for t in tasks]
            for fut in cf.as_completed(futures):
                results.append(fut.result())
                progress.advance(task_done=True)
    finally:
        stop.set()
        if drainer is not None:
            drainer.join(timeout=2)
    return sorted(results, key=lambda r: r.task_id)


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}..{steps[-1]} ({len(steps)} step{'' if len(steps) == 1 else 's'})"


def run(args) -> int:
    fmt = args.export_format
    kinds: tuple[str, ...] = KINDS
    if args.types:
        merged: list[str] = []
        for group in args.types:
            merged.extend(k for k in group if k not in merged)
        kinds = tuple(merged)
    engine = check_engine(args)
    runs = select_runs(args.run, args.run_id, args.time_start, args.time_end)
    for r in runs:
        note_incomplete(r, "export")
    out = os.path.abspath(args.output)
    for r in runs:
        for dirs in r.rank_dirs.values():
            for d in dirs:
                if out == os.path.abspath(d) or out.startswith(os.path.abspath(d) + os.sep):
                    raise TrainrecError(f"output directory {out} is inside the run's rank directory {d}")
    tasks = plan_tasks(runs, args, kinds, out)
    record = {
        "format": fmt,
        "source": os.path.abspath(args.run),
        "runs": [r.run_id for r in runs],
        "types": list(kinds),
        "steps": args.steps.text() if args.steps else None,
        "ranks": args.ranks.text() if args.ranks else None,
        "ndigits": _one_value({t.ndigits for t in tasks}) if fmt == "csv" else None,
        "step_count_per_record": _one_value({t.step_count_per_record for t in tasks}) if fmt == "csv" else None,
        "created": time.time(),
    }
    created = not os.path.exists(out)
    prepare_output(out, args.force, record)
    t0 = time.perf_counter()
    progress = Progress(sum(t.log_bytes for t in tasks), len(tasks), f"export {fmt}")
    try:
        results = execute(tasks, args.process_num, progress, engine, args.cluster)
    except OSError as exc:
        raise TrainrecError(f"export to {out} failed: {exc}") from exc
    finally:
        progress.close()
    elapsed = time.perf_counter() - t0
    status = report(results, runs, fmt, out, elapsed, args)
    if status:  # nothing exported: leave no directory that looks like an export
        _remove_output(out, created)
    return status

def _one_value(values: set):
    """The value all tasks share, or "per run" (runs of other settings exported together)."""
    return next(iter(values)) if len(values) == 1 else "per run"



def report(results: list[TaskResult], runs: list[Run], fmt: str, out: str, elapsed: float, args) -> int:
    seen: set[str] = set()
    for res in results:
        log.info("part %d: rank %d [%s]: %.2f s wall, %.2f s CPU", res.task_id, res.rank, ",".join(res.kinds),
                 res.seconds, res.cpu_seconds)
        for msg in res.messages:
            if msg not in seen:
                seen.add(msg)
                print(f"trainrec export: rank {res.rank}: {msg}", file=sys.stderr)
        if res.dropped_steps:
            print(f"trainrec export: rank {res.rank}: step(s) {', '.join(map(str, res.dropped_steps))} did not end "
                  "before the log stopped; not exported", file=sys.stderr)
        if res.bad_records:
            print(f"trainrec export: rank {res.rank}: {res.bad_records} inconsistent stats record(s) skipped", file=sys.stderr)
    superseded = sum(r.superseded for r in results)
    if superseded:
        print(f"trainrec export: {superseded} record(s) superseded by a resume were left out", file=sys.stderr)
    steps = sorted({s for r in results for s in r.steps})
    files = sum(len(r.files) for r in results)
    values = sum(r.values for r in results)
    ranks = sorted({r.rank for r in results})
    spans = [r.recorded_steps for r in results if r.recorded_steps is not None]
    first = min((a for a, _ in spans), default=None)
    last = max((b for _, b in spans), default=None)
    err = check_steps(args.steps, first, last, f"run {', '.join(r.run_id or '(no id)' for r in runs)}")
    if err:
        print(f"trainrec export: error: {err}; nothing exported", file=sys.stderr)
        return 2
    if not values:
        sel = []
        if args.steps is not None:
            sel.append(f"steps {args.steps.text()}")
        if args.types:
            sel.append("types " + ",".join(k for g in args.types for k in g))
        print(f"trainrec export: nothing to export: no statistics{' for ' + ' and '.join(sel) if sel else ''} "
              f"in run {', '.join(r.run_id for r in runs)}", file=sys.stderr)
        return 1
    what = f"{values} values in {files} CSV files" if fmt == "csv" else f"{values} scalars in {files} event files"
    print(f"exported run {', '.join(r.run_id or '(no id)' for r in runs)}: ranks {format_ranks(ranks)}, "
          f"steps {_ranges(steps)}: {what} to {out} in {elapsed:.2f} s")
    if any(r.still_running for r in results):
        print("the run is still being written: export again later for the rest", file=sys.stderr)
    return 0
