"""trainrec.analyzers.graph: hierarchical comparison graphs (msprobe's graph visualisation, and beyond).

* :mod:`.model`: the graph (nodes, ports, statistics over steps), columnar.
* :mod:`.from_run` / :mod:`.from_dump`: a graph from a trainrec run or from the reference's dump directory.
* :mod:`.matching`: pairing nodes of two graphs (exact, fuzzy).
* :mod:`.compare`: errors, precision index, overflow and the first divergent node and step.
* :mod:`.ranks`: data-parallel ranks of one run compared with each other.
"""

from __future__ import annotations

from .compare import Comparison, compare
from .from_dump import build_from_dump
from .from_run import build_from_run
from .matching import match_exact, match_fuzzy
from .model import Graph, GraphInputError, Node, Port

__all__ = [
    "Comparison",
    "Graph",
    "GraphInputError",
    "Node",
    "Port",
    "build_from_dump",
    "build_from_run",
    "compare",
    "match_exact",
    "match_fuzzy",
]
