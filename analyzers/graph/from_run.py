"""A :class:`~.model.Graph` from a trainrec run: one rank's module tree and xy statistics.

Nodes are named the reference's way (``Module.{path}.{Class}.forward.{n}``, ``.backward.{n}``,
``.parameters_grad``); parameters are ports of a module's first forward call, reduced gradients of
its ``parameters_grad`` node. Only a call's first input and output tensor are recorded. API calls
come from :mod:`.api_nodes`. Parenting rules: docs/graphs.md ("The graph").
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from trainrec.replay.rows import value_matrix
from trainrec.replay.run import Run
from trainrec.schema.events import SLOTS, ModuleStructureRecorded

from .api_nodes import API_TYPES, ApiCallsReader, place_api_calls, shape_module_calls
from .model import MODULE, OPS, ROOT_NAME, Graph, GraphInputError, Port

KINDS = ("actv", "actv_grad", "param", "grad_reduced", "grad_unreduced")
_OP_OF = {"max": "Max", "min": "Min", "mean": "Mean", "norm": "Norm"}
_RECORD_HINT = ('record with xy_distribution: true and all_xy: true (every module\'s inputs and outputs), '
                'wg_distribution: true and param_distribution: true, and ops including min, max, mean and norm')


def build_from_run(run: Run, rank: int | None = None) -> Graph:
    """The graph of ``rank`` (default: the run's first rank). Raises GraphInputError where the run
    recorded no xy statistics or none of the four ops."""
    rank = run.ranks[0] if rank is None else rank
    if rank not in run.ranks:
        raise GraphInputError(f"{run.where}: rank {rank} is not in the run (ranks: {run.ranks})")
    classes: dict[str, str] = {}
    parents: dict[str, str | None] = {}
    apis = ApiCallsReader(run.where)  # (in the same pass over the log: the API level's records)
    for ev in run.events(rank, types=[ModuleStructureRecorded, *API_TYPES]):
        if type(ev) is not ModuleStructureRecorded:
            apis.feed(ev)
            continue
        for name, cls, par in zip(ev.names, ev.classes or ("",) * len(ev.names),
                                  ev.parents or (-1,) * len(ev.names), strict=True):
            classes.setdefault(name, cls or "Module")
            parents.setdefault(name, ev.names[par] if par >= 0 else None)
    by_step: dict[int, list[tuple]] = defaultdict(list)  # step -> [(kind, names, record, values n x 4)]
    seen_kinds: set[str] = set()
    for ev, names in run.stats(KINDS, rank=rank):
        cols = [i for i, op in enumerate(ev.ops) if op in _OP_OF]
        if not cols:
            continue
        vals = np.full((len(names), len(OPS)), np.nan)
        vals[:, [OPS.index(_OP_OF[ev.ops[i]]) for i in cols]] = value_matrix(ev)[:, cols]
        seen_kinds.add(ev.kind)
        by_step[ev.step].append((ev.kind, names, ev, vals))
    if not seen_kinds & {"actv", "actv_grad"}:
        raise GraphInputError(f"{run.where} (rank {rank}): no module input/output statistics (xy) with the ops "
                              f"min/max/mean/norm were recorded, so there is no graph to build; {_RECORD_HINT}")
    graph = Graph(run.where, "run")
    return _Builder(graph, classes, parents).build(by_step, apis.result(), apis.module_shapes)


def _inside(child: str, parent: str) -> bool:
    """Whether module path ``child`` lies inside module path ``parent`` ("" is the model)."""
    return child != parent and (parent == "" or child.startswith(parent + "."))


def _forward_parents(order: list[tuple]) -> list[tuple | None]:
    """Per forward call ``((micro, call id), module)`` in completion order, the call enclosing it: a
    call completing claims the unclaimed calls completed just before it in its micro step that lie
    inside its module (a call outside the model's forward stays at the top)."""
    parent: list[tuple | None] = [None] * len(order)
    pending: list[int] = []
    for i, (c, mod) in enumerate(order):
        while pending and order[pending[-1]][0][0] == c[0] and _inside(order[pending[-1]][1], mod):
            parent[pending.pop()] = order[i]
        pending.append(i)
    return parent


def _backward_parents(order: list[tuple]) -> list[tuple | None]:
    """Per backward call in start order, the latest open call of an enclosing module in its micro step."""
    parent: list[tuple | None] = [None] * len(order)
    stack: list[int] = []
    for i, (c, mod) in enumerate(order):
        while stack and not (order[stack[-1]][0][0] == c[0] and _inside(mod, order[stack[-1]][1])):
            stack.pop()
        parent[i] = order[stack[-1]] if stack else None
        stack.append(i)
    return parent


def _layout(records: list[tuple]) -> tuple:
    """What decides a step's nodes and ports: its rows' kinds, names, slots, micro steps and call ids.
    Steps usually repeat it, and then reuse the previous step's port indices."""
    return tuple((kind, tuple(names), ev.slots, ev.micro_steps, ev.call_ids) for kind, names, ev, _ in records)


def _rows(records: list[tuple]) -> list[tuple]:
    """``(kind, name, slot, micro step, call id, position)`` of every row of a step's records."""
    out = []
    for kind, names, ev, _ in records:
        slots, micros, calls = ev.column("slots"), ev.column("micro_steps"), ev.column("call_ids")
        for i, name in enumerate(names):
            out.append((kind, name, SLOTS[slots[i]], int(micros[i]), int(calls[i]), len(out)))
    return out


class _Builder:
    def __init__(self, graph: Graph, classes: dict[str, str], parents: dict[str, str | None]) -> None:
        self.graph, self.classes, self.parents = graph, classes, parents
        self.first_order: dict[str, tuple] = {}
        self.forward_calls: dict[str, list] = {}  # module -> [((micro, call id), node name)] of the last step made
        self.backward_calls: dict[str, list] = {}  # the same of the backward calls

    def label(self, path: str) -> str:
        cls = self.classes.get(path, "Module")
        return f"Module.{path}.{cls}" if path else f"Module.{cls}"

    def module_of_param(self, pname: str) -> tuple[str, str]:
        parts = pname.split(".")
        for k in range(len(parts) - 1, 0, -1):
            mod = ".".join(parts[:k])
            if mod in self.classes:
                return mod, ".".join(parts[k:])
        return "", pname

    def build(self, by_step: dict[int, list[tuple]], apis: dict | None = None, shapes: dict | None = None) -> Graph:
        """The graph of every step's records; ``apis``: the API calls of each step, ``shapes``: the
        module calls' dtypes and shapes the API level recorded (:mod:`.api_nodes`)."""
        layouts: dict[tuple, tuple] = {}
        filled = []
        for step in sorted(by_step):
            records = by_step[step]
            key = _layout(records)
            done = layouts.get(key)
            if done is None:
                self.forward_calls, self.backward_calls = {}, {}
                ports = np.asarray(self.step(_rows(records)), dtype=np.int64)
                done = layouts[key] = (ports, (self.forward_calls, self.backward_calls))
            ports = done[0]
            vals = np.concatenate([r[3] for r in records])
            if apis and step in apis:  # API calls under the forward calls they were made in
                api_ports, api_vals = place_api_calls(self, apis[step], done[1])
                ports, vals = np.concatenate([ports, api_ports]), np.concatenate([vals, api_vals])
            if shapes and step in shapes:
                shape_module_calls(self, shapes[step], done[1][0])
            keep = ports >= 0
            filled.append((step, ports[keep], vals[keep]))
        ranked = sorted(self.first_order, key=self.first_order.__getitem__)
        for i, name in enumerate(ranked):
            self.graph.nodes[name].order = i
        self.graph.fill(filled)
        return self.graph

    def node(self, name: str, parent: str | None, key: tuple, node_type: int = MODULE):
        node = self.graph.add_node(name, parent, node_type)
        self.first_order.setdefault(name, key)
        return node

    def step(self, rows: list[tuple]) -> list[int]:
        """Make the nodes and ports of one step's rows; their port indices (-1: a row not shown)."""
        ports = [-1] * len(rows)
        calls: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)  # (dir, module) -> calls
        for kind, name, _slot, micro, call, _seq in rows:
            if kind in ("actv", "actv_grad"):
                calls[(kind, name)].append((micro, call))
        for key in calls:
            calls[key] = sorted(set(calls[key]))
        names: dict[tuple, str] = {}
        for (kind, mod), lst in calls.items():
            direction = "forward" if kind == "actv" else "backward"
            for n, c in enumerate(lst):
                names[(kind, mod, c)] = f"{self.label(mod)}.{direction}.{n}"
        self.forward_calls, self.backward_calls = ({mod: [(c, names[(kind, mod, c)]) for c in lst]
                                                    for (k, mod), lst in calls.items() if k == kind}
                                                   for kind in ("actv", "actv_grad"))
        for kind in ("actv", "actv_grad"):
            order = sorted((c, mod) for (k, mod), lst in calls.items() if k == kind for c in lst)
            parents = _forward_parents(order) if kind == "actv" else _backward_parents(order)
            up = dict(zip(order, parents, strict=True))
            depth: dict[tuple, int] = {}
            for item in order:  # (a parent's depth is known once its own parent's is: walk up)
                chain = [item]
                while up[chain[-1]] is not None and up[chain[-1]] not in depth:
                    chain.append(up[chain[-1]])
                for x in reversed(chain):
                    depth[x] = 0 if up[x] is None else depth[up[x]] + 1
            for item in sorted(order, key=depth.__getitem__):  # parents first, else execution order
                (c, mod), parent = item, up[item]
                pname = names[(kind, parent[1], parent[0])] if parent is not None else ROOT_NAME
                self.node(names[(kind, mod, c)], pname, (kind != "actv", c))
        grad_kind = "grad_reduced" if any(r[0] == "grad_reduced" for r in rows) else "grad_unreduced"
        add = self.graph.add_port
        for kind, name, slot, micro, call, seq in rows:
            if kind in ("actv", "actv_grad"):
                node = self.graph.nodes[names[(kind, name, (micro, call))]]
                if kind == "actv":
                    port = f"{slot}.0"
                else:  # a backward call takes the output's gradient in and gives the input's out
                    port = "input.0" if slot == "output_grad" else "output.0"
                ports[seq] = add(node, Port(port))
            elif kind == "param":
                mod, local = self.module_of_param(name)
                fwd = f"{self.label(mod)}.forward.0"
                node = self.node(fwd, self.up_forward(mod), (False, (micro, call)))
                ports[seq] = add(node, Port(f"parameters.{local}"))
            elif kind == grad_kind:
                mod, local = self.module_of_param(name)
                back = calls.get(("actv_grad", mod))
                parent = names[("actv_grad", mod, back[-1])] if back else ROOT_NAME
                node = self.node(f"{self.label(mod)}.parameters_grad", parent, (True, (micro, 1 << 40, seq)))
                ports[seq] = add(node, Port(f"parameters_grad.{local}"))
        return ports

    def up_forward(self, mod: str) -> str:
        up = self.parents.get(mod)
        while up is not None:
            name = f"{self.label(up)}.forward.0"
            if name in self.graph.nodes:
                return name
            up = self.parents.get(up)
        return ROOT_NAME


__all__ = ["build_from_run"]
