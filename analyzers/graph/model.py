"""The graph model: a model's module/API hierarchy with per-step tensor statistics, columnar.

A :class:`Graph` holds nodes (modules, API calls, collections) in a tree, each with its ports
(``input.0``, ``output.0``, ``parameters.weight``, ``parameters_grad.weight``), and the statistics of
every port at every step in one array ``values[step, port, op]`` with the reference's four ops (NaN
where absent). Both builders (:mod:`.from_run`, :mod:`.from_dump`) produce it; everything else reads
only it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from trainrec.schema.errors import TrainrecError

OPS = ("Max", "Min", "Mean", "Norm")

# The reference's node types (its .vis node_type field).
MODULE, API, MULTI_COLLECTION, API_LIST = 0, 1, 8, 9
ROOT_NAME = "DefaultModel"


class GraphInputError(TrainrecError):
    """A run or dump directory cannot give a graph: the message names what is missing and what to record."""


@dataclass
class Port:
    """One tensor (or other value) of a node; ``shape``/``dtype`` empty where the source did not record them."""

    name: str
    dtype: str = ""
    shape: tuple | None = None
    type: str = "torch.Tensor"
    requires_grad: bool | None = None

    @property
    def role(self) -> str:
        """``input``, ``output``, ``parameters`` or ``parameters_grad``: the first part of the name."""
        return self.name.split(".", 1)[0]


@dataclass
class Node:
    name: str
    node_type: int = MODULE
    parent: str | None = None
    children: list[str] = field(default_factory=list)
    order: int = -1  # execution order (forward calls by completion, then backward, then grads); -1 none
    ports: list[Port] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)

    def port(self, name: str) -> Port | None:
        return next((p for p in self.ports if p.name == name), None)


class Graph:
    """Nodes in a tree under :data:`ROOT_NAME`, and their ports' statistics over steps."""

    def __init__(self, source: str = "", kind: str = "") -> None:
        self.source = source  # where it was built from (a path), for messages
        self.kind = kind  # "run" or "dump"
        self.nodes: dict[str, Node] = {ROOT_NAME: Node(ROOT_NAME, API_LIST)}
        self.steps: list[int] = []
        self.port_keys: list[tuple[str, str]] = []  # port index -> (node name, port name)
        self.port_index: dict[tuple[str, str], int] = {}
        self.values = np.full((0, 0, len(OPS)), np.nan)

    @property
    def root(self) -> Node:
        return self.nodes[ROOT_NAME]

    def add_node(self, name: str, parent: str | None, node_type: int = MODULE) -> Node:
        """The node ``name`` (made under ``parent``, the root where None, if new)."""
        node = self.nodes.get(name)
        if node is None:
            parent = parent if parent in self.nodes else ROOT_NAME
            node = self.nodes[name] = Node(name, node_type, parent)
            self.nodes[parent].children.append(name)
        return node

    def add_port(self, node: Node, port: Port) -> int:
        key = (node.name, port.name)
        i = self.port_index.get(key)
        if i is None:
            i = self.port_index[key] = len(self.port_keys)
            self.port_keys.append(key)
            node.ports.append(port)
        return i

    def set_values(self, steps: list[int], rows: list[tuple[int, int, list[float]]]) -> None:
        """Fill :attr:`values` from ``(step, port index, [Max, Min, Mean, Norm])`` rows."""
        self.steps = sorted(set(steps))
        where = {s: i for i, s in enumerate(self.steps)}
        self.values = np.full((len(self.steps), len(self.port_keys), len(OPS)), np.nan)
        if rows:
            si = np.fromiter((where[r[0]] for r in rows), np.int64, len(rows))
            pi = np.fromiter((r[1] for r in rows), np.int64, len(rows))
            self.values[si, pi] = np.asarray([r[2] for r in rows], dtype=np.float64)

    def fill(self, steps: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """Fill :attr:`values` from ``(step, port indices, values n x 4)`` per step (arrays)."""
        self.steps = sorted({s for s, _, _ in steps})
        where = {s: i for i, s in enumerate(self.steps)}
        self.values = np.full((len(self.steps), len(self.port_keys), len(OPS)), np.nan)
        for s, ports, vals in steps:
            self.values[where[s], ports] = vals

    def ancestors(self, name: str) -> list[str]:
        """Names from the root's child down to ``name``'s parent."""
        out = []
        p = self.nodes[name].parent
        while p is not None and p != ROOT_NAME:
            out.append(p)
            p = self.nodes[p].parent
        return out[::-1]

    def preorder(self) -> list[str]:
        """Every node name, parents before children, children in their recorded order."""
        out, todo = [], [ROOT_NAME]
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(reversed(self.nodes[n].children))
        return out

    def execution_order(self) -> list[str]:
        """Nodes with an execution order, in it (ties by name)."""
        return sorted((n for n in self.nodes.values() if n.order >= 0), key=lambda n: (n.order, n.name))

    def port_stats(self, step_index: int, node: str) -> dict[str, dict[str, float]]:
        """``{port: {op: value}}`` of ``node`` at ``steps[step_index]``."""
        out = {}
        for p in self.nodes[node].ports:
            row = self.values[step_index, self.port_index[(node, p.name)]]
            out[p.name] = {op: float(v) for op, v in zip(OPS, row, strict=True)}
        return out

    def describe(self) -> str:
        n_api = sum(1 for n in self.nodes.values() if n.node_type == API)
        return (f"{len(self.nodes) - 1} nodes ({n_api} API calls), {len(self.port_keys)} tensors, "
                f"{len(self.steps)} step(s) from {self.source}")
