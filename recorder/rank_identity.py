"""Who a recording process is in its run: rank, world size, pipeline stage, group mates, and the run id
the ranks share. Read from ``torch.distributed`` (or the environment before it is up) when the
monitor is made, and joined with the process group where it was initialized later."""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import runinfo
from .failures import warn_once
from .output import Output

log = logging.getLogger(__name__)


class RankIdentity:
    """``rank``, ``world_size`` (fixed: they named the rank directory), ``pp_stage``, ``group_mates`` and
    ``run_id`` (may change at :meth:`join_process_group`), ``distributed`` (torch.distributed is up)."""

    def __init__(self, process_group=None) -> None:
        info = runinfo.rank_info(process_group)
        self.process_group = process_group
        self.rank, self.world_size, self.pp_stage = info.rank, info.world_size, info.pp_stage
        self.group_mates = info.group_mates
        self.distributed = info.distributed
        self._run_id_shared = runinfo.run_id_shared_now()
        self.run_id = runinfo.shared_run_id()

    def several_ranks(self) -> bool:
        return self.distributed and self.world_size > 1

    def join_process_group(self, output: Output, *, append_output: bool, reopen: Callable[[], None],
                           hook_failed: Callable[[str, BaseException], None]) -> None:
        """torch.distributed was initialized after this monitor was made (msprobe's documentation makes
        the monitor first): its rank and world size came from the environment (``RANK``,
        ``WORLD_SIZE``, as torchrun sets them), which named the rank directory and the log's header
        and stay the log's; from here on ``dp_group`` and ``tp_group`` deduplicate. ``reopen()`` opens
        ``output``'s log again (under the new run id or pipeline stage) where it is still empty."""
        info = runinfo.rank_info(self.process_group)
        if not info.distributed:
            if self.world_size > 1 and not runinfo.run_id_shared_now():
                warn_once("unshared_run", f"trainrec: rank {self.rank} of WORLD_SIZE={self.world_size} without "
                          "torch.distributed initialized, and no TRAINREC_RUN_ID or TORCHELASTIC_RUN_ID in the "
                          "environment: each rank's log is a run of its own, which replay does not merge. Set "
                          "TRAINREC_RUN_ID to one value in every rank's environment (torchrun: --rdzv-id or "
                          "--standalone), or initialize torch.distributed before monitor_gnorm_with_ad")
            return
        if info.rank != self.rank or info.world_size != self.world_size:
            warn_once("late_dist", f"trainrec: torch.distributed was initialized after TrainerMon was made, and "
                      f"its rank {info.rank} of {info.world_size} differs from the environment's "
                      f"(RANK={self.rank}, WORLD_SIZE={self.world_size}) that named the log directory "
                      f"{output.rank_dir}; make TrainerMon after init_process_group, or set RANK and WORLD_SIZE")
        self.distributed = True
        # the pipeline stage and group mates, as a monitor made after init_process_group has them (the
        # environment gave stage 0 and this rank alone): the log's header and the anomalies carry them
        header = (self.pp_stage, self.group_mates)
        restage = (info.pp_stage, tuple(info.group_mates)) != (self.pp_stage, tuple(self.group_mates))
        self.pp_stage, self.group_mates = info.pp_stage, info.group_mates
        if output.watcher is not None:  # dynamic mode: the ranks agree on the step a change applies at
            try:
                output.watcher.join_group()
            except Exception as exc:  # noqa: BLE001 - monitoring never kills training
                hook_failed("dynamic config watcher", exc)
        if not self._share_run_id(output, restage, append_output, reopen) and restage and output.writer is not None:
            # the log keeps its header (it holds events, or continues a run): so do its anomalies
            self.pp_stage, self.group_mates = header

    def _share_run_id(self, output: Output, restage: bool, append_output: bool, reopen: Callable[[], None]) -> bool:
        """The run id was chosen before torch.distributed was up, with no TRAINREC_RUN_ID or
        TORCHELASTIC_RUN_ID to share: each rank made its own, and replay would list every rank as a run
        of its own. The ranks agree on one now (through the process group's store), and the log, still
        empty, is opened again under it (in a new rank directory). ``restage``: the pipeline stage or
        group mates changed since the log's header was written: the empty log is opened again for them
        also where the run id was shared already. Returns whether the log was opened again."""
        rid = self.run_id
        if not self._run_id_shared:
            self._run_id_shared = True
            rid = runinfo.shared_run_id()
        if (rid == self.run_id and not restage) or append_output:
            return False
        if output.writer is None:  # format api: no log
            self.run_id = rid
            return False
        if output.emitted or not output.made_rank_dir:
            if rid != self.run_id:
                log.warning("trainrec: rank %d: torch.distributed was initialized after TrainerMon was made and "
                            "its log already holds events, so its run id stays this rank's own: replay lists "
                            "this rank's log as a run of its own. Make TrainerMon after init_process_group, or "
                            "set TRAINREC_RUN_ID in every rank's environment", self.rank)
            return False
        self.run_id = rid
        output.discard_if_empty()
        reopen()
        return True
