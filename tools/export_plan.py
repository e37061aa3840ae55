"""What ``trainrec export csv|tb`` exports: the runs chosen (``--run-id``, ``--time-start/--time-end``),
their ranks (``--ranks``), and the export tasks made of them, split by data type where there are more
processes than ranks, with the CSV options each rank's run recorded unless given.
"""

from __future__ import annotations

import os
import sys

from trainrec.replay.discover import stamp_key_or_none
from trainrec.replay.reader import LogReader
from trainrec.replay.run import Run, open_run
from trainrec.replay.run_select import list_runs
from trainrec.replay.stepindex import first_record
from trainrec.schema import layout
from trainrec.schema.errors import FormatError, NotARunError
from trainrec.schema.events import ConfigApplied, StepEnded, TensorStatsRecorded

from .export_task import ExportTask


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
