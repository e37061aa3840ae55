"""The API level's record of one pass: the calls of a model chunk's forward pass, or the gradients
through the calls of one micro step's backward, as columns, and their way to the log as one
:class:`~trainrec.schema.events.ApiCallsRecorded` (:mod:`.api_calls`, :mod:`.api_backward`)."""

from __future__ import annotations

import time
from array import array

import numpy as np
import torch
from trainrec.schema.events import DIR_FORWARD, ApiCallsRecorded

from .step_stats import StatsPart, StepStats

NO_MODULE = 0xFFFFFFFF
_NO_SHAPE = 255
_NOT_TENSOR = 2
_TENSOR = "torch.Tensor"


class ApiPass:
    """The calls of one pass, columnar: names, modules, positions, ports (their metadata) and rows."""

    __slots__ = ("st", "micro", "vpp", "direction", "names", "modules", "positions", "port_counts", "ports", "types",
                 "dtypes", "ndims", "dims", "grads", "rows", "depths", "frames", "mod_calls", "mod_positions",
                 "mod_dtypes", "mod_ndims", "mod_dims")

    def __init__(self, st, micro: int, vpp: int, direction: int = DIR_FORWARD) -> None:
        self.st, self.micro, self.vpp, self.direction = st, micro, vpp, direction
        self.names, self.modules, self.positions = array("I"), array("I"), array("I")
        self.port_counts = array("H")
        self.ports, self.types, self.dtypes = array("I"), array("I"), array("I")
        self.ndims, self.dims, self.grads = array("B"), array("q"), array("B")
        self.rows: list = []
        self.depths, self.frames = array("H"), array("I")
        self.mod_calls, self.mod_positions, self.mod_dtypes = array("I"), array("I"), array("I")
        self.mod_ndims, self.mod_dims = array("B"), array("q")

    def add_module_call(self, intern, module: int, position: int, tensors: tuple) -> None:
        """A monitored module call of the pass, completed at ``position``, and the dtype and shape of its
        selected input and output (``tensors``, None where no tensor)."""
        dtypes, ndims, dims = [], [], []
        for x in tensors:
            if isinstance(x, torch.Tensor):
                dtypes.append(intern(str(x.dtype)))
                ndims.append(min(x.dim(), _NO_SHAPE - 1))
                dims.extend(x.shape[:_NO_SHAPE - 1])
            else:
                dtypes.append(intern(""))
                ndims.append(_NO_SHAPE)
        self.mod_calls.append(module)
        self.mod_positions.append(position)
        self.mod_dtypes.extend(dtypes)
        self.mod_ndims.extend(ndims)
        self.mod_dims.extend(dims)

    def add(self, intern, name: str, module: int, position: int, ports: list, block, stack: list | None) -> None:
        """One call: ``ports`` as ``(port name, value)`` in the record's order, ``block`` their rows
        (``len(ports) x ops``), ``stack`` its interned frames (None: not asked). Made in full first,
        then appended (a failure leaves none)."""
        port_ids, types, dtypes, ndims, dims, grads = [], [], [], [], [], []
        for port, v in ports:
            port_ids.append(intern(port))
            if isinstance(v, torch.Tensor):
                types.append(intern(_TENSOR))
                dtypes.append(intern(str(v.dtype)))
                ndims.append(min(v.dim(), _NO_SHAPE - 1))
                dims.extend(v.shape[:_NO_SHAPE - 1])
                grads.append(int(v.requires_grad))
            else:
                types.append(intern(type_name(v)))
                dtypes.append(intern(""))
                ndims.append(_NO_SHAPE)
                grads.append(_NOT_TENSOR)
        name_id = intern(name)
        self.names.append(name_id)
        self.modules.append(module)
        self.positions.append(position)
        self.port_counts.append(len(ports))
        self.ports.extend(port_ids)
        self.types.extend(types)
        self.dtypes.extend(dtypes)
        self.ndims.extend(ndims)
        self.dims.extend(dims)
        self.grads.extend(grads)
        self.rows.append(block)
        if stack is not None:
            self.depths.append(min(len(stack), 0xFFFF))
            self.frames.extend(stack[:0xFFFF])


def write_pass(ctx, p: ApiPass) -> None:
    """The pass's calls to the log: its rows copied to the host as a step's are, the record made on the
    writer's thread (``ctx``: the monitor's :class:`~.hook_context.HookContext`)."""
    writer = ctx.output.writer
    if writer is None or writer.closed or writer.error is not None or not (len(p.names) or len(p.mod_calls)):
        return
    hs = None
    if p.rows:
        stats = StepStats(p.st.stats.ops)
        for block in p.rows:
            stats.add(StatsPart("api", block, (0,) * len(block)))
        hs = stats.finish(p.st.step)
    ctx.sync_names()
    fids = ctx.name_table.file_ids
    rank, step, ops = ctx.identity.rank, p.st.step, tuple(p.st.stats.ops)

    def ids(col: array) -> bytes:
        return fids[np.frombuffer(col, dtype=np.uint32)].astype("<u4").tobytes() if len(col) else b""

    fields = dict(micro_step=p.micro, vpp_stage=p.vpp, ops=ops, dtype="f", name_ids=ids(p.names),
                  module_ids=_file_ids_or_none(fids, p.modules),
                  positions=np.frombuffer(p.positions, dtype=np.uint32).astype("<u4").tobytes(),
                  port_counts=np.frombuffer(p.port_counts, dtype=np.uint16).astype("<u2").tobytes(),
                  port_ids=ids(p.ports), type_ids=ids(p.types), dtype_ids=ids(p.dtypes),
                  ndims=p.ndims.tobytes(), dims=np.frombuffer(p.dims, dtype=np.int64).astype("<i8").tobytes(),
                  requires_grad=p.grads.tobytes(),
                  stack_depths=np.frombuffer(p.depths, dtype=np.uint16).astype("<u2").tobytes(),
                  stack_frames=ids(p.frames), direction=p.direction, module_calls=ids(p.mod_calls),
                  module_positions=np.frombuffer(p.mod_positions, dtype=np.uint32).astype("<u4").tobytes(),
                  module_dtype_ids=ids(p.mod_dtypes), module_ndims=p.mod_ndims.tobytes(),
                  module_dims=np.frombuffer(p.mod_dims, dtype=np.int64).astype("<i8").tobytes())

    def build() -> list:
        values = np.ascontiguousarray(hs.wait(), dtype="<f4") if hs is not None else np.empty(0, dtype="<f4")
        return [ApiCallsRecorded(rank=rank, step=step, wall=time.time(), values=values.tobytes(), **fields)]

    writer.write(build)


def _file_ids_or_none(fids: np.ndarray, local: array) -> bytes:
    """Monitor-local name ids as the file's, :data:`NO_MODULE` kept."""
    ids = np.frombuffer(local, dtype=np.uint32)
    none = ids == NO_MODULE
    return np.where(none, NO_MODULE, fids[np.where(none, 0, ids)]).astype("<u4").tobytes()


def type_name(v) -> str:
    """The reference's type name of a value that is no tensor: ``int``, ``float``, ``torch.dtype``, ..."""
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


__all__ = ["NO_MODULE", "ApiPass", "type_name", "write_pass"]
