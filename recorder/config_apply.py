"""Config application for a ``RecordingSession``: the dynamic watcher's check of a new config (targets
chosen ahead), and making a config the active one (targets, statistics engine, alerts, schedule,
ConfigApplied or ConfigRejected)."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from trainrec.schema.errors import ConfigError
from trainrec.schema.events import ConfigApplied, ConfigRejected

from .failures import warn_once, warn_unrecorded
from .stats import StatsEngine

if TYPE_CHECKING:
    from .config import MonitorConfig
    from .session import RecordingSession

# (the monitor's logger: its warnings were given there before this part moved out)
log = logging.getLogger("trainrec.recorder.monitor")


def check_config(mon: RecordingSession, config: MonitorConfig) -> int:
    """The dynamic watcher's check before it decides a change: targets chosen for ``config``
    (raises ConfigError, e.g. a target that matches no module), kept for :func:`apply_config`;
    returns the first step it would collect, applied after this one."""
    mon.checked = None
    if mon.monitored.chunks and config is not mon.config:
        mon.checked = (config, mon.monitored.select(config))
    return config.first_collected(mon.cycle.step)


def apply_config(mon: RecordingSession, config: MonitorConfig, step: int, content_hash: str, reason: str = "dynamic") -> None:
    """Make ``config`` the active one from step ``step + 1`` (dynamic glue; static calls it once).

    Collection honours ``start_step`` (absolute, as the reference), ``step_interval`` and
    ``collect_times`` counted from here.
    """
    old = mon.config
    if mon.monitored.chunks and (config is not old):
        checked, mon.checked = mon.checked, None
        try:
            # may raise ConfigError: nothing changed yet
            targets, params = checked[1] if checked and checked[0] is config else mon.monitored.select(config)
        except ConfigError as exc:
            log.warning("trainrec: config not applied at step %d: %s", step, exc)
            mon.emit(ConfigRejected(rank=mon.rank, step=step, wall=time.time(), content_hash=content_hash,
                                     path=os.fspath(mon.config_path) if mon.config_path else "",
                                     reason=str(exc), keys=(exc.key,) if exc.key else ()))
            return
        mon.monitored.retarget(targets, params)
    mon.config = config
    warn_unrecorded(config, mon.world_size)
    changed = [k for k in ("format", "ndigits", "step_count_per_record") if getattr(config, k) != getattr(old, k)]
    if changed and reason != "static":
        keeps = ("it writes no log (format 'api')" if mon.output.writer is None else
                 "its log keeps everything, and `trainrec export` makes csv or tensorboard files from it")
        warn_once(f"output-{'-'.join(changed)}", f"trainrec: {', '.join(changed)} changed in the config, but "
                   f"this run's output was set up at its start: {keeps}; the change applies at the next launch")
    if config.ops != old.ops or config.eps != old.eps:
        mon.context.engine = StatsEngine(config.ops, config.eps)
    if config.alert != old.alert:
        mon.output.make_alerts(config, mon.pp_stage, mon.group_mates)
    mon.cycle.schedule_from(step)
    if config.print_struct and mon.monitored.chunks and mon.struct is None and reason != "static":
        mon.attach_struct_hooks()  # switched on with print_struct: the next step writes it and ends the run
    mon.emit(ConfigApplied(rank=mon.rank, step=step, wall=time.time(),
                            path=os.fspath(mon.config_path) if mon.config_path else "",
                            content_hash=content_hash, config=dict(config.raw),
                            start_step=config.first_collected(step + 1), reason=reason))
