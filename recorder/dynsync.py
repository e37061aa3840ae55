"""Agreement between ranks on the step at which a config file state takes effect.

Ranks read the shared file at different moments. :class:`StepAgreement` runs rounds of
``all_reduce(MAX)`` over ``[id, -id, -interval]`` on a gloo group (``id``: the identity of the file
state read last; ``interval``: steps proposed until the next round). Where ``max == -(-min)`` every
rank read the same state, and as every rank harvests a round at the same step, all decide it there.
Each round is launched asynchronously and harvested at the next sync step, about ``sync_period``
seconds later (the minimum proposal wins, so the schedule stays uniform). The first round is waited
for at once, so a ``"switch": true`` at start-up is decided at the first step, as in one process."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)

DISAGREE_WARN_SECONDS = 30.0


def resolve_group(group: Any) -> Any:
    """The gloo group to agree on, or None when there is nobody to agree with.

    ``group`` given: used as it is (it must be a gloo group; raises ValueError if torch.distributed
    is not initialized). None: the default group if torch.distributed is initialized with several
    ranks and a gloo backend, else a new gloo group over all ranks (a collective call: every rank
    must make it, in the same order relative to other group creations), else None.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return None
    if group is None:
        if dist.get_world_size() <= 1:
            return None
        group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    if dist.get_world_size(group) <= 1:
        return None
    return group


class StepAgreement:
    """Rounds of ``all_reduce(MAX, [id, -id, -interval])``: decide a state when all ranks saw it."""

    def __init__(self, group: Any, sync_period: float, max_interval: int) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._period = sync_period
        self._max = max_interval
        self._tensor = torch.zeros(3, dtype=torch.int64)
        self._values = self._tensor.numpy()
        self._work: Any = None
        self._voted: Any = None
        self._last_time = 0.0
        self._last_step = 0
        self._disagree_since: float | None = None
        self._warned = False
        self.launches = 0  # rounds started (benchmarks)

    def _launch(self, step: int, latest: Any) -> None:
        now = time.monotonic()
        steps = step - self._last_step
        if self._work is None or steps <= 0:
            interval = 1
        else:
            per_step = (now - self._last_time) / steps
            interval = self._max if per_step <= 0 else max(1, min(self._max, int(self._period / per_step)))
        self._last_time, self._last_step = now, step
        ident = latest.identity if latest is not None else 0
        self._values[0] = ident
        self._values[1] = -ident
        self._values[2] = -interval
        self._voted = latest
        self.launches += 1
        self._work = self._dist.all_reduce(
            self._tensor, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True
        )

    def round(self, step: int, latest: Any) -> tuple[Any, int]:
        """Harvest the round in flight (the first one synchronously), launch the next one."""
        if self._work is None:
            self._launch(step, latest)
        self._work.wait()
        hi, neg_lo, neg_interval = (int(v) for v in self._values)
        voted = self._voted
        self._launch(step, latest)
        agreed = hi == -neg_lo and hi != 0
        if not agreed:
            now = time.monotonic()
            if self._disagree_since is None:
                self._disagree_since = now
            elif now - self._disagree_since > DISAGREE_WARN_SECONDS and not self._warned:
                self._warned = True
                log.warning(
                    "trainrec: ranks have read different states of the config file for 30 s; a change applies "
                    "only once every rank has read it (is the file on a filesystem all hosts share?)"
                )
            return None, 1
        self._disagree_since = None
        return voted, max(1, -neg_interval)

    def close(self, timeout: float) -> None:
        work, self._work = self._work, None
        if work is None:
            return
        try:
            import datetime

            work.wait(datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - peers may be gone at shutdown
            log.debug("trainrec: the last config agreement round did not finish", exc_info=True)
