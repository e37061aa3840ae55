"""Report size and build time: `trainrec report` on bench_export's synthesised run.

The run: STEPS steps x TENSORS tensors x 6 ops, two kinds (grad_reduced, param), float32, written once
under ``.bench/export/`` and reused. Measured: the command as its own process (start-up included,
best of REPEAT), the page's size, and how the size follows ``--max-bins``; where Chromium, chromedriver
and selenium are there, the default page's load in headless Chromium (until its script has drawn
everything) and a switch to the other kind (its matrices decoded then).

    .venv/bin/python benchmarks/bench_report.py [--steps 2000] [--tensors 500] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from bench_export import synthesise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench", "export"))
    args = ap.parse_args()
    run_dir = os.path.join(args.work, f"run-{args.steps}x{args.tensors}")
    if not os.path.isdir(run_dir):
        synthesise(run_dir, args.steps, args.tensors)
    log = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(run_dir) for f in fs)
    values = 2 * args.steps * args.tensors * 6
    print(f"run: {args.steps} steps x {args.tensors} tensors x 6 ops x 2 kinds = {values / 1e6:.1f} M values, "
          f"log {log / 1e6:.0f} MB")
    out = os.path.join(args.work, "report.html")
    for bins in (300, 100, 1000):
        best = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "trainrec.tools.cli", "report", run_dir, "-o", out,
                            "--max-bins", str(bins)], check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            best = wall if best is None else min(best, wall)
        print(f"trainrec report --max-bins {bins}: {best:.2f} s wall (process, best of {args.repeat}), "
              f"{os.path.getsize(out) / 1e6:.1f} MB page")
        if bins == 300:
            browser_times(out)
    return 0


def browser_times(page: str) -> None:
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By
    except ImportError:
        return
    if not binary or not driver:
        return
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        t0 = time.perf_counter()
        browser.get("file://" + os.path.abspath(page))
        loaded = time.perf_counter() - t0
        buttons = browser.find_elements(By.CSS_SELECTOR, "#kinds button")
        t0 = time.perf_counter()
        buttons[-1].click()
        switched = time.perf_counter() - t0
        print(f"  headless Chromium: page loaded and drawn in {loaded:.2f} s; another kind shown in {switched:.2f} s")
    finally:
        browser.quit()


if __name__ == "__main__":
    sys.exit(main())
