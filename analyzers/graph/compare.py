"""Comparing two graphs over every step they share: errors, precision index, overflow, first divergence.

Per paired port and step, the absolute and relative error of each statistic; per paired node and
step, the reference's precision index (1 error, 0.5 warning, 0 pass) and, on the debug side, the
overflow level; then the first divergent step and node. The rules and thresholds
(:data:`NOISE_FLOOR`, :data:`JUMP`) are in docs/graphs.md ("Errors and the precision index").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .layer_mapping import pair_by_layer_mapping, pair_by_node_mapping
from .matching import match_exact, match_fuzzy
from .model import OPS, ROOT_NAME, Graph, GraphInputError

INPUT_ROLES = ("input", "parameters")
OUTPUT_ROLES = ("output", "parameters_grad")
NOISE_FLOOR = 1e-4
JUMP = 1e4
ERR_NAMES = [f"{op}AbsErr" for op in OPS] + [f"{op}RelativeErr" for op in OPS]


@dataclass
class Comparison:
    debug: Graph
    bench: Graph
    pairs: dict[str, str]  # debug node -> bench node
    steps: list[tuple[int, int]]  # (debug step, bench step) compared, in order
    nodes: list[str]  # paired debug nodes with ports compared (columns of the arrays below)
    precision: np.ndarray  # [step, node] 0 / 0.5 / 1, NaN without values
    overflow: np.ndarray  # [step, node] 0..3
    input_err: np.ndarray  # [step, node] worst input NormRelativeErr (NaN: no inputs)
    output_err: np.ndarray  # [step, node]
    port_pairs: list[tuple[int, int]]  # (debug port index, bench port index)
    errors: np.ndarray  # [step, port pair, 8]: the ERR_NAMES
    static_error: dict[str, str]  # debug node -> what differs in dtype/shape/requires_grad
    threshold: float
    first: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def unmatched_debug(self) -> list[str]:
        return [n for n in self.debug.preorder() if n not in self.pairs]

    @property
    def unmatched_bench(self) -> list[str]:
        paired = set(self.pairs.values())
        return [n for n in self.bench.preorder() if n not in paired]

    def node_precision(self, step_index: int) -> dict[str, float]:
        """Precision index of every paired debug node at one step, collections taking their worst child."""
        own = {n: float(v) for n, v in zip(self.nodes, self.precision[step_index], strict=True)}
        out: dict[str, float] = {}

        def walk(name: str) -> float:
            worst = own.get(name, float("nan"))
            for child in self.debug.nodes[name].children:
                v = walk(child)
                if not np.isnan(v) and (np.isnan(worst) or (name not in own and v > worst)):
                    worst = v
            if name in self.pairs:
                out[name] = worst
            return worst

        walk(ROOT_NAME)
        return out

    def verdict(self) -> dict:
        """The JSON-able summary: sizes, unmatched counts, worst precision per step, first divergence."""
        worst = [float(np.nanmax(row)) if np.isfinite(row).any() else None for row in self.precision]
        return {
            "debug": self.debug.source, "bench": self.bench.source,
            "debug_nodes": len(self.debug.nodes) - 1, "bench_nodes": len(self.bench.nodes) - 1,
            "matched": len(self.pairs) - 1,
            "unmatched_debug": len(self.unmatched_debug), "unmatched_bench": len(self.unmatched_bench),
            "steps": [d for d, _ in self.steps], "worst_precision_per_step": worst,
            "errors_per_step": [int(np.sum(row == 1)) for row in self.precision],
            "threshold": self.threshold, "first_divergence": self.first, "notes": list(self.notes),
        }


def compare(debug: Graph, bench: Graph, *, fuzzy: bool = False, threshold: float = 0.01,
            layer_mapping: dict | None = None, mapping: dict | None = None,
            input_roles=INPUT_ROLES, output_roles=OUTPUT_ROLES, where_mapping: tuple = (None, None)) -> Comparison:
    """Compare ``debug`` against ``bench``. ``layer_mapping``: the reference's ``-lm`` mapping (see
    :mod:`.layer_mapping`); ``mapping``: ``{debug name: bench name}`` pairs that win over matching.
    Raises GraphInputError where no node pairs (two different models) or no step is shared."""
    pairs = match_fuzzy(debug, bench) if fuzzy else match_exact(debug, bench)
    if layer_mapping is not None:
        pairs = pair_by_layer_mapping(debug, bench, layer_mapping, pairs, f"-lm {where_mapping[0] or 'mapping'}")
    if mapping is not None:
        pairs = pair_by_node_mapping(debug, bench, mapping, pairs, f"--mapping {where_mapping[1] or 'mapping'}")
    if len(pairs) <= 1:
        raise GraphInputError(f"no node of {debug.source} pairs with one of {bench.source} (first names: "
                              f"{_first(debug)} vs {_first(bench)}): two different models? Compare runs of the "
                              f"same model, or try fuzzy matching (-f) or a layer mapping (-lm)")
    notes = []
    common = sorted(set(debug.steps) & set(bench.steps))
    if common:
        steps = [(s, s) for s in common]
    else:
        steps = list(zip(debug.steps, bench.steps, strict=False))
        if steps:
            notes.append("the two sides share no step number: steps compared by position")
    if not steps:
        raise GraphInputError(f"{debug.source} or {bench.source} has no recorded step to compare")
    di = [debug.steps.index(d) for d, _ in steps]
    bi = [bench.steps.index(b) for _, b in steps]
    nodes, port_pairs, roles, col_of = [], [], [], []
    static_error: dict[str, str] = {}
    for d, b in pairs.items():
        dn, bn = debug.nodes[d], bench.nodes[b]
        k = None
        for p in dn.ports:
            q = bn.port(p.name)
            if q is None:
                continue
            if k is None:
                k = len(nodes)
                nodes.append(d)
            port_pairs.append((debug.port_index[(d, p.name)], bench.port_index[(b, q.name)]))
            roles.append(0 if p.role in input_roles else 1 if p.role in output_roles else 2)
            col_of.append(k)
            diff = [f"{w} {x} vs {y}" for w, x, y in (("dtype", p.dtype, q.dtype), ("shape", p.shape, q.shape),
                                                      ("requires_grad", p.requires_grad, q.requires_grad))
                    if x not in ("", None) and y not in ("", None) and x != y]
            if diff:
                static_error.setdefault(d, f"{p.name}: " + ", ".join(diff))
    dp = np.asarray([p for p, _ in port_pairs], dtype=np.int64)
    bp = np.asarray([q for _, q in port_pairs], dtype=np.int64)
    dv = debug.values[np.ix_(di, dp)] if len(dp) else np.zeros((len(steps), 0, len(OPS)))
    bv = bench.values[np.ix_(bi, bp)] if len(bp) else np.zeros((len(steps), 0, len(OPS)))
    with np.errstate(invalid="ignore", divide="ignore"):
        absd = np.abs(dv - bv)
        rel = np.where(absd == 0, 0.0, absd / np.abs(bv))
    errors = np.concatenate([absd, rel], axis=2)
    roles_a, col_a = np.asarray(roles, dtype=np.int64), np.asarray(col_of, dtype=np.int64)
    n_nodes = len(nodes)
    in_err = _reduce(rel[:, :, 3], roles_a == 0, col_a, n_nodes)
    out_err = _reduce(rel[:, :, 3], roles_a == 1, col_a, n_nodes)
    dbad = ~np.isfinite(dv).all(axis=2) & ~np.all(np.isnan(dv), axis=2)
    bbad = ~np.isfinite(bv).all(axis=2) & ~np.all(np.isnan(bv), axis=2)
    nan_only_debug = _any(dbad & ~bbad, roles_a == 1, col_a, n_nodes)
    in_abn = _any(dbad, roles_a == 0, col_a, n_nodes)
    out_abn = _any(dbad, roles_a == 1, col_a, n_nodes)
    has_values = _any(~np.all(np.isnan(dv), axis=2), np.ones(len(roles), bool), col_a, n_nodes)
    precision = _precision(in_err, out_err, nan_only_debug, has_values)
    for d, _why in static_error.items():
        precision[:, nodes.index(d)] = np.where(has_values[:, nodes.index(d)], 1.0, np.nan)
    in_norm = _reduce(np.abs(dv[:, :, 3]), roles_a == 0, col_a, n_nodes)
    out_norm = _reduce(np.abs(dv[:, :, 3]), roles_a == 1, col_a, n_nodes)
    with np.errstate(invalid="ignore"):
        jump = out_norm > JUMP * in_norm
    overflow = np.select([in_abn & ~out_abn, (in_abn & out_abn) | jump, ~in_abn & out_abn], [1, 2, 3], 0)
    cmp = Comparison(debug, bench, pairs, steps, nodes, precision, overflow, in_err, out_err, port_pairs, errors,
                     static_error, threshold, notes=notes)
    cmp.first = first_divergence(cmp, nan_only_debug)
    return cmp


def _reduce(values: np.ndarray, mask: np.ndarray, cols: np.ndarray, n: int) -> np.ndarray:
    """Per step, the NaN-ignoring max of ``values[:, mask]`` into columns ``cols`` (NaN where none)."""
    out = np.full((values.shape[0], n), -np.inf)
    if mask.any():
        v = np.where(np.isnan(values[:, mask]), -np.inf, values[:, mask])
        for s in range(values.shape[0]):
            np.maximum.at(out[s], cols[mask], v[s])
    out[out == -np.inf] = np.nan
    return out


def _any(flags: np.ndarray, mask: np.ndarray, cols: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((flags.shape[0], n), dtype=bool)
    if mask.any():
        for s in range(flags.shape[0]):
            np.logical_or.at(out[s], cols[mask], flags[s, mask])
    return out


def _precision(in_err, out_err, nan_only_debug, has_values) -> np.ndarray:
    ie = np.nan_to_num(in_err, nan=0.0)
    oe = np.nan_to_num(out_err, nan=0.0)
    error = nan_only_debug | ((ie < 0.1) & (oe > 0.5))
    warning = (oe > 10 * ie) & (oe > NOISE_FLOOR)
    out = np.where(error, 1.0, np.where(warning, 0.5, 0.0))
    return np.where(has_values, out, np.nan)


def first_divergence(cmp: Comparison, nan_only_debug: np.ndarray) -> dict | None:
    """The earliest step with an output crossing the threshold, and its first node in execution order
    whose outputs cross while its inputs do not (else its first crossing node, noted)."""
    t = cmp.threshold
    with np.errstate(invalid="ignore"):
        out_cross = (cmp.output_err > t) | nan_only_debug
        in_cross = cmp.input_err > t
    order = np.asarray([cmp.debug.nodes[n].order for n in cmp.nodes], dtype=np.int64)
    by_order = np.argsort(np.where(order < 0, np.iinfo(np.int64).max, order), kind="stable")
    for s in range(len(cmp.steps)):
        crossing = [k for k in by_order if out_cross[s, k]]
        if not crossing:
            continue
        clean = [k for k in crossing if not in_cross[s, k]]
        k = (clean or crossing)[0]
        name = cmp.nodes[k]
        return {
            "step": cmp.steps[s][0], "bench_step": cmp.steps[s][1], "node": name, "bench_node": cmp.pairs[name],
            "input_error": _f(cmp.input_err[s, k]), "output_error": _f(cmp.output_err[s, k]),
            "inputs_clean": bool(clean), "nodes_crossing": len(crossing),
            "note": "" if clean else "every crossing node's inputs already crossed (the inputs of the model differ?)",
        }
    return None


def _f(v) -> float | None:
    return None if np.isnan(v) else float(v)


def _first(g: Graph) -> list[str]:
    return g.root.children[:2]


__all__ = ["ERR_NAMES", "Comparison", "compare", "first_divergence"]
