"""A :class:`~.model.Graph` from the reference's dump directory (msprobe ``task: statistics``).

The path may be a ``rank`` directory (``dump.json``, ``construct.json``, ``stack.json``), a
``step{N}`` directory or the dump root; every step found becomes a step of the graph. Nodes keep
the dump's names; top-level API runs are grouped under ``Apis_Between_Modules.N`` as the reference
does (docs/graphs.md).
"""

from __future__ import annotations

import json
import os
import re

from .model import API, API_LIST, MODULE, OPS, ROOT_NAME, Graph, GraphInputError, Port

FILES = ("dump.json", "construct.json", "stack.json")
_RECORD_HINT = ("dump with msprobe's PrecisionDebugger, task \"statistics\", level \"mix\" or \"L0\", which writes "
                "dump.json, construct.json and stack.json into {dump_path}/step{N}/rank{R}/")


def find_dump_dirs(path: str, rank: int | None = None) -> list[tuple[int, str]]:
    """``(step, directory)`` of every dump directory under ``path``, by step. Raises GraphInputError."""
    if not os.path.isdir(path):
        raise GraphInputError(f"{path}: not a directory; a dump directory is needed ({_RECORD_HINT})")
    if any(os.path.exists(os.path.join(path, f)) for f in FILES):
        _check_files(path)
        m = re.search(r"step(\d+)", path)
        return [(int(m.group(1)) if m else 0, path)]
    found = []
    for step_dir in sorted(os.listdir(path)):
        m = re.fullmatch(r"step(\d+)", step_dir)
        full = os.path.join(path, step_dir)
        if m and os.path.isdir(full):
            rank_dir = _rank_dir(full, rank)
            if rank_dir:
                found.append((int(m.group(1)), rank_dir))
    if not found:
        rank_dir = _rank_dir(path, rank)
        if rank_dir:
            return find_dump_dirs(rank_dir)
        raise GraphInputError(f"{path}: no dump directory (dump.json, construct.json, stack.json) here nor in "
                              f"step*/rank*/ below it; {_RECORD_HINT}")
    for _step, d in found:
        _check_files(d)
    return sorted(found)


def _rank_dir(step_dir: str, rank: int | None) -> str | None:
    ranks = {}
    for d in os.listdir(step_dir):
        m = re.fullmatch(r"rank(\d*)", d)
        if m and os.path.isdir(os.path.join(step_dir, d)):
            ranks[int(m.group(1) or 0)] = os.path.join(step_dir, d)
    if not ranks:
        return None
    if rank is None:
        return ranks[min(ranks)]
    if rank not in ranks:
        raise GraphInputError(f"{step_dir}: no rank{rank} directory (ranks there: {sorted(ranks)})")
    return ranks[rank]


def _check_files(d: str) -> None:
    missing = [f for f in FILES if not os.path.isfile(os.path.join(d, f))]
    if missing:
        raise GraphInputError(f"{d}: missing {', '.join(missing)}; a dump directory needs all of "
                              f"{', '.join(FILES)} ({_RECORD_HINT})")


def _load(d: str, name: str) -> dict:
    path = os.path.join(d, name)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise GraphInputError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise GraphInputError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def build_from_dump(path: str, rank: int | None = None) -> Graph:
    """The graph of the dump directories under ``path`` (see the module docstring)."""
    graph = Graph(path, "dump")
    rows: list[tuple[int, int, list[float]]] = []
    order: dict[str, int] = {}
    steps = []
    for step, d in find_dump_dirs(path, rank):
        steps.append(step)
        dump = _load(d, "dump.json")
        data = dump.get("data")
        if not isinstance(data, dict) or not data:
            raise GraphInputError(f"{os.path.join(d, 'dump.json')}: no \"data\" entries; {_RECORD_HINT}")
        construct, stacks = _load(d, "construct.json"), _load(d, "stack.json")
        _add_nodes(graph, data, construct, stacks, order)
        for name, entry in data.items():
            node = graph.nodes[name]
            for port, tensor in _ports(name, entry):
                meta = Port(port, str(tensor.get("dtype", "")), _shape(tensor.get("shape")),
                            str(tensor.get("type", "")), tensor.get("requires_grad"))
                i = graph.add_port(node, meta)
                rows.append((step, i, _values(tensor)))
    for name, i in order.items():
        graph.nodes[name].order = i
    graph.set_values(steps, rows)
    return graph


def _add_nodes(graph: Graph, data: dict, construct: dict, stacks: dict, order: dict[str, int]) -> None:
    group, group_n = [], [0]

    def close_group() -> None:
        if len(group) >= 2:
            gname = f"Apis_Between_Modules.{group_n[0]}"
            group_n[0] += 1
            graph.add_node(gname, ROOT_NAME, API_LIST)
            kids = graph.root.children
            kids.insert(kids.index(group[0]), kids.pop())  # where its first call was
            for n in group:
                _move(graph, n, gname)
        group.clear()

    # parameter gradients last: msprobe writes their entries when it registers its hooks, before any
    # backward call they hang under (and they come after the backward pass in execution order)
    names = [n for n in data if not n.endswith(".parameters_grad")]
    names += [n for n in data if n.endswith(".parameters_grad")]
    for name in construct:
        if name not in data and construct[name] is not None:
            names.append(name)  # a parent with no statistics of its own
    for name in names:
        parent = construct.get(name)
        if name.endswith(".parameters_grad") and parent is None:
            parent = _last_backward(graph, name)
        if parent is not None and parent not in graph.nodes and parent != "optimizer":
            graph.add_node(parent, construct.get(parent), MODULE if parent.startswith("Module.") else API)
        node_type = MODULE if name.startswith("Module.") else API
        node = graph.add_node(name, parent if parent in graph.nodes else None, node_type)
        if node.parent == ROOT_NAME and node_type == API:
            group.append(name)
        elif node.parent == ROOT_NAME:
            close_group()
        order.setdefault(name, len(order))
        st = stacks.get(name)
        if isinstance(st, list) and not node.stack:
            node.stack = [str(s) for s in st]
    close_group()


def _move(graph: Graph, name: str, new_parent: str) -> None:
    node = graph.nodes[name]
    graph.nodes[node.parent].children.remove(name)
    node.parent = new_parent
    graph.nodes[new_parent].children.append(name)


def _last_backward(graph: Graph, grad_name: str) -> str | None:
    prefix = grad_name[: -len("parameters_grad")] + "backward."
    back = [n for n in graph.nodes if n.startswith(prefix)]
    return back[-1] if back else None


def _ports(name: str, entry: dict):
    """``(port name, tensor dict)`` of one dump entry, in the reference's order."""
    if not isinstance(entry, dict):
        return
    if name.endswith(".parameters_grad"):
        for pname, ts in entry.items():
            for t in ts if isinstance(ts, list) else [ts]:
                if isinstance(t, dict):
                    yield f"parameters_grad.{pname}", t
        return
    for role, key in (("input", "input_args"), ("input", "input"), ("output", "output")):
        items = entry.get(key)
        if isinstance(items, dict):
            items = [items]
        for i, t in enumerate(items or []):
            yield from _one_deep(f"{role}.{i}", t)
    for k, t in (entry.get("input_kwargs") or {}).items():
        yield from _one_deep(f"input.{k}", t)
    for k, t in (entry.get("parameters") or {}).items():
        if isinstance(t, dict):
            yield f"parameters.{k}", t


def _one_deep(port: str, t):
    """A value's port, or its elements' one list deep (``input.0.1``: a list argument, as ``torch.cat``'s)."""
    if isinstance(t, dict) and t.get("type"):
        yield port, t
    elif isinstance(t, list):
        for j, u in enumerate(t):
            if isinstance(u, dict) and u.get("type"):
                yield f"{port}.{j}", u


def _values(tensor: dict) -> list[float]:
    """Max, Min, Mean, Norm of a tensor entry; a number's value stands for all of them."""
    if "value" in tensor and not any(op in tensor for op in OPS):
        v = _num(tensor["value"])
        return [v, v, v, abs(v)]
    return [_num(tensor.get(op)) for op in OPS]


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _shape(v) -> tuple | None:
    return tuple(v) if isinstance(v, list) else None


__all__ = ["FILES", "build_from_dump", "find_dump_dirs"]
