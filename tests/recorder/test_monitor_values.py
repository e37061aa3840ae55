"""Recorded statistics equal statistics computed independently (float64, torch) on the same tensors.

Covers weight gradients per micro step (unreduced) and at the optimizer step (reduced), parameters
(before the update), Adam exp_avg/exp_avg_sq and update/ratio (after the update), activations and
activation gradients, with gradient accumulation of 2 and 3 micro steps.
"""

from __future__ import annotations

import math

import pytest
import torch
from trainmon_util import (
    ALL_OPS,
    TinyNet,
    assert_close,
    events_of,
    loss_of,
    make,
    ref_stats,
    stats_table,
    write_config,
)
from trainrec.recorder import TrainerMon, fused, grad_batch
from trainrec.recorder.names import squash_all


def run_and_observe(tmp_path, monkeypatch, grad_acc: int, steps: int = 2):
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    cfg = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
           "mv_distribution": True, "ur_distribution": True, "ops": ALL_OPS, "format": "csv"}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=grad_acc, optimizer=opt)
    pnames = squash_all([n for n, _ in model.named_parameters()])
    mnames = squash_all([n for n, _ in model.named_modules()])
    seen: dict = {}
    acts: list = []

    def fwd(mod, args, output, name):
        x = args[0]
        y = output[0] if isinstance(output, tuple) else output
        acts.append(("fwd", name, x.detach().clone() if torch.is_tensor(x) else None, y.detach().clone()))

    def bwd(mod, gin, gout, name):
        # input_grad is the gradient of the input tensor (all its uses): pair gets h twice, pair(h, h)
        gi = gin[0] + gin[1] if name == "pair" else gin[0]
        acts.append(("bwd", name, gi.detach().clone() if gi is not None else None, gout[0].detach().clone()))

    for n, m in model.named_modules():
        if n in ("layers.1", "pair", "head", "layers.0.0"):
            m.register_forward_hook(lambda mod, a, o, n=n: fwd(mod, a, o, mnames[n]))
            m.register_full_backward_hook(lambda mod, gi, go, n=n: bwd(mod, gi, go, mnames[n]))
    for step in range(steps):
        acts.clear()
        for micro in range(grad_acc):
            loss_of(model, step * 10 + micro).backward()
            for n, p in model.named_parameters():
                seen[("unreduced", step, pnames[n], micro)] = p.grad.detach().clone()
            for kind, name, a, b in acts:
                seen[(kind, step, name, micro)] = (a, b)
            acts.clear()
        for n, p in model.named_parameters():
            seen[("reduced", step, pnames[n])] = p.grad.detach().clone()
            seen[("param", step, pnames[n])] = p.detach().clone()
        opt.step()
        for n, p in model.named_parameters():
            st = opt.state[p]
            seen[("mv", step, pnames[n])] = (st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"]))
        opt.zero_grad()
    mon.close()
    return events_of(out), seen, pnames, mnames


@pytest.mark.parametrize("kernel", ["fused", "torch", "triton"])
@pytest.mark.parametrize("grad_acc", [2, 3])
def test_recorded_values_equal_independent_statistics(tmp_path, monkeypatch, grad_acc, kernel):
    if kernel == "fused" and not fused.AVAILABLE:
        pytest.skip("the one-pass kernel (recorder/_fused.c) is not built")
    if kernel == "triton":  # its kernels on CPU tensors, under the interpreter (tests/conftest.py)
        pytest.importorskip("triton")
        monkeypatch.setenv("TRAINREC_STATS_BACKEND", "triton")
    else:
        monkeypatch.setattr(fused, "AVAILABLE", kernel == "fused")
    events, seen, pnames, mnames = run_and_observe(tmp_path, monkeypatch, grad_acc)
    unred = stats_table(events, "grad_unreduced")
    red = stats_table(events, "grad_reduced")
    par = stats_table(events, "param")
    ea = stats_table(events, "exp_avg")
    eas = stats_table(events, "exp_avg_sq")
    upd = stats_table(events, "update")
    rat = stats_table(events, "ratio")
    actv = stats_table(events, "actv")
    actg = stats_table(events, "actv_grad")
    checked = 0
    for step in range(2):
        for name in pnames.values():
            for micro in range(grad_acc):
                want = ref_stats(seen[("unreduced", step, name, micro)])
                assert_close(unred[(step, name, "", micro)], want, what=f"unreduced {name} step {step} micro {micro}")
                checked += 1
            assert_close(red[(step, name, "", 0)], ref_stats(seen[("reduced", step, name)]), what=f"reduced {name}")
            assert_close(par[(step, name, "", 0)], ref_stats(seen[("param", step, name)]), what=f"param {name}")
            m, v, t = seen[("mv", step, name)]
            assert_close(ea[(step, name, "", 0)], ref_stats(m), what=f"exp_avg {name}")
            assert_close(eas[(step, name, "", 0)], ref_stats(v), rtol=1e-3, atol=1e-12, what=f"exp_avg_sq {name}")
            b1, b2, eps = 0.9, 0.999, 1e-8
            m_hat = m.double() / (1 - b1**t)
            v_hat = v.double() / (1 - b2**t)
            assert_close(upd[(step, name, "", 0)], ref_stats(m_hat / (v_hat.sqrt() + eps)), rtol=1e-3, what=f"update {name}")
            want_ratio = ref_stats(m_hat / v_hat.sqrt())
            got_ratio = rat[(step, name, "", 0)]
            if not math.isnan(want_ratio["norm"]):
                assert_close(got_ratio, want_ratio, rtol=1e-3, what=f"ratio {name}")
            checked += 6
        for micro in range(grad_acc):
            for mod in ("1", "pair", "head", "0.0"):
                x, y = seen[("fwd", step, mod, micro)]
                assert_close(actv[(step, mod, "input", micro)], ref_stats(x), what=f"input {mod}")
                assert_close(actv[(step, mod, "output", micro)], ref_stats(y), what=f"output {mod}")
                gi, go = seen[("bwd", step, mod, micro)]
                assert_close(actg[(step, mod, "output_grad", micro)], ref_stats(go), what=f"output_grad {mod}")
                if gi is not None:
                    assert_close(actg[(step, mod, "input_grad", micro)], ref_stats(gi), what=f"input_grad {mod}")
                checked += 4
    assert checked > 100
    # every module that runs is recorded, the root ("") included (a ModuleList is never called);
    # the embedding's input grads (int tokens) are NaN rows
    assert {k[1] for k in actv} == set(mnames.values()) - {"layers"}
    assert math.isnan(actg[(0, "embed", "input_grad", 0)]["norm"])


def use_kernel(monkeypatch, kernel: str) -> None:
    """The statistics path of the monitors made next: the one-pass C kernel, torch's reductions, or the
    Triton engine (its kernels on CPU tensors under the interpreter: tests/conftest.py)."""
    if kernel == "fused" and not fused.AVAILABLE:
        pytest.skip("the one-pass kernel (recorder/_fused.c) is not built")
    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRAINREC_STATS_BACKEND", "triton")
    else:
        monkeypatch.setattr(fused, "AVAILABLE", kernel == "fused")


@pytest.mark.parametrize("kernel", ["fused", "torch", "triton"])
def test_reduced_gradients_reuse_unchanged_rows_and_see_in_place_changes(tmp_path, monkeypatch, kernel):
    """Without a reduction between backward and step, reduced == last unreduced (the torch path reuses the
    row, the one-pass kernel and the Triton engine measure again, bitwise the same); a clip (in place) is
    seen."""
    use_kernel(monkeypatch, kernel)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ALL_OPS}), params_have_main_grad=False,
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    loss_of(model, 1).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    mon.close()
    events = events_of(tmp_path / "out")
    unred, red = stats_table(events, "grad_unreduced"), stats_table(events, "grad_reduced")
    pn = squash_all([n for n, _ in model.named_parameters()])
    for n, short in pn.items():
        assert red[(0, short, "", 0)] == unred[(0, short, "", 0)]
        assert_close(red[(1, short, "", 0)], ref_stats(clipped[n]), what=f"clipped {short}")
        assert red[(1, short, "", 0)]["norm"] < unred[(1, short, "", 0)]["norm"]


def _wide(tmp_path, monkeypatch, reuse: bool, grad_acc: int = 1, d: int = 16):
    """A weight-gradient monitor (``TRAINREC_REUSE_UNCHANGED_GRADS`` as ``reuse`` says) on TinyNet with an
    embedding and a head of 4096 x ``d`` (64K elements or more), gradients large enough for fingerprints:
    (mon, model, opt)."""
    monkeypatch.setattr(grad_batch, "REUSE_UNCHANGED", reuse)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ALL_OPS}), params_have_main_grad=False,
                     live_export=False)
    torch.manual_seed(0)
    model = TinyNet(vocab=4096, d=d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=grad_acc, optimizer=opt)
    return mon, model, opt


@pytest.mark.parametrize("kernel", ["fused", "torch", "triton"])
@pytest.mark.parametrize("write", [".data", "numpy", "numpy, at the max alone"])
def test_reduced_gradients_see_writes_the_version_counter_misses(tmp_path, monkeypatch, kernel, write):
    """Writes through ``.data`` or numpy leave a gradient's version counter as it was: the reused row's
    check sees them (the kernel's fingerprint: its min and max elements and its sample; the torch
    path's norm; the Triton engine measures again), and the reduced rows are the statistics of the
    gradients the optimizer got."""
    use_kernel(monkeypatch, kernel)
    mon, model, opt = _wide(tmp_path, monkeypatch, reuse=True)
    loss_of(model, 0).backward()
    for p in model.parameters():
        v = p.grad._version
        if write == ".data":
            p.grad.data.mul_(0.5)
        elif write == "numpy":
            p.grad.numpy()[...] *= 0.5
        else:
            flat = p.grad.numpy().reshape(-1)
            flat[flat.argmax()] *= 0.5
        assert p.grad._version == v
    written = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    mon.close()
    events = events_of(tmp_path / "out")
    unred, red = stats_table(events, "grad_unreduced"), stats_table(events, "grad_reduced")
    for n, short in squash_all([n for n, _ in model.named_parameters()]).items():
        assert_close(red[(0, short, "", 0)], ref_stats(written[n]), what=f"written {short}")
        assert red[(0, short, "", 0)]["max"] < unred[(0, short, "", 0)]["max"]


@pytest.mark.skipif(not fused.FINGERPRINTS, reason="the one-pass kernel is not built")
@pytest.mark.parametrize("reuse", [False, True])
def test_reduced_gradients_unchanged_since_the_backward_are_not_measured_again(tmp_path, monkeypatch, reuse):
    """By default the kernel measures the large gradients (64K elements or more) once per step, at the
    end of the backward pass: at the optimizer step their rows are the backward's, after their
    fingerprints (two elements and one line per KiB) are read back. TRAINREC_REUSE_UNCHANGED_GRADS=0
    measures them again."""
    calls = []
    real = fused._stats_tensors
    monkeypatch.setattr(fused, "_stats_tensors", lambda xs, *a: (calls.append(len(xs)), real(xs, *a))[1])
    mon, model, opt = _wide(tmp_path, monkeypatch, reuse)
    n = len(list(model.parameters()))
    large = sum(p.numel() >= fused.FINGERPRINT_MIN_NUMEL for p in model.parameters())
    assert large == 2
    for step in range(3):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert calls == [n, n - large if reuse else n] * 3
    events = events_of(tmp_path / "out")
    unred, red = stats_table(events, "grad_unreduced"), stats_table(events, "grad_reduced")
    assert len(red) == 3 * n and all(red[k] == unred[k] for k in red)


@pytest.mark.parametrize("grad_acc", [1, 2])
@pytest.mark.parametrize("reuse", [False, True])
def test_rows_zeroed_through_data_show_in_the_reduced_gradient(tmp_path, monkeypatch, grad_acc, reuse):
    """Zeroing a row of the embedding's gradient through ``.data`` (freezing a token) leaves the version
    counter, and where the row holds neither extreme the min and max elements, as they were: a row of
    256 changes the fingerprint's sample, so the reduced row shows it, reused or measured again."""
    if reuse and not fused.FINGERPRINTS:
        pytest.skip("the one-pass kernel is not built")
    mon, model, opt = _wide(tmp_path, monkeypatch, reuse, grad_acc, d=256)
    for m in range(grad_acc):
        loss_of(model, m).backward()
    g = model.embed.weight.grad
    used = sorted(set(torch.nonzero(g.abs().sum(1)).flatten().tolist()))
    keep = {int(g.reshape(-1).argmin()) // g.shape[1], int(g.reshape(-1).argmax()) // g.shape[1]}
    row = next(r for r in used if r not in keep)  # a token's row that holds neither extreme
    g.data[row].zero_()
    written = g.clone()
    opt.step()
    mon.close()
    red = stats_table(events_of(tmp_path / "out"), "grad_reduced")[(0, "embed.weight", "", 0)]
    assert_close(red, ref_stats(written), what="embed.weight")


@pytest.mark.skipif(not fused.FINGERPRINTS, reason="the one-pass kernel is not built")
@pytest.mark.parametrize("reuse", [False, True])
def test_a_narrow_row_zeroed_through_data_outside_the_sample_is_the_blind_spot_of_reuse(tmp_path, monkeypatch,
                                                                                        reuse):
    """The documented limit of the default reuse: a row of 16 (64 bytes) zeroed through ``.data``, outside
    the fingerprint's sample and away from the extremes, goes unseen (the reduced row is the
    backward's); TRAINREC_REUSE_UNCHANGED_GRADS=0 measures it again and shows it."""
    mon, model, opt = _wide(tmp_path, monkeypatch, reuse)
    loss_of(model, 0).backward()
    g = model.embed.weight.grad
    used = sorted(set(torch.nonzero(g.abs().sum(1)).flatten().tolist()))
    keep = {int(g.reshape(-1).argmin()) // g.shape[1], int(g.reshape(-1).argmax()) // g.shape[1]}
    row = next(r for r in used if r not in keep and r % 16)  # rows 0, 16, 32, ... start a sampled line
    g.data[row].zero_()
    written = g.clone()
    before = written.norm().item()
    opt.step()
    mon.close()
    events = events_of(tmp_path / "out")
    red = stats_table(events, "grad_reduced")[(0, "embed.weight", "", 0)]
    unred = stats_table(events, "grad_unreduced")[(0, "embed.weight", "", 0)]
    if reuse:
        assert red == unred and red["norm"] > before * (1 + 1e-4)  # unseen
    else:
        assert_close(red, ref_stats(written), what="embed.weight")


def test_main_grad_is_used_for_reduced_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ["norm"]}), params_have_main_grad=True,
                     live_export=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    loss_of(model, 0).backward()
    for p in model.parameters():
        p.main_grad = torch.full_like(p, 2.0)
    opt.step()
    mon.close()
    red = stats_table(events_of(tmp_path / "out"), "grad_reduced")
    for n, p in model.named_parameters():
        short = squash_all([m for m, _ in model.named_parameters()])[n]
        assert red[(0, short, "", 0)]["norm"] == pytest.approx(2.0 * math.sqrt(p.numel()), rel=1e-5)


class _FusedWgradLinear(torch.autograd.Function):
    """Megatron's gradient_accumulation_fusion: the weight gradient is added into ``main_grad`` by the
    backward itself; ``.grad`` gets a tensor of undefined contents (``torch.empty`` there, NaN here)
    and ``grad_added_to_main_grad`` tells the wrapper's hook not to add it again."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        w.main_grad.add_(go.reshape(-1, go.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
        w.grad_added_to_main_grad = True
        return go @ w, torch.full_like(w, float("nan"))


@pytest.mark.parametrize("buffer", ["contiguous", "separate", "contiguous-in-parts"])
def test_main_grad_accumulated_by_the_owners_hook_is_measured_with_this_micro_steps_gradient(
        tmp_path, monkeypatch, buffer):
    """Megatron's DDP adds ``.grad`` into ``main_grad`` (a view into its contiguous buffer) in a hook on
    the gradient accumulator that runs after the monitor's. Each micro step's unreduced row is the sum
    so far, for every parameter: the one that fires last too (it was measured before the add, a row of
    zeros), and one whose gradient the backward added into ``main_grad`` itself (fused accumulation).
    The multi-process variant with overlap_grad_reduce is in test_megatron_ddp_standin.py."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    if buffer.endswith("-in-parts"):  # main_grad + .grad summed and measured 7 elements at a time
        from trainrec.recorder import grad_batch

        monkeypatch.setattr(grad_batch, "SUM_PART_NUMEL", 7)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fused_w = model[2].weight
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    off, accs = 0, []
    for p in params:
        p.main_grad = flat[off:off + p.numel()].view_as(p) if buffer != "separate" else torch.zeros_like(p)
        off += p.numel()
        acc = p.expand_as(p).grad_fn.next_functions[0][0]

        def owner_hook(*_unused, p=p):
            if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
                p.main_grad.add_(p.grad)
            p.grad = None

        acc.register_hook(owner_hook)
        accs.append(acc)

    def forward(x):
        return _FusedWgradLinear.apply(torch.tanh(model[0](x)), fused_w) + model[2].bias

    opt = torch.optim.SGD(params, lr=0.1)
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "ops": ALL_OPS}), params_have_main_grad=True,
                     live_export=False)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    want = {}
    for step in range(2):
        for micro in range(2):
            forward(torch.randn(5, 4)).square().sum().backward()
            want[(step, micro)] = {n: ref_stats(p.main_grad) for n, p in model.named_parameters()}
        for p in params:
            p.grad = p.main_grad.clone()
            p.grad_added_to_main_grad = False
        opt.step()
        opt.zero_grad()
        for p in params:
            p.main_grad.zero_()
    mon.close()
    un = stats_table(events_of(tmp_path / "out"), "grad_unreduced")
    short = squash_all([n for n, _ in model.named_parameters()])
    assert len(un) == 2 * 2 * len(params)
    for (step, micro), rows in want.items():
        for n, ref in rows.items():
            assert ref["norm"] > 0
            assert_close(un[(step, short[n], "", micro)], ref, what=f"{buffer} {n} step {step} micro {micro}")


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_sparse_embedding_gradients_are_measured_as_the_dense_tensor(tmp_path, monkeypatch, kernel):
    """``nn.Embedding(sparse=True)`` gives sparse COO gradients (recommender and large-vocabulary
    models). Their rows are the statistics of the dense gradient they stand for (rows not looked up
    are zeros), and the other parameters' rows in the same batch are unaffected."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setattr(fused, "AVAILABLE", fused.AVAILABLE and kernel)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8, sparse=True), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(tmp_path, {"wg_distribution": True, "mg_direction": True, "ops": ALL_OPS}),
                     params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    want = {}
    for step in range(2):
        x = torch.randint(0, 16, (5, 3))  # 16 of 64 rows at most: most of the gradient is not stored
        model(x).square().mean().backward()
        assert model[0].weight.grad.is_sparse
        want[step] = {n: ref_stats(p.grad.to_dense()) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    mon.close()
    ev = events_of(tmp_path / "out")
    assert not [e for e in ev if type(e).__name__ == "HookFailed"]
    for kind in ("grad_unreduced", "grad_reduced"):
        table = stats_table(ev, kind)
        for step, rows in want.items():
            for name, ref in rows.items():
                assert ref["zeros"] > 0.5 or name != "0.weight"
                assert_close(table[(step, name, "", 0)], ref, rtol=1e-5, what=f"{kind} {name} step {step}")
    assert stats_table(ev, "mg_direction") == {}  # SGD: not of Adam's family, nothing (no Adam takes sparse grads)
    # mg_direction of a sparse gradient (SparseAdam's case) is that of the dense one it stands for
    from trainrec.recorder.optim_rows import mg_direction

    g = torch.sparse_coo_tensor(torch.tensor([[1, 5]]), torch.randn(2, 8), (64, 8))
    m = torch.randn(64, 8)
    want_md = ((torch.sign(g.to_dense()) * torch.sign(m)).sum() / g.numel() + 1) / 2
    assert float(mg_direction(g, m)) == pytest.approx(float(want_md), abs=1e-6)
