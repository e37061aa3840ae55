"""The reference's command line: ``python -m trainrec.tools.graph -i compare.json -o OUT [-lm mapping.yaml] [-oc] [-f] [-cs]``.

``compare.json`` is msprobe's: ``{"npu_path": DUMP, "bench_path": DUMP, "is_print_compare_log": true}``;
with ``npu_path`` only, the graph is built instead. Either path may also be a trainrec run. Writes
OUT/compare.html and OUT/verdict.json (OUT/graph.html when building).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainrec.analyzers.graph import GraphInputError
from trainrec.schema.errors import TrainrecError

from .cmd_graph import add_compare_options, finish_compare
from .graph_html import write_build_html
from .graph_sides import load_side


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainrec.tools.graph", description=__doc__.split("\n\n", 1)[1])
    p.add_argument("-i", "--input_path", required=True, metavar="compare.json")
    p.add_argument("-o", "--output_path", required=True, metavar="OUT")
    add_compare_options(p)
    args = p.parse_args(argv)
    args.output = args.output_path
    try:
        return _run(args)
    except TrainrecError as exc:
        print(f"graph: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"graph: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    try:
        with open(args.input_path, encoding="utf-8") as f:
            spec = json.load(f)
    except ValueError as exc:
        raise GraphInputError(f"{args.input_path}: not JSON ({exc})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("npu_path"), str):
        raise GraphInputError(f"{args.input_path}: expected {{\"npu_path\": DUMP_DIR, \"bench_path\": DUMP_DIR}}; "
                              f"npu_path is missing")
    debug = load_side(spec["npu_path"])
    bench_path = spec.get("bench_path")
    if not bench_path:
        os.makedirs(args.output, exist_ok=True)
        print(f"wrote {write_build_html(debug, os.path.join(args.output, 'graph.html'))}")
        return 0
    return finish_compare(debug, load_side(str(bench_path)), args)


if __name__ == "__main__":
    sys.exit(main())
