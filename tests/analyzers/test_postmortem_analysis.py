"""The post-mortem analyzer on event streams built here: endings, waits, desyncs, the verdict."""

from __future__ import annotations

import pytest
from trainrec.analyzers.postmortem import (
    CLOSED,
    CONFIRM_S,
    EXCEPTION,
    KILLED,
    RUNNING,
    SIGTERM,
    UNKNOWN,
    Ending,
    analyze,
)
from trainrec.schema.events import (
    DIR_BACKWARD,
    CollectiveCalled,
    ExceptionRaised,
    HooksFired,
    NamesInterned,
    StallDetected,
    StepBegan,
    StepEnded,
    pack_array,
)

T0 = 1_700_000_000.0


def _steps(rank: int, n: int, calls: list | None = None, wall: float = T0) -> list:
    """``n`` steps of one all_reduce each on group [0, 1] (``calls``: (op, shapes) per step instead)."""
    out = [NamesInterned(rank=rank, first_id=0, names=("enc", "head"))]
    for s in range(n):
        op, shapes = calls[s] if calls else ("all_reduce", ((4,),))
        out += [StepBegan(rank=rank, step=s, wall=wall + s),
                CollectiveCalled(rank=rank, step=s, wall=wall + s + 0.1, op=op, group="0", group_ranks=(0, 1),
                                 group_seq=s, shapes=shapes, dtypes=("float32",) * len(shapes)),
                HooksFired(rank=rank, step=s, wall=wall + s + 0.2, module_ids=pack_array("I", [0, 1]),
                           directions=bytes([0, DIR_BACKWARD]), call_ids=pack_array("I", [0, 1]),
                           micro_steps=pack_array("H", [0, 0])),
                StepEnded(rank=rank, step=s, wall=wall + s + 0.5)]
    return out


@pytest.mark.parametrize("end, want", [
    (Ending(close_reason="close"), CLOSED),
    (Ending(close_reason="sigterm"), SIGTERM),
    (Ending(close_reason="exit after an uncaught KeyError"), EXCEPTION),
    (Ending(torn_bytes=12, writer_running=False, writer_pid=7), KILLED),
    (Ending(writer_running=False, writer_pid=7), KILLED),
    (Ending(writer_running=True, writer_pid=7), RUNNING),
    (Ending(writer_host="other"), UNKNOWN),
])
def test_endings(end, want):
    report = analyze({0: _steps(0, 2)}, {0: end})
    assert report.ranks[0].ending == want
    assert report.ranks[0].last_completed_step == 1
    assert report.ranks[0].last_hook == {"step": 1, "module": "head", "direction": "backward", "micro_step": 0,
                                         "call_id": 1}


def test_a_clean_run_has_nothing_to_explain():
    report = analyze({r: _steps(r, 3) for r in (0, 1)}, {r: Ending(close_reason="close") for r in (0, 1)})
    assert report.verdict == "Every rank closed its log cleanly; last completed step 2. Nothing to explain."
    assert report.desyncs == [] and report.waits == [] and report.behind == []


def test_a_rank_that_never_issued_the_call_is_waited_for_once_the_logs_go_on():
    killed = {r: Ending(writer_running=False) for r in (0, 1)}
    ahead = _steps(0, 4)
    behind = _steps(1, 3)[:-1]  # step 2's call issued, the step never ended
    # the logs end right after rank 0's call #3: not enough to say rank 1 would not have issued it too
    report = analyze({0: ahead, 1: behind}, killed)
    (w,) = report.waits
    assert (w["seq"], w["ahead"], w["behind"], w["confirmed"]) == (3, [0], [1], False)
    assert report.waited_for == [] and "waited there" not in report.verdict
    # a stall report of rank 1 well after it: rank 0 waited for rank 1
    stall = StallDetected(rank=1, step=2, wall=T0 + 3.1 + CONFIRM_S + 1, elapsed=30.0, threshold=10.0,
                          modules=("(model)", "enc"))
    report = analyze({0: ahead, 1: [*behind, stall]}, killed)
    assert report.waited_for == [1] and report.behind == [1]
    assert report.verdict.startswith("Rank 0 issued all_reduce #3 on group [0, 1] and waited there for rank 1, "
                                     "which had not issued it where its log ends (rank 1 at step 2 in module enc, its last call #2, "
                                     "stalled for 30 s with no collective in flight).")


def test_a_desync_is_named_at_the_first_sequence_number_where_calls_differ():
    same = [("all_reduce", ((4,),))] * 2
    calls0 = [*same, ("all_reduce", ((4,),)), ("all_reduce", ((8,),))]
    calls1 = [*same, ("all_gather", ((4,), (4,), (4,))), ("all_reduce", ((8,),))]
    report = analyze({0: _steps(0, 4, calls0), 1: _steps(1, 4, calls1)},
                     {r: Ending(writer_running=False) for r in (0, 1)})
    (d,) = report.desyncs
    assert d["seq"] == 2 and d["calls"]["0"]["op"] == "all_reduce" and d["calls"]["1"]["op"] == "all_gather"
    assert "out of step on group [0, 1] at call #2" in report.verdict


def test_calls_left_out_by_cc_codeline_leave_gaps_not_a_desync():
    a = [e for e in _steps(0, 4) if not (isinstance(e, CollectiveCalled) and e.group_seq == 1)]
    b = [e for e in _steps(1, 4) if not (isinstance(e, CollectiveCalled) and e.group_seq in (1, 2))]
    report = analyze({0: a, 1: b}, {r: Ending(close_reason="close") for r in (0, 1)})
    assert report.desyncs == [] and report.waits == []


def test_the_first_exception_by_time_is_the_failure():
    ends = {r: Ending(close_reason="exit after an uncaught RuntimeError") for r in (0, 1)}
    first = ExceptionRaised(rank=1, step=2, wall=T0 + 5, error="RuntimeError: bad batch", modules=("(model)", "enc"))
    then = ExceptionRaised(rank=0, step=2, wall=T0 + 6, error="RuntimeError: Connection closed by peer",
                           modules=("(model)", "enc"))
    report = analyze({0: [*_steps(0, 3), then], 1: [*_steps(1, 2), first]}, ends)
    assert report.verdict.startswith("Rank 1 failed first, at step 2 in module enc: RuntimeError: bad batch. "
                                     "Then rank 0 failed too (RuntimeError: Connection closed by peer).")
    assert [r.ending for r in report.ranks] == [EXCEPTION, EXCEPTION]


def test_collectives_failed_by_a_peer_gone_point_at_the_rank_that_died():
    """Rank 0 killed outright; rank 1's all_reduce then fails (connection reset by peer) and ends it by
    an exception: rank 1 is not the origin."""
    lost = ExceptionRaised(rank=1, step=2, wall=T0 + 5, modules=("(model)", "enc"),
                           error="RuntimeError: [pair.cc:537] Read error: Connection reset by peer.")
    report = analyze({0: _steps(0, 3), 1: [*_steps(1, 3), lost]},
                     {0: Ending(writer_running=False), 1: Ending(close_reason="close after an exception: X")})
    assert "failed first" not in report.verdict
    assert report.verdict.startswith("Rank 1 failed in a collective because a peer went away (RuntimeError: ")
    assert "rank 0 ended without an exception (see the endings): the origin is there." in report.verdict
    assert "Endings: rank 0 killed; rank 1 exception." in report.verdict
