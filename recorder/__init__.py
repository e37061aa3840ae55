"""trainrec.recorder: in-training code (the only subpackage that imports torch).

- :class:`TrainerMon`: mindstudio-probe 1.2.1's monitor API, recording into the trainrec log.
- :class:`Recorder` / :func:`record`: the native API.
- :func:`parse_config` / :func:`load_config` / :class:`MonitorConfig`: the config, validated up front.
- :class:`LogWriter`: the per-rank log writer thread.
"""

from __future__ import annotations

from .config import MonitorConfig, load_config, parse_config
from .monitor import TrainerMon
from .native import DEFAULT_CONFIG, Recorder, record
from .stats import StatsEngine
from .writer import LogWriter, install_sigterm_handler

__all__ = [
    "DEFAULT_CONFIG",
    "LogWriter",
    "MonitorConfig",
    "Recorder",
    "StatsEngine",
    "TrainerMon",
    "install_sigterm_handler",
    "load_config",
    "parse_config",
    "record",
]
