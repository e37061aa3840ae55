"""API call nodes of a trainrec run: the records of the recorder's API level (``api_xy``).

Each recorded call (``Functional.linear.0.forward``) becomes a node under the forward call of the
innermost monitored module it ran in, with its arguments and results as ports; the gradients through
it make a ``...backward`` node under that module's backward call. :func:`shape_module_calls` gives
module calls the shapes the forward records list, so exact matching compares them. The placement
rules are in docs/graphs.md ("The graph", "The API level").
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from trainrec.replay.names import NameResolver
from trainrec.replay.run import Run
from trainrec.schema.events import DIR_BACKWARD, ApiCallsRecorded, FileOpened, NamesInterned, unpack_array

from .model import API, OPS, ROOT_NAME, GraphInputError, Port

_OP_OF = {"max": "Max", "min": "Min", "mean": "Mean", "norm": "Norm"}
_NO_MODULE = 0xFFFFFFFF
_NO_SHAPE = 255
_AFTER_CALL = 1 << 40  # (an order key placing a call after the module call before it, before the next)


@dataclass
class ApiCall:
    """One recorded API call (or the gradients through one, ``backward``): its name, enclosing module
    (None: none), micro step, hook position, ports (with their rows in the step's values) and stack."""

    name: str
    module: str | None
    micro: int
    position: int
    ports: list
    rows: list
    stack: tuple = ()
    backward: bool = False


# the records :class:`ApiCallsReader` takes (the name tables and the API records)
API_TYPES = (ApiCallsRecorded, NamesInterned, FileOpened)


class ApiCallsReader:
    """Fed one rank's records of :data:`API_TYPES` in order (with others of the same pass, which it
    skips); :meth:`result` gives ``{step: (calls, values ports x 4)}`` (empty without any). ``where``
    (the run) heads its errors."""

    def __init__(self, where: str = "") -> None:
        self.where = where
        self.resolver = NameResolver()
        self.calls: dict[int, list[ApiCall]] = defaultdict(list)
        self.values: dict[int, list[np.ndarray]] = defaultdict(list)
        self.ports: dict[int, int] = defaultdict(int)
        # step -> [(module, micro, position, ((dtype, shape) of the input, of the output))]
        self.module_shapes: dict[int, list] = defaultdict(list)

    def feed(self, ev) -> None:
        t = type(ev)
        if t is NamesInterned or t is FileOpened:
            self.resolver.feed(ev)
        elif t is ApiCallsRecorded:
            self._add(ev)

    def _add(self, ev: ApiCallsRecorded) -> None:
        name = lambda i, r=ev.rank: self.resolver.name(r, i)  # noqa: E731
        cols = [k for k, op in enumerate(ev.ops) if op in _OP_OF]
        n_ports = len(ev.port_ids) // 4
        raw = np.frombuffer(ev.values, dtype="<f4" if ev.dtype == "f" else "<f8").reshape(n_ports, len(ev.ops))
        vals = np.full((n_ports, len(OPS)), np.nan)
        vals[:, [OPS.index(_OP_OF[ev.ops[k]]) for k in cols]] = raw[:, cols]
        port_names = [name(i) for i in unpack_array("I", ev.port_ids)]
        types = [name(i) for i in unpack_array("I", ev.type_ids)]
        dtypes = [name(i) for i in unpack_array("I", ev.dtype_ids)]
        dims = unpack_array("q", ev.dims).tolist()
        grads = list(ev.requires_grad)
        depths = unpack_array("H", ev.stack_depths) if ev.stack_depths else None
        frames = [name(i) for i in unpack_array("I", ev.stack_frames)]
        k = d = f = 0
        base = self.ports[ev.step]
        suffix = ".backward" if ev.direction == DIR_BACKWARD else ".forward"
        for c, (nid, mid, pos, nport) in enumerate(zip(unpack_array("I", ev.name_ids), unpack_array("I", ev.module_ids),
                                                      unpack_array("I", ev.positions),
                                                      unpack_array("H", ev.port_counts), strict=True)):
            ports = []
            for j in range(k, k + nport):
                nd = ev.ndims[j]
                shape = None if nd == _NO_SHAPE else tuple(dims[d:d + nd])
                d += 0 if nd == _NO_SHAPE else nd
                ports.append(Port(port_names[j], dtypes[j], shape, types[j], None if grads[j] > 1 else bool(grads[j])))
            stack = ()
            if depths is not None:
                stack, f = tuple(frames[f:f + depths[c]]), f + depths[c]
            if not name(nid).endswith(suffix):  # (a backward record cut short of its direction reads as forward)
                raise GraphInputError(
                    f"{self.where} (rank {ev.rank}, step {ev.step}, record {ev.seq}): API call {name(nid)!r} in a "
                    f"record of {suffix[1:]} calls, whose names end in {suffix!r}: the record is damaged")
            self.calls[ev.step].append(ApiCall(name(nid), None if mid == _NO_MODULE else name(mid), ev.micro_step,
                                               pos, ports, list(range(base + k, base + k + nport)), stack,
                                               ev.direction == DIR_BACKWARD))
            k += nport
        self.ports[ev.step] = base + k
        self.values[ev.step].append(vals)
        if ev.module_calls:
            self._add_module_calls(ev, name)

    def _add_module_calls(self, ev: ApiCallsRecorded, name) -> None:
        dtypes = [name(i) for i in unpack_array("I", ev.module_dtype_ids)]
        dims = unpack_array("q", ev.module_dims).tolist()
        d = 0
        for c, (mid, pos) in enumerate(zip(unpack_array("I", ev.module_calls), unpack_array("I", ev.module_positions),
                                           strict=True)):
            io = []
            for j in (2 * c, 2 * c + 1):
                nd = ev.module_ndims[j]
                io.append((dtypes[j], None if nd == _NO_SHAPE else tuple(dims[d:d + nd])))
                d += 0 if nd == _NO_SHAPE else nd
            self.module_shapes[ev.step].append((name(mid), ev.micro_step, pos, tuple(io)))

    def result(self) -> dict[int, tuple[list[ApiCall], np.ndarray]]:
        return {s: (self.calls[s], np.concatenate(self.values[s])) for s in self.calls}


def api_calls_of_run(run: Run, rank: int) -> dict[int, tuple[list[ApiCall], np.ndarray]]:
    """``{step: (calls, values ports x 4)}`` of ``rank``'s API records (empty without any)."""
    reader = ApiCallsReader(run.where)
    for ev in run.events(rank, types=API_TYPES):
        reader.feed(ev)
    return reader.result()


def place_api_calls(builder, step_calls: tuple[list[ApiCall], np.ndarray], module_calls: tuple[dict, dict]) -> tuple:
    """Make the nodes and ports of one step's API calls under the module calls of ``builder``'s graph
    (``module_calls``: forward and backward calls, each module -> [((micro, call id), node name)] in
    order). Returns ``(port indices, values)`` of their rows."""
    calls, values = step_calls
    graph = builder.graph
    keys = tuple({mod: [c for c, _ in lst] for mod, lst in d.items()} for d in module_calls)
    ports = np.full(len(values), -1, dtype=np.int64)
    for seq, call in enumerate(calls):
        if call.backward:
            parent = _enclosing_backward(builder, call, module_calls[1], keys[1])
        else:
            parent = _enclosing(builder, call, module_calls[0], keys[0])
        key = (call.backward, (call.micro, call.position - 1, _AFTER_CALL, seq))
        node = builder.node(call.name, parent, key, API)
        if call.stack and not node.stack:
            node.stack = list(call.stack)
        for port, row in zip(call.ports, call.rows, strict=True):
            ports[row] = graph.add_port(node, port)
    return ports, values


def _enclosing(builder, call: ApiCall, forward_calls: dict, keys: dict) -> str:
    """The forward node a call sits under (see the module docstring)."""
    mod = call.module
    while mod is not None:
        lst = keys.get(mod)
        if lst:
            i = bisect_left(lst, (call.micro, call.position))
            if i < len(lst) and lst[i][0] == call.micro:
                return forward_calls[mod][i][1]
        mod = builder.parents.get(mod)
    return ROOT_NAME


def shape_module_calls(builder, calls: list, forward_calls: dict) -> None:
    """Give the recorded dtypes and shapes of module calls (:attr:`ApiCallsReader.module_shapes` of a
    step) to the ports ``input.0``/``output.0`` of their forward nodes (``forward_calls`` as in
    :func:`place_api_calls`), where those ports have none yet."""
    nodes = builder.graph.nodes
    for mod, micro, position, io in calls:
        lst = forward_calls.get(mod)
        if not lst:
            continue
        i = bisect_left([c for c, _ in lst], (micro, position)) - 1  # (its firing: the last before its end)
        if i < 0 or lst[i][0][0] != micro:
            continue
        node = nodes[lst[i][1]]
        for port, (dtype, shape) in zip(("input.0", "output.0"), io, strict=True):
            p = node.port(port)
            if p is not None and p.shape is None and shape is not None:
                p.dtype, p.shape = dtype, shape


def _enclosing_backward(builder, call: ApiCall, backward_calls: dict, keys: dict) -> str:
    """The backward node a call's gradients sit under (see the module docstring)."""
    mod = call.module
    while mod is not None:
        lst = keys.get(mod)
        if lst:
            i = bisect_left(lst, (call.micro, call.position)) - 1
            if i >= 0 and lst[i][0] == call.micro:
                return backward_calls[mod][i][1]
            i += 1  # (none fired before it: the module's first in the micro step)
            if i < len(lst) and lst[i][0] == call.micro:
                return backward_calls[mod][i][1]
        mod = builder.parents.get(mod)
    return ROOT_NAME


__all__ = ["API_TYPES", "ApiCall", "ApiCallsReader", "api_calls_of_run", "place_api_calls", "shape_module_calls"]
