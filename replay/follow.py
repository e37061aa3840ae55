"""Live tail of a run that is still being written.

:class:`RunFollower` keeps one :class:`~trainrec.replay.reader.LogReader` per followed file; each
:meth:`RunFollower.poll` picks up new rank directories and files (a resume's) and returns the events
completed since the last call (an incomplete last frame is waited for). :func:`follow` is the
generator loop around it, ended by ``stop``, an idle timeout, or with ``until_closed`` once every
file is closed or its writer gone. What is followed, in which order, and ``from_start``:
``docs/python-api.md``, "Following a run being written".
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from trainrec.schema import layout, procid
from trainrec.schema.errors import FormatError
from trainrec.schema.events import Event, FileOpened, NamesInterned

from .discover import LogFile, scan_file
from .reader import LogReader
from .run import resolve_types
from .run_select import list_runs, select_run

log = logging.getLogger(__name__)

_BOOKKEEPING = (FileOpened, NamesInterned)

# Log bytes read from each followed file per poll (RunFollower.poll's default): the events of one
# poll are held at once (about 6-9x the bytes they were read from), and a follower that starts on a long
# run (a resumed launch's export reading the earlier launch's log) would otherwise take it all in one.
POLL_BYTES = 16 << 20


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a zombie, killed and not yet reaped by its
    parent, is not running). A pid alone may be another process's by now: see :func:`writer_running`."""
    return procid.pid_running(pid)


def writer_running(header: FileOpened) -> bool:
    """Whether the process that wrote a log runs, on this host: its pid, and where the header has them
    (a writer of this version), its start time and boot id; a later process holding the pid is not it."""
    return procid.process_running(header.pid, header.proc_start, header.boot_id)


def writer_gone(header: FileOpened | None) -> bool:
    """Whether the process that wrote a log (its FileOpened's host, pid and start) is known to be gone:
    only knowable on its own host; False where it cannot be told."""
    return (header is not None and bool(header.pid) and header.host == socket.gethostname()
            and not writer_running(header))


class RunFollower:
    """Incremental reader of a whole run; see the module docstring."""

    def __init__(self, path: str, *, run_id: str | None = None, from_start: bool = True,
                 skip_files: Iterable[str] = ()) -> None:
        """``skip_files``: log files never read (a live export resuming after one that projected them
        whole)."""
        self.path = os.path.abspath(path)
        self.run_id = run_id  # a prefix until the launch is found, then the exact id
        self._resolved = False
        self._from_start = from_start
        self._first = True
        self._mode: str | None = None  # "output", "rankdir", "file"
        self._readers: dict[str, LogReader] = {}
        self._ranks: dict[str, int] = {}
        self._skip: set[str] = set()  # files whose initial content is skipped (from_start=False)
        self._dirs: set[str] = set()  # rank directories followed
        self._seen: set[str] = {os.path.abspath(f) for f in skip_files}  # files looked at (followed or not)
        self._waiting: set[str] = set()  # files whose header could not be read yet
        self._dir_mtimes: dict[str, int] = {}
        self._dir_listed: dict[str, float] = {}  # when each directory was last listed in full
        self._next_log: dict[str, int] = {}  # the index the next log file of each directory will have
        self.file_errors: dict[str, FormatError] = {}
        self._frozen = False
        self._chosen: set[str] = set()  # the chosen launch's files at the first look, and its ranks
        self._chosen_ranks: set[int] = set()

    # ------------------------------------------------------------------ state
    @property
    def readers(self) -> dict[str, LogReader]:
        return dict(self._readers)

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self._ranks.values()))

    @property
    def writers_gone(self) -> bool:
        """Every rank's latest file is closed cleanly or its writer is known to be gone (a crash), and
        at least one is not closed: nothing more will come unless another launch resumes the run."""
        if not self._readers:
            return False
        latest = self._latest_readers()
        return (all(r.closed_cleanly or writer_gone(r.header) for r in latest)
                and not all(r.closed_cleanly for r in latest))

    def _latest_readers(self) -> list[LogReader]:
        """Each rank's latest file's reader (by its header's start time; an earlier one that a crash
        left unclosed never will be: a resumed launch wrote after it)."""
        latest: dict[int, tuple] = {}
        for path, r in self._readers.items():
            key = (r.header.start_time if r.header is not None else float("inf"), path)
            rank = self._ranks[path]
            if rank not in latest or key > latest[rank][0]:
                latest[rank] = (key, r)
        return [r for _, r in latest.values()]

    @property
    def unfollowable(self) -> FormatError | None:
        """Why nothing can be followed, when every log file found so far is one that cannot be read
        (not a log, an unsupported version, a directory, no permission) and none is still being
        created: the first such error. None while some file is followed or may still become one, or
        while no file has been found yet (a run directory whose logs may appear later)."""
        if self._readers or self._waiting or not self.file_errors:
            return None
        return next(iter(self.file_errors.values()))

    @property
    def closed(self) -> bool:
        """Every rank of the launch has been seen and each rank's latest file is closed cleanly (an
        earlier one that a crash left unclosed never will be: a resumed launch wrote after it)."""
        if not self._readers:
            return False
        world = max((r.header.world_size for r in self._readers.values() if r.header is not None), default=1)
        if len(self.ranks) < world and self._mode == "output":
            return False
        return all(r.closed_cleanly for r in self._latest_readers())

    # ------------------------------------------------------------------ polling
    def poll(self, max_bytes: int | None = None) -> list[Event]:
        """Events completed since the last call, after looking for new directories and files, from about
        ``max_bytes`` (default :data:`POLL_BYTES`) more bytes of each file at most, so that a backlog,
        such as a resumed run's earlier log, is taken in steps of bounded memory. An empty list means
        every followed file was read to its end."""
        max_bytes = max_bytes or POLL_BYTES
        self._discover()
        out: list[Event] = []
        behind: set[str] = set()  # directories with a file not read to its end in this poll
        for path, reader in list(self._readers.items()):
            d = os.path.dirname(path)
            if d in behind:
                continue  # a rank's later file (a resume's) only after its earlier ones, as written
            try:
                events = self._poll_file(path, reader, max_bytes)
            except FormatError as exc:
                log.warning("trainrec: not following %s", exc)
                self.file_errors[path] = exc
                del self._readers[path]
                continue
            if not reader.at_eof:
                behind.add(d)
            out.extend(events)
        self._first = False
        return out

    def _poll_file(self, path: str, reader: LogReader, max_bytes: int | None) -> list[Event]:
        skip = path in self._skip  # the content there at the first look: read to its end, less the bookkeeping
        kept: list[Event] = []
        while True:
            events = reader.poll(max_bytes)
            kept += [ev for ev in events if isinstance(ev, _BOOKKEEPING)] if skip else events
            if reader.at_eof:
                self._skip.discard(path)
                return kept
            if kept and not skip:
                return kept
            # nothing complete in this much (a frame longer than max_bytes): read on

    def stop_discovering(self, keep: Callable[[FileOpened | None], bool] | None = None) -> None:
        """Follow only the files followed so far, and of those only the ones whose header ``keep``
        accepts: no new directories or files from now on (a live export whose training process is gone
        must not take up the next launch's log)."""
        self._frozen = True
        if keep is not None:
            for path, reader in list(self._readers.items()):
                if not keep(reader.header):
                    del self._readers[path]

    def _discover(self) -> None:
        if self._frozen:
            return
        if self._mode is None:
            if os.path.isfile(self.path):
                self._mode = "file"
            elif os.path.isdir(self.path):
                is_rank_dir = layout.list_logs(self.path) or layout.parse_rank_dir(os.path.basename(self.path))
                self._mode = "rankdir" if is_rank_dir else "output"
            else:
                return
        if self._mode == "file":
            self._add(self.path, None)
            return
        if self._mode == "rankdir":
            self._dirs.add(self.path)
            self._scan_dir(self.path)
            return
        if not self._resolved and not self._resolve():
            return
        try:
            entries = sorted(e.path for e in os.scandir(self.path) if e.is_dir())
        except OSError as exc:
            log.warning("trainrec: cannot list %s: %s", self.path, exc)
            return
        for d in entries:
            self._scan_dir(d)

    def _resolve(self) -> bool:
        runs = list_runs(self.path)
        if not runs:
            return False
        if self.run_id is not None and not any(r.run_id.startswith(self.run_id) for r in runs):
            return False  # the run asked for has not started yet
        info = select_run(runs, self.path, self.run_id)
        headers = [f.header for f in info.all_files if f.header is not None]
        if not headers and any(f.error is None for f in info.all_files):
            # a file of it is still being created: chosen now, the launch would have no run id, and the
            # ranks that start later could not be told as its own
            return False
        # (the id its headers carry: a launch kept apart from another of the same id is RUNID#k)
        self.run_id = headers[0].run_id if headers else info.run_id
        self._chosen = {f.path for f in info.all_files}
        self._chosen_ranks = set(info.files)
        self._resolved = True
        for fs in info.files.values():
            for f in fs:
                self._dirs.add(f.dir)
        return True

    def _scan_dir(self, d: str) -> None:
        try:
            mtime = os.stat(d).st_mtime_ns
        except OSError:
            return
        # A directory's mtime has the kernel's clock granularity (milliseconds): a file created in the
        # same tick as the last listing leaves it unchanged. Listed again while it is that recent.
        if self._dir_mtimes.get(d) != mtime or time.time_ns() - mtime < _RACY_MTIME_NS:
            now = time.monotonic()
            last = self._dir_listed.get(d)
            if last is None or now - last >= _LIST_EVERY_S:
                self._dir_mtimes[d] = mtime
                self._dir_listed[d] = now
                logs = layout.list_logs(d)  # in index order
                for p in logs:
                    if p not in self._seen:
                        self._seen.add(p)
                        self._waiting.add(p)
                if logs:
                    self._next_log[d] = (layout.log_index(os.path.basename(logs[-1])) or 0) + 1
            else:
                # A live export writes its CSV files into this directory, which changes its mtime at
                # every step, and listing a directory of many files at every poll is slow (figures: commit
                # 81ae7c3). Between listings, the next log file (a resume's) is looked for by its name.
                nxt = os.path.join(d, layout.log_file_name(self._next_log.get(d, 0)))
                if nxt not in self._seen and os.path.exists(nxt):
                    self._next_log[d] = self._next_log.get(d, 0) + 1
                    self._seen.add(nxt)
                    self._waiting.add(nxt)
        for p in sorted(w for w in self._waiting if os.path.dirname(w) == d):
            self._consider(p)

    def _consider(self, path: str) -> None:
        lf = scan_file(path)
        if lf.error is not None:
            self._waiting.discard(path)
            self.file_errors[path] = lf.error
            log.warning("trainrec: not following %s", lf.error)
            return
        if lf.header is None:
            return  # still being created: look again next poll
        d = os.path.dirname(path)
        if self._mode == "output":
            why_not = self._not_ours(lf)
            if why_not is not None:
                if lf.empty and not lf.closed and d in self._dirs and not writer_gone(lf.header):
                    # Only its preamble so far: a resumed launch writes its RunResumed after the header,
                    # so whether this file continues the run cannot be told yet. Looked at again next poll.
                    return
                self._waiting.discard(path)
                if why_not:
                    log.warning("trainrec: not following %s: %s", path, why_not)
                return
            self._dirs.add(d)
        self._waiting.discard(path)
        self._add(path, lf.rank)

    def _not_ours(self, lf: LogFile) -> str | None:
        """None where a file found in an output directory belongs to the launch followed; else why not
        (empty where it is simply another run's)."""
        ours = bool(self.run_id) and lf.header.run_id == self.run_id
        resumed = lf.resume_step is not None and lf.dir in self._dirs
        known_dir = not self.run_id and lf.dir in self._dirs
        if not (ours or resumed or known_dir):
            return ""
        if (ours and not resumed and lf.path not in self._chosen
                and (lf.rank in self._chosen_ranks or lf.rank in self._ranks.values())):
            return f"another launch writes run id {self.run_id} at rank {lf.rank} (trainrec check)"
        return None

    def _add(self, path: str, rank: int | None) -> None:
        if path in self._readers or path in self.file_errors:
            return
        self._readers[path] = LogReader(path)
        self._ranks[path] = rank if rank is not None else 0
        if self._first and not self._from_start:
            self._skip.add(path)


# how long after its last change a directory is listed on every poll (see RunFollower._scan_dir)
_RACY_MTIME_NS = 2_000_000_000
_LIST_EVERY_S = 5.0  # a changing directory is listed in full at most this often (see _scan_dir)

def follow(
    run_path: str,
    poll_interval: float = 0.5,
    stop: threading.Event | Callable[[], bool] | None = None,
    from_start: bool = True,
    *,
    idle_timeout: float | None = None,
    until_closed: bool = False,
    run_id: str | None = None,
    types: Iterable[str | type[Event]] | None = None,
) -> Iterator[Event]:
    """Yield events of a run as they are written (see the module docstring).

    Ends when ``stop`` is set (a ``threading.Event``) or returns true (a callable), when no new event
    arrived for ``idle_timeout`` seconds, or, with ``until_closed``, once every rank's files are
    closed cleanly or left unclosed by a writer that is gone (a crash; only knowable on the writer's
    host: elsewhere pass ``idle_timeout``). Without any of these it runs until the consumer stops
    iterating.
    """
    if poll_interval <= 0:
        raise ValueError("poll_interval must be positive")
    wanted = resolve_types(types) if types is not None else None
    follower = RunFollower(run_path, run_id=run_id, from_start=from_start)

    def stopped() -> bool:
        if stop is None:
            return False
        if isinstance(stop, threading.Event):
            return stop.is_set()
        return bool(stop())

    last_new = time.monotonic()
    while not stopped():
        events = follower.poll()
        if events:
            last_new = time.monotonic()
            for ev in events:
                if wanted is None or type(ev) in wanted:
                    yield ev
            continue
        if until_closed and follower.closed:
            return
        if until_closed and follower.writers_gone:
            log.warning("trainrec: the process writing %s is gone and left a log not closed (a crash): "
                        "following ends", run_path)
            return
        if idle_timeout is not None and time.monotonic() - last_new >= idle_timeout:
            return
        if isinstance(stop, threading.Event):
            stop.wait(poll_interval)
        else:
            time.sleep(poll_interval)
