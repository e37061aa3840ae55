"""``trainrec postmortem`` on real gloo groups that hang, raise, desync or are killed with SIGKILL.

Each test starts its own group of rank processes (:mod:`postmortem_ranks`), lets it fail, kills what
is left with SIGKILL and checks that the post-mortem names what the ranks printed: the rank that
stopped, its step and module, the collective and sequence number the others were blocked in.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
from postmortem_ranks import BAD_STEP, Ranks
from trainrec.analyzers.postmortem import EXCEPTION, KILLED, RUNNING, peer_lost, postmortem
from trainrec.replay.run import open_run
from trainrec.tools.cli import main

pytestmark = pytest.mark.slow


def _postmortem_cli(out, capsys) -> tuple[dict, str]:
    assert main(["postmortem", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(["postmortem", str(out)]) == 0
    return report, capsys.readouterr().out


def _stalls_logged(out, world: int) -> bool:
    """Whether every rank's log holds a StallDetected (the watchdog fired everywhere)."""
    try:
        run = open_run(str(out))
    except Exception:  # noqa: BLE001 - not every rank directory is there yet
        return False
    return len(run.ranks) == world and all(any(True for _ in run.events(rank=r, types=["sl"])) for r in run.ranks)


def test_a_rank_sleeping_before_all_reduce_is_named_with_its_step_module_and_the_call_others_wait_in(
        tmp_path, capsys):
    world, out = 3, tmp_path / "out"
    ranks = Ranks("hang", world, tmp_path, out)
    try:
        ranks.wait_for(lambda: "sleeping" in ranks.output(world - 1), 120, "the last rank to sleep")
        ranks.wait_for(lambda: _stalls_logged(out, world), 60, "the stall watchdog on every rank")
        # a live run: dump -f shows the stalls as they are written, inspect notes them
        dump_out = tmp_path / "dump.jsonl"
        with open(dump_out, "w") as f:
            dump = subprocess.Popen([sys.executable, "-m", "trainrec.tools.cli", "dump", str(out), "-f",
                                     "--type", "StallDetected", "--poll-interval", "0.1"], stdout=f)
        assert main(["inspect", str(out)]) == 0
        live = capsys.readouterr().out
        assert live.count("STALL: running for") >= world and "in all_reduce #3" in live
        running, _ = _postmortem_cli(out, capsys)  # on the live run: still running, and who waits for whom
        assert [r["ending"] for r in running["ranks"]] == [RUNNING] * world and running["waited_for"] == [world - 1]
        time.sleep(1.0)
    finally:
        ranks.kill()  # SIGKILL: the logs end without FileClosed
    dump.wait(60)  # (it ends once every writer is gone)
    stalls = [json.loads(line) for line in dump_out.read_text().splitlines()]
    assert {s["rank"] for s in stalls} == set(range(world)) and all(s["type"] == "StallDetected" for s in stalls)

    sleeper = world - 1
    seq = ranks.last(0, "call")  # the all_reduce the others printed they were entering
    step = ranks.last(0, "call", field=2)
    assert all(ranks.last(r, "call") == seq for r in range(sleeper)) and ranks.last(sleeper, "call") == seq - 1
    report, text = _postmortem_cli(out, capsys)
    assert report["waited_for"] == [sleeper]
    by_rank = {r["rank"]: r for r in report["ranks"]}
    assert all(r["ending"] == KILLED for r in report["ranks"])
    s = by_rank[sleeper]
    assert s["current_step"] == step and s["last_completed_step"] == ranks.last(sleeper, "done") == step - 1
    assert s["last_stall"]["modules"][-1] == "sync" and s["last_stall"]["collective_op"] == ""
    assert "time.sleep" in s["last_stall"]["innermost_frame"] or "in forward" in s["last_stall"]["innermost_frame"]
    for r in range(sleeper):
        assert by_rank[r]["last_collective"]["op"] == "all_reduce" and by_rank[r]["last_collective"]["seq"] == seq
        assert by_rank[r]["last_stall"]["collective_op"] == "all_reduce"
        assert by_rank[r]["last_stall"]["collective_seq"] == seq
    verdict = report["verdict"]
    assert f"waited there for rank {sleeper}" in verdict and f"all_reduce #{seq}" in verdict
    assert f"rank {sleeper} at step {step} in module sync" in verdict
    assert "verdict: Ranks 0, 1 issued all_reduce" in text and "killed" in text


def test_a_rank_raising_in_its_forward_is_named_with_the_module(tmp_path, capsys):
    world, out = 2, tmp_path / "out"
    ranks = Ranks("raise", world, tmp_path, out)
    try:
        ranks.wait_for(lambda: ranks.procs[world - 1].poll() is not None, 120, "the last rank to raise")
        ranks.wait_exit(0, 20)  # its peer, in all_reduce, sees the connection closed (or hangs: killed)
    finally:
        ranks.kill()
    assert "RuntimeError: bad batch on rank 1" in ranks.stderr(1)
    report, text = _postmortem_cli(out, capsys)
    r1 = report["ranks"][1]
    assert r1["ending"] == "exception" and r1["exception"]["error"] == "RuntimeError: bad batch on rank 1"
    assert r1["exception"]["modules"][-1] == "sync" and r1["current_step"] == BAD_STEP
    assert report["verdict"].startswith(f"Rank 1 failed first, at step {BAD_STEP} in module sync: "
                                        "RuntimeError: bad batch on rank 1.")
    assert "bad batch on rank 1 (in sync)" in text


def test_a_desync_is_named_at_its_sequence_number(tmp_path, capsys):
    world, out = 2, tmp_path / "out"
    ranks = Ranks("desync", world, tmp_path, out)
    try:
        ranks.wait_for(lambda: all(ranks.last(r, "call") == BAD_STEP for r in range(world)), 120,
                       "both ranks to enter the call of the bad step")
        ranks.wait_for(lambda: _stalls_logged(out, world) or any(p.poll() is not None for p in ranks.procs), 60,
                       "the stall watchdog or an error")
    finally:
        ranks.kill()
    seq = ranks.last(0, "call")
    report, text = _postmortem_cli(out, capsys)
    (d,) = report["desyncs"]
    assert d["seq"] == seq and d["group_ranks"] == [0, 1]
    assert d["calls"]["0"]["op"] == "all_reduce" and d["calls"]["1"]["op"] == "all_gather"
    assert d["calls"]["0"]["shapes"] == [[4, 8]] and d["calls"]["1"]["shapes"] == [[4, 8]] * 3
    assert f"out of step on group [0, 1] at call #{seq}" in report["verdict"]
    assert f"DESYNC on group [0, 1] at call #{seq}" in text


def check_kill9_trial(ranks: Ranks, out, world: int) -> list[str]:
    """What the post-mortem of a group killed with SIGKILL says that contradicts what its ranks printed
    (empty: nothing). Shared with ``benchmarks/bench_postmortem.py``, which runs many trials."""
    report = postmortem(open_run(str(out)))
    problems = []
    by_rank = {s.rank: s for s in report.ranks}
    for r in range(world):
        s = by_rank.get(r)
        if s is None:
            problems.append(f"rank {r}: no log")
            continue
        done = ranks.last(r, "done")
        # a rank killed a few milliseconds after its peer may first see its collective fail (connection
        # reset by the peer) and end by that exception: true, and never the origin
        lost_peer = s.exception is not None and peer_lost(s.exception["error"]) and r != ranks.killed_first
        if s.ending != KILLED and not (lost_peer and s.ending == EXCEPTION):
            problems.append(f"rank {r}: ending {s.ending!r}, but it was killed")
        if s.exception is not None and not lost_peer:
            problems.append(f"rank {r}: an exception {s.exception}, but none was raised")
        if lost_peer and f"Rank {r} failed first" in report.verdict:
            problems.append(f"rank {r} named as the origin, but its peer was killed first")
        if s.last_completed_step is not None and (done is None or s.last_completed_step > done + 1):
            problems.append(f"rank {r}: last completed step {s.last_completed_step}, printed {done}")
    if report.desyncs:
        problems.append(f"a desync {report.desyncs}, but every rank made the same calls")
    for w in report.waits:
        if not (w["confirmed"] and w["blocked"]):
            continue
        # a rank named as blocked in call #seq can have finished no step that made it; the ranks it
        # waits for cannot have issued it
        step_of_call = w["seq"]  # one all_reduce per step, from step 0
        for r in w["blocked"]:
            if (ranks.last(r, "done") or -1) >= step_of_call:
                problems.append(f"rank {r} said blocked in #{w['seq']}, but it printed step {step_of_call} done")
        for r in w["behind"]:
            if (ranks.last(r, "call") or -1) >= w["seq"]:
                problems.append(f"rank {r} said not to have issued #{w['seq']}, but it printed it did")
    if "killed" not in report.verdict and "went away" not in report.verdict:
        problems.append(f"the verdict does not say the ranks were killed: {report.verdict}")
    return problems


def run_kill9_trial(tmp_path, trial: int, world: int = 2, rng: random.Random | None = None) -> list[str]:
    """One trial: a group trains, and after a random while each rank is killed with SIGKILL, in a
    random order, a few milliseconds apart, or in odd trials up to 1.5 s apart (the survivors' calls
    then fail, or hang, on the peer gone)."""
    rng = rng or random.Random(trial)
    out = os.path.join(str(tmp_path), f"trial{trial}")
    ranks = Ranks("run", world, tmp_path, out)
    try:
        ranks.wait_for(lambda: all(ranks.last(r, "done") is not None for r in range(world)), 120,
                       "the first steps")
        time.sleep(rng.uniform(0.0, 2.0))
        order = list(range(world))
        rng.shuffle(order)
        ranks.killed_first = order[0]
        for r in order:
            ranks.procs[r].kill()
            time.sleep(rng.uniform(0.0, 0.05) if trial % 2 == 0 else rng.uniform(0.1, 1.5))
    finally:
        ranks.kill()
    return check_kill9_trial(ranks, out, world)


@pytest.mark.parametrize("trial", [0])
def test_kill9_at_a_random_moment_the_verdict_agrees_with_what_the_ranks_printed(tmp_path, trial):
    """One trial here; ``benchmarks/bench_postmortem.py`` runs many (see benchmarks/RESULTS.md)."""
    assert run_kill9_trial(tmp_path, trial) == []
