"""kill -9 trials: the post-mortem of a group killed at random moments never contradicts its ranks.

Each trial starts a gloo group of ranks (``tests/tools/postmortem_ranks.py``'s ``run`` scenario:
training with collectives and the stall watchdog recorded, each rank printing every call it enters
and every step it finishes), waits a random while (0 to 2 s after the first steps), kills every rank
with SIGKILL in a random order, a few milliseconds apart (even trials) or 0.1 to 1.5 s apart (odd
trials: the survivors' calls fail or hang on the peer gone), and runs ``trainrec postmortem``'s
analysis on the logs. A contradiction is an ending other than "killed", an exception or a desync where none
happened, a last completed step past what the rank printed (by more than the step it was in), a rank
said to be blocked in a call while it printed that call's step done, or a rank said never to have
issued a call it printed it entered (see ``check_kill9_trial`` in ``tests/tools/test_postmortem.py``).

Usage: ``.venv/bin/python benchmarks/bench_postmortem.py [--trials 20] [--world 2] [--seed 0]``
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "tools")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from test_postmortem import run_kill9_trial
    from trainrec.analyzers.postmortem import postmortem
    from trainrec.replay.run import open_run

    rng = random.Random(args.seed)
    failed = 0
    verdicts: dict[str, int] = {}
    t_start = time.monotonic()
    for trial in range(args.trials):
        tmp = tempfile.mkdtemp(prefix="bench-postmortem-")
        try:
            problems = run_kill9_trial(tmp, trial, world=args.world, rng=rng)
            report = postmortem(open_run(os.path.join(tmp, f"trial{trial}")))
            kind = ("waits confirmed" if report.waited_for else "calls in flight" if report.waits else
                    "in step")
            verdicts[kind] = verdicts.get(kind, 0) + 1
            steps = [r.last_completed_step for r in report.ranks]
            print(f"trial {trial:3d}: last completed steps {steps}, {kind}: "
                  f"{'OK' if not problems else 'CONTRADICTS: ' + '; '.join(problems)}", flush=True)
            failed += bool(problems)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.trials} trials of {args.world} ranks in {time.monotonic() - t_start:.0f} s: "
          f"{failed} with a contradiction; kinds of ending: {verdicts}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
