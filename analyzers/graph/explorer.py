"""Model Explorer's graph JSON and node data, from a graph or a comparison (pure: returns dicts).

Each graph node becomes a Model Explorer node whose ``namespace`` is its ancestors' names, with
edges in execution order and its port statistics at one step as attributes; the node data is that
step's precision index (none where unmatched).
"""

from __future__ import annotations

import math

from .compare import Comparison
from .model import ROOT_NAME, Graph

THRESHOLDS = [{"value": 0.25, "bgColor": "#dff3df"}, {"value": 0.75, "bgColor": "#ffe08a"},
              {"value": 1.0, "bgColor": "#ff8a80"}]


def _num(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.6g}"


def explorer_graph(graph: Graph, step_index: int = 0, graph_id: str = "debug") -> dict:
    """``{"label", "graphs": [{"id", "nodes"}]}`` of ``graph`` with its statistics at ``steps[step_index]``."""
    names = [n for n in graph.preorder() if n != ROOT_NAME]
    ordered = [n.name for n in graph.execution_order()]
    previous = {b: a for a, b in zip(ordered, ordered[1:], strict=False)}
    nodes = []
    for name in names:
        node = graph.nodes[name]
        stats = graph.port_stats(step_index, name) if graph.steps else {}
        attrs = [{"key": "node_type", "value": str(node.node_type)}, {"key": "order", "value": str(node.order)}]
        outputs = []
        for k, port in enumerate(node.ports):
            line = ", ".join(f"{op} {_num(v)}" for op, v in stats.get(port.name, {}).items())
            attrs.append({"key": port.name, "value": line})
            if port.role in ("output", "parameters_grad"):
                outputs.append({"id": str(k), "attrs": [{"key": "tensor", "value": port.name},
                                                        {"key": "statistics", "value": line}]})
        edges = [{"sourceNodeId": previous[name], "sourceNodeOutputId": "0", "targetNodeInputId": "0"}] \
            if name in previous else []
        nodes.append({"id": name, "label": name, "namespace": "/".join(graph.ancestors(name)), "attrs": attrs,
                      "incomingEdges": edges, "outputsMetadata": outputs})
    step = graph.steps[step_index] if graph.steps else None
    return {"label": f"{graph.source} (step {step})", "graphs": [{"id": graph_id, "nodes": nodes}]}


def explorer_node_data(cmp: Comparison, step_index: int, graph_id: str = "debug") -> dict:
    """``{graph_id: {"results": {node id: {"value"}}, "thresholds"}}``: precision at one compared step."""
    results = {name: {"value": v} for name, v in cmp.node_precision(step_index).items()
               if name != ROOT_NAME and not math.isnan(v)}
    return {graph_id: {"results": results, "thresholds": THRESHOLDS}}


__all__ = ["THRESHOLDS", "explorer_graph", "explorer_node_data"]
