"""``trainrec graph build|compare|ranks``: hierarchical comparison graphs, and where two runs part::

    trainrec graph build RUN -o OUT                 one side's hierarchy as a viewer (OUT/graph.html)
    trainrec graph compare DEBUG BENCH -o OUT       two sides compared node by node over every step
    trainrec graph ranks RUN [-o OUT]               data-parallel ranks compared with each other

Each side is a trainrec run (output directory, rank directory or log) or the reference's dump
directory (dump.json, construct.json, stack.json; or step*/rank*/ above them). ``compare`` prints
the verdict (matched and unmatched nodes, errors per step, the first divergent node and step) and
writes it to OUT/verdict.json beside OUT/compare.html. The reference's own command line is
``python -m trainrec.tools.graph -i compare.json -o OUT``.
"""

from __future__ import annotations

import argparse
import os
import sys

import orjson
from trainrec.analyzers.graph import build_from_run, compare
from trainrec.analyzers.graph.explorer import explorer_graph, explorer_node_data
from trainrec.analyzers.graph.layer_mapping import check_layer_mapping
from trainrec.analyzers.graph.ranks import SCOPES, compare_ranks_full
from trainrec.analyzers.graph.vis import vis_compare
from trainrec.replay.run import open_run

from .graph_html import write_build_html, write_compare_html, write_ranks_html
from .graph_sides import load_mapping_file, load_side
from .graph_visdb import write_vis_db


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("graph", help="build and compare hierarchical graphs; find the first divergent node",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="graph_command", metavar="ACTION")
    sub.required = True
    b = sub.add_parser("build", help="one run's or dump's hierarchy as an HTML viewer")
    b.add_argument("side", metavar="RUN", help="a trainrec run or a dump directory")
    b.add_argument("-o", "--output", required=True, metavar="OUT", help="output directory")
    b.add_argument("--rank", type=int, default=None, help="the rank to build (default: the first)")
    b.set_defaults(func=run_build)
    c = sub.add_parser("compare", help="compare DEBUG against BENCH over every step")
    c.add_argument("debug", metavar="DEBUG", help="a trainrec run or a dump directory")
    c.add_argument("bench", metavar="BENCH", help="a trainrec run or a dump directory")
    c.add_argument("-o", "--output", required=True, metavar="OUT", help="output directory")
    add_compare_options(c)
    c.add_argument("--rank-debug", type=int, default=None, help="DEBUG's rank (default: the first)")
    c.add_argument("--rank-bench", type=int, default=None, help="BENCH's rank (default: the first)")
    c.set_defaults(func=run_compare)
    r = sub.add_parser("ranks", help="compare a run's data-parallel ranks; name the first that departs")
    r.add_argument("side", metavar="RUN", help="a trainrec run with two or more ranks")
    r.add_argument("-o", "--output", default=None, metavar="OUT",
                   help="also write OUT/ranks.json and OUT/ranks.html (each rank against the first, a rank selector)")
    r.add_argument("--scope", choices=sorted(SCOPES), default="dp",
                   help="dp: parameters and reduced gradients (default); all: activations too (same data per rank)")
    r.add_argument("--threshold", type=float, default=0.01, help="relative error of a norm that departs")
    r.add_argument("--vis-db", action="store_true",
                   help="with -o, also write OUT/ranks.vis.db: every rank against the first, for tb-graph-ascend's "
                        "Rank and Step dropdowns")
    r.set_defaults(func=run_ranks)


def add_compare_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--fuzzy_match", "--fuzzy", dest="fuzzy", action="store_true",
                   help="fuzzy matching: modules by name alone, API calls by order within their module")
    p.add_argument("-lm", "--layer_mapping", default=None, metavar="mapping.yaml",
                   help="the reference's layer mapping: {ClassName: {debug attribute: bench attribute}}")
    p.add_argument("--mapping", default=None, metavar="FILE",
                   help="a node mapping, YAML or JSON: {debug node name: bench node name}")
    p.add_argument("-oc", "--overflow_check", dest="overflow", action="store_true", help="show overflow levels")
    p.add_argument("-cs", "--complete_stack", dest="complete_stack", action="store_true",
                   help="keep whole call stacks in the viewer (default: the last 3 frames)")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="relative error of a norm that counts as divergent (default 0.01)")
    p.add_argument("--model-explorer", action="store_true",
                   help="also write Model Explorer's graph JSON and node data (OUT/explorer_graph.json, "
                        "OUT/explorer_node_data.json) at the first divergent step (else the last)")
    p.add_argument("--vis", action="store_true",
                   help="also write OUT/compare.vis for TensorBoard's tb-graph-ascend plugin, at the first "
                        "divergent step (else the last)")
    p.add_argument("--vis-db", action="store_true",
                   help="also write OUT/compare.vis.db (tb-graph-ascend's SQLite form: the --max-steps steps the page holds)")
    p.add_argument("--max-steps", type=int, default=20, metavar="N",
                   help="steps whose statistics the viewer holds (default 20: first, last, divergent, spread)")


def run_build(args: argparse.Namespace) -> int:
    graph = load_side(args.side, args.rank)
    os.makedirs(args.output, exist_ok=True)
    path = write_build_html(graph, os.path.join(args.output, "graph.html"))
    print(f"built {graph.describe()}\nwrote {path}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    debug = load_side(args.debug, args.rank_debug)
    bench = load_side(args.bench, args.rank_bench)
    return finish_compare(debug, bench, args)


def finish_compare(debug, bench, args) -> int:
    layer_mapping = mapping = None
    if args.layer_mapping:
        layer_mapping = check_layer_mapping(load_mapping_file(args.layer_mapping, "-lm"), f"-lm {args.layer_mapping}")
    if args.mapping:
        mapping = load_mapping_file(args.mapping, "--mapping")
    cmp = compare(debug, bench, fuzzy=args.fuzzy, threshold=args.threshold, layer_mapping=layer_mapping,
                  mapping=mapping, where_mapping=(args.layer_mapping, args.mapping))
    os.makedirs(args.output, exist_ok=True)
    verdict = cmp.verdict()
    with open(os.path.join(args.output, "verdict.json"), "wb") as f:
        f.write(orjson.dumps(verdict, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    html = write_compare_html(cmp, os.path.join(args.output, "compare.html"), max_steps=args.max_steps,
                              overflow=args.overflow, complete_stack=args.complete_stack)
    if getattr(args, "model_explorer", False):
        write_explorer(cmp, args.output)
    if getattr(args, "vis", False):
        with open(os.path.join(args.output, "compare.vis"), "wb") as f:
            f.write(orjson.dumps(vis_compare(cmp, shown_step(cmp), overflow=args.overflow)))
    if getattr(args, "vis_db", False):
        write_vis_db([(getattr(args, "rank_debug", None) or 0, cmp)],
                     os.path.join(args.output, "compare.vis.db"), overflow=args.overflow, max_steps=args.max_steps)
    print_verdict(verdict, sys.stdout)
    print(f"wrote {html} and {os.path.join(args.output, 'verdict.json')}")
    return 0


def shown_step(cmp) -> int:
    """The compared step the single-step outputs show: the first divergent one, else the last."""
    return next((i for i, (d, _) in enumerate(cmp.steps) if cmp.first and d == cmp.first["step"]), len(cmp.steps) - 1)


def write_explorer(cmp, out: str) -> None:
    """Model Explorer's files for the debug side at the first divergent step (else the last)."""
    s = shown_step(cmp)
    debug_index = cmp.debug.steps.index(cmp.steps[s][0])
    for name, data in (("explorer_graph.json", explorer_graph(cmp.debug, debug_index)),
                       ("explorer_node_data.json", explorer_node_data(cmp, s))):
        with open(os.path.join(out, name), "wb") as f:
            f.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))


def print_verdict(v: dict, out) -> None:
    out.write(f"debug {v['debug']}: {v['debug_nodes']} nodes; bench {v['bench']}: {v['bench_nodes']} nodes\n")
    out.write(f"matched {v['matched']}; unmatched: {v['unmatched_debug']} debug, {v['unmatched_bench']} bench\n")
    bad = [(s, e) for s, e in zip(v["steps"], v["errors_per_step"], strict=True) if e]
    out.write(f"{len(v['steps'])} step(s) compared; steps with precision errors: "
              f"{', '.join(f'{s} ({e})' for s, e in bad[:10]) or 'none'}\n")
    for note in v["notes"]:
        out.write(f"note: {note}\n")
    f = v["first_divergence"]
    if f is None:
        out.write(f"no divergence: no output's norm differs by more than {v['threshold']:g} (relative)\n")
    else:
        out.write(f"FIRST DIVERGENCE: step {f['step']}, node {f['node']} (output error {f['output_error']:.3g}, "
                  f"input error {_g(f['input_error'])}){'; ' + f['note'] if f['note'] else ''}\n")


def _g(v) -> str:
    return "none" if v is None else f"{v:.3g}"


def run_ranks(args: argparse.Namespace) -> int:
    run = open_run(args.side)
    graphs = {r: build_from_run(run, r) for r in run.ranks}
    for r, g in graphs.items():
        g.source = f"{args.side} (rank {r})"
    verdict, per_rank = compare_ranks_full(graphs, scope=args.scope, threshold=args.threshold)
    d = verdict["departs"]
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "ranks.json"), "wb") as f:
            f.write(orjson.dumps(verdict, option=orjson.OPT_INDENT_2))
        html = write_ranks_html(per_rank, verdict["base_rank"], os.path.join(args.output, "ranks.html"))
        if args.vis_db:
            write_vis_db(sorted(per_rank.items()), os.path.join(args.output, "ranks.vis.db"))
        print(f"wrote {html} and {os.path.join(args.output, 'ranks.json')}")
    print(f"ranks {verdict['ranks']} compared with rank {verdict['base_rank']} (scope {args.scope})")
    if d is None:
        print(f"no rank departs: every compared norm agrees within {args.threshold:g} (relative)")
    else:
        print(f"FIRST DEPARTURE: rank {d['rank']} at step {d['step']}, node {d['node']} "
              f"(output error {_g(d['output_error'])})")
    return 0
