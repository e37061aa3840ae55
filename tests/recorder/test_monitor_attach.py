"""How TrainerMon binds to the optimizer (given, found, wrapped, a second one) and takes its hooks off at close."""

from __future__ import annotations

from trainmon_util import events_of, loss_of, make, steps_with, train, write_config
from trainrec.recorder import TrainerMon
from trainrec.schema.events import StepEnded


def test_hooks_removed_on_close(tmp_path, out):
    cfg = {"xy_distribution": True, "wg_distribution": True}
    mon, model, opt = train(tmp_path, cfg, steps=1, close=False)
    assert any(m._forward_hooks for m in model.modules())
    mon.close()
    for m in model.modules():
        assert not m._forward_hooks and not m._backward_hooks and not m._forward_pre_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    mon.close()  # idempotent


def test_second_optimizer_instance_does_not_disturb(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    model, opt = make()
    other_model, other_opt = make(seed=1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for s in range(3):
        loss_of(other_model, s).backward()
        other_opt.step()
    loss_of(model, 0).backward()
    opt.step()
    mon.close()
    ev = events_of(out)
    assert steps_with(ev, "grad_reduced") == [0]
    assert [e.step for e in ev if isinstance(e, StepEnded)] == [0]


def test_optimizer_none_binds_the_optimizer_of_the_model(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True}), live_export=False)
    model, opt = make()
    other_model, other_opt = make(seed=1)
    mon.monitor_gnorm_with_ad(model, optimizer=None)
    loss_of(other_model, 0).backward()
    other_opt.step()  # not ours: ignored
    for s in range(2):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    assert mon.session.binding.opt is opt and not mon.session.binding.waiting
    mon.close()
    assert steps_with(events_of(out), "grad_reduced") == [0, 1]


def test_set_wrapped_optimizer_follows_dot_optimizer(tmp_path, out):
    class Wrapper:  # like DeepSpeed / Megatron mixed-precision wrappers
        def __init__(self, inner):
            self.optimizer = inner

        def step(self):
            self.optimizer.step()

    model, opt = make()
    wrapper = Wrapper(opt)
    TrainerMon.set_wrapped_optimizer(wrapper)
    try:
        mon = TrainerMon(write_config(tmp_path, {"mv_distribution": True}), live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=None)
        loss_of(model, 0).backward()
        wrapper.step()
        mon.close()
    finally:
        TrainerMon.set_wrapped_optimizer(None)
    assert steps_with(events_of(out), "exp_avg") == [0]
