"""Monitor lifetime: an output directory that cannot be written fails the start, clearly; a monitor dropped
without close() (with its model and optimizer) is collected, and its log closed."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import weakref

import pytest
import torch
from trainmon_util import new_threads
from trainrec.recorder import TrainerMon
from trainrec.replay import open_run
from trainrec.schema.events import FileClosed


def _train_and_drop(cfg_path, out_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(str(cfg_path), params_have_main_grad=False, output_dir=str(out_dir))
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return weakref.ref(mon), weakref.ref(model), weakref.ref(opt)


def _threads(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_dropped_monitor_is_collected_and_its_log_closed(tmp_path, monkeypatch):
    """Hooks on parameters are out of the collector's sight, so one holding the monitor kept the
    monitor, the model and the optimizer alive until exit, with the log open and two threads running.
    Dynamic mode's watcher thread did the same."""
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "xy_distribution": True, "mv_distribution": True,
                               "format": "csv", "switch": True}))
    before = {t.ident for t in threading.enumerate()}
    refs = _train_and_drop(cfg, tmp_path / "out")
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and new_threads(before):
        time.sleep(0.05)
    assert [t.name for t in new_threads(before)] == []  # writer, spill, watcher, export
    run = open_run(str(tmp_path / "out"))
    events = list(run.events())
    assert isinstance(events[-1], FileClosed)
    assert sorted({e.step for e in events if type(e).__name__ == "StepEnded"}) == [0, 1, 2]
    # the live export read the log to its end and exited (dynamic mode starts recording at step 1)
    recorded = sorted({e.step for e in events if getattr(e, "kind", None) == "grad_reduced"})
    assert recorded == [1, 2]
    rank_dir = next((tmp_path / "out").iterdir())
    assert sorted(p.name for p in rank_dir.glob("grad_reduced_*.csv")) == [f"grad_reduced_{s}-{s}.csv" for s in recorded]


def test_a_monitor_in_use_is_not_collected(tmp_path):
    """The model's hooks keep a recording alive while the model is: dropping only the monitor object
    records on (as before)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "format": "api"}))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(str(cfg), params_have_main_grad=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    ref = weakref.ref(mon.session)
    del mon
    gc.collect()
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    session = ref()
    assert session is not None
    assert session.step_count == 2 and session.metrics("grad_reduced")  # still recording
    session.close()


def _alert_run(tmp_path, name, close):
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps({"format": "csv", "xy_distribution": True, "all_xy": True, "wg_distribution": True,
                               "param_distribution": True, "mv_distribution": True,
                               "alert": {"rules": [{"rule_name": "AnomalyTurbulence",
                                                    "args": {"threshold": 1e-9, "warmup": 1, "noise": 0,
                                                             "range_floor": 0}}], "dump": True}}))
    out = tmp_path / name

    def body():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(150) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = TrainerMon(str(cfg), params_have_main_grad=False, output_dir=str(out))
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        g = torch.Generator().manual_seed(0)
        for _ in range(6):
            model(torch.randn(2, 8, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
        if close:
            mon.close()

    body()
    gc.collect()
    from collections import Counter

    events = list(open_run(str(out)).events())
    assert isinstance(events[-1], FileClosed)
    return Counter(e.step for e in events if type(e).__name__ == "AnomalyDetected")


def test_a_dropped_monitor_keeps_the_anomalies_of_its_last_steps(tmp_path):
    """Detection runs on the writer's thread: the detector is closed after the writer has drained (it
    was closed first, and the anomalies of the steps still queued were lost)."""
    closed = _alert_run(tmp_path, "closed", close=True)
    dropped = _alert_run(tmp_path, "dropped", close=False)
    assert closed[5] > 0 and dropped == closed


def test_a_kept_loss_or_a_missing_optimizer_does_not_keep_a_dropped_monitor(tmp_path):
    """The last loss in a variable (a notebook) holds its graph, whose gradient hooks held the monitor;
    a monitor given no optimizer waits for one through a global optimizer hook, which held it for good
    where it was dropped before any optimizer step."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"xy_distribution": True, "all_xy": True, "wg_distribution": True, "format": "api"}))

    def with_kept_loss():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon(str(cfg), params_have_main_grad=False)
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        loss = None
        for _ in range(2):
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return weakref.ref(mon), loss

    def without_optimizer():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        mon = TrainerMon(str(cfg), params_have_main_grad=False, output_dir=str(tmp_path / "noopt"))
        mon.monitor_gnorm_with_ad(model)
        model(torch.randn(2, 4)).sum().backward()  # a cell that failed before the optimizer stepped
        return weakref.ref(mon)

    ref, loss = with_kept_loss()
    gc.collect()
    assert ref() is None and loss.grad_fn is not None
    ref = without_optimizer()
    gc.collect()
    assert ref() is None
    # and an optimizer stepping afterwards finds no monitor to bind
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.sum().backward()
    opt.step()


def test_an_output_directory_that_cannot_be_written_is_a_clear_error_at_start(tmp_path, monkeypatch):
    """$MONITOR_OUTPUT_DIR (or output_dir) under a regular file: an error naming the setting and the
    path when the monitor is made (it was the bare OSError of makedirs), and nothing left behind."""
    from trainrec.recorder import TrainerMon, record
    from trainrec.schema.errors import WriterError

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(blocker / "out"))
    with pytest.raises(WriterError, match=r"cannot write the monitor's log under '.*a_file/out' \(\$MONITOR_OUTPUT_DIR\)"):
        TrainerMon({"wg_distribution": True}, live_export=False)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(WriterError, match=r"under '.*a_file/x' \(output_dir\): .*Not a directory"):
        with record(model, config={"wg_distribution": True}, output_dir=str(blocker / "x")):
            pass
    assert sorted(os.listdir(tmp_path)) == ["a_file"]
    assert not model._forward_hooks and not model._forward_pre_hooks


_WRITER_FAILS = """
import json, logging, resource, signal, sys, time
import torch
from trainrec.recorder import record
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
said = []
handler = logging.Handler()
handler.emit = lambda r: said.append(r.getMessage())
logging.getLogger("trainrec").addHandler(handler)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
hooks = []
with record(model, opt, config={"wg_distribution": True, "xy_distribution": True}, output_dir=sys.argv[1]):
    # (until 20 steps after the failure was noticed: how soon the writer thread writes depends on the load)
    while len(hooks) < 20000 and not (len(hooks) > 20 and hooks[-20] == 2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        hooks.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()))
        time.sleep(0.001)
print(json.dumps({"hooks": hooks, "said": said}))
"""


def test_a_failed_log_writer_stops_the_collection_and_is_said_once(tmp_path):
    """The log's file system full (here the file size limit): training goes on, the hooks go at the next
    step (their statistics could reach nothing), and closing says nothing more about it."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _WRITER_FAILS, str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    hooks = out["hooks"]
    # the model chunk's two (the step's boundaries) stay; the statistics' hooks go
    assert hooks[0] > 2 and hooks[-20:] == [2] * 20 and len(hooks) < 20000
    assert hooks == sorted(hooks, reverse=True)  # removed once, never put back
    assert any("writer" in m and "failed" in m for m in out["said"]), out["said"]
    assert not any("closing the log failed" in m for m in out["said"]), out["said"]


def test_a_second_open_monitor_on_the_same_model_is_warned_about(tmp_path, caplog):
    """A sweep or notebook that makes a new monitor on the model without closing the last one: both
    record every step; a warning names the other's log. After close(), a new monitor is alone."""
    import logging

    model = torch.nn.Linear(3, 3)
    first = TrainerMon({"wg_distribution": True}, output_dir=str(tmp_path / "a"), live_export=False)
    first.monitor_gnorm_with_ad(model)
    with caplog.at_level(logging.WARNING, logger="trainrec"):
        second = TrainerMon({"wg_distribution": True}, output_dir=str(tmp_path / "b"), live_export=False)
        second.monitor_gnorm_with_ad(model)
    said = [r.getMessage() for r in caplog.records if "also monitored" in r.getMessage()]
    assert len(said) == 1 and first.log_path in said[0]
    first.close()
    second.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainrec"):
        third = TrainerMon({"wg_distribution": True}, output_dir=str(tmp_path / "c"), live_export=False)
        third.monitor_gnorm_with_ad(model)
        third.close()
    assert not [r for r in caplog.records if "also monitored" in r.getMessage()]


@pytest.mark.parametrize("run_id", [None, "shared-id"])
def test_ranks_from_the_environment_without_a_shared_run_id_are_warned_about(tmp_path, monkeypatch, caplog, run_id):
    """torchrun without --standalone or --rdzv-id, and no init_process_group: each rank makes a run id
    of its own and replay lists as many one-rank runs; a warning says how to name the run."""
    import logging

    from trainrec.recorder import failures

    monkeypatch.setattr(failures, "_warned", set())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # what torchrun sets without a rendezvous id
    if run_id is None:
        monkeypatch.delenv("TRAINREC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("TRAINREC_RUN_ID", run_id)
    with caplog.at_level(logging.WARNING, logger="trainrec"):
        mon = TrainerMon({"wg_distribution": True}, output_dir=str(tmp_path), live_export=False)
        mon.monitor_gnorm_with_ad(torch.nn.Linear(2, 2))
        mon.close()
    said = [r.getMessage() for r in caplog.records if "a run of its own" in r.getMessage()]
    assert mon.rank == 1 and mon.world_size == 2
    assert len(said) == (1 if run_id is None else 0) and all("TRAINREC_RUN_ID" in m for m in said)


@pytest.mark.parametrize("api", ["record", "TrainerMon"])
def test_an_exception_out_of_the_with_block_is_the_logs_close_reason_and_goes_on_unchanged(tmp_path, api):
    """A NaN check that raises between backward and the optimizer step inside ``with record(...)``: the
    exception comes out as it was raised, the step it cut short keeps what it recorded (no StepEnded),
    and the log's FileClosed says the exception closed it (it said "close", and ``inspect`` that the
    log was closed in the middle of the step by a close())."""
    from trainrec.recorder import record
    from trainrec.replay.reader import read_log
    from trainrec.schema.events import StepEnded, TensorStatsRecorded

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "ops": ["norm"]}

    class LossIsNaN(Exception):
        pass

    err = LossIsNaN("loss is nan")
    if api == "record":
        rec = record(model, opt, config=cfg, output_dir=str(tmp_path / "out"))
    else:
        rec = TrainerMon(cfg, output_dir=str(tmp_path / "out"), live_export=False)
        rec.monitor_gnorm_with_ad(model, optimizer=opt)
    with pytest.raises(LossIsNaN) as ei, rec:
        for step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            if step == 2:
                raise err
            opt.step()
            opt.zero_grad()
    assert ei.value is err and ei.value.__context__ is None
    reader, events = read_log(rec.log_path)
    assert [e.step for e in events if isinstance(e, StepEnded)] == [0, 1]
    assert 2 in {e.step for e in events if isinstance(e, TensorStatsRecorded) and e.kind == "grad_unreduced"}
    assert isinstance(events[-1], FileClosed) and "LossIsNaN" in events[-1].reason


def test_a_closed_recorder_says_so_and_puts_no_hooks_back(tmp_path):
    """step() on a closed recorder began a new step: its hooks went back on the model, for good, with no
    log to write to; a second ``with rec:`` recorded nothing, silently. Both are a RuntimeError now, and
    the model keeps no hook; the metrics of the last step stay readable."""
    from trainrec.recorder import record

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))

    def hooks():
        return (sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
                + sum(len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})
                      for p in model.parameters()))

    rec = record(model, config={"wg_distribution": True, "xy_distribution": True}, output_dir=str(tmp_path / "out"))
    with rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
    assert hooks() == 0 and rec.step_count == 1
    with pytest.raises(RuntimeError, match="closed"):
        rec.step()
    with pytest.raises(RuntimeError, match="closed"), rec:
        pass
    assert hooks() == 0 and rec.step_count == 1
    assert rec.metrics("grad_reduced")


def test_two_open_recorders_writing_to_one_output_directory_are_warned_about(tmp_path, caplog):
    """A GAN's two recorders without an output_dir each (both under $MONITOR_OUTPUT_DIR): one run id, two
    rank-0 directories, and replay shows one of them, the other's log hidden, with nothing said. A
    warning names the other's log; with their own directories nothing is said."""
    import logging

    from trainrec.recorder import record

    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    cfg = {"wg_distribution": True}
    with caplog.at_level(logging.WARNING, logger="trainrec"):
        with record(gen, config=cfg, output_dir=str(tmp_path / "own_g")), \
                record(disc, config=cfg, output_dir=str(tmp_path / "own_d")):
            pass
        assert not [r for r in caplog.records if "same output directory" in r.getMessage()]
        with record(gen, config=cfg, output_dir=str(tmp_path / "out")) as rg, \
                record(disc, config=cfg, output_dir=str(tmp_path / "out" / ".")):
            pass
    said = [r.getMessage() for r in caplog.records if "same output directory" in r.getMessage()]
    assert len(said) == 1 and rg.log_path in said[0] and "output_dir" in said[0]
