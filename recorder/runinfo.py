"""Who this process is in the run, and where its log goes.

- Rank, world size, pipeline stage and group mates: from ``torch.distributed`` when initialized
  (``process_group`` gives the stage, as in the reference), else ``RANK`` / ``WORLD_SIZE``.
- The run id shared by all ranks of a launch (:func:`shared_run_id`).
- The rank directory: ``$MONITOR_OUTPUT_DIR/{Mon}{DD}_{HH}-{MM}-{SS}-rank{R}-{8 hex}`` in local time,
  or with ``append_output: [start, end]`` this rank's existing directory whose time stamp lies in
  the range (inclusive; the latest of several); no match is a ConfigError naming the key.
- The live projection process for ``format: csv/tensorboard`` (owned by ``trainrec.tools.live_export``)."""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass

from trainrec.schema import codec, framing, layout
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import FileOpened

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    pp_stage: int
    group_mates: tuple
    distributed: bool


def _dist():
    try:
        import torch.distributed as dist
    except Exception:  # pragma: no cover - torch without distributed
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def rank_info(process_group=None) -> RankInfo:
    dist = _dist()
    if dist is not None:
        rank = dist.get_rank()
        world = dist.get_world_size()
        group = process_group if process_group is not None else dist.group.WORLD
        try:
            pp_stage = dist.get_group_rank(group, rank)
            mates = tuple(dist.get_process_group_ranks(group))
        except Exception:  # noqa: BLE001 - a group this rank is not part of
            pp_stage, mates = 0, (rank,)
        return RankInfo(rank, world, max(pp_stage, 0), mates, True)
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    return RankInfo(rank, world, 0, (rank,), False)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        log.warning("trainrec: ignoring non-integer %s=%r", name, os.environ.get(name))
        return default


RUN_ID_WAIT_S = 60.0
_monitors_made = itertools.count()


def shared_run_id(wait_s: float | None = None) -> str:
    """A run id all ranks of a launch agree on, without a collective call, so that a monitor made on
    some ranks only blocks nobody.

    ``TRAINREC_RUN_ID`` where set. Else, with torch.distributed initialized, rank 0 posts a new id in
    the process group's store and the other ranks read it there, waiting up to ``wait_s`` seconds (the
    n-th monitor of each process pairs with rank 0's n-th); where rank 0 posts none in time, a warning
    and an id of this rank's own. Else ``TORCHELASTIC_RUN_ID``, else new."""
    env = os.environ.get("TRAINREC_RUN_ID")
    if env:
        return env
    dist = _dist()
    if dist is not None:
        nth = next(_monitors_made)
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - a process group without a store
            store = None
        if store is not None:
            key = f"trainrec/run_id/{nth}"
            if dist.get_rank() == 0:
                rid = uuid.uuid4().hex
                store.set(key, rid)
                return rid
            wait = RUN_ID_WAIT_S if wait_s is None else wait_s
            try:
                store.wait([key], datetime.timedelta(seconds=wait))
                return store.get(key).decode()
            except Exception:  # noqa: BLE001 - timed out (the store says so in its own words)
                log.warning("trainrec: rank 0 has made no TrainerMon within %.0f s of this rank's (a monitor on "
                            "some ranks only?); this rank's log gets a run id of its own, so `trainrec` lists "
                            "it as a run of its own. Set TRAINREC_RUN_ID in every rank's environment to name "
                            "the run instead.", wait)
                return uuid.uuid4().hex
    v = os.environ.get("TORCHELASTIC_RUN_ID")
    return v if v and v.lower() != "none" else uuid.uuid4().hex


def run_id_shared_now() -> bool:
    """Whether :func:`shared_run_id` gives every rank the same id now: named in the environment, or
    agreed through torch.distributed's store. Otherwise each rank makes its own."""
    if os.environ.get("TRAINREC_RUN_ID") or _dist() is not None:
        return True
    v = os.environ.get("TORCHELASTIC_RUN_ID")
    return bool(v) and v.lower() != "none"


def previous_run_id(rank_dir: str) -> str | None:
    """The run id of the newest log file in ``rank_dir`` whose first record can be read: a launch that
    appends to the directory (``append_output``) continues that run under the same id, so that its
    file is grouped with the run's earlier ones even where it never got as far as its RunResumed
    record (a resume that failed at start-up)."""
    for path in reversed(layout.list_logs(rank_dir)):
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 16)
            head = framing.decode_file_header(data)
            if head is None:
                continue
            status, payload, _ = framing.read_frame(data, framing.FILE_HEADER_SIZE)
            if status is not framing.Frame.OK:
                continue
            ev = codec.decode(payload, head[0])
        except Exception:  # noqa: BLE001 - an unreadable or foreign file says nothing
            continue
        if isinstance(ev, FileOpened) and ev.run_id:
            return ev.run_id
    return None


def new_rank_dir(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, layout.rank_dir_name(rank))


def find_append_dir(output_dir: str, rank: int, time_range: tuple) -> str:
    """The existing rank directory of ``rank`` whose time stamp is within ``time_range`` (inclusive)."""
    start, end = time_range
    try:
        lo, hi = layout.stamp_key(start), layout.stamp_key(end)
    except ValueError as exc:
        raise ConfigError(f"bad time stamp: {exc}", "append_output") from None
    if lo > hi:
        raise ConfigError(f"the time range [{start}, {end}] is empty: its start is after its end", "append_output")
    found = []
    try:
        names = os.listdir(output_dir)
    except OSError:
        names = []
    for name in names:
        parsed = layout.parse_rank_dir(name)
        if parsed is None or parsed[1] != rank or not os.path.isdir(os.path.join(output_dir, name)):
            continue
        try:
            key = layout.stamp_key(parsed[0])
        except ValueError:
            continue
        if lo <= key <= hi:
            found.append((key, os.path.getmtime(os.path.join(output_dir, name)), name))
    if not found:
        raise ConfigError(
            f"no rank directory of rank {rank} with a time stamp in [{start}, {end}] under {output_dir!r}",
            "append_output",
        )
    found.sort()
    return os.path.join(output_dir, found[-1][2])


# The live projection is background work: at the lowest priority (niceness +19) the scheduler gives
# training's threads the cores when they compete (a 2-core machine: torch's two intra-op threads), and
# the export catches up when they idle. It only ever lags; it never drops anything (it follows the log).
# At +10 the export still competed with training (benchmarks/bench_recorder.py, config b).
LIVE_EXPORT_NICE = 19


class LiveExport:
    """The live CSV/TensorBoard projection process that follows this rank's log (exports teammate)."""

    _warned = False

    def __init__(self, fmt: str, rank_dir: str, ndigits: int, step_count_per_record: int) -> None:
        self.proc: subprocess.Popen | None = None
        self._out = None
        self._fmt = fmt
        self._rank_dir = rank_dir
        self._stopping = False  # stopped by the recorder (stop, or wait's timeout): its exit is no failure
        self._reported = False
        try:
            import importlib.util

            spec = importlib.util.find_spec("trainrec.tools.live_export")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            if not LiveExport._warned:
                LiveExport._warned = True
                log.warning("trainrec: format %r needs trainrec.tools.live_export, which is not installed; "
                            "only the log is written (export it later with `trainrec export`)", fmt)
            return
        cmd = [
            sys.executable, "-m", "trainrec.tools.live_export",
            "--format", "csv" if fmt == "csv" else "tensorboard",
            "--rank-dir", rank_dir, "--ndigits", str(ndigits),
            "--step-count-per-record", str(step_count_per_record), "--parent-pid", str(os.getpid()),
            "--nice", str(LIVE_EXPORT_NICE),
        ]
        try:
            self._out = open(os.path.join(rank_dir, "live_export.out"), "ab", opener=layout.private_opener)  # noqa: SIM115
            self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as exc:
            log.warning("trainrec: could not start the live %s export: %s", fmt, exc)
            self.proc = None

    def stop(self) -> None:
        """Stop the projection now (SIGTERM: it closes the files written so far whole): where the log
        will never get its FileClosed (the writer failed), waiting for it would only take the timeout."""
        if self.proc is not None and self.proc.poll() is None:
            self._stopping = True
            self.proc.terminate()
        self.wait(5.0)

    def check(self) -> bool:
        """Whether the projection is still running or ended well; where it died (an error of its own, a
        full or read-only disk, a kill), a warning says so, once: its files stop where it died, while
        the log goes on (``trainrec export`` writes them all from it)."""
        proc = self.proc
        if proc is None or self._reported or self._stopping:
            return True
        rc = proc.poll()
        if rc is None or rc == 0:
            return True
        self._reported = True
        how = f"was killed by signal {-rc}" if rc < 0 else f"failed (exit status {rc})"
        said = ""
        try:
            with open(os.path.join(self._rank_dir, "live_export.out"), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 2000))
                lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
            said = f": {lines[-1].strip()}" if lines else ""
        except OSError:
            pass
        cmd = "csv" if self._fmt == "csv" else "tb"
        log.warning("trainrec: the live %s export of %s (pid %d) %s%s; its files stop where it did, the log "
                    "goes on: `trainrec export %s %s` writes them all", self._fmt, self._rank_dir, proc.pid, how,
                    said, cmd, os.path.dirname(os.path.abspath(self._rank_dir)))
        return False

    def wait(self, timeout: float = 30.0) -> None:
        """Wait for the projection to finish (it exits after reading FileClosed)."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("trainrec: the live export (pid %d) did not exit within %.0f s; stopping it",
                            self.proc.pid, timeout)
                self._stopping = True
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            self.check()
            self.proc = None
        if self._out is not None:
            self._out.close()
            self._out = None
