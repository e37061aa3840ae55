"""The monitors of this process still open: one exit handler closes them all (a registration per
monitor would stay for the process's life, one per monitor ever made), and a monitor being installed
is warned of another open one that records the same model or writes to the same directory."""

from __future__ import annotations

import logging
import os
import sys
import weakref

log = logging.getLogger(__name__)

_open: weakref.WeakSet = weakref.WeakSet()  # RecordingSession instances, until closed


def add(mon) -> None:
    _open.add(mon)


def remove(mon) -> None:
    _open.discard(mon)


def warn_if_monitored_already(mon) -> None:
    """Another open monitor hooks one of ``mon``'s modules (a notebook or sweep that made a new monitor on
    the same model without closing the last): both record every step, each at its own cost."""
    others = [m for m in list(_open) if m is not mon and not m.closed]
    mine = {id(c) for c in mon.monitored.chunks}
    for other in others:
        if any(id(c) in mine for c in other.monitored.chunks):
            log.warning("trainrec: this model is also monitored by another TrainerMon that is still open "
                        "(its log: %s): both record every step, each at its own cost; close() the other one "
                        "(or use `with TrainerMon(...)`/`with record(...)`)", other.log_path or "none, format api")
            return
    # two models of one process (a GAN's generator and discriminator) logged side by side: one run id,
    # one rank, two launches in one directory, of which replay shows one
    here = os.path.realpath(mon.output_dir)
    for other in others:
        if (mon.output.writer is not None and other.output.writer is not None and other.rank == mon.rank
                and os.path.realpath(other.output_dir) == here):
            log.warning("trainrec: another open monitor of this process writes to the same output directory "
                        "%s (its log: %s): replay shows one launch per directory, so one of the two logs would "
                        "be hidden; give each its own output_dir (or $MONITOR_OUTPUT_DIR)", here, other.log_path)
            return


def close_all_at_exit() -> None:
    """At exit: close every monitor still open (``RecordingSession.close``, with the reason in its FileClosed).
    Registered by the session module, after the writers' exit handler: it runs before that one."""
    # the FileClosed says how the process ended: after an uncaught exception (the interpreter keeps it
    # in sys.last_value for us), or without the monitor's close()
    exc = getattr(sys, "last_value", None)
    reason = f"exit after an uncaught {type(exc).__name__}" if exc is not None else "exit"
    for mon in list(_open):
        try:
            mon.close(reason)
        except Exception:  # noqa: BLE001
            pass
