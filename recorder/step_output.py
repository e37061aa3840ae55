"""The records of collected steps: written to the log at a step's end, or while a long step goes on
(the spill thread: a process killed in the middle of a step leaves what it recorded), and the latest
step's statistics for the api metrics (``generate_*_metrics``)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from trainrec.schema.events import HooksFired
from trainrec.schema.naming import reference_tag

from .names import NameTable
from .output import Output
from .step_state import StepState
from .step_stats import StepStats, build_stats_events

log = logging.getLogger(__name__)

# A collected step open this long has what it recorded so far written while it goes on (StepOutput.spill),
# checked every SPILL_TICK_S seconds.
SPILL_AFTER_S = 1.0
SPILL_TICK_S = 0.5
SPILL_IDLE_S = 5.0  # how often the idle spill thread looks whether its monitor is gone


class StepOutput:
    """Writes a collected step's records (``output``'s log, ``name_table``'s ids, ``rank``'s records)."""

    def __init__(self, output: Output, name_table: NameTable, rank: int) -> None:
        self._output = output
        self._names = name_table
        self._rank = rank
        self.lock = threading.RLock()  # the step's records: written at its end or by the spill thread
        self._last: dict = {}  # the latest collected step's stats (metrics)

    def sync_names(self, step: int) -> None:
        """Announce new names to the log once."""
        with self.lock:
            self._names.sync(self._output.writer, step)

    def write(self, st: StepState) -> None:
        """The step's hook firings and statistics, to the log (and to the api metrics); less what
        :meth:`spill` has written of them while the step went on."""
        writer = self._output.writer
        with self.lock:
            st.written = True
            rest = st.stats
            if st.spilled_parts:
                rest = StepStats(st.stats.ops)
                rest.parts = st.stats.parts[st.spilled_parts:]
            if writer is None:  # format api: the metrics are made of the step's rows when asked for
                self._last = {"stats": st.stats, "step": st.step}
                return
            live = not writer.closed and writer.error is None
            # rows on the host: the records are made on the writer's thread (Python the training thread
            # does not wait for); rows on a device: their copy to the
            # host is started here. The api metrics: the step's rows, made when asked for unless made here
            hs = rest if live and all(_on_host(p.values) for p in rest.parts) else rest.finish(st.step)
            self._last = {"hs": hs} if hs is not rest and rest is st.stats else {"stats": st.stats, "step": st.step}
            if live:
                writer.write(self._records(st, hs, st.spilled_fires, len(st.micro)))

    def _records(self, st: StepState, stats, f0: int, f1: int):
        """A callable for the writer's thread making the HooksFired of firings ``f0:f1`` and the stats
        records of ``stats`` (a StepStats, or HostStats already made); caller holds the lock."""
        self._names.sync(self._output.writer, st.step)
        fids = self._names.file_ids  # replaced, never changed in place, when names are added
        wall = time.time()
        rank, step, alerts, names = self._rank, st.step, self._output.alerts, self._names.names
        # slices (copies) here: a numpy view of the live arrays would lock them against the training
        # thread's appends (BufferError in its hooks) while the spill thread writes
        cols = (st.mod_ids[f0:f1], st.dirs[f0:f1], st.call_ids[f0:f1], st.micro[f0:f1]) if f1 > f0 else None

        def build():  # a generator: the firings reach the log even where the statistics fail
            if cols is not None:
                mod = fids[np.frombuffer(cols[0], dtype=np.uint32)].astype("<u4")
                yield HooksFired(rank=rank, step=step, wall=wall, module_ids=mod.tobytes(),
                                 directions=cols[1].tobytes(), call_ids=cols[2].tobytes(),
                                 micro_steps=cols[3].tobytes())
            hs = stats.finish(step, to_host=False) if isinstance(stats, StepStats) else stats
            if hs.kinds:
                yield from deferred_stats(hs, rank, fids, wall, alerts, names)()

        return build

    def spill(self, st: StepState | None, step_t0: float, current: Callable[[], StepState | None]) -> None:
        """Runs on the spill thread (:func:`spill_loop`; ``current()``: the step open now): a collected
        step open for SPILL_AFTER_S or more has the rows and hook firings it has recorded so far
        written now, so that a process killed in
        the middle of a step (kill -9 of a rank hung in a collective, an OOM kill) leaves them in the
        log. Rows still on an accelerator wait for the step's end (reading them here would wait on the
        device). Nothing happens for steps shorter than SPILL_AFTER_S."""
        writer = self._output.writer
        if (st is None or writer is None or writer.closed or writer.error is not None
                or time.perf_counter() - step_t0 < SPILL_AFTER_S):
            return
        with self.lock:
            if st.written or current() is not st:
                return
            f1 = len(st.micro)  # appended last by StepState.fire: the other columns hold as many
            parts = st.stats.parts
            k0 = k1 = st.spilled_parts
            while k1 < len(parts) and _on_host(parts[k1].values):
                k1 += 1
            if k1 == k0 and f1 == st.spilled_fires:
                return
            batch = StepStats(st.stats.ops)
            batch.parts = parts[k0:k1]
            writer.write(self._records(st, batch, st.spilled_fires, f1))
            st.spilled_parts, st.spilled_fires = k1, f1

    def metrics(self, kind: str) -> dict:
        """``{tag: {op: 0-dim tensor}}`` of ``kind`` at the latest collected step."""
        if "stats" in self._last:
            self._last = {"hs": self._last["stats"].finish(self._last["step"], to_host=False)}
        last = self._last.get("hs")
        if last is None:
            return {}
        if last.event is not None:
            last.event.synchronize()  # the host copy made for the writer may still be in flight
        out: dict = {}
        vals = last.values
        for k, a, b in last.kinds:
            if k != kind:
                continue
            # the reference's dtypes: norm and mean float64, the NaN count int64, the rest float32 (min and
            # max are the tensor's own dtype there: float32 holds bfloat16 and float16 values exactly); a
            # tensor that was not there (a NaN row) is float32 NaN throughout, as the reference's
            block = vals[a:b]
            cols = [block[:, j].to(_API_DTYPES.get(op, torch.float32)) for j, op in enumerate(last.ops)]
            missing = torch.isnan(block).all(dim=1).tolist()
            for r in range(a, b):
                name = self._names.names[int(last.name_ids[r])]
                tag = reference_tag(kind, name, int(last.slots[r]), int(last.micro_steps[r]), self._rank,
                                    int(last.vpp_stages[r]))
                i = r - a
                out[tag] = ({op: block[i, j] for j, op in enumerate(last.ops)} if missing[i]
                            else {op: cols[j][i] for j, op in enumerate(last.ops)})
        return out


_warned: list = []
_API_DTYPES = {"norm": torch.float64, "mean": torch.float64, "nans": torch.int64}


def deferred_stats(hs, rank: int, file_ids: np.ndarray, wall: float, alerts, names: list[str]):
    """The callable run on the writer thread: host values -> TensorStatsRecorded (+ anomalies)."""

    def build() -> list:
        events = build_stats_events(hs, rank, file_ids, wall)
        if alerts is None:
            return events
        out = []
        arr = hs.values.numpy()
        for ev, (kind, a, b) in zip(events, hs.kinds, strict=True):
            out.append(ev)
            try:
                out.extend(alerts.observe(
                    step=hs.step, kind=kind, ops=list(hs.ops), names=[names[int(i)] for i in hs.name_ids[a:b]],
                    values=arr[a:b], micro_steps=hs.micro_steps[a:b], call_ids=hs.call_ids[a:b],
                    slots=hs.slots[a:b], vpp_stages=hs.vpp_stages[a:b],
                    placeholders=None if hs.placeholders is None else hs.placeholders[a:b],
                ))
            except Exception as exc:  # noqa: BLE001 - anomaly detection never stops recording
                if not _warned:
                    _warned.append(True)
                    log.warning("trainrec: anomaly detection failed: %r", exc)
        return out

    return build


def _on_host(values) -> bool:
    return isinstance(values, np.ndarray) or values.device.type == "cpu"


def spill_loop(ref, stop: threading.Event, step_open: threading.Event) -> None:
    """The spill thread of a monitor (``ref``: a weak reference to it, so that the thread keeps nothing
    alive): :meth:`StepOutput.spill` of its step every SPILL_TICK_S seconds while a collected step is open
    (``step_open``), asleep otherwise (steps the config skips wake nothing), until ``stop`` is set."""
    while not stop.is_set():
        if not step_open.wait(SPILL_IDLE_S):
            if ref() is None:
                return
            continue
        if stop.wait(SPILL_TICK_S):
            return
        mon = ref()
        if mon is None:
            return
        ctx = mon.context
        try:
            mon.step_output.spill(ctx.state, ctx.step_t0, functools.partial(getattr, ctx, "state"))
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            ctx.hook_failed("writing the step in progress", exc)
        del mon, ctx
