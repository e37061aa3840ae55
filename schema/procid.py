"""Who a process is, beyond its pid: what a log's writer identity is made of, and whether it still runs.

A pid is reused once its process is gone, so liveness by pid alone can take an unrelated process for
a log's writer (a tail waiting forever, ``check`` saying "still being written"). A process is told by
``(host, boot id, pid, start time)``: the start time is the kernel's, in clock ticks since boot
(``/proc/PID/stat``, field 22), the same for every reader of the host. Where ``/proc`` is absent
(not Linux) the start time is 0, unknown, and liveness falls back to the pid.
"""

from __future__ import annotations

import functools
import os
import uuid


def start_ticks(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot; 0 when it cannot be told."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return int(rest[19])  # field 22 of the line; rest starts at field 3
    except (OSError, IndexError, ValueError):
        return 0


@functools.cache
def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``), or "" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def new_writer_id() -> str:
    """A random 128-bit writer nonce: two writers never share one, whatever else they share."""
    return uuid.uuid4().hex


def pid_running(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a zombie, dead and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (OverflowError, ValueError):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: it exists


def process_running(pid: int, ticks: int = 0, boot: str = "") -> bool:
    """Whether the process ``pid`` that started at ``ticks`` (0: unknown) in boot ``boot`` ("" unknown)
    still runs on this host: a pid now held by a process started later is not it, nor is any pid of
    an earlier boot."""
    if pid <= 0 or not pid_running(pid):
        return False
    if boot and boot_id() and boot != boot_id():
        return False
    if ticks:
        now = start_ticks(pid)
        if now and now != ticks:
            return False
    return True
