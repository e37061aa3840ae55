"""The stall watchdog: a thread that notices a training step running far longer than the steps before.

A few times a second it reads the monitor's progress (current step, when it began). When the step
has run longer than ``factor`` times the recent steps' median and at least ``min_seconds``, it
writes a :class:`StallDetected` event with :func:`stall_report`'s findings (every thread's stack, the
model's modules in the main thread's stack, the last hook fired, the collective in flight), and
again each time the elapsed time doubles. Nothing runs on the training thread. The step's clock
starts at the previous optimizer step's end, so an evaluation or checkpoint counts too:
``min_seconds`` keeps those quiet. See docs/postmortem.md."""

from __future__ import annotations

import faulthandler
import logging
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable

from trainrec.schema.events import StallDetected

log = logging.getLogger(__name__)

_STACKS_LIMIT = 64 << 10  # characters of the stack dump kept (the end is cut)
_DURATIONS = 32  # recent step durations the median is taken over


class StallWatchdog:
    """``progress()`` gives ``(step, perf_counter at its start)``, ``()`` before training begins (the model
    not given yet), or None once the monitor is gone;
    ``report(elapsed, median, threshold, count)`` builds and writes the event."""

    def __init__(self, *, rank: int, factor: float, min_seconds: float, progress: Callable[[], tuple | None],
                 report: Callable[[float, float, float, int], None]) -> None:
        self.factor = float(factor)
        self.min_seconds = float(min_seconds)
        self._progress = progress
        self._report = report
        self._poll = max(0.05, min(1.0, self.min_seconds / 4))
        self._stop = threading.Event()
        self.reports = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"trainrec-watchdog-rank{rank}")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        durations: deque = deque(maxlen=_DURATIONS)
        seen: tuple | None = None
        count = 0
        while not self._stop.wait(self._poll):
            try:
                now_progress = self._progress()
            except Exception:  # noqa: BLE001 - the monitor is closing
                return
            if now_progress is None:
                return
            if not now_progress:  # not training yet
                continue
            step, t0 = now_progress
            if seen is None or step != seen[0]:
                if seen is not None and step > seen[0] and t0 > seen[1]:
                    durations.append((t0 - seen[1]) / (step - seen[0]))
                seen = (step, t0)
                count = 0
            median = statistics.median(durations) if durations else 0.0
            threshold = max(self.factor * median, self.min_seconds)
            elapsed = time.perf_counter() - t0
            if elapsed > threshold * (2 ** count):
                count += 1
                self.reports += 1
                try:
                    self._report(elapsed, median, threshold, count)
                except Exception as exc:  # noqa: BLE001 - the watchdog never takes training down
                    log.warning("trainrec: the stall watchdog failed to report: %r", exc)


def all_stacks() -> str:
    """Every thread's Python stack as :func:`faulthandler.dump_traceback` writes it."""
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = f.read().decode("utf-8", errors="replace")
    return text if len(text) <= _STACKS_LIMIT else text[:_STACKS_LIMIT] + "\n...(cut)\n"


def modules_in_frames(frames, names: dict[int, str]) -> tuple:
    """The modules of ``names`` (``id(module) -> name``) whose ``forward`` runs in ``frames`` (innermost
    last), outermost first, each once."""
    out: list[str] = []
    for frame in frames:
        if frame.f_code.co_name != "forward":
            continue
        try:
            mod = frame.f_locals.get("self")
        except Exception:  # noqa: BLE001 - a frame that cannot show its locals
            continue
        name = names.get(id(mod)) if mod is not None else None
        if name is not None and (not out or out[-1] != name):
            out.append(name)
    return tuple(out)


def main_thread_frames() -> list:
    """The main thread's frames, outermost first."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def traceback_frames(exc: BaseException) -> list:
    """The frames of an exception's traceback, outermost first."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def stall_event(*, rank: int, step: int, elapsed: float, median: float, threshold: float, count: int,
                names: dict[int, str], hook: tuple | None, collective) -> StallDetected:
    """The StallDetected event of a stall seen now: ``hook`` is ``(module, direction, micro step, call id)``
    of the last hook fired, ``collective`` the :class:`~.collectives.CallInFlight` or None."""
    now = time.perf_counter()
    fields = {}
    if hook is not None:
        fields.update(hook_module=hook[0], hook_direction=hook[1], hook_micro_step=hook[2], hook_call_id=hook[3])
    if collective is not None:
        fields.update(collective_op=collective.op, collective_group_ranks=collective.group_ranks,
                      collective_seq=collective.seq, collective_elapsed=now - collective.t0)
    return StallDetected(rank=rank, step=step, wall=time.time(), elapsed=elapsed, median_step=median,
                         threshold=threshold, count=count, stacks=all_stacks(),
                         modules=modules_in_frames(main_thread_frames(), names), **fields)
