"""What goes wrong inside a recording, said once: hook failures counted per place, one-time warnings,
the config's warnings of what it does not record."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trainrec.schema.events import HookFailed

from .config import MonitorConfig

log = logging.getLogger(__name__)

MAX_FAILURE_EVENTS = 10  # HookFailed records per place; more are counted, and their total written at close


class HookFailures:
    """Failures inside hooks, counted per place (``where``): the first of each place is a warning, the
    first MAX_FAILURE_EVENTS of each a HookFailed record (through ``emit``), and a place with more
    gets one total at close (:meth:`emit_totals`). Never raises into training."""

    def __init__(self, emit: Callable[[object], None]) -> None:
        self._emit = emit
        self.counts: dict[str, int] = {}

    def failed(self, where: str, exc: BaseException, rank: int, step: int) -> None:
        n = self.counts.get(where, 0) + 1
        self.counts[where] = n
        if n == 1:
            log.warning("trainrec: %s failed (training goes on; further failures there are counted): %s",
                        where, exc)
        if n <= MAX_FAILURE_EVENTS:
            try:
                self._emit(HookFailed(rank=rank, step=step, wall=time.time(), where=where,
                                      error=f"{type(exc).__name__}: {exc}", count=n))
            except Exception:  # noqa: BLE001 - a failing writer must not kill training either
                pass

    def emit_totals(self, rank: int, step: int) -> None:
        """One HookFailed with the total of each place that failed more than MAX_FAILURE_EVENTS times."""
        for where, n in self.counts.items():
            if n > MAX_FAILURE_EVENTS:
                self._emit(HookFailed(rank=rank, step=step, wall=time.time(), where=where, error="(total)", count=n))


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """``message`` as a warning, once per process for ``key``."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def warn_unrecorded(cfg: MonitorConfig, world_size: int, applied: bool = True) -> None:
    """Say once that the config records nothing (no statistics option on, or collect_times 0), and that
    module_ranks names no rank of the world (no rank records activations): the reference is silent
    about these. Not ``applied`` (dynamic mode, before the switch), the config records nothing yet."""
    options = ("xy_distribution", "wg_distribution", "param_distribution", "mv_distribution", "ur_distribution",
               "mg_direction")
    if applied and not cfg.print_struct and not any(getattr(cfg, k) for k in options):
        warn_once("no-options", f"trainrec: the config turns on none of {', '.join(options)}: no statistics are "
                  "recorded (the log holds the steps and the module structure only)")
    elif applied and cfg.collect_times == 0:
        warn_once("collect_times-0", "trainrec: collect_times is 0: no step is collected (as in msprobe 1.2.1)")
    if (cfg.xy_distribution and cfg.module_ranks
            and not any(0 <= r < world_size for r in cfg.module_ranks)):
        warn_once(f"module_ranks-{cfg.module_ranks}-{world_size}",
                  f"trainrec: module_ranks {list(cfg.module_ranks)} names no rank of this run's world size "
                  f"{world_size}: no rank records activations (xy_distribution)")
