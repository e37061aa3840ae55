"""What the hooks and the collection parts read of a running recording, in one small object the
monitor owns and updates: the collected step's state, the monitored parameters, the statistics engine,
the active config."""

from __future__ import annotations

import time
from collections.abc import Callable


class RecordingContext:
    """The live values a recording's hooks and collection parts share.

    ``state``: the collected step's :class:`~trainrec.recorder.step_state.StepState` (None on a step that is not
    collected); ``params``: the monitored parameters (:class:`~trainrec.recorder.targets.ParamInfo`);
    ``engine``: the :class:`~trainrec.recorder.stats.StatsEngine` of the config's ops; ``step_t0``: when
    the current step began (``time.perf_counter``); ``params_have_main_grad``: the monitor's argument;
    ``hook_failed(where, exc)``: reports a failure inside a hook (a HookFailed record; training goes on);
    ``config``: the active :class:`~trainrec.recorder.config.MonitorConfig` (the monitor's ``config``).
    """

    __slots__ = ("config", "engine", "hook_failed", "params", "params_have_main_grad", "state", "step_t0")

    def __init__(self, engine, params_have_main_grad: bool, hook_failed: Callable[[str, BaseException], None],
                 config=None) -> None:
        self.state = None
        self.params: list = []
        self.engine = engine
        self.step_t0 = time.perf_counter()
        self.params_have_main_grad = params_have_main_grad
        self.hook_failed = hook_failed
        self.config = config
