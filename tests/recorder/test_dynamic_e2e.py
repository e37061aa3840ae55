"""End to end: a real training loop with TrainerMon in DYNAMIC_MONITOR mode, switched by editing config.json.

Start mid-run by an edit, stop after collect_times with switch=false written back into the file,
restart by a second edit; the replayed log shows every switch and statistics only at the right steps.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from trainrec.recorder import TrainerMon
from trainrec.replay.reader import LogReader, read_log
from trainrec.schema.events import (
    ConfigApplied,
    ConfigChanged,
    ConfigRejected,
    MonitoringStopped,
    TensorStatsRecorded,
)


def save(path, doc: dict) -> None:
    """Save as an editor does: write a temporary file, then rename it over the config."""
    tmp = str(path) + ".swp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


class Training:
    def __init__(self, mon: TrainerMon) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        mon.monitor_gnorm_with_ad(self.model, optimizer=self.opt)
        self.x = torch.randn(32, 8)
        self.step = 0
        self.reader = LogReader(mon.log_path)
        self.events: list = []

    def once(self) -> None:
        self.opt.zero_grad()
        self.model(self.x).pow(2).mean().backward()
        self.opt.step()  # TrainerMon's optimizer hooks end the step and poll the watcher
        self.step += 1
        time.sleep(0.002)
        self.events.extend(self.reader.poll())

    def until(self, pred, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.once()
            if pred():
                return
        pytest.fail(f"timed out after {timeout} s waiting for {what} (step {self.step})")

    def count(self, cls) -> int:
        return sum(isinstance(e, cls) for e in self.events)


@pytest.fixture
def one_thread():
    """A tiny model on a shared CPU: one intra-op thread is faster and steadier than several."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_dynamic_start_stop_restart_with_trainermon(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    cfg = tmp_path / "config.json"
    first = {"wg_distribution": True, "ops": ["norm", "max"], "switch": False, "collect_times": 3}
    cfg.write_text(json.dumps(first, indent=2))
    mon = TrainerMon(str(cfg), output_dir=str(tmp_path / "out"), live_export=False)
    try:
        t = Training(mon)
        t.until(lambda: t.step >= 5, "a few idle steps")
        edit1 = t.step
        save(cfg, {**first, "switch": True})
        t.until(lambda: json.loads(cfg.read_text())["switch"] is False, "switch=false written back")
        assert cfg.read_text() == json.dumps(first, indent=2)  # only the value changed, key order kept
        t.until(lambda: t.count(ConfigChanged) == 3, "the write-back to be seen in the log")
        assert t.count(ConfigApplied) == 1  # our own write did not restart anything
        edit2 = t.step
        # start_step is absolute (as the reference's): far enough ahead that the invalid edit below
        # is seen while this config is active.
        second = {**first, "switch": True, "collect_times": 2, "step_interval": 2, "start_step": edit2 + 100}
        save(cfg, second)
        t.until(lambda: t.count(ConfigApplied) == 2, "the restart")
        # An invalid edit while monitoring: rejected, the second config goes on to its end.
        cfg.write_text(json.dumps({**second, "collect_times": "two"}))
        t.until(lambda: t.count(ConfigRejected) == 1, "the rejection")
        t.until(lambda: t.count(MonitoringStopped) == 2, "the second collection to finish")
    finally:
        mon.close()

    _, events = read_log(mon.log_path)
    applied = [e for e in events if isinstance(e, ConfigApplied)]
    stopped = [e for e in events if isinstance(e, MonitoringStopped)]
    changed = [e for e in events if isinstance(e, ConfigChanged)]
    stats_steps = sorted({e.step for e in events if isinstance(e, TensorStatsRecorded)})
    (rejected,) = [e for e in events if isinstance(e, ConfigRejected)]
    assert rejected.keys == ("collect_times",) and "goes on with the config in effect since step" in rejected.reason

    # The start: seen and applied at one step after the edit, collected from the next step on.
    a1, a2 = applied
    assert a1.step >= edit1 and a1.start_step == a1.step + 1 and a1.config["collect_times"] == 3
    assert changed[0].step == 0 and changed[1].step == a1.step and changed[1].changed_keys == ("switch",)
    assert changed[2].changed_keys == ("switch",) and changed[2].step > a1.step + 3  # the write-back, seen
    # The restart: the second edit, applied at one step; start_step is absolute (0) with step_interval 2.
    assert a2.step >= edit2 and a2.config["collect_times"] == 2
    assert changed[3].step == a2.step
    assert changed[3].changed_keys == ("collect_times", "start_step", "step_interval", "switch")
    assert rejected.step > a2.step and changed[4].step == rejected.step
    restart_steps = [edit2 + 100, edit2 + 102]
    assert stats_steps == [a1.step + 1, a1.step + 2, a1.step + 3, *restart_steps]
    assert [(s.step, s.reason, s.collections) for s in stopped] == [
        (a1.step + 3, "collect_times", 3),
        (restart_steps[-1], "collect_times", 2),
    ]
    kinds = {e.kind for e in events if isinstance(e, TensorStatsRecorded) and e.step == a1.step + 1}
    assert kinds == {"grad_unreduced", "grad_reduced"}
    # The file holds the user's invalid edit, which the write-back must not overwrite.
    assert json.loads(cfg.read_text()) == {**second, "collect_times": "two"}


def test_print_struct_waits_for_the_switch(tmp_path, monkeypatch, one_thread):
    """In dynamic mode nothing runs before the switch says so: print_struct in a file that says
    "switch": false leaves training alone; switched on, the next step writes module_struct.json and
    ends the run with the reference's exception."""
    from trainrec.recorder.monitor import PRINT_STRUCT_EXIT

    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    cfg = tmp_path / "config.json"
    doc = {"xy_distribution": True, "print_struct": True, "switch": False}
    cfg.write_text(json.dumps(doc))
    out = tmp_path / "out"
    mon = TrainerMon(str(cfg), output_dir=str(out), live_export=False)
    try:
        t = Training(mon)
        t.until(lambda: t.step >= 5, "idle steps with print_struct and the switch off")
        assert not (out / "module_struct.json").exists()
        save(cfg, {**doc, "switch": True})
        with pytest.raises(Exception, match=PRINT_STRUCT_EXIT):
            t.until(lambda: False, "the struct step", timeout=20.0)
        struct = json.loads((out / "module_struct.json").read_text())
        assert {"0:0", "0:2"} <= set(struct)
    finally:
        mon.close()


def dynamic_monitor(tmp_path, monkeypatch, first: dict):
    """A TrainerMon in dynamic mode on ``tmp_path/config.json``, which holds ``first``."""
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(first))
    return cfg, TrainerMon(str(cfg), output_dir=str(tmp_path / "out"), live_export=False)


def test_switch_off_and_the_first_collected_step_are_reported_as_they_happen(tmp_path, monkeypatch, one_thread,
                                                                             caplog):
    """ConfigApplied.start_step (and the INFO notice) give the first step really collected, here the
    next multiple of step_interval; MonitoringStopped by switch=false gives the step the notice says."""
    first = {"wg_distribution": True, "ops": ["norm"], "switch": False, "step_interval": 4, "collect_times": 100}
    cfg, mon = dynamic_monitor(tmp_path, monkeypatch, first)
    try:
        t = Training(mon)
        t.until(lambda: t.step >= 5, "a few idle steps")
        with caplog.at_level("INFO", logger="trainrec"):
            save(cfg, {**first, "switch": True})
            t.until(lambda: t.count(TensorStatsRecorded) >= 4, "two collected steps")
            save(cfg, first)
            t.until(lambda: t.count(MonitoringStopped) == 1, "the stop")
    finally:
        mon.close()
    _, events = read_log(mon.log_path)
    (applied,) = [e for e in events if isinstance(e, ConfigApplied)]
    steps = sorted({e.step for e in events if isinstance(e, TensorStatsRecorded)})
    assert applied.start_step == steps[0] and steps[0] % 4 == 0 and steps[0] > applied.step
    assert any(f"monitoring from step {steps[0]} " in r.getMessage() for r in caplog.records)
    (stop,) = [e for e in events if isinstance(e, MonitoringStopped)]
    assert stop.reason == "switch_off" and stop.step >= steps[-1]
    assert any(f"monitoring stops after step {stop.step}" in r.getMessage() for r in caplog.records)


def test_native_record_watches_its_config_file(tmp_path, monkeypatch, one_thread):
    """record() given a config path under DYNAMIC_MONITOR watches that file, as TrainerMon does."""
    from trainrec.recorder import record

    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    cfg = tmp_path / "config.json"
    first = {"wg_distribution": True, "ops": ["norm"], "switch": False, "collect_times": 2}
    cfg.write_text(json.dumps(first))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt, config=str(cfg), output_dir=str(tmp_path / "out")) as rec:
        reader = LogReader(rec.log_path)
        events: list = []
        deadline = time.monotonic() + 20
        while not any(isinstance(e, MonitoringStopped) for e in events) and time.monotonic() < deadline:
            if rec.step_count == 3:
                save(cfg, {**first, "switch": True})
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.002)
            events.extend(reader.poll())
    applied = [e for e in events if isinstance(e, ConfigApplied)]
    assert len(applied) == 1 and applied[0].reason == "dynamic"
    steps = sorted({e.step for e in events if isinstance(e, TensorStatsRecorded)})
    assert steps == [applied[0].step + 1, applied[0].step + 2]


def test_a_config_dict_under_dynamic_monitor_applies_as_a_static_one(tmp_path, monkeypatch, caplog):
    """DYNAMIC_MONITOR needs a file to watch: with a dict, a warning says dynamic mode is off, and the
    config applies from the start (it recorded nothing at all)."""
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    with caplog.at_level("WARNING", logger="trainrec"):
        mon = TrainerMon({"wg_distribution": True, "ops": ["norm"]}, output_dir=str(tmp_path / "out"),
                         live_export=False)
    assert any("dynamic mode is off" in r.getMessage() for r in caplog.records)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    _, events = read_log(mon.log_path)
    assert sorted({e.step for e in events if isinstance(e, TensorStatsRecorded)}) == [0, 1]


def test_a_target_that_matches_no_module_is_rejected_before_anything_changes(tmp_path, monkeypatch, one_thread,
                                                                              caplog):
    """Only the model can tell that a target matches nothing: such a change is rejected like an invalid
    file (the path, and that monitoring stays off), the watcher does not think monitoring started, and
    the next valid edit starts it."""
    first = {"wg_distribution": True, "ops": ["norm"], "switch": False, "collect_times": 2}
    cfg, mon = dynamic_monitor(tmp_path, monkeypatch, first)
    try:
        t = Training(mon)
        t.until(lambda: t.step >= 3, "a few idle steps")
        with caplog.at_level("INFO", logger="trainrec"):
            save(cfg, {**first, "switch": True, "targets": {"no_such_layer": {}}})
            t.until(lambda: t.count(ConfigRejected) == 1, "the rejection")
        assert not any("monitoring from step" in r.getMessage() for r in caplog.records)
        assert not mon.session.output.watcher.active
        save(cfg, {**first, "switch": True})
        t.until(lambda: t.count(MonitoringStopped) == 1, "the valid start to run its course")
    finally:
        mon.close()
    _, events = read_log(mon.log_path)
    (rejected,) = [e for e in events if isinstance(e, ConfigRejected)]
    assert rejected.keys == ("targets.no_such_layer",) and rejected.path == str(cfg)
    assert str(cfg) in rejected.reason and rejected.reason.endswith("monitoring stays off")
    (applied,) = [e for e in events if isinstance(e, ConfigApplied)]
    assert applied.step > rejected.step
    assert sorted({e.step for e in events if isinstance(e, TensorStatsRecorded)}) == [applied.step + 1,
                                                                                      applied.step + 2]


@pytest.mark.parametrize("value", ["1", "yes", "on"])
def test_a_dynamic_monitor_value_that_is_not_true_or_false_is_a_warning(tmp_path, monkeypatch, caplog, value):
    """msprobe turns dynamic mode on for 'true' only (any case); DYNAMIC_MONITOR=1 left it off without a
    word, so the config's switch: false was ignored and monitoring ran from step 0."""
    monkeypatch.setenv("DYNAMIC_MONITOR", value)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "switch": False}))
    with caplog.at_level("WARNING", logger="trainrec"):
        mon = TrainerMon(str(cfg), output_dir=str(tmp_path / "out"), live_export=False)
    mon.close()
    assert not mon.dynamic
    assert any(f"DYNAMIC_MONITOR={value!r} is neither true nor false" in r.getMessage() for r in caplog.records)


def test_dynamic_monitor_false_is_quiet(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DYNAMIC_MONITOR", "False")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"wg_distribution": True}))
    with caplog.at_level("WARNING", logger="trainrec"):
        TrainerMon(str(cfg), output_dir=str(tmp_path / "out"), live_export=False).close()
    assert not [r for r in caplog.records if "DYNAMIC_MONITOR" in r.getMessage()]
