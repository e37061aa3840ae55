"""The reference viewer's ``.vis`` JSON (tb-graph-ascend), from a comparison or one graph (pure: dicts).

``{"NPU": {"root", "node"}, "Bench": {...}, "Colors", "task": "summary", "MicroSteps", "ToolTip",
"OverflowCheck"}`` (one graph: ``root``/``node`` at the top level). A node holds its type, parent,
children, ``matched_node_link`` (the counterpart's ancestors ending with its name; empty when
unmatched), ``data`` (precision index, overflow level), ``input_data``/``output_data`` keyed
``{node}.input.N`` with the statistics and, on the debug side, the errors; all at one step.
"""

from __future__ import annotations

import json
import math

from .compare import ERR_NAMES, Comparison
from .model import ROOT_NAME, Graph

COLORS = {"#DFF3DF": {"value": [0, 0.2], "description": "pass: outputs agree with the bench side"},
          "#FFE08A": {"value": [0.2, 0.6], "description": "warning: output error over 10x the input error"},
          "#FF8A80": {"value": [0.6, 1], "description": "error: outputs differ while inputs agree, or NaN/Inf"}}
NPU_PREFIX, BENCH_PREFIX = "N___", "B___"  # the viewer's side prefixes in matched_node_link
TOOLTIP = {"precision_index": "1 error, 0.5 warning, 0 pass (the reference's summary rules)",
           "NormRelativeErr": "|debug Norm - bench Norm| / |bench Norm|"}


def _clean(v: float):
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v


def _tensors(graph: Graph, step_index: int, name: str, errors: dict | None) -> tuple[dict, dict]:
    node = graph.nodes[name]
    stats = graph.port_stats(step_index, name) if graph.steps else {}
    inputs, outputs = {}, {}
    for port in node.ports:
        entry = {"type": port.type or "torch.Tensor", "dtype": port.dtype, "shape": list(port.shape or []),
                 "requires_grad": port.requires_grad}
        entry.update({op: _clean(v) for op, v in stats.get(port.name, {}).items()})
        if errors and port.name in errors:
            entry.update({k: _clean(float(v)) for k, v in zip(ERR_NAMES, errors[port.name], strict=True)})
        key = f"{name}.{port.name}"
        (outputs if port.role in ("output", "parameters_grad") else inputs)[key] = entry
    return inputs, outputs


def _side(graph: Graph, step_index: int, links: dict[str, list[str]], data: dict[str, dict],
          errors: dict[str, dict]) -> dict:
    nodes = {}
    for name in graph.preorder():
        node = graph.nodes[name]
        inputs, outputs = _tensors(graph, step_index, name, errors.get(name))
        nodes[name] = {
            "id": name, "node_type": node.node_type, "upnode": node.parent or "", "subnodes": list(node.children),
            "matched_node_link": links.get(name, []), "data": data.get(name, {}), "input_data": inputs,
            "output_data": outputs, "stack_info": list(node.stack), "micro_step_id": 0, "suggestions": {},
        }
    return {"root": ROOT_NAME, "node": nodes}


def _link(graph: Graph, name: str, prefix: str) -> list[str]:
    """The counterpart's ancestors ending with its name, each with the viewer's side prefix."""
    path = [ROOT_NAME, *graph.ancestors(name), name] if name != ROOT_NAME else [ROOT_NAME]
    return [prefix + n for n in path]


def vis_compare(cmp: Comparison, step_index: int, overflow: bool = False) -> dict:
    """The ``.vis`` of a comparison at compared step ``step_index``."""
    d_step = cmp.debug.steps.index(cmp.steps[step_index][0])
    b_step = cmp.bench.steps.index(cmp.steps[step_index][1])
    precision = cmp.node_precision(step_index)
    over = dict(zip(cmp.nodes, cmp.overflow[step_index].tolist(), strict=True))
    data = {}
    for name in cmp.pairs:
        p = precision.get(name, float("nan"))
        data[name] = {"precision_index": None if math.isnan(p) else p}
        if overflow and over.get(name):
            data[name]["overflow_level"] = ["", "medium", "high", "critical"][over[name]]
    errors: dict[str, dict] = {}
    for k, (dp, _bp) in enumerate(cmp.port_pairs):
        node, port = cmp.debug.port_keys[dp]
        errors.setdefault(node, {})[port] = cmp.errors[step_index, k]
    d_links = {d: _link(cmp.bench, b, BENCH_PREFIX) for d, b in cmp.pairs.items()}
    b_links = {b: _link(cmp.debug, d, NPU_PREFIX) for d, b in cmp.pairs.items()}
    return {"NPU": _side(cmp.debug, d_step, d_links, data, errors),
            "Bench": _side(cmp.bench, b_step, b_links, {}, {}),
            "Colors": COLORS, "task": "summary", "MicroSteps": 1, "ToolTip": TOOLTIP, "OverflowCheck": overflow,
            "StepList": [d for d, _ in cmp.steps], "Step": cmp.steps[step_index][0]}


def vis_build(graph: Graph, step_index: int) -> dict:
    """The single-graph ``.vis`` of one graph at ``steps[step_index]``."""
    side = _side(graph, step_index, {}, {}, {})
    return {**side, "task": "summary", "MicroSteps": 1, "ToolTip": {}, "OverflowCheck": False,
            "Colors": COLORS}




def vis_db_rows(comparisons: list[tuple[int, Comparison, list[int]]],
                overflow: bool = False) -> tuple[dict, list[str], list[tuple]]:
    """What ``.vis.db`` holds (tb-graph-ascend's SQLite form) for ``(rank, comparison, compared step indices)``:
    ``(config, stacks, node rows)``; rows follow :data:`DB_NODE_COLUMNS`, ``stack_id`` indexes ``stacks``.
    Matched links carry plain names here (the plugin looks the last one up as it is)."""
    stacks: dict[str, int] = {}
    rows: list[tuple] = []
    steps: set[int] = set()
    for rank, cmp, step_indices in comparisons:
        for s in step_indices:
            steps.add(cmp.steps[s][0])
            vis = vis_compare(cmp, s, overflow)
            for source in ("NPU", "Bench"):
                for order, (name, node) in enumerate(vis[source]["node"].items()):
                    stack = _json_list(node["stack_info"])
                    sid = stacks.setdefault(stack, len(stacks))
                    link = [n[len(NPU_PREFIX):] for n in node["matched_node_link"]]
                    data = node["data"]
                    rows.append((1, order, name, node["node_type"], node["upnode"] if name != ROOT_NAME else "",
                                 _json_list(node["subnodes"]), data.get("precision_index"),
                                 data.get("overflow_level"), 0, _json_list(link), sid, "[]", "[]", 0,
                                 _json_obj(node["input_data"]), _json_obj(node["output_data"]), source, "",
                                 cmp.steps[s][0], rank, 0))
    first = comparisons[0][1]
    config = {"graph_type": "compare", "task": "summary", "tool_tip": _json_obj(TOOLTIP), "micro_steps": 1,
              "overflow_check": int(overflow), "node_colors": _json_obj(COLORS),
              "rank_list": _json_list(sorted(r for r, _, _ in comparisons)), "step_list": _json_list(sorted(steps)),
              "source": f"{first.debug.source} vs {first.bench.source}"}
    return config, list(stacks), rows


DB_NODE_COLUMNS = ("graph_id", "node_order", "node_name", "node_type", "up_node", "sub_nodes", "precision_index",
                   "overflow_level", "micro_step_id", "matched_node_link", "stack_id", "parallel_merge_info",
                   "matched_distributed", "modified", "input_data", "output_data", "data_source", "dump_data_dir",
                   "step", "rank", "is_distributed")


def _json_list(v) -> str:
    return json.dumps(list(v))


def _json_obj(v) -> str:
    return json.dumps(v, allow_nan=False)


__all__ = ["COLORS", "DB_NODE_COLUMNS", "vis_build", "vis_compare", "vis_db_rows"]
