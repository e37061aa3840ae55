"""Names on disk: the output directory, rank directories and log files.

Contract (checked by the reader)::

    $MONITOR_OUTPUT_DIR/                          (default ./monitor_output)
      {Mon}{DD}_{HH}-{MM}-{SS}-rank{R}-{8 hex}/   one per rank per launch: the reference's names, in local time (its are UTC+8)
        trainrec-00000.trl                        log files, created exclusively, only appended;
        trainrec-00001.trl                        a resume adds the next index, so names sort in time order
      anomaly_detected/rank{R}/anomaly.json       reference-compatible anomaly dumps (alert.dump)
      module_struct.json                          print_struct

All ranks of one launch share a run id, stored in every file's FileOpened record.
"""

from __future__ import annotations

import errno
import os
import re
import time
import uuid

LOG_SUFFIX = ".trl"
LOG_PREFIX = "trainrec-"
LOG_NAME_RE = re.compile(r"^trainrec-(\d{5,})\.trl$")
# The reference's discovery regex (append_output, csv2tb): prefix is the time stamp.
RANK_DIR_RE = re.compile(r"([\w-]{0,20})-rank(\d{1,5})-")
TIME_FORMAT = "%b%d_%H-%M-%S"
EXPORT_MARKER = ".trainrec-export.json"  # in a directory `trainrec export` wrote: what, from where
DEFAULT_OUTPUT_DIR = "./monitor_output"
# The reference's permissions for what it writes (msprobe's file utilities): files rw-r-----, directories
# rwxr-x---; the process's umask can only take more away.
FILE_MODE = 0o640
DIR_MODE = 0o750


def private_opener(path: str, flags: int) -> int:
    """``open(..., opener=private_opener)``: a file created with :data:`FILE_MODE`."""
    return os.open(path, flags, FILE_MODE)


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` with :data:`DIR_MODE` for every directory it creates (makedirs'
    own mode reaches only the last one)."""
    if not path or os.path.isdir(path):
        return
    make_dirs(os.path.dirname(os.path.abspath(path)))
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):  # a file where a directory should be: what makedirs says
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None


def output_dir_from_env() -> str:
    return os.environ.get("MONITOR_OUTPUT_DIR") or DEFAULT_OUTPUT_DIR


def rank_dir_name(rank: int, when: float | None = None, suffix: str | None = None) -> str:
    """``Nov30_11-13-33-rank0-4700973a``: local time of the launch, rank, 8 hex digits."""
    stamp = time.strftime(TIME_FORMAT, time.localtime(time.time() if when is None else when))
    return f"{stamp}-rank{rank}-{suffix or uuid.uuid4().hex[:8]}"


def parse_rank_dir(name: str) -> tuple[str, int] | None:
    """``(time stamp, rank)`` of a rank directory name, or None when it is not one."""
    m = RANK_DIR_RE.match(name)
    if not m:
        return None
    return m.group(1), int(m.group(2))


def log_file_name(index: int) -> str:
    return f"{LOG_PREFIX}{index:05d}{LOG_SUFFIX}"


def log_index(name: str) -> int | None:
    m = LOG_NAME_RE.match(name)
    return int(m.group(1)) if m else None


def list_logs(rank_dir: str) -> list[str]:
    """Log files of a rank directory, in the order they were written."""
    try:
        names = os.listdir(rank_dir)
    except OSError:
        return []
    found = sorted((log_index(n), n) for n in names if log_index(n) is not None)
    return [os.path.join(rank_dir, n) for _, n in found]


def stamp_key(stamp: str) -> tuple[int, int, int, int, int]:
    """Sort key of a ``Nov30_11-13-33`` stamp (month, day, hour, minute, second); raises ValueError."""
    t = time.strptime(stamp, TIME_FORMAT)
    return (t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec)
