"""``csv2tensorboard_by_step``: the reference's CSV directories (or ours) to TensorBoard, compatibly.

Same call as mindstudio-probe 1.2.1's ``msprobe.pytorch.monitor.csv2tb``::

    from trainrec.tools.csv2tb import csv2tensorboard_by_step
    csv2tensorboard_by_step(monitor_path, time_start, time_end, process_num=1, data_type_list=None,
                            output_dirpath=None)

It converts the rank directories of ``monitor_path`` whose time stamp (``Dec03_21-34-40-rank0-...``)
lies in ``[time_start, time_end]`` (inclusive; None: unbounded), for the data types of
``data_type_list`` (default: ``actv, actv_grad, exp_avg, exp_avg_sq, grad_unreduced, grad_reduced,
param``; ours, ``update`` and ``ratio``, are accepted too), and writes
``{output_dirpath}/rank{R}/{data_type}/events.out.tfevents...`` with scalar tags
``vp{vpp}:{name}/{column}`` (``vp0:embed_0/input.min``, ``vp0:embed.weight/norm``). The default output
directory is ``{monitor_path}/{now:%b%d_%H-%M-%S}-csv2tensorboard_by_step`` (local time).

Differences from the reference, all on purpose:

* a (name, step) that appears twice (a resumed run appended to its CSV) keeps its last values and
  a warning, instead of raising ``duplicated step`` and skipping the rest of the data type;
* several launches of the same rank in the range are all converted, to ``rank{R}_{dir name}``
  (the reference keyed directories by rank, so one silently replaced the other);
* a time range that matches no directory raises an error naming what was found;
* many scalars per TensorBoard event and ``process_num`` processes across (directory, data type),
  rather than one ``add_scalar`` per value and processes across ranks only.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import logging
import os
import re
import socket
import time
from dataclasses import dataclass

import numpy as np
from trainrec.analyzers.tb_encode import ScalarTemplate, event_bytes
from trainrec.schema import layout
from trainrec.schema.errors import NotARunError

from .export_files import TbEventFile, pool_context, tb_file_name

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
    """(header, vpp list, name list, step list, values float64 matrix) of one CSV file."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows:
        return None
    header = rows[0]
    if len(header) < 4 or header[0] != "vpp_stage" or header[2] != "step":
        raise ValueError(f"not a monitor CSV (header {','.join(header[:4])}...)")
    start = 4 if header[3] == "micro_step" else 3  # msprobe 1.2.2 added a micro_step column
    body = [r for r in rows[1:] if r]
    if any(len(r) != len(header) for r in body):
        bad = next(i for i, r in enumerate(body, 2) if len(r) != len(header))
        raise ValueError(f"line {bad} has a different number of fields than the header")
    names = []
    for r in body:
        name = f"vp{r[0]}:{r[1]}"
        if start == 4:
            name = f"{name}:micro{r[3]}"
        names.append(name)
    steps = [int(float(r[2])) for r in body]
    values = np.array([r[start:] for r in body], dtype=np.float64).reshape(len(body), len(header) - start)
    return header[start:], names, steps, values


def convert_csv_files(task: _Task) -> _Result:
    """Convert one data type of one directory (runs in a worker process)."""
    pattern = re.compile(_FILE_RE.format(re.escape(task.data_type)))
    files = []
    for name in os.listdir(task.csv_dir):
        m = pattern.match(name)
        if m:
            files.append((int(m.group(1)), int(m.group(2)), name))
    files.sort()
    by_step: dict[int, dict[str, float]] = {}
    cols_of: dict[str, list[str]] = {}
    duplicates = 0
    problems = []
    for _s, _e, name in files:
        path = os.path.join(task.csv_dir, name)
        try:
            parsed = _read_csv(path)
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            problems.append(f"{path}: {exc}")
            continue
        if parsed is None:
            continue
        cols, names, steps, values = parsed
        for i, (n, s) in enumerate(zip(names, steps, strict=True)):  # a repeated (name, step): last wins
            slot = by_step.setdefault(s, {})
            if n in slot:
                duplicates += 1
            cols_of[n] = cols
            slot[n] = values[i]
    out = _Result(task.out_dir, 0, 0, 0, duplicates, problems)
    if not by_step:
        return out
    os.makedirs(task.out_dir, exist_ok=True)
    for old in os.listdir(task.out_dir):
        if old.startswith("events.out.tfevents."):
            os.remove(os.path.join(task.out_dir, old))
            log.warning("existing %s replaced", os.path.join(task.out_dir, old))
    templates: dict[tuple, ScalarTemplate] = {}
    now = time.time()
    path = os.path.join(task.out_dir, tb_file_name(now, socket.gethostname()))
    with TbEventFile(path, wall=now) as f:
        for step in sorted(by_step):
            rows = by_step[step]
            key = tuple((n, len(v)) for n, v in rows.items())
            tmpl = templates.get(key)
            if tmpl is None:
                tags = [f"{n}/{c}" for n in rows for c in cols_of[n]]
                tmpl = templates[key] = ScalarTemplate(tags)
            values = np.concatenate(list(rows.values())) if rows else np.empty(0)
            f.write(event_bytes(now, step, summary=tmpl.summary(values)))
            out.scalars += len(tmpl)
    out.files = len(files)
    out.steps = len(by_step)
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
    os.makedirs(output_dirpath, exist_ok=True)
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
