"""trainrec.replay: reading logs back.

* :mod:`.reader`: one log file, frame by frame, surviving torn tails and damage (``LogReader``).
* :mod:`.record_stream`: the records of a file's frames, checked, decoded, numbered and accounted for.
* :mod:`.discover`: output directories, rank directories and the launches (runs) in them.
* :mod:`.run_select`: the runs of an output directory, and the one a RUN argument names.
* :mod:`.run`: ``open_run(path)``, a run's ranks, files and events merged in execution order.
* :mod:`.rows`: the flat, numpy/pandas-friendly view of statistics.
* :mod:`.follow`: a live tail of a run that is still being written.
* :mod:`.names`: resolving interned name ids.
* :mod:`.summary`: per-rank and per-file summaries of a run (``trainrec inspect``).
* :mod:`.integrity`: what is wrong with a run's files, from its summary (``trainrec check``).
* :mod:`.stepindex`: reading only some steps of a log through its step index (``--steps``).
* :mod:`.stats_columns`: stats records decoded straight into columns (``columnar=True``).
* :mod:`.stats_templates`: stats records of a layout read before, decoded from the bytes that vary.
* :mod:`.step_records`: step records decoded without the codec's generic walk (the same events).
* :mod:`.frame_search`: finding the next valid frame in damaged bytes (the reader's resynchronisation).
* :mod:`.problems`: the damage found in a log file, as the reader lists it.
* :mod:`.name_ranges`: the name ids a log file has interned, and records that contradict them.
"""

from __future__ import annotations

from .discover import RunInfo
from .follow import RunFollower, follow
from .integrity import Finding, findings
from .names import NameResolver
from .problems import Problem
from .reader import LogReader, SeqGap, read_head, read_log
from .rows import execution_order, rows_from_events, value_matrix
from .run import Run, open_run, resolve_types
from .run_select import list_runs
from .stats_columns import StatsColumns
from .stepindex import FileIndex, load_index, read_steps
from .summary import RunSummary, summarize

__all__ = [
    "FileIndex",
    "Finding",
    "LogReader",
    "NameResolver",
    "Problem",
    "Run",
    "RunFollower",
    "RunInfo",
    "RunSummary",
    "SeqGap",
    "StatsColumns",
    "execution_order",
    "findings",
    "follow",
    "list_runs",
    "load_index",
    "open_run",
    "read_head",
    "read_log",
    "read_steps",
    "resolve_types",
    "rows_from_events",
    "summarize",
    "value_matrix",
]
