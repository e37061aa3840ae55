"""Mapping files: the reference's layer mapping (``-lm mapping.yaml``) and a plain node mapping.

A layer mapping ``{ClassName: {debug attribute: bench attribute}}`` (``TopLayer``: the model) serves
code bases that name modules differently: debug module paths are rewritten segment by segment
under each segment's owning class (docs/graphs.md, "Matching"). A node mapping is
``{debug node name: bench node name}``. tools/ parses the files; these take the parsed dicts.
"""

from __future__ import annotations

import re

from .matching import pair_apis
from .model import Graph, GraphInputError

_MODULE = re.compile(r"^Module\.(?:(?P<path>.+)\.)?(?P<cls>[^.]+)\.(?P<call>forward\.\d+|backward\.\d+|parameters_grad)$")


def module_classes(graph: Graph) -> dict[str, str]:
    """``{module path: class}`` read off the graph's module node names (the root's path is "")."""
    out = {}
    for name in graph.nodes:
        m = _MODULE.match(name)
        if m:
            out.setdefault(m.group("path") or "", m.group("cls"))
    return out


def check_layer_mapping(mapping, where: str) -> dict[str, dict[str, str]]:
    if not isinstance(mapping, dict) or not all(isinstance(v, dict) for v in mapping.values()):
        raise GraphInputError(f"{where}: expected a mapping of class names to {{debug attribute: bench attribute}}")
    return {str(k): {str(a): str(b) for a, b in v.items()} for k, v in mapping.items()}


def pair_by_layer_mapping(debug: Graph, bench: Graph, mapping: dict[str, dict[str, str]], pairs: dict[str, str],
                          where: str = "layer mapping") -> dict[str, str]:
    """Add module pairs found through ``mapping`` (and the API calls inside them) to ``pairs``.
    Raises GraphInputError where the mapping names no class of the debug side."""
    classes = module_classes(debug)
    root_class = classes.get("", "")
    known = set(classes.values()) | {"TopLayer"}
    if not set(mapping) & known:
        raise GraphInputError(f"{where} names no class of {debug.source} (its classes: "
                              f"{', '.join(sorted(known)[:12])}); nothing would be mapped")
    taken = set(pairs.values())
    for name in debug.preorder():
        m = _MODULE.match(name)
        if not m or name in pairs:
            continue
        segments = (m.group("path") or "").split(".") if m.group("path") else []
        mapped = []
        for i, seg in enumerate(segments):
            owner = classes.get(".".join(segments[:i]), "") if i else root_class
            table = mapping.get(owner) or (mapping.get("TopLayer") if i == 0 else None) or {}
            mapped.append(table.get(seg, seg))
        path = ".".join(s for s in ".".join(mapped).split(".") if s)
        target = f"Module.{path + '.' if path else ''}{m.group('cls')}.{m.group('call')}"
        if target in bench.nodes and target not in taken:
            pairs[name] = target
            taken.add(target)
    return pair_apis(debug, bench, pairs)


def pair_by_node_mapping(debug: Graph, bench: Graph, mapping, pairs: dict[str, str],
                         where: str = "node mapping") -> dict[str, str]:
    """Add ``{debug node: bench node}`` pairs (they win over matching). Raises GraphInputError where
    the file is not such a mapping or none of its entries names a node of both sides."""
    if not isinstance(mapping, dict):
        raise GraphInputError(f"{where}: expected {{debug node name: bench node name}}")
    hits = {str(d): str(b) for d, b in mapping.items() if str(d) in debug.nodes and str(b) in bench.nodes}
    if mapping and not hits:
        first = next(iter(mapping))
        raise GraphInputError(f"{where}: none of its {len(mapping)} entries names a node of both sides "
                              f"(e.g. {first!r} -> {mapping[first]!r})")
    for d, b in hits.items():
        for k in [k for k, v in pairs.items() if v == b]:
            del pairs[k]
        pairs[d] = b
    return pairs


__all__ = ["check_layer_mapping", "module_classes", "pair_by_layer_mapping", "pair_by_node_mapping"]
