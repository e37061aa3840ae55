"""Pairing the nodes of two graphs, the reference's ways.

:func:`match_exact` pairs nodes of the same name, ancestors and port signature; :func:`match_fuzzy`
(``-f``) pairs modules by name and API calls by parent, name without counter and order, plus the
backward calls msprobe places elsewhere (:func:`pair_displaced_backward`). Both return
``{debug name: bench name}``; the root always pairs with the root. Rules: docs/graphs.md ("Matching").
"""

from __future__ import annotations

import re
from collections import defaultdict

from .model import API, MODULE, ROOT_NAME, Graph, Node

_COUNTER = re.compile(r"\.\d+(?=\.(forward|backward)$)|\.\d+$")


def io_signature(node: Node) -> list[tuple]:
    """``(port, type, shape)`` of the node's inputs and outputs (shape None where unknown)."""
    return [(p.name, p.type, p.shape) for p in node.ports if p.role in ("input", "output")]


def same_signature(a: Node, b: Node) -> bool:
    sa, sb = io_signature(a), io_signature(b)
    if len(sa) != len(sb):
        return False
    for (na, ta, ha), (nb, tb, hb) in zip(sa, sb, strict=True):
        if na != nb or (ta and tb and ta != tb) or (ha is not None and hb is not None and ha != hb):
            return False
    return True


def match_exact(debug: Graph, bench: Graph) -> dict[str, str]:
    pairs = {ROOT_NAME: ROOT_NAME}
    for name in debug.preorder():
        if name == ROOT_NAME or name not in bench.nodes:
            continue
        if debug.ancestors(name) == bench.ancestors(name) and same_signature(debug.nodes[name], bench.nodes[name]):
            pairs[name] = name
    return pairs


# Tensor operators as the reference names them (it wraps ``Tensor.__mul__``) and as torch hands them to a
# TorchFunctionMode (``Tensor.mul``), which trainrec's API level records: one key for both
_OPERATORS = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__isub__": "sub_",
    "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div", "__div__": "div",
    "__itruediv__": "div_", "__idiv__": "div_", "__rtruediv__": "__rdiv__", "__pow__": "pow",
    "__matmul__": "matmul", "__neg__": "neg", "__abs__": "abs", "__mod__": "remainder", "__lt__": "lt",
    "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__ne__": "ne", "__and__": "bitwise_and",
    "__or__": "bitwise_or", "__xor__": "bitwise_xor",
}


def api_key(name: str) -> str:
    """An API call's name without its call counter: ``Functional.linear.0.forward`` -> ``Functional.linear.forward``
    (a tensor operator by its method's name: ``Tensor.__mul__`` -> ``Tensor.mul``)."""
    return _method_name(_COUNTER.sub("", name, count=1))


def _method_name(name: str) -> str:
    """``name`` with a tensor operator by its method's name (``Tensor.__mul__.0.backward`` -> ``Tensor.mul.0.backward``)."""
    if name.startswith("Tensor.__"):
        head, _, rest = name[len("Tensor."):].partition(".")
        if head in _OPERATORS:
            return f"Tensor.{_OPERATORS[head]}.{rest}" if rest else f"Tensor.{_OPERATORS[head]}"
    return name


def match_fuzzy(debug: Graph, bench: Graph) -> dict[str, str]:
    pairs = {ROOT_NAME: ROOT_NAME}
    for name in debug.preorder():  # modules and collections: by name alone
        node = debug.nodes[name]
        if name != ROOT_NAME and node.node_type != API and name in bench.nodes:
            pairs[name] = name
    return pair_apis(debug, bench, pairs)


def pair_apis(debug: Graph, bench: Graph, pairs: dict[str, str]) -> dict[str, str]:
    """Add to ``pairs`` the API calls of paired parents, by (name without counter, order within the parent)."""
    bench_keys: dict[tuple, str] = {}
    for parent in bench.preorder():
        counts: dict[str, int] = defaultdict(int)
        for child in bench.nodes[parent].children:
            if bench.nodes[child].node_type == API:
                key = api_key(child)
                bench_keys[(parent, key, counts[key])] = child
                counts[key] += 1
    taken = set(pairs.values())
    for parent in debug.preorder():
        counts = defaultdict(int)
        other = pairs.get(parent)
        for child in debug.nodes[parent].children:
            if debug.nodes[child].node_type != API:
                continue
            key = api_key(child)
            hit = bench_keys.get((other, key, counts[key])) if other is not None else None
            counts[key] += 1
            if (child not in pairs and hit is not None and hit not in taken
                    and same_signature(debug.nodes[child], bench.nodes[hit])):
                pairs[child] = hit
                taken.add(hit)
    if {debug.kind, bench.kind} == {"run", "dump"}:
        pair_displaced_backward(debug, bench, pairs)
    return pairs


def pair_displaced_backward(debug: Graph, bench: Graph, pairs: dict[str, str]) -> dict[str, str]:
    """Add to ``pairs`` the backward API calls (``...backward``) that a run and a msprobe dump place apart.

    msprobe 1.2.1 puts the backward of a call made in the first layer under an ancestor module (or at
    the top), trainrec under that layer's backward call (docs/graphs.md, "Matching"). A still unpaired
    backward call pairs with the other side's of the same name and counter and the same inputs and
    outputs, where the dump's parent is a proper ancestor of the counterpart of the run's parent."""
    taken = set(pairs.values())
    by_name: dict[str, str | None] = {}
    for name, node in bench.nodes.items():
        if node.node_type == API and name.endswith(".backward") and name not in taken:
            key = _method_name(name)
            by_name[key] = None if key in by_name else name  # (two of one name: neither)
    inverse = {b: d for d, b in pairs.items()}
    for name in debug.preorder():
        node = debug.nodes[name]
        if node.node_type != API or not name.endswith(".backward") or name in pairs:
            continue
        hit = by_name.get(_method_name(name))
        if hit is None or hit in taken or not same_signature(node, bench.nodes[hit]):
            continue
        if debug.kind == "run":
            placed_apart = _above(bench, _module_parent(bench, hit), pairs.get(node.parent))
        else:
            placed_apart = _above(debug, _module_parent(debug, name), inverse.get(bench.nodes[hit].parent))
        if placed_apart:
            pairs[name] = hit
            taken.add(hit)
    return pairs


def _module_parent(graph: Graph, name: str) -> str:
    """The nearest module (or the root) above ``name``, past collections (``Apis_Between_Modules.N``)."""
    parent = graph.nodes[name].parent
    while parent != ROOT_NAME and graph.nodes[parent].node_type != MODULE:
        parent = graph.nodes[parent].parent
    return parent


def _above(graph: Graph, upper: str, name: str | None) -> bool:
    """Whether ``upper`` is a proper ancestor of the (module) node ``name``, the root included."""
    if name is None or name == ROOT_NAME or name not in graph.nodes:
        return False
    return upper == ROOT_NAME or upper in graph.ancestors(name)


__all__ = ["api_key", "io_signature", "match_exact", "match_fuzzy", "pair_apis", "pair_displaced_backward",
           "same_signature"]
