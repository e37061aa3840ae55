"""Installing a recording session on its model (``TrainerMon.monitor_gnorm_with_ad``, ``record()``): the
model and its arguments checked, the model's chunks and targets, the process groups, the whole-run chunk and
optimizer hooks, the optimizer bound, a resumed run noted, and the first step begun."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING

from trainrec.schema.errors import ConfigError
from trainrec.schema.events import RunResumed

from . import fsdp, open_monitors
from .chunk_hooks import make_chunk_hook, make_chunk_pre_hook
from .compile_mode import eager
from .failures import warn_once
from .model_args import checked_arguments, checked_model, compiled_fullgraph
from .steps import weak_call
from .targets import uninitialized

if TYPE_CHECKING:
    from .session import RecordingSession

# (the monitor's logger: its warnings were given there before this part moved out)
log = logging.getLogger("trainrec.recorder.monitor")


def _content_hash(raw: dict) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def install(mon: RecordingSession, model, grad_acc_steps: int, optimizer, dp_group, tp_group, start_iteration: int) -> None:
    """:meth:`RecordingSession.install`: ``model`` is a module or a list of virtual-pipeline chunks."""
    if mon.monitored.chunks:
        raise RuntimeError("monitor_gnorm_with_ad was already called on this monitor (one model per monitor)")
    try:
        given, acc = checked_model(model), checked_arguments(grad_acc_steps, start_iteration)
    except (ConfigError, TypeError):
        mon.output.discard_if_empty()  # nothing installed: no empty run left beside a fixed one
        raise
    mon.monitored.install(given, tp_group)
    mon.steps.grad_acc = acc
    mon.cycle.step = int(start_iteration)
    if not mon.identity.distributed:
        mon.identity.join_process_group(mon.output, append_output=bool(mon.config.append_output),
                                        reopen=mon.open_output, hook_failed=mon.hook_failed)
    fsdp1 = fsdp.fsdp1_units(mon.monitored.chunks)
    if dp_group is not None and mon.identity.distributed and not fsdp1:  # FSDP1: every gradient is a shard
        mon.collection.ownership.join_dp_group(dp_group)
    if any(getattr(u, "_use_orig_params", True) for u in fsdp1):
        warn_once("fsdp1", "trainrec: the model is wrapped in FullyShardedDataParallel (FSDP1) with "
                   "use_orig_params=True, which accumulates gradients in its flat parameters, outside the "
                   "parameters' own gradient hooks: weight gradients before reduction (grad_unreduced) are "
                   "not recorded for them (with use_orig_params=False they are, per flat parameter: this "
                   "rank's whole local gradient of the FSDP unit). Reduced gradients, parameters and Adam "
                   "state are this rank's shards; activations are recorded as usual. FSDP2 "
                   "(torch.distributed.fsdp.fully_shard) records every parameter's unreduced gradient.")
    try:
        mon.monitored.build(mon.config)  # raises ConfigError before any training
    except ConfigError as exc:
        mon.monitored.chunks = []  # nothing installed: the caller may fix the config and call again
        mon.output.discard_if_empty()
        raise exc.with_source(mon.config_source()) from None
    if mon.output.discarded:  # an earlier call failed on the config: this one records
        mon.open_output()
    mon.write_structure()
    open_monitors.warn_if_monitored_already(mon)
    # micro steps (module hooks), gradient batches, optimizer steps that never ran: every step; on the
    # wrapper of a chunk compiled with fullgraph=True, whose own hooks run outside the graph (inside
    # it, a hook that dynamo may not trace is a graph break, which fullgraph makes an error)
    hooked = [m if compiled_fullgraph(m) else c for m, c in zip(given, mon.monitored.chunks, strict=True)]
    run_handles = mon.handles.group("run")
    run_handles += [chunk.register_forward_pre_hook(make_chunk_pre_hook(mon.hooks, vpp))
                    for vpp, chunk in enumerate(hooked)]
    run_handles += [chunk.register_forward_hook(make_chunk_hook(mon.hooks, vpp)) for vpp, chunk in enumerate(hooked)]
    mon.steps.chunk0_params = [p for p in mon.monitored.chunks[0].parameters() if p.requires_grad]
    mon.mark_params()
    mon.hooks.lazy_chunks.update(vpp for vpp, c in enumerate(mon.monitored.chunks)
                                 if any(map(uninitialized, c.parameters())))
    if not mon.steps.manual:
        # every optimizer's step, once each: another optimizer's (a GAN's other model's) tells the
        # passes of this model inside that model's step from this model's own (_other_stepped)
        from torch.optim.optimizer import register_optimizer_step_post_hook

        run_handles.append(register_optimizer_step_post_hook(eager(weak_call(mon.steps.other_stepped))))
    mon.bind_optimizer(optimizer)
    if mon.output.resumed_from:
        if mon.cycle.step == 0:
            log.warning("trainrec: append_output resumes the run in this launch, but training starts "
                        "at step 0 here (start_iteration not given, or 0): replay takes every step from 0 on as "
                        "re-run, so what the earlier launches recorded is superseded (hidden from inspect, "
                        "exports and anomalies; the live CSV export removes its files). Pass "
                        "monitor_gnorm_with_ad(..., start_iteration=<the step training resumes at>)")
        mon.emit(RunResumed(rank=mon.rank, step=mon.cycle.step, wall=time.time(),
                             previous_files=mon.output.resumed_from, last_step=mon.cycle.step - 1,
                             reason="append_output"))
    if mon.config.print_struct and not mon.dynamic:
        mon.attach_struct_hooks()
    else:
        # dynamic: nothing runs before the switch says so, print_struct included (apply_config)
        mon.handles.group("first call").extend(mon.monitored.targets.first_call_checks(
            mon.config_source(), weak_call(mon.rejected_at_first_call)))
        if not mon.dynamic:
            mon.apply_config(mon.config, mon.cycle.step - 1, _content_hash(mon.config.raw), reason="static")
    mon.cycle.begin()
