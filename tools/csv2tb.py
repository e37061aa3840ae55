"""``csv2tensorboard_by_step``: the reference's CSV directories (or ours) to TensorBoard, compatibly.

Same call as mindstudio-probe 1.2.1's ``msprobe.pytorch.monitor.csv2tb``::

    from trainrec.tools.csv2tb import csv2tensorboard_by_step
    csv2tensorboard_by_step(monitor_path, time_start, time_end, process_num=1, data_type_list=None,
                            output_dirpath=None)

It converts the rank directories of ``monitor_path`` stamped within ``[time_start, time_end]``
(inclusive; None: unbounded) to ``{output_dirpath}/rank{R}/{data_type}/events.out.tfevents...``,
many scalars per event. Tags and the differences from the reference (duplicate steps, several
launches of a rank, an empty time range): docs/exports.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import io
import logging
import os
import re
import socket
import time
from dataclasses import dataclass

import numpy as np
from trainrec.analyzers.frames import last_of_each
from trainrec.analyzers.tb_encode import ScalarTemplate, event_bytes
from trainrec.schema import layout
from trainrec.schema.errors import NotARunError

from .partition import pool_context
from .tb_event_file import TbEventFile, tb_file_name

log = logging.getLogger(__name__)

__all__ = ["ALL_DATA_TYPES", "csv2tensorboard_by_step", "convert_csv_files"]

ALL_DATA_TYPES = ["actv", "actv_grad", "exp_avg", "exp_avg_sq", "grad_unreduced", "grad_reduced", "param"]
EXTRA_DATA_TYPES = ["update", "ratio"]
_FILE_RE = r"^{}_(\d+)-(\d+)\.csv$"


@dataclass
class _Task:
    csv_dir: str
    data_type: str
    out_dir: str


@dataclass
class _Result:
    out_dir: str
    files: int
    scalars: int
    steps: int
    duplicates: int
    problems: list


def _check_time(value, name: str):
    if value is None:
        return None
    try:
        return layout.stamp_key(str(value))
    except ValueError:
        raise ValueError(
            f"illegal timestamp {name}={value!r}: expected the prefix of an output directory, like 'Dec03_21-34-40'"
        ) from None


def _target_dirs(monitor_path: str, time_start, time_end) -> list[tuple[int, str]]:
    lo, hi = _check_time(time_start, "time_start"), _check_time(time_end, "time_end")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"time_start({time_start}) is after time_end({time_end})")
    found: list[tuple[int, str]] = []
    stamps: list[str] = []
    for name in sorted(os.listdir(monitor_path)):
        path = os.path.join(monitor_path, name)
        m = layout.RANK_DIR_RE.match(name)
        if not m or not os.path.isdir(path):
            continue
        stamps.append(name)
        try:
            key = layout.stamp_key(m.group(1))
        except ValueError:
            continue
        if (lo is None or key >= lo) and (hi is None or key <= hi):
            found.append((int(m.group(2)), path))
    if not found:
        listing = ", ".join(stamps[:20]) + (" ..." if len(stamps) > 20 else "") if stamps else "none"
        raise NotARunError(
            f"no rank directory stamped in {time_start or 'any time'} .. {time_end or 'any time'}; "
            f"rank directories found: {listing}",
            monitor_path,
        )
    return found


def _read_csv(path: str):
    """(value columns, row names, steps int64, values float64 matrix) of one CSV file, or None if empty."""
    with open(path, newline="", encoding="utf-8") as f:
        text = f.read()
    first, _, rest = text.partition("\n")
    header = next(csv.reader([first]), [])
    if not header:
        return None
    if len(header) < 4 or header[0] != "vpp_stage" or header[2] != "step":
        raise ValueError(f"not a monitor CSV (header {','.join(header[:4])}...)")
    start = 4 if header[3] == "micro_step" else 3  # msprobe 1.2.2 added a micro_step column
    width = len(header) - start
    if '"' in rest:  # quoted names (with commas): the csv module, row by row
        body = [r for r in csv.reader(io.StringIO(rest)) if r]
        heads = [[*r[:start], ",".join(r[start:])] for r in body]
        for i, r in enumerate(body):
            if len(r) != len(header):
                raise ValueError(f"line {i + 2} has {len(r)} fields, the header {len(header)}")
    else:
        heads = [line.split(",", start) for line in rest.split("\n") if line.strip()]
        for i, h in enumerate(heads):
            if len(h) != start + 1:
                raise ValueError(f"line {i + 2} has too few fields")
    if not heads:
        return tuple(header[start:]), [], np.zeros(0, np.int64), np.zeros((0, width))
    if start == 4:
        names = [f"vp{h[0]}:{h[1]}:micro{h[3]}" for h in heads]
    else:
        names = [f"vp{h[0]}:{h[1]}" for h in heads]
    steps = np.array([h[2] for h in heads], dtype=np.float64).astype(np.int64)
    values = np.loadtxt([h[start] for h in heads], delimiter=",", dtype=np.float64, ndmin=2)
    if values.shape != (len(heads), width):
        raise ValueError(f"{values.shape[1]} values per line, the header names {width}")
    return tuple(header[start:]), names, steps, values


def convert_csv_files(task: _Task) -> _Result:
    """Convert one data type of one directory (runs in a worker process)."""
    pattern = re.compile(_FILE_RE.format(re.escape(task.data_type)))
    files = []
    for name in os.listdir(task.csv_dir):
        m = pattern.match(name)
        if m:
            files.append((int(m.group(1)), int(m.group(2)), name))
    files.sort()
    problems = []
    parts = []
    for _s, _e, name in files:
        path = os.path.join(task.csv_dir, name)
        try:
            parsed = _read_csv(path)
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            problems.append(f"{path}: {exc}")
            continue
        if parsed is not None and len(parsed[1]):
            parts.append(parsed)
    out = _Result(task.out_dir, len(files), 0, 0, 0, problems)
    if not parts:
        return out
    # Rows of the files in order; a repeated (name, step) keeps its last values, at its first place.
    names = [n for p in parts for n in p[1]]
    steps = np.concatenate([p[2] for p in parts])
    cols = [p[0] for p in parts for _ in p[1]]
    row_file = np.concatenate([np.full(len(p[1]), i) for i, p in enumerate(parts)])
    row_in_file = np.concatenate([np.arange(len(p[1])) for p in parts])
    keys = list(zip(steps.tolist(), names, strict=True))
    take = last_of_each(keys)
    if take is None:
        take = np.arange(len(keys))
    else:
        out.duplicates = len(keys) - len(take)
    order = take[np.argsort(steps[take], kind="stable")]
    sorted_steps = steps[order]
    uniq, starts = np.unique(sorted_steps, return_index=True)
    bounds = [*starts.tolist(), len(order)]
    layout.make_dirs(task.out_dir)
    for old in os.listdir(task.out_dir):
        if old.startswith("events.out.tfevents."):
            os.remove(os.path.join(task.out_dir, old))
            log.warning("existing %s replaced", os.path.join(task.out_dir, old))
    uniform = all(p[0] == parts[0][0] for p in parts)
    allvals = np.concatenate([p[3] for p in parts]) if uniform else None
    templates: dict[tuple, ScalarTemplate] = {}
    now = time.time()
    path = os.path.join(task.out_dir, tb_file_name(now, socket.gethostname()))
    with TbEventFile(path, wall=now) as f:
        for j, step in enumerate(uniq.tolist()):
            sel = order[bounds[j] : bounds[j + 1]]
            rows = sel.tolist()
            key = (tuple(names[i] for i in rows), parts[0][0] if uniform else tuple(cols[i] for i in rows))
            tmpl = templates.get(key)
            if tmpl is None:
                if len(templates) > 64:
                    templates.clear()
                row_cols = [parts[0][0]] * len(rows) if uniform else key[1]
                tmpl = templates[key] = ScalarTemplate(
                    [f"{n}/{c}" for n, cs in zip(key[0], row_cols, strict=True) for c in cs]
                )
            if allvals is not None:
                values = allvals[sel]
            else:
                values = np.concatenate([parts[row_file[i]][3][row_in_file[i]] for i in rows])
            f.write(event_bytes(now, step, summary=tmpl.summary(values)))
            out.scalars += len(tmpl)
    out.steps = len(uniq)
    return out


def csv2tensorboard_by_step(
    monitor_path,
    time_start=None,
    time_end=None,
    process_num=1,
    data_type_list=None,
    output_dirpath=None,
) -> str:
    """Convert the CSV files of the rank directories in a time range to TensorBoard; returns the output dir."""
    if isinstance(process_num, bool) or not isinstance(process_num, int) or process_num <= 0:
        raise ValueError(f"process_num({process_num}) is not a positive integer")
    valid = ALL_DATA_TYPES + EXTRA_DATA_TYPES
    if data_type_list is not None:
        if not isinstance(data_type_list, list):
            raise ValueError(f"data_type_list({data_type_list}) is not a list")
        for dt in data_type_list:
            if dt not in valid:
                raise ValueError(f"data type({dt}) is not supported, supported data type: {valid}")
    monitor_path = os.path.realpath(os.path.expanduser(str(monitor_path)))
    if not os.path.isdir(monitor_path):
        raise NotARunError("not a directory", monitor_path)
    targets = _target_dirs(monitor_path, time_start, time_end)
    if output_dirpath is None:
        stamp = time.strftime(layout.TIME_FORMAT, time.localtime())
        output_dirpath = os.path.join(monitor_path, f"{stamp}-csv2tensorboard_by_step")
    output_dirpath = os.path.expanduser(str(output_dirpath))
    layout.make_dirs(output_dirpath)
    counts: dict[int, int] = {}
    for rank, _ in targets:
        counts[rank] = counts.get(rank, 0) + 1
    types = data_type_list or ALL_DATA_TYPES
    tasks = []
    for rank, path in targets:
        rank_name = f"rank{rank}" if counts[rank] == 1 else f"rank{rank}_{os.path.basename(path)}"
        for dt in types:
            tasks.append(_Task(path, dt, os.path.join(output_dirpath, rank_name, dt)))
    if process_num == 1 or len(tasks) == 1:
        results = [convert_csv_files(t) for t in tasks]
    else:
        with cf.ProcessPoolExecutor(max_workers=min(process_num, len(tasks)), mp_context=pool_context()) as pool:
            results = list(pool.map(convert_csv_files, tasks))
    for r in results:
        for p in r.problems:
            log.error("csv2tensorboard: skipped %s", p)
        if r.duplicates:
            log.warning("csv2tensorboard: %d duplicated (name, step) rows for %s; the last ones were kept",
                        r.duplicates, r.out_dir)
    log.info("output has been saved to: %s", output_dirpath)
    return output_dirpath
