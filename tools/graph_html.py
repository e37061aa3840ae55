"""The graph viewer: one self-contained HTML file (no network; opens from ``file://``).

The page gets the two hierarchies (names, types, parents, ports, pairing), the precision index of
every compared step, and the port statistics of up to ``max_steps`` steps (first, last, the first
divergent step and steps spread between), as base64 arrays; trees are drawn lazily, a node's
children when it is first expanded, so 10,000 nodes stay responsive.
"""

from __future__ import annotations

import base64
import os
from html import escape

import numpy as np
import orjson
from trainrec.analyzers.graph import Comparison, Graph
from trainrec.analyzers.graph.compare import JUMP

_HERE = os.path.dirname(os.path.abspath(__file__))


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _side(graph: Graph, step_indices: list[int], stack_frames: int | None) -> tuple[dict, dict[str, int]]:
    names = graph.preorder()
    index = {n: i for i, n in enumerate(names)}
    nodes = [graph.nodes[n] for n in names]
    ports = [[p.name for p in n.ports] for n in nodes]
    meta = [[[p.dtype, list(p.shape) if p.shape is not None else None] for p in n.ports] for n in nodes]
    port_idx = [[graph.port_index[(n.name, p.name)] for p in n.ports] for n in nodes]
    vals = graph.values[step_indices].astype("<f4") if step_indices else np.zeros((0, 0, 4), "<f4")
    stacks = [(n.stack if stack_frames is None else n.stack[-stack_frames:]) for n in nodes]
    return {
        "source": graph.source, "names": names, "types": [n.node_type for n in nodes],
        "parents": [index[n.parent] if n.parent is not None else -1 for n in nodes],
        "order": [n.order for n in nodes], "ports": ports, "meta": meta, "portIdx": port_idx,
        "nPorts": len(graph.port_keys), "values": _b64(vals), "stacks": stacks,
    }, index


def pick_steps(n: int, must: list[int], max_steps: int) -> list[int]:
    """At most ``max_steps`` of ``n`` step indices: the first, the last, ``must`` and steps spread between."""
    if n <= max_steps:
        return list(range(n))
    chosen = {0, n - 1, *[m for m in must if 0 <= m < n]}
    for k in np.linspace(0, n - 1, max(2, max_steps)).astype(int):
        if len(chosen) >= max_steps:
            break
        chosen.add(int(k))
    return sorted(chosen)


def _page(title: str, payload: dict) -> str:
    with open(os.path.join(_HERE, "graph_page.js"), encoding="utf-8") as f:
        js = f.read()
    with open(os.path.join(_HERE, "graph_page.css"), encoding="utf-8") as f:
        css = f.read()
    # (orjson writes NaN and inf as null; "</" escaped so no string can close the script element)
    data = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY).decode().replace("</", "<\\/")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{css}</style></head><body>\n<script id=\"graph-data\" type=\"application/json\">{data}</script>\n"
            f"<script>{js}</script></body></html>\n")


def _write(path: str, text: str) -> str:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def write_build_html(graph: Graph, path: str, max_steps: int = 20) -> str:
    picked = pick_steps(len(graph.steps), [], max_steps)
    side, _ = _side(graph, picked, 3)
    payload = {"mode": "build", "title": graph.source, "steps": [graph.steps[i] for i in picked],
               "allSteps": graph.steps, "debug": side}
    return _write(path, _page(f"trainrec graph: {graph.source}", payload))


def compare_payload(cmp: Comparison, max_steps: int = 20, overflow: bool = False,
                    complete_stack: bool = False) -> dict:
    """What the page reads of one comparison."""
    frames = None if complete_stack else 3
    first_s = [i for i, (d, _) in enumerate(cmp.steps) if cmp.first and d == cmp.first["step"]]
    picked = pick_steps(len(cmp.steps), first_s, max_steps)
    dsteps = [cmp.debug.steps.index(cmp.steps[i][0]) for i in picked]
    bsteps = [cmp.bench.steps.index(cmp.steps[i][1]) for i in picked]
    debug, dindex = _side(cmp.debug, dsteps, frames)
    bench, bindex = _side(cmp.bench, bsteps, frames)
    debug["match"] = [bindex.get(cmp.pairs.get(n, ""), -1) for n in debug["names"]]
    bench["match"] = [-1] * len(bench["names"])
    for d, b in cmp.pairs.items():
        bench["match"][bindex[b]] = dindex[d]
    # precision codes per compared step and debug node: 0 pass, 1 warning, 2 error, 255 no value
    codes = np.full((len(cmp.steps), len(debug["names"])), 255, dtype=np.uint8)
    for s in range(len(cmp.steps)):
        for name, v in cmp.node_precision(s).items():
            if not np.isnan(v):
                codes[s, dindex[name]] = 0 if v == 0 else 1 if v == 0.5 else 2
    ov = np.zeros((len(cmp.steps), len(debug["names"])), dtype=np.uint8)
    if overflow:
        cols = [dindex[n] for n in cmp.nodes]
        ov[:, cols] = cmp.overflow
    payload = {
        "mode": "compare", "title": f"{cmp.debug.source} vs {cmp.bench.source}",
        "steps": [cmp.steps[i][0] for i in picked], "allSteps": [d for d, _ in cmp.steps],
        "debug": debug, "bench": bench, "precision": _b64(codes), "overflow": _b64(ov) if overflow else None,
        "staticError": cmp.static_error, "verdict": cmp.verdict(), "jump": JUMP,
    }
    return payload


def write_compare_html(cmp: Comparison, path: str, max_steps: int = 20, overflow: bool = False,
                       complete_stack: bool = False) -> str:
    payload = compare_payload(cmp, max_steps, overflow, complete_stack)
    return _write(path, _page(f"trainrec graph: {payload['title']}", payload))


def write_ranks_html(per_rank: dict[int, Comparison], base_rank: int, path: str, max_steps: int = 20) -> str:
    """One page, a rank selector: each rank's comparison with ``base_rank`` (every page holds its own sides)."""
    pages = [{"rank": r, **compare_payload(c, max_steps)} for r, c in sorted(per_rank.items())]
    payload = {"mode": "compare", "title": pages[0]["title"], "baseRank": base_rank, "rankPages": pages}
    return _write(path, _page(f"trainrec graph ranks: {pages[0]['debug']['source']}", payload))
