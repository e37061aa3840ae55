"""The list hooks of weight gradients (recorder/grad_batch.py, ``GradBatch.drain_fired``): where nothing but this
process's autograd engine touches a gradient inside the backward pass, each monitored parameter's
hook is the ``append`` of one list, handled at the end of the backward pass. They must record exactly
what the Python hooks record, and fall back to the Python hooks where they cannot."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from trainmon_util import ALL_OPS, assert_close, events_of, loss_of, make, ref_stats, stats_table
from trainrec.recorder import TrainerMon, grad_places, step_output
from trainrec.schema.events import HooksFired, TensorStatsRecorded

CFG = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True, "ops": ALL_OPS,
       "format": "csv"}


def _list_hooks(model) -> int:
    """How many of the model's parameters carry a list's ``append`` as a post-accumulate-grad hook."""
    return sum(any(isinstance(getattr(h, "__self__", None), list)
                   for h in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())
               for p in model.parameters())


def _run(out, python_hooks: bool, clip: bool = True, steps: int = 3, grad_acc: int = 2):
    mon = TrainerMon(dict(CFG), live_export=False, output_dir=str(out))
    model, opt = make(0)
    if python_hooks:
        mon.session.step_hooks.list_hooks_off = True  # the Python hooks, as distributed runs get them
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=grad_acc, optimizer=opt)
    hooked = _list_hooks(model)
    recorded = {id(i.param): i.name for i in mon.session.context.params}
    names = {n: recorded[id(p)] for n, p in model.named_parameters()}  # torch's -> the log's
    for s in range(steps):
        for m in range(grad_acc):
            loss_of(model, s * grad_acc + m).backward()
        if clip:  # between the backward passes and the step: reduced rows differ from unreduced ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    fast_off = mon.session.step_hooks.list_hooks_off
    mon.close()
    return events_of(out), hooked, fast_off, names


def _records(events) -> list:
    """Hook firings and statistics rows, as the log has them (names by id, values as bytes)."""
    out = []
    for ev in events:
        if isinstance(ev, HooksFired):
            out.append(("fired", ev.step, ev.module_ids, ev.directions, ev.call_ids, ev.micro_steps))
        elif isinstance(ev, TensorStatsRecorded):
            out.append(("stats", ev.step, ev.kind, ev.name_ids, ev.values, ev.call_ids, ev.micro_steps))
    return out


def test_list_hooks_record_exactly_what_the_python_hooks_record(tmp_path, monkeypatch):
    # (a step that a loaded machine keeps open past SPILL_AFTER_S is written in two parts: records
    # that differ in number from the other run's, though they hold the same rows)
    monkeypatch.setattr(step_output, "SPILL_AFTER_S", float("inf"))
    fast, hooked, fast_off, _ = _run(tmp_path / "fast", python_hooks=False)
    slow, hooked_slow, _, _ = _run(tmp_path / "slow", python_hooks=True)
    model, _ = make(0)
    assert hooked == len(list(model.parameters())) and not fast_off
    assert hooked_slow == 0
    a, b = _records(fast), _records(slow)
    assert len(a) == len(b) and any(r[0] == "fired" for r in a)
    assert a == b
    # and the rows are the gradients': unreduced before the clip, per micro step (independent check)
    table = stats_table(fast, "grad_unreduced")
    assert len(table) == 3 * 2 * len(list(model.parameters()))


def test_list_hooks_measure_each_micro_steps_gradient(tmp_path):
    """Independent of the Python hooks: each micro step's accumulated gradient, before a clip."""
    events, _, _, names = _run(tmp_path / "out", python_hooks=False, steps=1)
    got = stats_table(events, "grad_unreduced")
    reduced = stats_table(events, "grad_reduced")
    model, _ = make(0)
    for m in range(2):
        loss_of(model, m).backward()
        for name, p in model.named_parameters():
            assert_close(got[(0, names[name], "", m)], ref_stats(p.grad), what=f"{name} micro {m}")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    for name, p in model.named_parameters():
        assert_close(reduced[(0, names[name], "", 0)], ref_stats(p.grad), what=f"{name} reduced")


class TwoHeads(nn.Module):
    """Returns (a, b); the loss is taken from ``b`` alone, so the gradient hook on the first output
    tensor (where the end-of-backward callback is queued) never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def _two_heads(out):
    mon = TrainerMon(dict(CFG), live_export=False, output_dir=str(out))
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    return mon, model, opt


def test_a_backward_pass_the_output_hook_misses_falls_back_to_python_hooks(tmp_path):
    out = tmp_path / "out"
    mon, model, opt = _two_heads(out)
    assert _list_hooks(model) == 4
    grads = []
    for _ in range(3):
        x = torch.randn(3, 4)
        model(x)[1].pow(2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    assert mon.session.step_hooks.list_hooks_off and _list_hooks(model) == 0
    mon.close()
    got = stats_table(events_of(out), "grad_unreduced")
    for s in range(3):
        assert {k[1] for k in got if k[0] == s} == {"b.weight", "b.bias"}
        for name, g in grads[s].items():
            assert_close(got[(s, name, "", 0)], ref_stats(g), what=f"step {s} {name}")


def test_a_gradient_in_a_shared_buffer_falls_back_to_python_hooks(tmp_path):
    """A gradient that is a view into a larger buffer (DDP's bucket views, Megatron's grad buffer) is
    measured in its own hook: found among the list hooks' firings, the Python hooks take over."""
    out = tmp_path / "out"
    mon = TrainerMon(dict(CFG), live_export=False, output_dir=str(out))
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    buf = torch.zeros(4 * 4 + 4 + 8)
    model.weight.grad = buf[:16].view(4, 4)
    model.bias.grad = buf[16:20]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    want = []
    for _ in range(2):
        x = torch.randn(3, 4)
        model(x).sum().backward()
        want.append({"weight": model.weight.grad.clone(), "bias": model.bias.grad.clone()})
        opt.step()
        buf.zero_()  # zero_grad(set_to_none=False) on views keeps them views
    assert mon.session.step_hooks.list_hooks_off
    mon.close()
    got = stats_table(events_of(out), "grad_unreduced")
    for s in range(2):
        for name, g in want[s].items():
            assert_close(got[(s, name, "", 0)], ref_stats(g), what=f"step {s} {name}")
    assert np.isfinite([v["norm"] for v in got.values()]).all()


def test_firings_left_unhandled_at_close_are_recorded(tmp_path):
    """A run that ends (close) after a backward pass whose end was not seen, before its optimizer step:
    the list hooks' firings are measured as the hooks are removed, and the unfinished step keeps them."""
    out = tmp_path / "out"
    mon, model, _ = _two_heads(out)
    model(torch.randn(3, 4))[1].pow(2).sum().backward()
    assert len(mon.session.step_hooks.fired) == 2
    mon.close()
    got = stats_table(events_of(out), "grad_unreduced")
    assert sorted(k[1] for k in got) == ["b.bias", "b.weight"]
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_close(got[(0, name, "", 0)], ref_stats(p.grad), what=name)


def _checkpointed_chunks(out, python_hooks: bool):
    """Two model chunks, the first recomputed in the backward pass (activation checkpointing): its
    forward pre-hook runs inside the backward pass, after the second chunk's gradients fired."""
    mon = TrainerMon(dict(CFG), live_export=False, output_dir=str(out))
    torch.manual_seed(0)
    c0, c1 = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 2)
    opt = torch.optim.AdamW([*c0.parameters(), *c1.parameters()], lr=0.01)
    if python_hooks:
        mon.session.step_hooks.list_hooks_off = True
    mon.monitor_gnorm_with_ad([c0, c1], grad_acc_steps=2, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(c0, torch.randn(3, 4, generator=g), use_reentrant=False)
            c1(h).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    off = mon.session.step_hooks.list_hooks_off
    mon.close()
    return events_of(out), off


def test_a_chunk_recomputed_inside_backward_keeps_the_list_hooks(tmp_path):
    fast, off = _checkpointed_chunks(tmp_path / "fast", python_hooks=False)
    slow, _ = _checkpointed_chunks(tmp_path / "slow", python_hooks=True)
    assert not off
    assert _records(fast) == _records(slow)
    assert len(stats_table(fast, "grad_unreduced")) == 2 * 2 * 4


def test_the_batched_shared_buffer_check_agrees_with_the_per_tensor_one():
    """The end-of-backward check for gradients in a shared buffer, made for the whole batch without a
    Python call per tensor, says what the per-tensor check says: of plain tensors, a bucket-style view,
    a tensor whose storage was swapped for a larger buffer's (``.data =``), a sparse tensor, None and a
    tensor subclass."""
    buf = torch.zeros(10)
    swapped = torch.zeros(3)
    swapped.data = buf[4:7].data
    sparse = torch.eye(3).to_sparse()

    class Sub(torch.Tensor):
        pass

    sub = torch.zeros(3).as_subclass(Sub)
    cases = [
        [torch.zeros(3), torch.zeros(2, 2)],
        [torch.zeros(3), buf[2:5]],
        [torch.zeros(3), swapped],
        [torch.zeros(3), sparse],
        [torch.zeros(3), None],
        [sub, buf[:4]],
        [torch.nn.Parameter(torch.zeros(3)), torch.zeros(3)],
    ]
    want = [False, True, True, False, False, True, False]
    assert [any(map(grad_places.in_shared_buffer, c)) for c in cases] == want
    assert [grad_places.any_in_shared_buffer(c) for c in cases] == want
