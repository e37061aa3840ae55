"""What trainrec needs to know of torch's FSDP wrappers, found without importing them.

FSDP1 (``FullyShardedDataParallel``): its units, to say what its flat parameters hide.

FSDP2 (``fully_shard``): the module's registered parameters are DTensors holding this rank's shard.
Forward and backward run on an unsharded parameter FSDP keeps for each (``FSDPParam._unsharded_param``,
made at the first all-gather and reused), where autograd accumulates this rank's own gradient; FSDP
reduce-scatters it after the module's backward, assigns the reduced shard to the sharded parameter's
``.grad`` and runs the sharded parameter's post-accumulate-grad hooks then. So the unreduced row comes
from a hook on the unsharded parameter, found through FSDP's state (torch's own attributes, not a
public API: where they are missing, :func:`fsdp2_params` says so and the unreduced rows are left out).
"""

from __future__ import annotations

import sys
from typing import Any


def fsdp1_units(chunks) -> list:
    """The FSDP1 units (``FullyShardedDataParallel``, not FSDP2's ``fully_shard``) in the model."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: not in use (and no import cost)
    cls = getattr(fsdp, "FullyShardedDataParallel", None)
    return [] if cls is None else [m for c in chunks for m in c.modules() if isinstance(m, cls)]


def fsdp2_params(chunks) -> tuple[dict[int, Any], bool]:
    """``{id(sharded parameter): FSDPParam}`` of the FSDP2 modules in the model, and whether FSDP2
    modules were found whose state could not be read (another torch's internals)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    found: dict[int, Any] = {}
    unreadable = False
    if cls is None:
        return found, unreadable
    for c in chunks:
        for m in c.modules():
            if not isinstance(m, cls):
                continue
            try:
                state = m._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None)
                if groups is None:  # torch < 2.6: one group per module
                    groups = [g for g in (state._fsdp_param_group,) if g is not None]
                for g in groups:
                    for fp in g.fsdp_params:
                        found[id(fp.sharded_param)] = fp
            except Exception:  # noqa: BLE001 - FSDP's internals differ in this torch
                unreadable = True
    return found, unreadable


def unsharded_param(fsdp_param) -> Any:
    """The unsharded parameter FSDP computes on, or None before its first all-gather."""
    return getattr(fsdp_param, "_unsharded_param", None)
