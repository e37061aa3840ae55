"""trainrec.replay: reading logs back (no torch).

:func:`open_run` (:mod:`.run`) replays the ranks of a run as one stream of events and
:func:`follow` (:mod:`.follow`) tails a run still being written. :mod:`.reader` reads one log file
frame by frame, surviving torn tails and damage; :mod:`.discover` and :mod:`.run_select` find the
runs of an output directory; :mod:`.summary` and :mod:`.integrity` are the data behind ``trainrec
inspect`` and ``check``; :mod:`.stepindex` reads only some steps (``--steps``); :mod:`.rows` and
:mod:`.stats_columns` give statistics as columns. The other modules are parts of the reader and of
the decoding.
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
