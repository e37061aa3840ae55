"""The one progress bar of the trainrec commands: a line on stderr, redrawn at most ten times a second,
only when stderr is a terminal (quiet in pipes, logs and tests).

``label [#########                     ]  30%   12.0/40.0 MB 1/4 parts    2.1 s``
"""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """A one-line progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int, tasks: int, label: str, enabled: bool | None = None) -> None:
        self.total = max(total, 1)
        self.tasks = tasks
        self.label = label
        self.done = 0
        self.tasks_done = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()

    def advance(self, nbytes: int = 0, task_done: bool = False) -> None:
        with self._lock:
            self.done += nbytes
            self.tasks_done += int(task_done)
            now = time.monotonic()
            if self.enabled and (task_done or now - self._last >= 0.1):
                self._last = now
                frac = min(1.0, self.done / self.total)
                bar = "#" * int(frac * 30)
                sys.stderr.write(
                    f"\r{self.label} [{bar:<30}] {frac:4.0%} {self.done / 1e6:7.1f}/{self.total / 1e6:.1f} MB "
                    f"{self.tasks_done}/{self.tasks} parts {now - self.t0:6.1f} s"
                )
                sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
