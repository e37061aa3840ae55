"""The recorder's output: the log writer, the live export, the anomaly detector, the dynamic config
watcher, the flight probes and the spill thread, owned by one object and shut down in one place.

The output holds no reference to the monitor that uses it, so a monitor dropped without ``close()``
(with its model) still has its log closed by the finalizer (:meth:`Output.closed_with`).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import weakref
from collections.abc import Callable

from trainrec.schema import layout
from trainrec.schema.errors import WriterError

from . import runinfo
from .config import MonitorConfig
from .writer import LogWriter
from .writer_exit import install_sigterm_handler

log = logging.getLogger(__name__)
_warned: set[str] = set()


class Output:
    """One rank's output: opened (:meth:`open`), emptied again (:meth:`discard_if_empty`), closed once.

    ``output_dir_given``: the directory came from the caller (else from the environment), for the
    error that says where the log could not be written; ``live_export``: csv/tensorboard formats start
    the live projection process.
    """

    def __init__(self, rank: int, output_dir: str, output_dir_given: bool, live_export: bool) -> None:
        self.rank = rank
        self.output_dir = output_dir
        self.output_dir_given = output_dir_given
        self.live_export = live_export
        self.writer: LogWriter | None = None
        self.live: runinfo.LiveExport | None = None
        self.alerts = None  # alerts.AlertEngine, run on the writer's thread
        self.watcher = None  # dynamic.DynamicConfigWatcher
        self.probes = None  # flight.FlightProbes: they write into the log
        self.rank_dir: str | None = None
        self.resumed_from: tuple = ()  # the log files of the run resumed (append_output)
        self.made_rank_dir = False  # the rank directory is this output's own (not append_output's)
        self.emitted = False  # an event went to the log (its directory is kept whatever happens)
        self.writer_failed = False  # the log writer failed: said once
        self.discarded = False  # a config error removed the empty output (discard_if_empty)
        self.spill_stop = threading.Event()
        self.step_open = threading.Event()  # a collected step is open: the spill thread looks at it
        self._spilling = False
        self._closed = False
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ opening
    def open(self, cfg: MonitorConfig, run_id: str, world_size: int, pp_stage: int, group_mates) -> str:
        """Make the rank directory and the log (a WriterError saying where, on failure), the live export
        and the detector. Returns the run id the log carries (a resumed run's own, under append_output)."""
        if cfg.append_output:
            self.rank_dir = runinfo.find_append_dir(self.output_dir, self.rank, cfg.append_output)
            self.resumed_from = tuple(os.path.basename(p) for p in layout.list_logs(self.rank_dir))
            run_id = runinfo.previous_run_id(self.rank_dir) or run_id
        else:
            self.rank_dir = runinfo.new_rank_dir(self.output_dir, self.rank)
        made = not os.path.isdir(self.rank_dir)
        try:
            layout.make_dirs(self.rank_dir)
            self.writer = LogWriter(self.rank_dir, rank=self.rank, world_size=world_size, run_id=run_id,
                                    pp_stage=pp_stage, group_mates=group_mates)
        except (OSError, WriterError) as exc:
            if made:  # what this failed start made goes (an empty log file, the rank directory)
                shutil.rmtree(self.rank_dir, ignore_errors=True)
            source = ("output_dir" if self.output_dir_given else "$MONITOR_OUTPUT_DIR"
                      if os.environ.get("MONITOR_OUTPUT_DIR") else "the default; $MONITOR_OUTPUT_DIR chooses another")
            raise WriterError(f"trainrec: cannot write the monitor's log under {self.output_dir!r} ({source}): "
                              f"{exc}; give a writable directory") from exc
        self.made_rank_dir = not cfg.append_output
        self.discarded = False
        install_sigterm_handler()  # preemption (SLURM, elastic) closes the log; False off the main thread
        if cfg.format in ("csv", "tensorboard") and self.live_export:
            self.live = runinfo.LiveExport(cfg.format, self.rank_dir, cfg.ndigits, cfg.step_count_per_record)
        self.make_alerts(cfg, pp_stage, group_mates)
        return run_id

    def make_alerts(self, cfg: MonitorConfig, pp_stage: int, group_mates) -> None:
        """The anomaly detector of ``cfg.alert`` (none without a log: format api detects nothing)."""
        if self.alerts is not None:
            self._quietly("anomaly engine", self.alerts.close)
            self.alerts = None
        if cfg.alert is not None and self.writer is None:
            log.warning("trainrec: alert is configured with format \"api\", which writes no log: anomalies are "
                        "detected on the writer thread as the log is written, so none are detected here. Use "
                        "another format (the log is always written), or trainrec anomalies on a recorded run.")
        if cfg.alert is None or self.writer is None:
            return
        try:
            from .alerts import AlertEngine
        except ImportError:
            _warn_once("alerts", "trainrec: alert is configured but trainrec.recorder.alerts is not available; "
                       "anomalies are not detected while recording")
            return
        dump_dir = os.path.join(self.output_dir, "anomaly_detected") if cfg.alert.get("dump") else None
        self.alerts = AlertEngine(cfg.alert, rank=self.rank, pp_stage=pp_stage, group_mates=group_mates,
                                  dump_dir=dump_dir, resume=bool(cfg.append_output))

    def start_watcher(self, path, validate: Callable, emit: Callable, check: Callable) -> bool:
        """Start the dynamic config watcher of the file ``path``; False (said why) where there is none."""
        try:
            from .dynamic import DynamicConfigWatcher
        except ImportError:
            _warn_once("dynamic", "trainrec: DYNAMIC_MONITOR is set but trainrec.recorder.dynamic is not available; "
                       "dynamic mode is off: the config applies as it is, from the start")
            return False
        if path is None:
            log.warning("trainrec: DYNAMIC_MONITOR needs a config file path (this config is a dict); dynamic mode "
                        "is off: the config applies as it is, from the start")
            return False
        self.watcher = DynamicConfigWatcher(os.fspath(path), validate=validate, emit=emit, rank=self.rank,
                                            writes_back=self.rank == 0, group=None, check=check)
        self.watcher.start()
        return True

    def start_spilling(self, loop: Callable) -> bool:
        """Start the spill thread, ``loop(spill_stop, step_open)``, once; whether it was started now."""
        if self._spilling:
            return False
        self._spilling = True
        threading.Thread(target=loop, args=(self.spill_stop, self.step_open), daemon=True,
                         name=f"trainrec-spill-rank{self.rank}").start()
        return True

    def closed_with(self, owner) -> None:
        """Close this output when ``owner`` is garbage-collected without :meth:`close` (not at exit: the
        owner's own exit handler closes it in full there)."""
        self._finalizer = weakref.finalize(owner, self._dropped)
        self._finalizer.atexit = False

    # ------------------------------------------------------------------ use
    def emit(self, event) -> bool:
        """Hand an event to the writer; False where the writer failed just now (said once, never raised)."""
        w = self.writer
        if w is not None and not w.closed:
            self.emitted = True
            try:
                w.write(event)
            except WriterError as exc:
                self.writer_failed = True
                log.debug("trainrec: the log writer failed (%s); monitoring records nothing more", exc)  # it said so
                return False
        return True

    def stop_spilling(self) -> None:
        self.spill_stop.set()
        self.step_open.set()  # wakes the spill thread, which sees the stop

    # ------------------------------------------------------------------ shutdown
    def close(self, reason: str = "close", before_log_closes: Callable | None = None,
              writer_timeout: float | None = None, live_wait_s: float | None = 30.0) -> None:
        """Stop the spill thread, the probes and the watcher, run ``before_log_closes`` (the last records),
        close the log (``reason`` in its FileClosed), then the detector, and wait for the live export
        (``live_wait_s`` None: reaped on a thread of its own). Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        self.stop_spilling()
        if self.probes is not None:
            self._quietly("flight probes", self.probes.close, reason)
        if self.watcher is not None:
            self._quietly("config watcher", self.watcher.close)
        if before_log_closes is not None:
            self._quietly("last records", before_log_closes)
        self._close_log(reason, writer_timeout)
        if self.alerts is not None:
            self._quietly("anomaly engine", self.alerts.close)
        self._end_live(live_wait_s)

    def discard_if_empty(self) -> None:
        """Before anything was recorded (a config error out of ``monitor_gnorm_with_ad``, or a log opened
        again under a shared run id): the rank directory this output made goes, with its empty log and
        what the live export made of it, so that a fixed relaunch leaves no empty run beside its own. A
        resumed run's directory (append_output) and anything else found in it stay."""
        w = self.writer
        if w is None or not self.made_rank_dir or self.emitted:
            return
        self._close_log("close", None)
        self._end_live(10.0)
        if self.alerts is not None:  # an empty anomaly.json (alert.dump) goes too
            self._quietly("anomaly engine", self.alerts.discard)
            self.alerts = None
        rank_dir, self.rank_dir = self.rank_dir, None
        try:
            names = os.listdir(rank_dir)
        except OSError:
            names = []
        for name in names:  # the log, and what the live export made of it (a TensorBoard file's header)
            if name in ("live_export.out", "live_export.done", os.path.basename(w.path)) or \
                    name.startswith("events.out.tfevents."):
                try:
                    os.remove(os.path.join(rank_dir, name))
                except OSError:
                    pass
        try:
            os.rmdir(rank_dir)
        except OSError:
            pass  # something else is in it (or it is gone): left as it is
        self.writer = self.live = None
        self.discarded = True

    def _close_log(self, reason: str, timeout: float | None) -> None:
        w = self.writer
        if w is None:
            return
        try:
            w.close(reason, timeout)
        except Exception as exc:  # noqa: BLE001
            # (a writer failure already said once, when it happened: not again here)
            said = self.writer_failed or w.error is not None  # (the writer logs its failure)
            (log.debug if said else log.warning)("trainrec: closing the log failed: %r", exc)

    def _end_live(self, wait_s: float | None) -> None:
        live = self.live
        if live is None:
            return
        if wait_s is None:  # it exits after reading FileClosed: reaped off this thread
            threading.Thread(target=live.wait, daemon=True, name="trainrec-live-export-reaper").start()
        elif self.writer is not None and self.writer.error is not None:
            live.stop()  # the log never got its FileClosed: nothing to wait for
        else:
            live.wait(wait_s)

    def _dropped(self) -> None:
        """The owner was garbage-collected without close(): runs wherever the collector runs, so nothing
        here waits for long."""
        where = self.writer.path if self.writer is not None else "format api"
        log.info("trainrec: a TrainerMon was dropped without close() (%s): its log is closed now; a step begun "
                 "after the last optimizer step, if any, is not in it (close() writes it)", where)
        self.close(writer_timeout=10.0, live_wait_s=None)

    @staticmethod
    def _quietly(what: str, close: Callable, *args) -> None:
        try:
            close(*args)
        except Exception as exc:  # noqa: BLE001 - shutting down never raises into training
            log.warning("trainrec: closing the %s failed: %r", what, exc)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)
