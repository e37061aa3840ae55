"""Post-mortem of a run: how each rank ended, where it was, and what the ranks were waiting for.

:func:`analyze` takes each rank's events (in the order the rank wrote them) and what its log's end
says (:class:`Ending`) and returns a :class:`Report`: per rank its ending and last step, hook,
collective, stall, exception, anomaly and config; across ranks the ranks behind, collective
desyncs, blocked ranks and whom they wait for, and a verdict. :func:`postmortem` does it for a
replayed :class:`Run`. What a log cannot show (a killed rank's last flush interval; collectives
recorded at issue, not completion) is in docs/postmortem.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from trainrec.replay.follow import pid_alive
from trainrec.replay.names import NameResolver
from trainrec.replay.run import Run
from trainrec.schema.events import (
    DIR_BACKWARD,
    AnomalyDetected,
    CollectiveCalled,
    ConfigApplied,
    Event,
    ExceptionRaised,
    FileOpened,
    HooksFired,
    MonitoringStopped,
    NamesInterned,
    StallDetected,
    StepEnded,
)

__all__ = ["Ending", "RankState", "Report", "analyze", "endings_of", "postmortem"]

CONFIRM_S = 1.0  # seconds the logs must go on after a call for the ranks that did not issue it to be late
_MAX_CALLS = 100_000  # calls per rank and group kept for the desync comparison (the last ones)

# how a rank ended (RankState.ending)
CLOSED = "closed cleanly"
EXCEPTION = "exception"
SIGTERM = "SIGTERM"
KILLED = "killed"
RUNNING = "still running"
UNKNOWN = "not closed"


@dataclass
class Ending:
    """What the end of a rank's last log file says: its FileClosed reason (None: not closed), the bytes
    of a torn last record, whether its writer process runs (None: unknown, another host)."""

    close_reason: str | None = None
    torn_bytes: int = 0
    writer_running: bool | None = None
    writer_pid: int = 0
    writer_host: str = ""


@dataclass
class RankState:
    rank: int
    ending: str = UNKNOWN
    ending_detail: str = ""
    last_completed_step: int | None = None
    current_step: int = -1
    last_event: dict | None = None
    last_hook: dict | None = None
    last_collective: dict | None = None
    last_stall: dict | None = None
    exception: dict | None = None
    last_anomaly: dict | None = None
    config: dict | None = None
    monitoring_stopped: str = ""
    last_wall: float = 0.0
    # group name -> {seq: (op, shapes)}; group name -> ranks; group name -> last seq
    calls: dict = field(default_factory=dict, repr=False)
    group_ranks: dict = field(default_factory=dict, repr=False)
    last_seq: dict = field(default_factory=dict, repr=False)
    last_call_wall: dict = field(default_factory=dict, repr=False)  # group name -> wall of its last call

    def to_json(self) -> dict:
        return {
            "rank": self.rank, "ending": self.ending, "ending_detail": self.ending_detail,
            "last_completed_step": self.last_completed_step, "current_step": self.current_step,
            "last_event": self.last_event, "last_hook": self.last_hook, "last_collective": self.last_collective,
            "last_stall": self.last_stall, "exception": self.exception, "last_anomaly": self.last_anomaly,
            "config": self.config, "monitoring_stopped": self.monitoring_stopped,
            "collective_seqs": {g: {"ranks": list(self.group_ranks.get(g, ())), "last_seq": s}
                                for g, s in sorted(self.last_seq.items())},
        }


@dataclass
class Report:
    ranks: list[RankState]
    behind: list[int]
    desyncs: list[dict]
    waits: list[dict]
    waited_for: list[int]
    verdict: str
    missing_ranks: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"ranks": [r.to_json() for r in self.ranks], "behind": self.behind, "desyncs": self.desyncs,
                "waits": self.waits, "waited_for": self.waited_for, "missing_ranks": self.missing_ranks,
                "verdict": self.verdict}


# ------------------------------------------------------------------------------------------- per rank
def _ending(state: RankState, end: Ending) -> None:
    reason = end.close_reason
    if reason is not None:
        if reason == "sigterm":
            state.ending, state.ending_detail = SIGTERM, "its log was closed on SIGTERM"
        elif "exception" in reason or "uncaught" in reason:
            state.ending, state.ending_detail = EXCEPTION, reason
        else:
            state.ending, state.ending_detail = CLOSED, reason
        if state.exception is not None and state.ending != EXCEPTION:
            state.ending = EXCEPTION
    elif end.writer_running:
        state.ending, state.ending_detail = RUNNING, f"its writer (pid {end.writer_pid}) is running"
    elif end.writer_running is False or end.torn_bytes:
        state.ending = KILLED
        state.ending_detail = (f"log not closed, torn tail of {end.torn_bytes} bytes" if end.torn_bytes
                               else "log not closed") + (f"; its writer (pid {end.writer_pid}) is gone"
                                                         if end.writer_running is False else "")
    else:
        state.ending = UNKNOWN
        state.ending_detail = f"log not closed (killed, or still running on {end.writer_host or 'another host'})"


def _rank_state(rank: int, events: Iterable[Event]) -> RankState:
    st = RankState(rank=rank)
    names = NameResolver()
    last_hooks: HooksFired | None = None
    for ev in events:
        t = type(ev)
        if ev.step > st.current_step:
            st.current_step = ev.step
        if ev.wall > st.last_wall:
            st.last_wall = ev.wall
        if t is NamesInterned or t is FileOpened:
            names.feed(ev)
            continue
        st.last_event = {"type": t.__name__, "step": ev.step, "wall": ev.wall}
        if t is StepEnded:
            if not ev.foreign_passes and (st.last_completed_step is None or ev.step > st.last_completed_step):
                st.last_completed_step = ev.step
        elif t is HooksFired:
            if len(ev.module_ids) >= 4:
                last_hooks = ev
        elif t is CollectiveCalled:
            st.group_ranks[ev.group] = tuple(ev.group_ranks)
            calls = st.calls.setdefault(ev.group, {})
            calls[ev.group_seq] = (ev.op, tuple(map(tuple, ev.shapes)))
            if len(calls) > _MAX_CALLS:
                del calls[next(iter(calls))]
            if ev.group_seq >= st.last_seq.get(ev.group, -1):
                st.last_seq[ev.group] = ev.group_seq
                st.last_call_wall[ev.group] = ev.wall
            st.last_collective = {"op": ev.op, "group": ev.group, "group_ranks": list(ev.group_ranks),
                                  "seq": ev.group_seq, "shapes": [list(s) for s in ev.shapes],
                                  "dtypes": list(ev.dtypes), "step": ev.step, "wall": ev.wall,
                                  "codeline": ev.codeline}
        elif t is StallDetected:
            st.last_stall = {"step": ev.step, "elapsed": ev.elapsed, "threshold": ev.threshold, "count": ev.count,
                             "modules": list(ev.modules), "hook_module": ev.hook_module,
                             "collective_op": ev.collective_op, "collective_seq": ev.collective_seq,
                             "collective_group_ranks": list(ev.collective_group_ranks),
                             "innermost_frame": _innermost_frame(ev.stacks), "wall": ev.wall}
        elif t is ExceptionRaised:
            st.exception = {"step": ev.step, "error": ev.error, "modules": list(ev.modules), "wall": ev.wall}
        elif t is AnomalyDetected:
            st.last_anomaly = {"step": ev.step, "tag_name": ev.tag_name, "op": ev.op, "value": ev.value,
                               "rule": ev.rule}
        elif t is ConfigApplied:
            st.config = dict(ev.config)
            st.monitoring_stopped = ""
        elif t is MonitoringStopped:
            st.monitoring_stopped = f"step {ev.step}: {ev.reason}"
    if last_hooks is not None:
        mods = names.ids_names(rank, last_hooks.module_ids)
        rows = list(last_hooks.rows())
        mid, direction, call, micro = rows[-1]
        st.last_hook = {"step": last_hooks.step, "module": mods[-1],
                        "direction": "backward" if direction == DIR_BACKWARD else "forward",
                        "micro_step": micro, "call_id": call}
    return st


def _innermost_frame(stacks: str) -> str:
    """The innermost frame of the main thread in a faulthandler dump (its first frame line)."""
    blocks = stacks.split("\n\n")
    main = next((b for b in blocks if "Thread" in b and "most recent call first" in b
                 and b.rstrip().splitlines()[-1].strip().startswith("File") and "<module>" in b), "")
    for line in main.splitlines()[1:]:
        line = line.strip()
        if line.startswith("File"):
            return line
    return ""


# ------------------------------------------------------------------------------------------ across ranks
def _desyncs(states: list[RankState]) -> list[dict]:
    out = []
    groups = sorted({g for s in states for g in s.calls})
    for g in groups:
        have = [s for s in states if g in s.calls]
        if len(have) < 2:
            continue
        seqs = sorted(set().union(*(s.calls[g].keys() for s in have)))
        for seq in seqs:
            calls = {s.rank: s.calls[g][seq] for s in have if seq in s.calls[g]}
            if len(calls) > 1 and len(set(calls.values())) > 1:
                out.append({"group": g, "group_ranks": list(have[0].group_ranks.get(g, ())), "seq": seq,
                            "calls": {str(r): {"op": op, "shapes": [list(x) for x in shapes]}
                                      for r, (op, shapes) in sorted(calls.items())}})
                break  # the first one of a group: later calls are out of step after it anyway
    return out


def _waits(states: list[RankState]) -> list[dict]:
    """Per process group whose members' last calls differ: who is ahead (blocked, where their log did
    not close) and who is behind (waited for). ``confirmed``: the logs go on for CONFIRM_S after the
    ahead ranks' call, so the others' records of it cannot just be lost in a kill."""
    by_rank = {s.rank: s for s in states}
    end = max((s.last_wall for s in states), default=0.0)
    out = []
    for g in sorted({g for s in states for g in s.last_seq}):
        ranks = next(s.group_ranks[g] for s in states if g in s.group_ranks)
        members = [by_rank[r] for r in ranks if r in by_rank]
        if len(members) < 2:
            continue
        seqs = {m.rank: m.last_seq.get(g, -1) for m in members}
        top = max(seqs.values())
        ahead = sorted(r for r, q in seqs.items() if q == top)
        behind = sorted(r for r, q in seqs.items() if q < top)
        if not behind:
            continue
        blocked = [r for r in ahead if by_rank[r].ending in (KILLED, RUNNING, UNKNOWN, SIGTERM, EXCEPTION)]
        op = by_rank[ahead[0]].calls.get(g, {}).get(top, ("?",))[0]
        since = min(by_rank[r].last_call_wall.get(g, end) for r in ahead)
        out.append({"group": g, "group_ranks": list(ranks), "seq": top, "op": op, "ahead": ahead,
                    "blocked": blocked, "behind": behind, "behind_seqs": {str(r): seqs[r] for r in behind},
                    "logs_go_on_s": round(end - since, 3), "confirmed": end - since >= CONFIRM_S})
    return out


def analyze(events: dict[int, Iterable[Event]], endings: dict[int, Ending] | Callable[[], dict[int, Ending]],
            missing_ranks: Iterable[int] = ()) -> Report:
    """The post-mortem of ranks' event streams (each in the order the rank wrote it). ``endings`` may be
    a callable, called once the streams are consumed (a replayed file's end is known after reading it)."""
    states = [_rank_state(r, evs) for r, evs in sorted(events.items())]
    ends = endings() if callable(endings) else endings
    for st in states:
        _ending(st, ends.get(st.rank, Ending()))
    top = max((s.current_step for s in states), default=-1)
    behind = [s.rank for s in states if s.current_step < top]
    desyncs = _desyncs(states)
    waits = _waits(states)
    waited: list[int] = []
    for w in sorted(waits, key=lambda w: (-len(w["blocked"]), w["group"])):
        if w["blocked"] and w["confirmed"]:
            low = min(w["behind_seqs"].values())
            waited = sorted(int(r) for r, q in w["behind_seqs"].items() if q == low)
            break
    report = Report(ranks=states, behind=behind, desyncs=desyncs, waits=waits, waited_for=waited, verdict="",
                    missing_ranks=sorted(missing_ranks))
    report.verdict = verdict(report)
    return report


# ------------------------------------------------------------------------------------------ the verdict
def _where(s: RankState) -> str:
    """Where a rank was last: step, module (stall, exception or last hook)."""
    parts = [f"step {s.current_step}"] if s.current_step >= 0 else []
    mods = (s.exception or {}).get("modules") or (s.last_stall or {}).get("modules")
    if mods:
        parts.append(f"in module {mods[-1]}")
    elif s.last_hook and s.last_hook["step"] == s.current_step:
        h = s.last_hook
        parts.append(f"after the {h['direction']} hook of module {h['module']} (micro step {h['micro_step']}, "
                     f"call {h['call_id']})")
    return " ".join(parts)


def _ranks(rs: Iterable[int]) -> str:
    rs = list(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|remote process exited|Broken pipe|"
                        r"NCCL communicator was aborted|peer .{0,40}(closed|gone|exited)", re.IGNORECASE)


def peer_lost(error: str) -> bool:
    """Whether an exception's message says a collective failed because another rank went away."""
    return _PEER_LOST.search(error) is not None


def verdict(r: Report) -> str:
    s_by = {s.rank: s for s in r.ranks}
    if not r.ranks:
        return "No rank has a readable log."
    out = []
    failed = sorted((s for s in r.ranks if s.exception), key=lambda s: s.exception["wall"])
    origins = [s for s in failed if not peer_lost(s.exception["error"])]
    if origins:
        first = origins[0]
        out.append(f"Rank {first.rank} failed first, at {_where(first)}: {first.exception['error']}.")
        rest = [s for s in failed if s is not first]
        if rest:
            out.append(f"Then {_ranks(s.rank for s in rest)} failed too "
                       f"({'; '.join(s.exception['error'][:120] for s in rest)}).")
    elif failed:  # only collectives that failed because a peer went away: the origin is a rank that died
        gone = [s.rank for s in r.ranks if not s.exception and s.ending != CLOSED]
        out.append(f"{_ranks(s.rank for s in failed).capitalize()} failed in a collective because a peer went "
                   f"away ({failed[0].exception['error'][:120]})"
                   + (f"; {_ranks(gone)} ended without an exception (see the endings): the origin is there"
                      if gone else "") + ".")
    if r.desyncs:
        d = r.desyncs[0]
        calls = "; ".join(f"rank {k} called {v['op']} {v['shapes']}" for k, v in d["calls"].items())
        out.append(f"Collectives are out of step on group {d['group_ranks']} at call #{d['seq']}: {calls}.")
    if r.waited_for:
        w = next(w for w in r.waits if w["blocked"] and w["confirmed"] and
                 sorted(int(k) for k, q in w["behind_seqs"].items() if q == min(w["behind_seqs"].values()))
                 == r.waited_for)
        culprits = [s_by[x] for x in r.waited_for]
        where = "; ".join(f"rank {c.rank} at {_where(c)}, its last call #{w['behind_seqs'][str(c.rank)]}"
                          + (f", stalled for {c.last_stall['elapsed']:.0f} s with no collective in flight"
                             + (f", its main thread at {c.last_stall['innermost_frame']}"
                                if c.last_stall["innermost_frame"] else "")
                             if c.last_stall and not c.last_stall["collective_op"] else "")
                          for c in culprits)
        out.append(f"{_ranks(w['blocked']).capitalize()} issued {w['op']} #{w['seq']} on group {w['group_ranks']} "
                   f"and waited there for {_ranks(r.waited_for)}, which had not issued it where its log ends ({where}).")
    if not failed and not r.waited_for:
        stalled = [s for s in r.ranks if s.last_stall and s.ending != CLOSED]
        if stalled:
            out.append("Stalled: " + "; ".join(
                f"rank {s.rank} at {_where(s)} for {s.last_stall['elapsed']:.0f} s"
                + (f" in {s.last_stall['collective_op']} #{s.last_stall['collective_seq']}"
                   if s.last_stall["collective_op"] else "") for s in stalled) + ".")
    endings: dict[str, list[int]] = {}
    for s in r.ranks:
        endings.setdefault(s.ending, []).append(s.rank)
    if set(endings) == {CLOSED} and not out:
        steps = sorted({s.last_completed_step for s in r.ranks}, key=lambda x: -1 if x is None else x)
        return (f"Every rank closed its log cleanly; last completed step {steps[-1]}"
                + (f" (ranks differ: {steps})" if len(steps) > 1 else "") + ". Nothing to explain.")
    out.append("Endings: " + "; ".join(f"{_ranks(rs)} {e}" for e, rs in endings.items()) + ".")
    if r.behind:
        out.append("Behind the others in its log: " + ", ".join(
            f"rank {x} (step {s_by[x].current_step}, last completed {s_by[x].last_completed_step})"
            for x in r.behind) + (" (a rank killed outright loses what it did in its last flush interval, "
                                  "0.2 s by default)" if any(s_by[x].ending == KILLED for x in r.behind) else "")
                   + ".")
    if r.missing_ranks:
        out.append(f"No log for {_ranks(r.missing_ranks)}.")
    return " ".join(out)


# ------------------------------------------------------------------------------------------ from a run
def endings_of(run: Run) -> dict[int, Ending]:
    """What each rank's last log file's end says (after the run's events were read)."""
    import socket

    out = {}
    readers = run.readers
    host = socket.gethostname()
    for r in run.ranks:
        files = run.files(r)
        reader = readers.get(files[-1]) if files else None
        if reader is None:
            out[r] = Ending()
            continue
        end = Ending(close_reason=reader.closed_event.reason if reader.closed_event else None,
                     torn_bytes=reader.pending_bytes)
        if reader.header is not None:
            end.writer_pid, end.writer_host = reader.header.pid, reader.header.host
            if end.close_reason is None and end.writer_pid and end.writer_host == host:
                end.writer_running = pid_alive(end.writer_pid)
        out[r] = end
    return out


def postmortem(run: Run) -> Report:
    """The post-mortem of a replayed run (each rank read once)."""
    return analyze({r: run.events(rank=r) for r in run.ranks}, lambda: endings_of(run), run.missing_ranks)
