"""The recorder's hook path alone: the median step of a model whose step is mostly the monitor's hooks.

100 blocks of ``Linear(8, 8)`` and ``Tanh`` on a 4 x 8 batch, SGD, one thread, every step collected with
``xy_distribution`` + ``all_xy`` + ``wg_distribution`` (ops norm and max): 200 module hooks' forward and
gradient work and 200 weight-gradient hooks per step against tensors too small to cost anything, so a
change in what each hook call reads (attribute hops, closures) shows in the step time. Run it with two
recorders alternately (the figure moves by several percent with the machine's load).

Usage: ``.venv/bin/python benchmarks/bench_hook_path.py [--steps 80] [--warmup 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from trainrec.recorder import TrainerMon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "config.json")
        with open(cfg, "w") as f:
            json.dump({"xy_distribution": True, "all_xy": True, "wg_distribution": True, "ops": ["norm", "max"]}, f)
        model = torch.nn.Sequential(*[m for _ in range(100) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        mon = TrainerMon(cfg, params_have_main_grad=False, output_dir=os.path.join(d, "out"), live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        x = torch.randn(4, 8)
        times = []
        for _ in range(args.warmup + args.steps):
            t = time.perf_counter()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
        mon.close()
    print(f"median step {statistics.median(times[args.warmup:]) * 1e3:.2f} ms over {args.steps} steps")


if __name__ == "__main__":
    main()
