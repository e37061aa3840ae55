"""Finding runs on disk: rank directories, their log files, and the launches they belong to.

Only the head of each file (its records up to the first that is not preamble) is read here. A file
belongs to the run its FileOpened's ``run_id`` names, a file beginning with RunResumed continues the
file before it, and where a rank has several chains under one run id the run is split into launches
``RUNID``, ``RUNID#2``, ... each with a :attr:`RunInfo.conflict`. Runs are ordered oldest first. The
rules in full: ``docs/log-format.md``, "Which files make a run". Choosing one run, and resolving a RUN
argument, is :mod:`trainrec.replay.run_select`'s.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from trainrec.schema import layout
from trainrec.schema.errors import FormatError
from trainrec.schema.events import (
    ConfigApplied,
    ConfigChanged,
    ConfigRejected,
    FileClosed,
    FileOpened,
    ModuleStructureRecorded,
    NamesInterned,
    NamesRepeated,
    RunResumed,
)

from .reader import LogReader

log = logging.getLogger(__name__)

# Records that may come before a RunResumed at the start of a file (one ModuleStructureRecorded per
# virtual-pipeline chunk, so their number is not bounded).
_PREAMBLE = (FileOpened, NamesInterned, NamesRepeated, ModuleStructureRecorded, ConfigApplied, ConfigChanged,
             ConfigRejected)


def stamp_key_or_none(stamp: str | None) -> tuple[int, ...] | None:
    if not stamp:
        return None
    try:
        return layout.stamp_key(stamp)
    except ValueError:
        return None


@dataclass
class LogFile:
    """One log file as found on disk, with what its first records say."""

    path: str
    dir: str
    index: int
    stamp: str | None  # time stamp of its rank directory's name
    dir_rank: int | None  # rank in its directory's name
    header: FileOpened | None = None
    version: int | None = None
    resume_step: int | None = None  # step a RunResumed at the start of the file continues from
    error: FormatError | None = None
    empty: bool = False  # nothing but its preamble (and maybe its FileClosed) is recorded in it
    closed: bool = False  # its FileClosed follows the preamble directly (set only where ``empty``)

    def writer(self) -> str:
        """Who wrote the file, in words (its header's host, pid, start and writer nonce)."""
        h = self.header
        if h is None:
            return "an unknown writer"
        nonce = f", writer {h.writer_id[:8]}" if h.writer_id else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.start_time)) if h.start_time else "?"
        return f"pid {h.pid} on {h.host or '?'} started {when}{nonce}"

    @property
    def rank(self) -> int:
        if self.header is not None and self.header.rank >= 0:
            return self.header.rank
        return self.dir_rank if self.dir_rank is not None else 0

    @property
    def run_id(self) -> str | None:
        return None if self.header is None else self.header.run_id


def resume_step(ev: RunResumed) -> int | None:
    """The first step a RunResumed record's file re-records (its own step, else last_step + 1)."""
    if ev.step >= 0:
        return ev.step
    if ev.last_step >= 0:
        return ev.last_step + 1
    return None


def scan_file(path: str, dir_stamp: str | None = None, dir_rank: int | None = None) -> LogFile:
    """Read the beginning of one log file; errors are kept on the result, not raised."""
    d = os.path.dirname(path)
    name = os.path.basename(path)
    if dir_stamp is None and dir_rank is None:
        parsed = layout.parse_rank_dir(os.path.basename(d))
        if parsed:
            dir_stamp, dir_rank = parsed
    lf = LogFile(path=path, dir=d, index=layout.log_index(name) or 0, stamp=dir_stamp, dir_rank=dir_rank)
    try:
        reader = LogReader(path)
        head = reader.head_while(lambda ev: isinstance(ev, _PREAMBLE))
    except FormatError as exc:
        lf.error = exc
        return lf
    lf.version = reader.version
    lf.empty = bool(head) and (isinstance(head[-1], _PREAMBLE) or isinstance(head[-1], FileClosed))
    lf.closed = bool(head) and isinstance(head[-1], FileClosed)
    for ev in head:
        if isinstance(ev, FileOpened):
            if lf.header is None:
                lf.header = ev
            continue
        if isinstance(ev, RunResumed):
            lf.resume_step = resume_step(ev)
            lf.empty = False
            break
        if not isinstance(ev, _PREAMBLE):
            break
    return lf


def scan_rank_dir(path: str) -> list[LogFile]:
    parsed = layout.parse_rank_dir(os.path.basename(os.path.normpath(path)))
    stamp, rank = parsed if parsed else (None, None)
    return [scan_file(p, stamp, rank) for p in layout.list_logs(path)]


@dataclass
class RunInfo:
    """One launch: its log files by rank, in the order each rank wrote them."""

    run_id: str
    files: dict[int, list[LogFile]] = field(default_factory=dict)
    # Found in an output directory (not given as one rank directory or file): every rank of the world
    # size should be here. ``unattributed``: files there whose header cannot be read, so that their
    # launch cannot be told (left out of every run, reported beside the one chosen).
    whole: bool = False
    unattributed: list[LogFile] = field(default_factory=list)
    # Its run id is shared with other launches that are not resumes of it (see the module docstring):
    # what to say about it, else "".
    conflict: str = ""

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks below the headers' world size with no log here (only known for a whole output directory)."""
        if not self.whole:
            return []
        world = max((f.header.world_size for f in self.all_files if f.header is not None), default=0)
        return [r for r in range(world) if r not in self.files]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.files)

    @property
    def rank_dirs(self) -> dict[int, tuple[str, ...]]:
        out = {}
        for r, fs in sorted(self.files.items()):
            dirs: list[str] = []
            for f in fs:
                if f.dir not in dirs:
                    dirs.append(f.dir)
            out[r] = tuple(dirs)
        return out

    @property
    def all_files(self) -> list[LogFile]:
        return [f for r in self.ranks for f in self.files[r]]

    @property
    def stamps(self) -> list[str]:
        found = {f.stamp for f in self.all_files if f.stamp}
        return sorted(found, key=lambda s: stamp_key_or_none(s) or ())

    @property
    def start_time(self) -> float:
        times = [f.header.start_time for f in self.all_files if f.header is not None]
        return min(times) if times else 0.0

    def sort_key(self) -> tuple:
        keys = [k for k in (stamp_key_or_none(s) for s in self.stamps) if k is not None]
        times = [f.header.start_time for f in self.all_files if f.header is not None]
        return (max(keys) if keys else (), max(times) if times else 0.0, self.run_id)

    def describe(self) -> str:
        stamps = self.stamps
        when = stamps[0] if len(stamps) == 1 else (f"{stamps[0]}..{stamps[-1]}" if stamps else "no stamp")
        return f"run {self.run_id or '(no run id)'}  stamps {when}  ranks {format_ranks(self.ranks)}"


def format_ranks(ranks: list[int]) -> str:
    """``0-3,6`` for [0, 1, 2, 3, 6]."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts) or "none"


def group_runs(scanned: list[list[LogFile]]) -> list[RunInfo]:
    """Group the files of several rank directories into runs (see the module docstring)."""
    runs: dict[str, RunInfo] = {}
    for files in scanned:
        prev_key: str | None = None
        for lf in files:
            if lf.resume_step is not None and prev_key is not None:
                key = prev_key
            elif lf.header is not None:
                key = lf.header.run_id or f"@{lf.stamp or lf.dir}"
            elif prev_key is not None:
                key = prev_key
            else:
                key = f"@{lf.stamp or lf.dir}"
            prev_key = key
            info = runs.get(key)
            if info is None:
                info = runs[key] = RunInfo(run_id=key if not key.startswith("@") else "")
            info.files.setdefault(lf.rank, []).append(lf)
    out: list[RunInfo] = []
    for info in runs.values():
        for r, fs in info.files.items():
            info.files[r] = _order_rank_files(fs)
        out.extend(_split_writers(info))
    return sorted(out, key=RunInfo.sort_key)


def _chains(files: list[LogFile]) -> list[list[LogFile]]:
    """A rank's files (in writing order) cut where a file neither resumes the one before nor is empty."""
    chains: list[list[LogFile]] = []
    for f in files:
        if chains and (f.resume_step is not None or f.empty or f.header is None):
            chains[-1].append(f)
        else:
            chains.append([f])
    return chains


def _chain_start(chain: list[LogFile]) -> float:
    times = [f.header.start_time for f in chain if f.header is not None]
    return min(times) if times else float("inf")


def _split_writers(info: RunInfo) -> list[RunInfo]:
    """One run per writer chain ordinal where a rank has several (see the module docstring)."""
    chains = {r: sorted(_chains(fs), key=_chain_start) for r, fs in info.files.items()}
    n = max((len(c) for c in chains.values()), default=1)
    if n <= 1:
        return [info]
    rid = info.run_id
    ids = [rid if k == 0 else f"{rid}#{k + 1}" for k in range(n)]
    writers = []
    for r in sorted(chains):
        if len(chains[r]) > 1:
            writers = [c[0].writer() for c in chains[r]]
            break
    said = (f"run id {rid or '(none)'} is shared by {n} launches that do not resume one another: "
            f"{', '.join(writers)} wrote the same rank without a RunResumed (TRAINREC_RUN_ID set alike in two "
            f"jobs, or a rank restarted in place without append_output); replay keeps them apart as runs "
            f"{', '.join(ids)}")
    out = []
    for k in range(n):
        files = {r: c[k] for r, c in chains.items() if k < len(c)}
        out.append(RunInfo(run_id=ids[k], files=files, conflict=said))
    return out


def _order_rank_files(files: list[LogFile]) -> list[LogFile]:
    """A rank's files in writing order: its directories by start time then stamp, files by index."""
    by_dir: dict[str, list[LogFile]] = {}
    for f in files:
        by_dir.setdefault(f.dir, []).append(f)

    def dir_key(d: str) -> tuple:
        fs = by_dir[d]
        times = [f.header.start_time for f in fs if f.header is not None]
        return (min(times) if times else float("inf"), stamp_key_or_none(fs[0].stamp) or (), d)

    out: list[LogFile] = []
    for d in sorted(by_dir, key=dir_key):
        out.extend(sorted(by_dir[d], key=lambda f: f.index))
    return out
