"""trainrec.recorder: in-training code (the only subpackage that imports torch).

- :class:`TrainerMon`: mindstudio-probe 1.2.1's monitor API, recording into the trainrec log.
- :class:`Recorder` / :func:`record`: the native API.
- :func:`parse_config` / :func:`load_config` / :class:`MonitorConfig`: the config, validated up front.
- :class:`LogWriter`: the per-rank log writer thread.

torch is not a dependency of the trainrec package (replay and the CLI run without it): importing this
subpackage without torch raises a ModuleNotFoundError that says how to install it.
"""

from __future__ import annotations

try:  # torch is the user's own (an extra, not a dependency): say so, instead of a traceback deep in a module
    import torch as _torch  # noqa: F401
except ModuleNotFoundError as _exc:
    if _exc.name != "torch":  # torch is there, but something it needs is not: its own error says what
        raise
    raise ModuleNotFoundError(
        "trainrec.recorder records PyTorch training and needs torch, which is not installed here: "
        "`pip install torch` (the build for your platform, see pytorch.org) or `pip install 'trainrec[torch]'`. "
        "Replaying logs (trainrec.replay, trainrec.analyzers and the `trainrec` command) works without it.",
        name="torch",
    ) from None

from .config import MonitorConfig, load_config, parse_config
from .monitor import TrainerMon
from .native import DEFAULT_CONFIG, Recorder, record
from .stats import StatsEngine
from .writer import LogWriter
from .writer_exit import install_sigterm_handler

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
