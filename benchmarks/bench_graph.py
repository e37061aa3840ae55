"""Build and compare time of a large comparison graph: N modules over S steps.

Writes two real logs with the real LogWriter (a module tree of blocks of four leaves, every module's
input and output statistics at every step; the second run differs in one block from one step on),
then times ``build_from_run`` for each and ``compare`` of the two, and the viewer's HTML. Prints the
figures; nothing is asserted.

    .venv/bin/python benchmarks/bench_graph.py [--modules 10000] [--steps 100] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from trainrec.analyzers.graph import build_from_run, compare
from trainrec.recorder.writer import LogWriter
from trainrec.replay import open_run
from trainrec.schema.events import (
    ModuleStructureRecorded,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    pack_array,
)

OPS = ("min", "max", "mean", "norm")


def tree(n_modules: int) -> tuple[list[str], list[str], list[int]]:
    """Root, then blocks ``b{i}`` of four leaves ``b{i}.l{j}`` until ``n_modules`` modules."""
    names, classes, parents = [""], ["Model"], [-1]
    i = 0
    while len(names) < n_modules:
        names.append(f"b{i}")
        classes.append("Block")
        parents.append(0)
        blk = len(names) - 1
        for j in range(4):
            if len(names) >= n_modules:
                break
            names.append(f"b{i}.l{j}")
            classes.append("Linear")
            parents.append(blk)
        i += 1
    return names, classes, parents


def forward_order(names: list[str], parents: list[int]) -> list[int]:
    """Module indices in forward completion order: each block's leaves, then the block; the root last."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    out = []
    for blk in kids.get(0, []):
        out.extend(kids.get(blk, []))
        out.append(blk)
    out.append(0)
    return out


def write_log(out_dir: str, n_modules: int, n_steps: int, diverge: tuple[int, int] | None) -> None:
    names, classes, parents = tree(n_modules)
    order = forward_order(names, parents)
    rng = np.random.default_rng(0)
    base = rng.random((n_modules, 2, len(OPS)), dtype=np.float32) + 0.5
    w = LogWriter(os.path.join(out_dir, "Dec04_00-00-00-rank0-00000000"), rank=0, world_size=1, run_id="bench",
                  flush_interval=0.5)
    w.write(ModuleStructureRecorded(rank=0, step=0, wall=1.0, names=tuple(names), classes=tuple(classes),
                                    parents=tuple(parents), param_counts=(0,) * n_modules))
    ids = w.intern(names, step=-1)
    row_ids = pack_array("I", [ids[m] for m in order for _ in range(2)])
    slots = bytes([1, 2] * len(order))
    calls = pack_array("I", [c for c in range(len(order)) for _ in range(2)])
    for s in range(n_steps):
        vals = base[order] * (1 + 0.001 * s)
        if diverge is not None and s >= diverge[1]:
            k = order.index(diverge[0])
            vals[k, 1] *= 2.0  # its output doubles from that step on
        w.write(StepBegan(rank=0, step=s, wall=2.0 + s))
        w.write(TensorStatsRecorded(rank=0, step=s, wall=2.0 + s, kind="actv", ops=OPS, dtype="f", name_ids=row_ids,
                                    values=vals.astype("<f4").tobytes(), call_ids=calls, slots=slots))
        w.write(StepEnded(rank=0, step=s, wall=2.5 + s, duration=0.5, collected=True))
    w.close()


def time_vis(cmp, tmp: str, n_steps: int) -> None:
    import orjson
    from trainrec.analyzers.graph.vis import vis_compare
    from trainrec.tools.graph_visdb import write_vis_db

    t = time.perf_counter()
    data = orjson.dumps(vis_compare(cmp, len(cmp.steps) // 2))
    print(f".vis (one step): {time.perf_counter() - t:.2f} s, {len(data) / 1e6:.1f} MB")
    t = time.perf_counter()
    path = write_vis_db([(0, cmp)], os.path.join(tmp, "compare.vis.db"), max_steps=n_steps)
    print(f".vis.db ({n_steps} steps): {time.perf_counter() - t:.2f} s, {os.path.getsize(path) / 1e6:.1f} MB")


def time_page(path: str, node: str) -> None:
    """Load the page in headless Chromium (selenium), then search the divergent node and select it."""
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("google-chrome") or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        t = time.perf_counter()
        browser.get("file://" + path)
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"
        t_load = time.perf_counter() - t
        t = time.perf_counter()
        browser.find_element(By.ID, "search").send_keys(node, Keys.ENTER)
        shown = browser.execute_script("return document.querySelectorAll('.row').length")
        print(f"page: loaded in {t_load:.2f} s; search + expand + select {node}: {time.perf_counter() - t:.2f} s "
              f"({shown} rows drawn)")
    finally:
        browser.quit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--vis-steps", type=int, default=0, metavar="N",
                    help="also time .vis (one step) and .vis.db (N steps) for tb-graph-ascend")
    ap.add_argument("--browser", action="store_true", help="also time loading and searching the page in headless Chromium")
    ap.add_argument("--dir", default=None, help="where to write the two logs (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        leaf = 7  # a leaf of block b1
        t = time.perf_counter()
        write_log(os.path.join(tmp, "bench"), args.modules, args.steps, None)
        write_log(os.path.join(tmp, "debug"), args.modules, args.steps, (leaf, args.steps // 2))
        print(f"wrote two logs of {args.modules} modules x {args.steps} steps in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        bench = build_from_run(open_run(os.path.join(tmp, "bench")))
        t_build = time.perf_counter() - t
        debug = build_from_run(open_run(os.path.join(tmp, "debug")))
        print(f"build: {t_build:.2f} s for {bench.describe()}")
        t = time.perf_counter()
        cmp = compare(debug, bench)
        t_cmp = time.perf_counter() - t
        f = cmp.first
        print(f"compare: {t_cmp:.2f} s ({len(cmp.pairs) - 1} pairs, {len(cmp.port_pairs)} tensors x "
              f"{len(cmp.steps)} steps); first divergence: step {f['step']}, {f['node']}")
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from trainrec.tools.graph_html import write_compare_html

        t = time.perf_counter()
        path = write_compare_html(cmp, os.path.join(tmp, "compare.html"))
        print(f"viewer: {time.perf_counter() - t:.2f} s, {os.path.getsize(path) / 1e6:.1f} MB (20 steps of statistics)")
        if args.browser:
            time_page(path, f["node"])
        if args.vis_steps:
            time_vis(cmp, tmp, args.vis_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
