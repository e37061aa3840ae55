"""The one progress bar of the trainrec commands: a line on stderr, redrawn at most ten times a second,
only when stderr is a terminal (quiet in pipes, logs and tests).

``label [#########                     ]  30%   12.0/40.0 MB 1/4 parts    2.1 s`` (parts: where a
command splits its work).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Progress:
    """A one-line progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int, tasks: int, label: str, enabled: bool | None = None, delay: float = 0.0) -> None:
        self.total = max(total, 1)
        self.tasks = tasks
        self.label = label
        self.done = 0
        self.tasks_done = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.monotonic()
        self.delay = delay  # draw nothing before this many seconds (a command that ends sooner stays quiet)
        self._drawn = False
        self._last = 0.0
        self._lock = threading.Lock()

    def advance(self, nbytes: int = 0, task_done: bool = False) -> None:
        with self._lock:
            self.done += nbytes
            self.tasks_done += int(task_done)
            now = time.monotonic()
            if self.enabled and (task_done or now - self._last >= 0.1) and now - self.t0 >= self.delay:
                self._draw(now)

    def _draw(self, now: float) -> None:
        self._drawn = True
        self._last = now
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * 30)
        parts = f"{self.tasks_done}/{self.tasks} parts " if self.tasks else ""
        sys.stderr.write(
            f"\r{self.label} [{bar:<30}] {frac:4.0%} {self.done / 1e6:7.1f}/{self.total / 1e6:.1f} MB "
            f"{parts}{now - self.t0:6.1f} s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        """The bar's final state (where it was drawn, or would be by now), and the end of its line."""
        with self._lock:
            now = time.monotonic()
            if self.enabled and (self._drawn or now - self.t0 >= self.delay):
                self._draw(now)
            if self._drawn:
                sys.stderr.write("\n")
                sys.stderr.flush()


DELAY = 2.0  # seconds before a command's bar appears


@contextmanager
def reading(run, label: str) -> Iterator[Progress]:
    """A :class:`Progress` of the bytes ``run`` reads (its ``on_bytes``) while the block runs, drawn
    after :data:`DELAY` seconds: the bar of every command that reads a whole run."""
    total = sum(os.path.getsize(p) for r in run.ranks for p in run.files(r) if os.path.exists(p))
    bar = Progress(total, 0, label, delay=DELAY)
    previous = run.on_bytes
    if bar.enabled:
        run.on_bytes = bar.advance
    try:
        yield bar
    finally:
        run.on_bytes = previous
        bar.close()
