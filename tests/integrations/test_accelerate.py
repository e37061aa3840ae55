"""`trainrec.integrations.accelerate.record_accelerated` in a real accelerate loop on CPU, with gradient
accumulation (accelerate skips the inner optimizer's step on the micro steps that only accumulate)."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from trainrec.integrations.accelerate import record_accelerated  # noqa: E402
from trainrec.replay import open_run  # noqa: E402
from trainrec.replay.rows import value_matrix  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_a_prepared_loop_with_accumulation(tmp_path):
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    applied = []  # what the torch optimizer inside is about to apply, per real step
    opt.optimizer.register_step_pre_hook(
        lambda o, a, k: applied.append({n: float(p.grad.norm()) for n, p in model.named_parameters()}))
    g = torch.Generator().manual_seed(0)
    with record_accelerated(acc, model, opt, {"wg_distribution": True, "ops": ["norm"]},
                            output_dir=str(tmp_path / "out")) as rec:
        for _ in range(6):
            x = torch.randn(4, 8, generator=g)
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
                opt.step()
                opt.zero_grad()
        assert rec.step_count == 3
    got = {}
    micro_steps = set()
    for ev, names in open_run(str(tmp_path / "out")).stats():
        if ev.kind == "grad_unreduced" and ev.micro_steps:
            micro_steps.update(ev.micro_steps[::2])
        if ev.kind == "grad_reduced":
            norms = value_matrix(ev)[:, 0].tolist()
            got.update({(ev.step, n): v for n, v in zip(names, norms, strict=True)})
    assert len(applied) == 3 and {s for s, _ in got} == {0, 1, 2}
    for step, grads in enumerate(applied):
        for name, norm in grads.items():
            assert got[(step, name)] == pytest.approx(norm, rel=1e-5)
    assert micro_steps == {0, 1}
