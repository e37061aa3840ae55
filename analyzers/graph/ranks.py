"""Data-parallel ranks of one run, which should agree, compared with each other.

Every rank's graph is compared with the first rank's (exact matching): ``scope="dp"`` compares
parameters and reduced gradients, ``scope="all"`` activations too (ranks fed the same data). The
departing rank is the one whose first divergence comes earliest (docs/graphs.md, "Ranks").
"""

from __future__ import annotations

from .compare import INPUT_ROLES, OUTPUT_ROLES, Comparison, compare
from .model import Graph, GraphInputError

SCOPES = {"dp": ((), ("parameters", "parameters_grad")), "all": (INPUT_ROLES, OUTPUT_ROLES)}


def compare_ranks(graphs: dict[int, Graph], *, scope: str = "dp", threshold: float = 0.01) -> dict:
    """The verdict over ranks: per rank its first divergence from the first rank, and who departs."""
    return compare_ranks_full(graphs, scope=scope, threshold=threshold)[0]


def compare_ranks_full(graphs: dict[int, Graph], *, scope: str = "dp",
                       threshold: float = 0.01) -> tuple[dict, dict[int, Comparison]]:
    """:func:`compare_ranks`'s verdict and each rank's Comparison with the first rank."""
    if scope not in SCOPES:
        raise GraphInputError(f"scope {scope!r}: expected one of {sorted(SCOPES)}")
    if len(graphs) < 2:
        raise GraphInputError(f"ranks: the run has {len(graphs)} rank(s) with statistics; two or more are needed")
    ranks = sorted(graphs)
    base = ranks[0]
    ins, outs = SCOPES[scope]
    per_rank: dict[int, Comparison] = {r: compare(graphs[r], graphs[base], threshold=threshold, input_roles=ins,
                                                  output_roles=outs) for r in ranks[1:]}

    def key(c: Comparison):
        f = c.first
        return (f["step"], c.debug.nodes[f["node"]].order) if f else None

    keys = {r: key(c) for r, c in per_rank.items()}
    found = [k for k in keys.values() if k is not None]
    departs = None
    if found:
        earliest = min(found)
        at = [r for r, k in keys.items() if k == earliest]
        rank = base if len(ranks) >= 3 and len(at) == len(ranks) - 1 else at[0]
        first = per_rank[at[0]].first
        departs = {"rank": rank, "step": first["step"], "node": first["node"], "compared_with": base,
                   "output_error": first["output_error"], "ranks_at_this_point": at}
    return {
        "scope": scope, "threshold": threshold, "ranks": ranks, "base_rank": base, "departs": departs,
        "per_rank": {str(r): {"first_divergence": c.first, "matched": len(c.pairs) - 1,
                              "unmatched": len(c.unmatched_debug)} for r, c in per_rank.items()},
    }, per_rank


__all__ = ["SCOPES", "compare_ranks", "compare_ranks_full"]
