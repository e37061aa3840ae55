"""Optimizer steps that never ran: torch.amp's GradScaler skips ``optimizer.step()`` when it finds
inf/NaN gradients (DeepSpeed's fp16 overflow does the same), so no optimizer hook fires. The monitor
notices it at the next step's first forward (more forwards than ``grad_acc_steps``, gradients
cleared): the skipped step ends there, marked ``optimizer_skipped``, with its own (non-finite)
gradients, and the next step's rows are the next step's."""

from __future__ import annotations

import math

import pytest
import torch
from trainmon_util import ALL_OPS, TinyNet, events_of, loss_of, make, stats_table, write_config
from trainrec.recorder import TrainerMon
from trainrec.replay.names import NameResolver
from trainrec.schema.events import StepBegan, StepEnded, TensorStatsRecorded


def ends(events) -> list[tuple[int, bool]]:
    return [(e.step, e.optimizer_skipped) for e in events if isinstance(e, StepEnded)]


def sam_passes(model, opt, i: int) -> None:
    """SAM's two passes of one step: a pass, zero_grad, a second pass at weights perturbed along the
    first pass's gradients, the weights restored (the second pass's gradients are the step's)."""
    loss_of(model, i).backward()
    with torch.no_grad():
        eps = [0.01 * p.grad for p in model.parameters()]
        for p, e in zip(model.parameters(), eps, strict=True):
            p.add_(e)
    opt.zero_grad()
    loss_of(model, i).backward()
    with torch.no_grad():
        for p, e in zip(model.parameters(), eps, strict=True):
            p.sub_(e)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("grad_acc", [1, 2])
def test_grad_scaler_skipped_step_ends_at_the_next_forward_with_its_own_gradients(tmp_path, out, grad_acc,
                                                                                  set_to_none):
    cfg = {"wg_distribution": True, "xy_distribution": True, "mv_distribution": True, "ops": ALL_OPS}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=grad_acc, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    stepped = []
    for s in range(5):
        for m in range(grad_acc):
            loss = loss_of(model, 10 * s + m)
            if s == 2:
                loss = loss * float("inf")  # every gradient of this step is inf or NaN
            scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        stepped.append(scaler.get_scale() == before)  # the scale halves where the step was skipped
        opt.zero_grad(set_to_none=set_to_none)  # False: zeroed in place, which the monitor notices too
    mon.close()
    assert stepped == [True, True, False, True, True]
    ev = events_of(out)
    assert ends(ev) == [(0, False), (1, False), (2, True), (3, False), (4, False)]
    un = stats_table(ev, "grad_unreduced")
    key = ("head.weight", "", grad_acc - 1)
    assert not math.isfinite(un[(2, *key)]["norm"])
    assert all(math.isfinite(un[(s, *key)]["norm"]) for s in (0, 1, 3, 4))
    # each step has each micro step once: step 3's rows are step 3's, not a second set in step 2
    assert sorted(k[3] for k in un if k[0] == 2 and k[1] == "head.weight") == list(range(grad_acc))
    assert sorted(k[3] for k in un if k[0] == 3 and k[1] == "head.weight") == list(range(grad_acc))
    actv = stats_table(ev, "actv")
    assert sorted(k[3] for k in actv if k[0] == 3 and k[1:3] == ("head", "output")) == list(range(grad_acc))
    # no optimizer step, so no reduced gradients and no Adam state rows at the skipped step
    assert {k[0] for k in stats_table(ev, "grad_reduced")} == {0, 1, 3, 4}
    assert {k[0] for k in stats_table(ev, "exp_avg")} == {0, 1, 3, 4}  # the state after each update


@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("grad_acc", [1, 2])
def test_a_skipped_last_step_ends_skipped_at_close(tmp_path, out, grad_acc, interval):
    """The scaler skips the run's last optimizer step: no forward follows to notice it, so close() ends
    it as that forward would have (it was left open, and ``inspect`` called it a step that never ended,
    as after a crash). A step cut short before its optimizer step (gradients not cleared) stays open."""
    cfg = {"wg_distribution": True, "ops": ["norm"], "step_interval": interval}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=grad_acc, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for s in range(3):
        for m in range(grad_acc):
            loss = loss_of(model, 10 * s + m)
            if s == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.close()
    assert ends(events_of(out)) == [(0, False), (1, False), (2, True)]


def test_a_step_cut_short_before_its_optimizer_step_stays_open_at_close(tmp_path, out):
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}), params_have_main_grad=False,
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=1, optimizer=opt)
    for s in range(2):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    (loss_of(model, 2) * float("nan")).backward()  # a NaN check would raise here, before opt.step()
    mon.close()
    ev = events_of(out)
    assert ends(ev) == [(0, False), (1, False)]
    assert 2 in {k[0] for k in stats_table(ev, "grad_unreduced")}


def test_undeclared_accumulation_and_no_grad_forwards_do_not_split_steps(tmp_path, out):
    """More forwards than grad_acc_steps while gradients are still there (accumulation the monitor was
    not told about), and training-mode forwards under no_grad: no step is taken for skipped."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}), params_have_main_grad=False,
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=1, optimizer=opt)
    for s in range(3):
        with torch.no_grad():
            model(torch.zeros(2, 3, dtype=torch.long))  # e.g. a sample logged before the step
        for m in range(3):
            loss_of(model, 10 * s + m).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert ends(events_of(out)) == [(0, False), (1, False), (2, False)]


def test_skipped_steps_are_noticed_on_steps_that_are_not_collected(tmp_path, out, capsys):
    """step_interval=2: the skipped step 1 is not collected, and the steps after it keep their numbers."""
    cfg = {"wg_distribution": True, "ops": ["norm"], "step_interval": 2}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for s in range(5):
        loss = loss_of(model, s) * (float("inf") if s == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    assert ends(ev) == [(0, False), (1, True), (2, False), (3, False), (4, False)]
    assert {k[0] for k in stats_table(ev, "grad_unreduced")} == {0, 2, 4}
    # `trainrec inspect` names them
    from trainmon_util import rank_dirs
    from trainrec.tools.cli import main

    assert main(["inspect", rank_dirs(out)[0]]) == 0
    assert "optimizer step skipped (inf/NaN gradients) at 1 step(s): 1" in capsys.readouterr().out
    # and `trainrec anomalies` says so next to its ranking
    assert main(["anomalies", rank_dirs(out)[0], "--rule", "NaNInf"]) == 0
    assert "note: the optimizer step never ran (inf/NaN gradients) at step(s) 1" in capsys.readouterr().err


def test_two_forwards_before_one_backward_do_not_split_steps(tmp_path, out):
    """A siamese/contrastive step: two forwards of the model, then one backward (gradients are all
    None at the second forward, as after a skipped step, but no backward ran yet in this step)."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}), params_have_main_grad=False,
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    for s in range(3):
        a = model(torch.zeros(2, 3, dtype=torch.long) + s)
        b = model(torch.ones(2, 3, dtype=torch.long) + s)
        (a - b).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert ends(events_of(out)) == [(0, False), (1, False), (2, False)]


def test_many_skipped_steps_in_a_row_warn_once_about_grad_acc_steps(tmp_path, out, caplog):
    """Eight steps in a row without an optimizer step: either the loss scaler keeps finding inf/NaN, or
    the run accumulates over more micro steps than it said (grad_acc_steps); the warning names both."""
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}), params_have_main_grad=False,
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with caplog.at_level("WARNING", logger="trainrec.recorder.monitor"):
        for s in range(12):
            scaler.scale(loss_of(model, s) * float("inf")).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        mon.close()
    warned = [r.getMessage() for r in caplog.records if "in a row never ran" in r.getMessage()]
    assert len(warned) == 1 and "grad_acc_steps=1" in warned[0]
    assert ends(events_of(out)) == [(s, True) for s in range(12)]  # step 11 ended at close


@pytest.mark.parametrize("interval", [1, 3])
def test_several_passes_per_optimizer_step_are_one_step(tmp_path, out, interval):
    """SAM (a pass, zero_grad, a second pass at perturbed weights, the optimizer step) and a GAN whose
    discriminator also runs in the generator's pass: more forwards than grad_acc_steps after a
    backward, gradients cleared, as after a skipped step, but every gradient is finite, so no step is
    taken for skipped (each optimizer step was logged as two, one of them "skipped"). On steps that are
    not collected (interval 3) the number of passes the last optimizer step took decides."""
    cfg = {"wg_distribution": True, "ops": ["norm"], "step_interval": interval}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    reduced = {}
    for s in range(7):
        sam_passes(model, opt, s)
        reduced[s] = float(model.head.weight.grad.norm())
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    assert ends(ev) == [(s, False) for s in range(7)]
    red = stats_table(ev, "grad_reduced")
    assert {k[0] for k in red} == set(range(0, 7, interval))
    for s in range(0, 7, interval):
        assert abs(red[(s, "head.weight", "", 0)]["norm"] - reduced[s]) <= 1e-6 * reduced[s]


class WithEmpty(TinyNet):
    """TinyNet with a parameter of no elements in its loss (a zero-size bias, a slot of a config left
    empty): its gradient, of no elements, gets a NaN row, its statistics being of nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return super().forward(x) + self.empty.sum()


def _empty_model():
    torch.manual_seed(0)
    model = WithEmpty()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("path", ["fused", "device"])  # (device: the code accelerators take, rows in tensors)
@pytest.mark.parametrize("case", ["first_input_grad", "empty_param"])
def test_placeholder_rows_do_not_make_steps_with_several_passes_look_skipped(tmp_path, out, case, path):
    """The NaN rows the recorder writes for no tensor's values are not inf/NaN gradients: with
    xy_distribution the embedding's input_grad (token ids take no gradient: the pair's other slot, a NaN
    row), and a parameter of no elements. Each made every SAM step (a pass, zero_grad, a second pass)
    look like a skipped step followed by one more, so the log held twice the steps, half "skipped"; the
    empty gradient also made the check of the reduced gradients before the first step fail (a
    HookFailed: no inf norm of nothing)."""
    from trainrec.schema.events import HookFailed

    cfg = {"wg_distribution": True, "ops": ALL_OPS}
    if case == "first_input_grad":
        cfg["xy_distribution"] = True
        model, opt = make()
    else:
        model, opt = _empty_model()
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    if path == "device":
        mon.session.context.engine.fused = mon.session.context.engine.host_paths = False
    for s in range(4):
        sam_passes(model, opt, s)
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    assert ends(ev) == [(s, False) for s in range(4)]
    assert not [e for e in ev if isinstance(e, HookFailed)]
    rows = stats_table(ev, "actv_grad" if case == "first_input_grad" else "grad_unreduced")
    key = ("embed", "input_grad", 0) if case == "first_input_grad" else ("empty", "", 0)
    assert all(math.isnan(v) for v in rows[(3, *key)].values())  # still recorded, as NaN rows


def test_a_skipped_step_is_noticed_beside_placeholder_rows(tmp_path, out):
    """An inf/NaN gradient still marks its step skipped where placeholder rows are there too."""
    cfg = {"wg_distribution": True, "xy_distribution": True, "ops": ["norm"]}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = _empty_model()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for s in range(4):
        scaler.scale(loss_of(model, s) * (float("inf") if s == 2 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.close()
    assert ends(events_of(out)) == [(0, False), (1, False), (2, True), (3, False)]


def test_a_gan_discriminator_used_in_the_generator_pass_keeps_its_step_count(tmp_path, out):
    cfg = {"wg_distribution": True, "ops": ["norm"], "step_interval": 2}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    disc, opt_d = make()
    gen = torch.nn.Embedding(50, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    mon.monitor_gnorm_with_ad(disc, optimizer=opt_d)
    for s in range(6):
        opt_d.zero_grad()
        real, fake = loss_of(disc, s), disc(torch.zeros(2, 3, dtype=torch.long)).mean() * gen.weight[s].sum().detach()
        (real + fake).backward()
        opt_d.step()
        opt_g.zero_grad()
        (disc(torch.ones(2, 3, dtype=torch.long)).mean() * gen.weight[s].sum()).backward()  # D's grads too
        opt_g.step()
    mon.close()
    ev = events_of(out)
    # the discriminator's pass in the last generator step: no step of its own (nor one left open)
    assert ends(ev) == [(s, False) for s in range(7)]
    assert [e.step for e in ev if isinstance(e, StepEnded) and e.foreign_passes] == [6]
    assert [e.step for e in ev if isinstance(e, StepBegan)] == list(range(7))


def test_no_grad_forwards_in_training_mode_take_no_micro_step(tmp_path, out):
    """A forward under no_grad with the model in train() (a target computed with the model) before each
    micro step: the training forwards are micro steps 0 and 1, their gradients too, and the no_grad
    forwards' activations are not recorded (they were micro 0, and shifted both training forwards to 1)."""
    cfg = {"wg_distribution": True, "xy_distribution": True, "ops": ["norm"]}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    outs, grads = {}, {}
    for s in range(2):
        for m in range(2):
            with torch.no_grad():
                model(torch.zeros(2, 3, dtype=torch.long) + 7)
            x = torch.tensor([[s, m, 3], [4, 5, 6]])
            y = model(x)
            outs[(s, m)] = float(y.detach().norm())
            y.pow(2).mean().backward()
            grads[(s, m)] = float(model.head.weight.grad.norm())
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(out)
    act = {k: v["norm"] for k, v in stats_table(ev, "actv").items() if k[1:3] == ("head", "output")}
    assert sorted(act) == [(s, "head", "output", m) for s in range(2) for m in range(2)]
    for (s, _, _, m), v in act.items():
        assert abs(v - outs[(s, m)]) <= 1e-5 * outs[(s, m)]
    un = {k: v["norm"] for k, v in stats_table(ev, "grad_unreduced").items() if k[1] == "head.weight"}
    assert {(k[0], k[3]): v for k, v in un.items()} == pytest.approx(grads, rel=1e-5)


def test_no_grad_calls_in_training_mode_record_no_rows_and_begin_no_step(tmp_path, out):
    """Under no_grad with the model in train(): a whole-model forward records nothing, the model's own
    (root) module included, whose forward hook runs after the hook that closes the model's forward; a
    submodule called by itself (targets made with the model's embedding) records nothing either; and
    such a forward after the last optimizer step begins no step. Each training forward keeps one row."""
    cfg = {"xy_distribution": True, "wg_distribution": True, "ops": ["norm"]}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    outs = {}
    for s in range(2):
        for m in range(2):
            with torch.no_grad():
                model(torch.zeros(2, 3, dtype=torch.long) + 7)
                model.embed(torch.ones(2, 3, dtype=torch.long))
            y = model(torch.tensor([[s, m, 3], [4, 5, 6]]))
            outs[(s, m)] = float(y.detach().norm())
            y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # a sample after the last step
        model(torch.zeros(2, 3, dtype=torch.long))
    mon.close()
    ev = events_of(out)
    res, rows = NameResolver(), {}
    for e in ev:
        res.feed(e)
        if isinstance(e, TensorStatsRecorded) and e.kind == "actv":
            for name, slot, micro in zip(res.names(e), e.column("slots"), e.column("micro_steps"), strict=True):
                key = (e.step, name, int(slot), int(micro))
                rows[key] = rows.get(key, 0) + 1
    names = {k[1] for k in rows}
    assert {"", "embed", "head"} <= names
    assert set(rows.values()) == {1}  # one row per module, slot and micro step: the training forward's
    assert {(k[0], k[3]) for k in rows} == {(s, m) for s in range(2) for m in range(2)}
    root = {(k[0], k[3]): v["norm"] for k, v in stats_table(ev, "actv").items() if k[1:3] == ("", "output")}
    assert root == pytest.approx(outs, rel=1e-5)
    assert [e.step for e in ev if isinstance(e, StepBegan)] == [0, 1]


@pytest.mark.parametrize("pattern", ["gan_generator_first", "sam", "scaler_skip"])
def test_several_passes_before_the_first_optimizer_step_on_a_step_not_collected_are_one_step(tmp_path, pattern):
    """start_step 2: step 0 is not collected, so it has no gradient rows, and no optimizer step has run
    yet to tell how many passes one takes. A GAN that steps the generator first (the discriminator's
    recorder sees the generator's pass, zero_grad, then its own pass) and SAM look there like a skipped
    step; the gradients are finite, so it is none: each recorder counts one step per optimizer step. A
    loss scaler's skip of step 0 (inf gradients) still is one."""
    from trainrec.recorder import record

    disc, opt_d = make()
    gen = torch.nn.Embedding(50, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    cfg = {"wg_distribution": True, "ops": ["norm"], "start_step": 2}
    with record(disc, opt_d, config=cfg, output_dir=str(tmp_path / "d")) as rec:
        for s in range(4):
            if pattern == "gan_generator_first":
                opt_g.zero_grad()
                (disc(torch.ones(2, 3, dtype=torch.long)).mean() * gen.weight[s].sum()).backward()  # D's grads too
                opt_g.step()
                opt_d.zero_grad()
                loss_of(disc, s).backward()
            elif pattern == "scaler_skip":  # step 0's optimizer step never runs: 5 steps
                if s == 0:
                    (loss_of(disc, s) * float("inf")).backward()
                    opt_d.zero_grad()
                loss_of(disc, s).backward()
            else:
                sam_passes(disc, opt_d, s)
            opt_d.step()
            opt_d.zero_grad()
        skipped = pattern == "scaler_skip"
        assert rec.step_count == 4 + skipped
    ev = events_of(tmp_path / "d")
    assert ends(ev) == [(0, skipped)] + [(s, False) for s in range(1, 4 + skipped)]
    assert {k[0] for k in stats_table(ev, "grad_reduced")} == set(range(2, 4 + skipped))
