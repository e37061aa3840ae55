"""The recorder's core, ``RecordingSession``, driven directly and through both faces."""

from __future__ import annotations

import pytest
from trainmon_util import events_of, loss_of, make, stats_table, steps_with
from trainrec.recorder import TrainerMon, record
from trainrec.recorder.session import RecordingSession, config_from
from trainrec.schema.events import FileClosed, StepEnded

CONFIG = {"wg_distribution": True, "param_distribution": True, "xy_distribution": True, "ops": ["norm", "max"]}


def test_a_session_records_steps_ended_by_hand_and_closes_once(tmp_path, out):
    config, path = config_from(dict(CONFIG))
    assert path is None  # (only a file can be watched)
    session = RecordingSession(config, output_dir=str(tmp_path / "core"), live_export=False, manual_steps=True,
                               params_have_main_grad=False)
    model, _ = make()
    session.install(model)
    for s in range(2):
        loss_of(model, s).backward()
        session.step()
    assert session.step_count == 2 and set(session.metrics("param"))
    session.close()
    session.close()  # idempotent
    assert session.closed
    with pytest.raises(RuntimeError, match="closed monitor"):
        session.step()
    ev = events_of(tmp_path / "core")
    assert [e.step for e in ev if isinstance(e, StepEnded)] == [0, 1]
    assert steps_with(ev, "grad_reduced") == [0, 1] and steps_with(ev, "actv") == [0, 1]
    assert [e.reason for e in ev if isinstance(e, FileClosed)] == ["close"]


def test_both_faces_write_the_same_statistics(tmp_path, out):
    """TrainerMon and record() are two faces on one core: the same model, config and steps give the same
    rows (names, steps, values)."""
    tables = {}
    for face in ("trainermon", "record"):
        model, _ = make(seed=3)
        where = str(tmp_path / face)
        if face == "trainermon":
            mon = TrainerMon(dict(CONFIG), params_have_main_grad=False, output_dir=where, live_export=False)
            mon.session.steps.manual = True  # (steps ended by hand, as record() without an optimizer)
            mon.monitor_gnorm_with_ad(model)
            step, close = mon.step, mon.close
        else:
            rec = record(model, config=dict(CONFIG), output_dir=where)
            step, close = rec.step, rec.close
        for s in range(2):
            loss_of(model, s).backward()
            step()
        close()
        ev = events_of(where)
        tables[face] = {kind: stats_table(ev, kind) for kind in ("grad_reduced", "param", "actv", "actv_grad")}
    for kind, table in tables["trainermon"].items():
        assert table and table.keys() == tables["record"][kind].keys(), kind
        for key, row in table.items():
            assert row == pytest.approx(tables["record"][kind][key], nan_ok=True), (kind, key)


def test_close_removes_every_hook_through_the_one_registry(tmp_path, out):
    """The session's hooks (chunks, a collected step's, the optimizer's, the backward markers, the first
    call's checks where selectors are given) are in its HookHandles, by group; close() leaves none on the model or the optimizer."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    global_before = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    model, opt = make()
    session = RecordingSession(config_from(dict(CONFIG))[0], output_dir=str(tmp_path / "core"), live_export=False,
                               params_have_main_grad=False)
    session.install(model, optimizer=opt)
    groups = {name: len(session.handles.group(name)) for name in ("run", "step", "optimizer")}
    assert all(groups.values()), groups
    loss_of(model, 0).backward()
    opt.step()
    session.close()
    assert len(session.handles) == 0
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert not (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks)
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == global_before
