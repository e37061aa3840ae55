"""Pairing the nodes of two graphs, the reference's ways.

* :func:`match_exact`: pre-order walk of the debug side; a node pairs with the bench node of the same
  name (call counts included) whose ancestor names are equal and whose inputs and outputs agree in
  number, type and shape (shape only where both sides recorded one).
* :func:`match_fuzzy` (``-f``): modules pair by name without the ancestor check; API calls lose their
  call counters and pair by (counterpart of their parent, name without counter, order within the parent).

Both return ``{debug name: bench name}``; the root always pairs with the root.
"""

from __future__ import annotations

import re
from collections import defaultdict

from .model import API, ROOT_NAME, Graph, Node

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
    key = _COUNTER.sub("", name, count=1)
    if key.startswith("Tensor.__"):
        head, _, rest = key[len("Tensor."):].partition(".")
        if head in _OPERATORS:
            key = f"Tensor.{_OPERATORS[head]}.{rest}" if rest else f"Tensor.{_OPERATORS[head]}"
    return key


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
    return pairs


__all__ = ["api_key", "io_signature", "match_exact", "match_fuzzy", "pair_apis", "same_signature"]
