"""The stall watchdog, the exception that ends a recording, and cc_log_only, in this process."""

from __future__ import annotations

import collections
import logging
import threading
import time

import pytest
import torch
from trainrec.recorder import record
from trainrec.recorder.collectives import LOG_ONLY_EXIT, CollectiveRecorder
from trainrec.replay.run import open_run
from trainrec.schema.events import DIR_FORWARD, ExceptionRaised, StallDetected


class Slow(torch.nn.Module):
    """Sleeps ``delay`` seconds in its forward at step ``at``."""

    def __init__(self, at: int, delay: float) -> None:
        super().__init__()
        self.at, self.delay, self.step = at, delay, 0

    def forward(self, x):
        if self.step == self.at:
            time.sleep(self.delay)
        return x


def _model(slow: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(collections.OrderedDict(inp=torch.nn.Linear(4, 4), slow=slow,
                                                       out=torch.nn.Linear(4, 1)))


def test_a_long_step_is_reported_with_stacks_modules_and_the_last_hook(tmp_path):
    slow = Slow(at=12, delay=2.5)
    model = _model(slow)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"xy_distribution": True, "stall_watchdog": {"factor": 5, "min_seconds": 0.5}}
    with record(model, opt, cfg, output_dir=str(tmp_path)):
        for step in range(14):
            slow.step = step
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.03)  # (steps long enough for the watchdog, which looks 8 times a second, to time some)
        assert any(t.name.startswith("trainrec-watchdog") for t in threading.enumerate())
    assert not any(t.name.startswith("trainrec-watchdog") for t in threading.enumerate())  # stopped on close
    stalls = list(open_run(str(tmp_path)).events(types=["sl"]))
    # past the threshold (5 x the median step, 0.5 s at least), then again each time the time doubles
    assert [s.count for s in stalls] == list(range(1, len(stalls) + 1)) and {s.step for s in stalls} == {12}
    s: StallDetected = stalls[0]
    assert 0.03 < s.median_step < 0.5 and s.threshold == max(5 * s.median_step, 0.5)
    assert s.threshold < s.elapsed < 2.5
    assert all(b.elapsed > 2 * a.threshold * 2 ** (a.count - 1) for a, b in zip(stalls, stalls[1:], strict=False))
    assert s.modules == ("(model)", "slow")
    assert "most recent call first" in s.stacks and "in forward" in s.stacks and "test_watchdog.py" in s.stacks
    # the last hook that fired: inp's forward (slow's fires after its forward returns)
    assert (s.hook_module, s.hook_direction, s.hook_micro_step) == ("inp", DIR_FORWARD, 0)
    assert s.collective_op == "" and s.collective_seq == -1


def test_an_exception_out_of_a_forward_is_recorded_with_its_module(tmp_path):
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise ValueError("no such token")

    model = _model(Broken())
    with pytest.raises(ValueError), record(model, None, {"wg_distribution": True}, output_dir=str(tmp_path)):
        model(torch.randn(2, 4))
    (ev,) = open_run(str(tmp_path)).events(types=[ExceptionRaised])
    assert ev.error == "ValueError: no such token" and ev.modules == ("(model)", "slow")
    assert ev.traceback.startswith("Traceback") and ev.traceback.rstrip().endswith("ValueError: no such token")


def test_a_clean_close_records_no_exception(tmp_path):
    model = _model(Slow(at=-1, delay=0))
    with record(model, None, {"wg_distribution": True}, output_dir=str(tmp_path)) as rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
    assert list(open_run(str(tmp_path)).events(types=[ExceptionRaised])) == []


def test_cc_log_only_logs_the_first_steps_calls_then_ends_the_run(caplog):
    """As the reference: the calls of the first step are logged, with their call sites, and the first
    call of the next step raises (on every rank alike: they make the same calls)."""
    step = [0]
    events = []
    rec = CollectiveRecorder({"enable": True, "cc_log_only": True}, rank=0, emit=events.append,
                             step=lambda: step[0], collecting=lambda: True)
    params = {"tensor": 0, "op": 1, "group": 2, "async_op": 3}
    x = torch.ones(3, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="trainrec.recorder.collectives"):
        for _ in range(2):
            rec.done(rec.issue("all_reduce", params, (x,), {}))
        step[0] = 1
        with pytest.raises(RuntimeError, match=LOG_ONLY_EXIT):
            rec.issue("all_reduce", params, (x,), {})
    (message,) = [r.getMessage() for r in caplog.records]
    assert "the collectives of step 0 on rank 0" in message
    assert "all_reduce" in message and "bfloat16" in message and "test_watchdog.py[" in message and "(x2)" in message
    assert len(events) == 2 and all(callable(e) for e in events)  # metadata only: made on the writer's thread
    assert [e()[0].dtypes for e in events] == [("bfloat16",)] * 2
