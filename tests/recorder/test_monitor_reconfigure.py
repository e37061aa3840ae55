"""Config changed while training runs: applied at a step boundary, rejected whole when wrong."""

from __future__ import annotations

import pytest
from trainmon_util import events_of, loss_of, make, steps_with, write_config
from trainrec.recorder import TrainerMon
from trainrec.schema.events import ConfigRejected


def test_apply_config_with_a_target_matching_nothing_is_rejected_and_the_old_config_goes_on(tmp_path, out):
    from trainrec.recorder.config import parse_config

    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    loss_of(model, 0).backward()
    opt.step()
    mon.session.apply_config(parse_config({"wg_distribution": True, "targets": {"nothing.here": {}}}), 0, "abc")
    loss_of(model, 1).backward()
    opt.step()
    mon.close()
    ev = events_of(out)
    rej = [e for e in ev if isinstance(e, ConfigRejected)]
    assert rej and rej[0].keys == ("targets.nothing.here",) and rej[0].content_hash == "abc"
    assert steps_with(ev, "grad_reduced") == [0, 1]


@pytest.mark.parametrize("first", ["api", "tensorboard"])
def test_a_dynamic_change_of_format_says_it_applies_at_the_next_launch(tmp_path, out, caplog, monkeypatch, first):
    """The output (log, live export) is set up when the monitor is made: a config switched on later with
    another format says so, and what this run gives instead, rather than writing nothing silently."""
    from trainrec.recorder import failures
    from trainrec.recorder.config import parse_config

    monkeypatch.setattr(failures, "_warned", set())
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "format": first}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        mon.session.apply_config(parse_config({"wg_distribution": True, "format": "csv"}), 0, "abc")
    mon.close()
    (msg,) = [r.getMessage() for r in caplog.records if "format changed" in r.getMessage()]
    assert "next launch" in msg
    assert ("writes no log" in msg) == (first == "api") and ("trainrec export" in msg) == (first != "api")


def test_reload_xy_switches_activation_hooks_without_stacking(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"xy_distribution": True, "wg_distribution": True}), live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    n_hooks = sum(len(m._forward_hooks) for m in model.modules())
    mon.reload_xy(True)
    mon.reload_xy(True)
    assert sum(len(m._forward_hooks) for m in model.modules()) == n_hooks
    loss_of(model, 0).backward()
    opt.step()
    mon.reload_xy()  # the reference's default: xy_distribution=False
    # left: the run's own hook on each model chunk (micro steps of weight gradients), no activation hook
    assert sum(len(m._forward_hooks) for m in model.modules()) == len(mon.session.monitored.chunks)
    loss_of(model, 1).backward()
    opt.step()
    mon.reload_xy(True)
    loss_of(model, 2).backward()
    opt.step()
    mon.close()
    ev = events_of(out)
    assert steps_with(ev, "actv") == [0, 2] and steps_with(ev, "grad_reduced") == [0, 1, 2]
