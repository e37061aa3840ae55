"""What a monitor records for the post-mortem besides statistics: collective calls (``cc_distribution``,
:mod:`.collectives`), stalls (``stall_watchdog``, :mod:`.watchdog`) and the exception that ended the
recording (:class:`ExceptionRaised`, always).

:func:`probes_for` builds :class:`FlightProbes` from a monitor through a narrow context of callables
that hold the monitor weakly (a dropped monitor is still collected); the monitor closes them in its
``close()``, or its finalizer does, which removes the ``torch.distributed`` wrappers and stops the
watchdog thread.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from trainrec.schema.events import ExceptionRaised

from .collectives import CollectiveRecorder
from .watchdog import StallWatchdog, modules_in_frames, stall_event, traceback_frames

log = logging.getLogger(__name__)

_TRACEBACK_LIMIT = 16 << 10  # characters of a traceback kept (its end: the innermost frames)


@dataclass
class ProbeContext:
    """What the probes need of a monitor."""

    rank: int
    emit: Callable  # event -> None (to the monitor's log)
    step: Callable[[], int]  # the current step
    progress: Callable[[], tuple | None]  # (step, perf_counter at its start), () before training; None once gone
    collecting: Callable[[], bool]  # the current step is collected
    last_hook: Callable[[], tuple | None]  # (module, direction, micro step, call id) of the last firing
    module_names: Callable[[], dict]  # id(module) -> name, of the monitored model


class FlightProbes:
    def __init__(self, ctx: ProbeContext, cc_options: dict, watchdog_options: dict, ops: tuple, eps: float) -> None:
        self.ctx = ctx
        self.collectives: CollectiveRecorder | None = None
        self.watchdog: StallWatchdog | None = None
        self._closed = False
        if cc_options.get("enable"):
            self.collectives = CollectiveRecorder(cc_options, rank=ctx.rank, emit=ctx.emit, step=ctx.step,
                                                  collecting=ctx.collecting, ops=ops, eps=eps)
            self.collectives.install()
        if watchdog_options.get("enable"):
            self.watchdog = StallWatchdog(rank=ctx.rank, factor=watchdog_options["factor"],
                                          min_seconds=watchdog_options["min_seconds"], progress=ctx.progress,
                                          report=self._report_stall)
            self.watchdog.start()

    def _report_stall(self, elapsed: float, median: float, threshold: float, count: int) -> None:
        ctx = self.ctx
        cc = self.collectives
        ev = stall_event(rank=ctx.rank, step=ctx.step(), elapsed=elapsed, median=median, threshold=threshold,
                         count=count, names=ctx.module_names(), hook=ctx.last_hook(),
                         collective=cc.in_flight() if cc is not None else None)
        ctx.emit(ev)
        log.warning("trainrec: rank %d: step %d has run for %.1f s (threshold %.1f s)%s%s", ctx.rank, ev.step,
                    elapsed, threshold, f", in {ev.collective_op} #{ev.collective_seq}" if ev.collective_op else "",
                    f", in module {ev.modules[-1]}" if ev.modules else "")

    def close(self, reason: str = "close") -> None:
        """Stop the watchdog, remove the wrappers; where ``reason`` says an exception ended the recording
        (the monitor's close reasons), write it as :class:`ExceptionRaised` first."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.close()
        if self.collectives is not None:
            self.collectives.close()
        exc = None
        if reason.startswith("exit after an uncaught"):
            exc = getattr(sys, "last_value", None)
        elif reason.startswith("close after an exception"):
            exc = sys.exc_info()[1]
        if exc is not None:
            try:
                self.ctx.emit(exception_event(exc, self.ctx.rank, self.ctx.step(), self.ctx.module_names()))
            except Exception as err:  # noqa: BLE001 - closing goes on
                log.debug("trainrec: recording the exception failed: %r", err)


def exception_event(exc: BaseException, rank: int, step: int, names: dict) -> ExceptionRaised:
    """The ExceptionRaised event of ``exc`` (``names``: id(module) -> name of the monitored model's)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(text) > _TRACEBACK_LIMIT:
        text = "...(cut)\n" + text[-_TRACEBACK_LIMIT:]
    return ExceptionRaised(rank=rank, step=step, wall=time.time(), error=f"{type(exc).__name__}: {exc}"[:2000],
                           modules=modules_in_frames(traceback_frames(exc), names), traceback=text)


def probes_for(mon) -> FlightProbes:
    """The probes of a recording session, configured by its config at this point."""
    ref = weakref.ref(mon)
    names_cache: dict = {}

    def emit(event) -> None:
        m = ref()
        if m is not None:
            m.emit(event)

    def step() -> int:
        m = ref()
        return m.cycle.step if m is not None else -1

    def progress() -> tuple | None:
        m = ref()
        if m is None or m.closed:
            return None
        return (m.cycle.step, m.context.step_t0) if m.monitored.chunks else ()  # (no model yet: nothing to time)

    def collecting() -> bool:
        m = ref()
        return m is not None and m.context.state is not None

    def last_hook() -> tuple | None:
        m = ref()
        st = m.context.state if m is not None else None
        if st is None or not len(st.mod_ids):
            return None
        i = len(st.mod_ids) - 1
        mid = st.mod_ids[i]
        names = m.name_table.names
        name = names[mid] if mid < len(names) else f"<module {mid}>"
        return (name, st.dirs[i], st.micro[i], st.call_ids[i])

    def module_names() -> dict:
        m = ref()
        chunks = list(m.monitored.chunks) if m is not None else []
        key = tuple(map(id, chunks))
        if names_cache.get("key") != key:
            several = len(chunks) > 1
            names = {}
            for vpp, chunk in enumerate(chunks):
                for name, module in chunk.named_modules():
                    names[id(module)] = (f"{vpp}:" if several else "") + (name or "(model)")
            names_cache.update(key=key, names=names)
        return names_cache.get("names", {})

    cfg = mon.config
    ctx = ProbeContext(rank=mon.rank, emit=emit, step=step, progress=progress, collecting=collecting,
                       last_hook=last_hook, module_names=module_names)
    return FlightProbes(ctx, cfg.cc_distribution, cfg.stall_watchdog, tuple(cfg.ops), cfg.eps)
