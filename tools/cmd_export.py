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
import json
import logging
import os
import shutil
import sys
import threading
import time

from trainrec.analyzers.projection import StepSet, parse_kinds, parse_steps
from trainrec.replay.discover import format_ranks, stamp_key_or_none
from trainrec.replay.reader import LogReader
from trainrec.replay.run import Run, open_run
from trainrec.replay.run_select import list_runs
from trainrec.replay.stepindex import first_record
from trainrec.schema import layout
from trainrec.schema.errors import FormatError, NotARunError, TrainrecError
from trainrec.schema.events import KINDS, ConfigApplied, StepEnded, TensorStatsRecorded

from .export_files import ExportTask, TaskResult, pool_context, run_task
from .partition import ENGINES, check_engine, positive_int, run_parts
from .progress import Progress
from .runarg import add_run_arguments, check_steps, note_incomplete

log = logging.getLogger(__name__)

MARKER = layout.EXPORT_MARKER
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
    from .export_parquet import add_parquet_parser  # (it imports this module's output helpers)

    add_parquet_parser(fsub, _types_arg, _steps_arg)


# ---------------------------------------------------------------------------------------- selection
def select_runs(path: str, run_id: str | None, time_start: str | None, time_end: str | None) -> list[Run]:
    """The runs to export: every run with a rank directory in the time range, or open_run's choice."""
    if (time_start is None and time_end is None) or not os.path.isdir(path) or layout.list_logs(path):
        return [open_run(path, run_id=run_id, time_start=time_start, time_end=time_end)]
    lo = _stamp(time_start, "--time-start", path)
    hi = _stamp(time_end, "--time-end", path)
    if lo is not None and hi is not None and lo > hi:
        raise NotARunError(f"time range {time_start}..{time_end} is empty (start after end)", path)
    runs = list_runs(path)
    if not runs:
        raise NotARunError("no trainrec runs found", path)
    chosen = []
    for info in runs:
        if run_id is not None and not info.run_id.startswith(run_id):
            continue
        keys = [stamp_key_or_none(s) for s in info.stamps]
        if any(k is not None and (lo is None or k >= lo) and (hi is None or k <= hi) for k in keys):
            chosen.append(Run(info, where=path))
    if not chosen:
        listing = "\n".join("  " + r.describe() for r in runs)
        raise NotARunError(
            f"no run has a rank directory stamped in {time_start or 'any time'} .. {time_end or 'any time'} (inclusive); runs found:\n{listing}",
            path,
        )
    return chosen


def _stamp(value: str | None, option: str, path: str):
    if value is None:
        return None
    key = stamp_key_or_none(value)
    if key is None:
        raise NotARunError(f"{option} {value!r} is not a time stamp like Nov30_11-13-33", path)
    return key


FROM_RUN = object()  # --ndigits / --step-count-per-record not given: the run's own


def recorded_csv_options(run: Run, rank: int, max_events: int = 10000) -> tuple[int | None, int]:
    """``(ndigits, step_count_per_record)`` of the config the rank's first log applied first (the
    settings its live export wrote the CSV files with: they are fixed at the run's start); the
    reference's defaults (6, 1) where the log holds no such config or a value that is not valid."""
    ndigits, per_record = 6, 1
    files = run.files(rank)
    if not files:
        return ndigits, per_record
    found = first_record(files[0], ConfigApplied.TAG, max_events)  # (the statistics are not decoded)
    events = [] if found is None else [found] if found is not False else None
    try:
        for i, ev in enumerate(LogReader(files[0]) if events is None else events):
            if isinstance(ev, ConfigApplied):
                cfg = ev.config if isinstance(ev.config, dict) else {}
                n, m = cfg.get("ndigits", 6), cfg.get("step_count_per_record", 1)
                if type(n) is int and n >= 0:
                    ndigits = n
                if type(m) is int and m >= 1:
                    per_record = m
                break
            if i >= max_events:
                break
    except FormatError:
        pass
    return ndigits, per_record


def kinds_seen(run: Run, rank: int, max_steps: int = 3, max_events: int = 20000) -> list[str]:
    """Data types in the first few steps of a rank's first log (to balance parallel parts)."""
    files = run.files(rank)
    seen: list[str] = []
    if not files:
        return seen
    ended = 0
    try:
        for i, ev in enumerate(LogReader(files[0])):
            if isinstance(ev, TensorStatsRecorded) and ev.kind not in seen:
                seen.append(ev.kind)
            elif isinstance(ev, StepEnded):
                ended += 1
            if ended >= max_steps or i >= max_events:
                break
    except FormatError:
        pass
    return seen


def plan_tasks(runs: list[Run], args, kinds: tuple[str, ...], out: str) -> list[ExportTask]:
    pairs = []
    for run in runs:
        ranks = run.ranks
        if args.ranks is not None:
            ranks = [r for r in ranks if r in args.ranks]
        for r in ranks:
            pairs.append((run, r))
    if not pairs:
        have = "; ".join(f"run {r.run_id}: ranks {r.ranks}" for r in runs)
        raise NotARunError(f"no rank matches --ranks {args.ranks.text()} ({have})", args.run)
    jobs = max(1, args.process_num)
    parts = 1 if len(pairs) >= jobs else min(len(kinds), -(-jobs // len(pairs)))
    tasks: list[ExportTask] = []
    used: set[str] = set()
    for run, r in pairs:
        dirs = run.rank_dirs.get(r) or (f"rank{r}",)
        name = os.path.basename(dirs[0].rstrip(os.sep))
        if name in used:
            name = f"{name}-{run.run_id[:8] or 'run'}"
        used.add(name)
        rank_out = os.path.join(out, name)
        info = type(run.info)(run_id=run.info.run_id, files={r: list(run.info.files[r])})
        if parts == 1:
            groups = [tuple(kinds)]
        else:
            present = kinds_seen(run, r)
            ordered = [k for k in kinds if k in present] + [k for k in kinds if k not in present]
            groups = [tuple(ordered[i::parts]) for i in range(parts)]
            groups = [tuple(k for k in kinds if k in g) for g in groups if g]
        ndigits, per_record = getattr(args, "ndigits", 6), getattr(args, "step_count_per_record", 1)
        if ndigits is FROM_RUN or per_record is FROM_RUN:
            run_ndigits, run_per_record = recorded_csv_options(run, r)
            ndigits = run_ndigits if ndigits is FROM_RUN else ndigits
            per_record = run_per_record if per_record is FROM_RUN else per_record
        if ndigits is not None and ndigits > 308 and args.export_format == "csv":
            print(f"trainrec export: note: rank {r}: ndigits {ndigits} rounds every value to nan, as the reference "
                  "does (numpy's round overflows above 308 decimals); pass --ndigits to choose", file=sys.stderr)
        for gi, group in enumerate(groups):
            suffix = "" if len(groups) == 1 else (group[0] if len(group) == 1 else f"part{gi}")
            tasks.append(
                ExportTask(
                    fmt=args.export_format, info=info, rank=r, out_dir=rank_out, kinds=group, steps=args.steps,
                    notes=gi == 0, ndigits=ndigits, step_count_per_record=per_record, tb_suffix=suffix,
                    task_id=len(tasks), note_kinds=tuple(kinds),
                )
            )
    return tasks


# ---------------------------------------------------------------------------------------- output dir
def prepare_output(out: str, force: bool, record: dict) -> None:
    try:
        _prepare_output(out, force, record)
    except OSError as exc:
        raise TrainrecError(f"cannot prepare output directory {out}: {exc.strerror or exc}"
                            f"{f' ({exc.filename})' if exc.filename and exc.filename != out else ''}") from exc


def _prepare_output(out: str, force: bool, record: dict) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainrecError(f"output {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not force:
            raise TrainrecError(f"output directory {out} exists and is not empty; choose another, or pass --force "
                                "to replace a previous trainrec export there")
        if not os.path.isfile(os.path.join(out, MARKER)):
            raise TrainrecError(f"output directory {out} is not empty and holds no trainrec export ({MARKER} "
                                "missing); refusing to mix or delete files there, choose another directory")
        _clear_dir(out)
    layout.make_dirs(out)
    with open(os.path.join(out, MARKER), "w", encoding="utf-8", opener=layout.private_opener) as f:
        json.dump(record, f, indent=2)
        f.write("\n")


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


def _clear_dir(path: str) -> None:
    """Remove everything inside ``path`` (not following links), keeping the directory."""
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.remove(entry.path)


def _one_value(values: set):
    """The value all tasks share, or "per run" (runs of other settings exported together)."""
    return next(iter(values)) if len(values) == 1 else "per run"


def _remove_output(out: str, created: bool) -> None:
    """Take back what :func:`prepare_output` and an export that wrote nothing left in ``out`` (the
    directory itself where this export created it; else it was empty, or a previous export that
    ``--force`` cleared)."""
    try:
        if created:
            shutil.rmtree(out)
        else:
            _clear_dir(out)
    except OSError as exc:
        log.warning("trainrec export: could not remove %s: %s", out, exc)


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
