"""SIGTERM (SLURM/elastic preemption) closes the TrainerMon log: the file ends with FileClosed."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from trainrec.replay.reader import read_log
from trainrec.schema.events import FileClosed, StepEnded

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from trainrec.recorder import TrainerMon
    mon = TrainerMon({"xy_distribution": True, "wg_distribution": True, "format": "csv"}, live_export=False,
                     output_dir=sys.argv[1])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    deadline = time.monotonic() + 60
    step = 0
    while time.monotonic() < deadline:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            print("ready", flush=True)
        time.sleep(0.01)
""")


def _signal_when(script: str, out, line: str, sig: int, delay: float = 0.0):
    """Run ``script`` (a training process writing to ``out``); once it prints ``line``, wait ``delay``
    seconds and send it ``sig``. Returns its exit status and the events of its rank-0 log."""
    import time

    proc = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == line
        time.sleep(delay)
        os.kill(proc.pid, sig)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
    (log_path,) = glob.glob(os.path.join(str(out), "*-rank0-*", "*.trl"))
    return (rc, *read_log(log_path))


def test_sigterm_closes_the_log(tmp_path):
    rc, reader, events = _signal_when(SCRIPT, tmp_path / "out", "ready", signal.SIGTERM)
    assert rc == -signal.SIGTERM  # the default disposition still ends the process
    assert reader.problems == []
    assert isinstance(events[-1], FileClosed) and reader.closed_cleanly
    assert events[-1].reason == "sigterm"
    assert sum(isinstance(e, StepEnded) for e in events) >= 3


# a small model trained for three steps, after the script has made its TrainerMon `mon`
_TRAIN3 = """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for step in range(3):
"""

CRASH = textwrap.dedent("""
    import sys, torch
    from trainrec.recorder import TrainerMon
    mon = TrainerMon({"xy_distribution": True, "wg_distribution": True, "format": "csv",
                      "ops": ["norm", "nans"]}, live_export=False,
                     output_dir=sys.argv[1])
""" + _TRAIN3 + """        x = torch.randn(8, 4)
        if step == 2:
            x[0, 0] = float("nan")
        loss = model(x).sum()
        loss.backward()
        if not torch.isfinite(loss):
            raise RuntimeError("loss is not finite")  # the run stops before its optimizer step
        opt.step()
        opt.zero_grad()
""")


def test_a_step_cut_short_by_an_exception_keeps_its_rows(tmp_path):
    """The training script raises between backward and the optimizer step (a NaN check): at exit the
    monitor writes what that step recorded (activations, gradients with their NaNs), with no StepEnded
    for it, so the post-mortem sees the step that went wrong."""
    from trainmon_util import stats_table

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", CRASH, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "loss is not finite" in proc.stderr
    (log_path,) = glob.glob(os.path.join(str(out), "*-rank0-*", "*.trl"))
    reader, events = read_log(log_path)
    assert reader.problems == [] and reader.closed_cleanly
    assert [e.step for e in events if isinstance(e, StepEnded)] == [0, 1]
    un = stats_table(events, "grad_unreduced")
    assert un[(2, "0.weight", "", 0)]["nans"] > 0 and un[(1, "0.weight", "", 0)]["nans"] == 0
    assert stats_table(events, "actv")[(2, "0", "output", 0)]["nans"] > 0


HANG = textwrap.dedent("""
    import sys, time, torch
    from trainrec.recorder import TrainerMon
    mon = TrainerMon({"xy_distribution": True, "wg_distribution": True, "ops": ["norm"]}, live_export=False,
                     output_dir=sys.argv[1])
""" + _TRAIN3 + """        model(torch.randn(8, 4)).sum().backward()
        if step == 2:
            print("hung", flush=True)
            time.sleep(600)  # a rank stuck in a collective, until the job's watchdog kills it
        opt.step()
        opt.zero_grad()
""")


def test_kill_9_in_a_hung_step_keeps_what_the_step_recorded(tmp_path):
    """A step open for more than SPILL_AFTER_S has its rows and hook firings written while it goes on: a
    rank killed with SIGKILL while hung after its backward (no atexit, no signal handler) still leaves
    that step's activations and unreduced gradients in the log (they stayed in memory until the step
    ended before, and the step the post-mortem needs most was lost)."""
    from trainmon_util import stats_table
    from trainrec.recorder.step_output import SPILL_AFTER_S, SPILL_TICK_S
    from trainrec.schema.events import HooksFired

    # + the writer's flush interval
    _, reader, events = _signal_when(HANG, tmp_path / "out", "hung", signal.SIGKILL,
                                     SPILL_AFTER_S + 2 * SPILL_TICK_S + 1.0)
    assert not reader.closed_cleanly and [e.step for e in events if isinstance(e, StepEnded)] == [0, 1]
    un, act = stats_table(events, "grad_unreduced"), stats_table(events, "actv")
    assert {k[0] for k in un} == {0, 1, 2} and {k[0] for k in act} == {0, 1, 2}
    assert len([k for k in un if k[0] == 2]) == 4 and len([k for k in act if k[0] == 2]) == len(
        [k for k in act if k[0] == 1])
    assert {e.step for e in events if isinstance(e, HooksFired)} == {0, 1, 2}


def test_sigterm_in_the_middle_of_a_step_keeps_what_the_step_recorded(tmp_path):
    """Preemption between backward and the optimizer step: the SIGTERM handler writes the open step's
    rows before it closes the log (it closed the log with nothing of that step)."""
    from trainmon_util import stats_table

    # at once: before the spill thread's first look at the step
    rc, reader, events = _signal_when(HANG, tmp_path / "out", "hung", signal.SIGTERM)
    assert rc == -signal.SIGTERM
    assert reader.closed_cleanly and events[-1].reason == "sigterm"
    assert [e.step for e in events if isinstance(e, StepEnded)] == [0, 1]
    assert {k[0] for k in stats_table(events, "grad_unreduced")} == {0, 1, 2}
    assert {k[0] for k in stats_table(events, "actv")} == {0, 1, 2}


HANG_IN_FORWARD = textwrap.dedent("""
    import sys, time, torch
    from trainrec.recorder import TrainerMon

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
            self.hang = False

        def forward(self, x):
            if self.hang:  # a collective inside the forward (a tensor-parallel all-reduce, FSDP's all-gather)
                print("hung", flush=True)
                time.sleep(600)
            return self.body(x)

    mon = TrainerMon({"xy_distribution": True, "wg_distribution": True, "ops": ["norm"]}, live_export=False,
                     output_dir=sys.argv[1])
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for step in range(3):
        model.hang = step == 2
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
""")


def _post_mortem(out):
    from trainrec.replay.run import open_run
    from trainrec.replay.summary import summarize
    from trainrec.schema.events import StepBegan

    (log_path,) = glob.glob(os.path.join(str(out), "*-rank0-*", "*.trl"))
    _, events = read_log(log_path)
    (rank,) = summarize(open_run(str(out))).ranks
    return [e.step for e in events if isinstance(e, StepBegan)], rank


def test_a_rank_killed_in_its_first_forward_shows_the_step_it_was_in(tmp_path):
    """A rank hung inside the model's forward (no module's forward hook has fired yet in that step) and
    then killed: the log says that step began and did not end. It ended with the previous step's
    records, as if the rank had died between steps, and the post-mortem of a multi-rank hang pointed at
    the other ranks, whose logs do show the step (they wait for this one in the backward's all-reduce)."""
    _, reader, _ = _signal_when(HANG_IN_FORWARD, tmp_path / "out", "hung", signal.SIGKILL, 1.0)
    assert not reader.closed_cleanly
    began, rank = _post_mortem(tmp_path / "out")
    assert began == [0, 1, 2]
    assert rank.unended == [2] and rank.last_step == 2


def test_a_rank_stopped_by_sigterm_in_its_first_forward_shows_the_step_it_was_in(tmp_path):
    rc, reader, events = _signal_when(HANG_IN_FORWARD, tmp_path / "out", "hung", signal.SIGTERM)
    assert rc == -signal.SIGTERM and reader.closed_cleanly and events[-1].reason == "sigterm"
    assert events[-1].step == 2
    began, rank = _post_mortem(tmp_path / "out")
    assert began == [0, 1, 2] and rank.unended == [2]


HANG_IN_COLLECTIVE = textwrap.dedent("""
    import os, sys, time, torch
    import torch.distributed as dist
    from trainrec.recorder import TrainerMon

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    if rank == 1:  # the rank that never comes to the all-reduce
        print("ready", flush=True)
        time.sleep(600)
    mon = TrainerMon({"wg_distribution": True, "ops": ["norm"]}, live_export=False, output_dir=sys.argv[1])
""" + _TRAIN3 + """        model(torch.randn(8, 4)).sum().backward()
        if step == 2:
            print("hung", flush=True)
            dist.all_reduce(torch.ones(4))  # blocks in gloo's C++, where no Python signal handler runs
        opt.step()
        opt.zero_grad()
""")


def test_sigterm_ends_a_rank_hung_in_a_collective(tmp_path):
    """A rank blocked in a collective (its peer hung elsewhere) never runs Python's signal handlers: the
    monitor's SIGTERM handler kept it alive where the default disposition ends it at once, and the job's
    preemption or torchrun's shutdown waited for the SIGKILL that follows. A watcher thread told of the
    signal (Python's wakeup fd) writes the step in progress, closes the log and ends the process by
    SIGTERM, as the default would have."""
    import time

    from ranks import free_port

    out = tmp_path / "out"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", HANG_IN_COLLECTIVE, str(out)], stdout=subprocess.PIPE,
                              text=True, env=dict(env, RANK=str(r))) for r in (0, 1)]
    try:
        assert procs[1].stdout.readline().strip() == "ready"
        assert procs[0].stdout.readline().strip() == "hung"
        time.sleep(1.0)  # into the all-reduce
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        rc = procs[0].wait(timeout=20)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            p.stdout.close()
    assert rc == -signal.SIGTERM and took < 15
    (log_path,) = glob.glob(os.path.join(str(out), "*-rank0-*", "*.trl"))
    reader, events = read_log(log_path)
    assert reader.closed_cleanly and events[-1].reason == "sigterm"
    from trainmon_util import stats_table

    assert {k[0] for k in stats_table(events, "grad_unreduced")} == {0, 1, 2}  # the step it hung in


FORKED_CHILD = textwrap.dedent("""
    import os, signal, sys, time, torch
    from trainrec.recorder import TrainerMon
    mon = TrainerMon({"wg_distribution": True, "ops": ["norm"]}, live_export=False, output_dir=sys.argv[1])
""" + _TRAIN3 + """        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    pid = os.fork()  # a DataLoader worker, a multiprocessing fork
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    time.sleep(0.5)
    os.kill(pid, signal.SIGTERM)  # the child dies of it (DataLoader ends stuck workers so)
    _, status = os.waitpid(pid, 0)
    time.sleep(4.0)  # the watcher's grace, and then some
    mon.close()
    print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
""")


def test_a_forked_childs_sigterm_leaves_the_parent_alone(tmp_path):
    """A forked child inherits the SIGTERM handler and Python's wakeup fd: its signal must not reach the
    parent's SIGTERM watcher, which would end the parent."""
    proc = subprocess.run([sys.executable, "-c", FORKED_CHILD, str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["child", str(int(signal.SIGTERM))]
    (log_path,) = glob.glob(os.path.join(str(tmp_path / "out"), "*-rank0-*", "*.trl"))
    reader, events = read_log(log_path)
    assert reader.closed_cleanly and events[-1].reason == "close"
