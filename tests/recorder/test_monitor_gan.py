"""A GAN recorded with the native API as the README says: one ``record()`` for the generator and its
optimizer, one for the discriminator and its own. Each model also runs inside the other's step: the
discriminator on the generator's output in the generator's step (its loss), the generator making
the fakes in the discriminator's step. Whichever optimizer steps second in an iteration, the other
model's pass after it belongs to no step of its own: the run ending there must not leave a step of
that model begun and never ended. Replayed with trainrec's own inspect code."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from trainrec.recorder import record
from trainrec.replay import open_run
from trainrec.replay.summary import summarize
from trainrec.schema.events import SLOTS, StepBegan, StepEnded, TensorStatsRecorded
from trainrec.tools.cmd_inspect import render

N = 5
BATCH = 6


def _models():
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    disc = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return gen, disc, torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(disc.parameters(), lr=1e-3)


def _order(pattern: str, i: int) -> str:
    if pattern == "alternating":
        return "generator_second" if i % 2 == 0 else "generator_first"
    return pattern


def _train(pattern, gen, disc, opt_g, opt_d, scaler=None, inf_at=None) -> dict:
    """N iterations of a discriminator step and a generator step, in the order ``pattern`` says; returns
    the norm of each discriminator output, by model and iteration, in the order they ran. ``scaler``: a
    GradScaler for the discriminator, whose loss is inf at iteration ``inf_at`` (its step skipped)."""
    bce = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(7)
    outs: dict = {"d": [], "g": []}

    def d_step(i):
        opt_d.zero_grad()
        fake = gen(torch.randn(BATCH, 4, generator=g)).detach()  # a generator forward in the discriminator's step
        outs["g"].append(float(fake.norm()))
        real_out, fake_out = disc(torch.randn(BATCH, 6, generator=g)), disc(fake)
        outs["d"] += [float(real_out.detach().norm()), float(fake_out.detach().norm())]
        loss = bce(real_out, torch.ones(BATCH, 1)) + bce(fake_out, torch.zeros(BATCH, 1))
        if scaler is None:
            loss.backward()
            opt_d.step()
            return
        if i == inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt_d)
        scaler.update()

    def g_step(i):
        opt_g.zero_grad()
        fake = gen(torch.randn(BATCH, 4, generator=g))
        outs["g"].append(float(fake.detach().norm()))
        out = disc(fake)  # the discriminator's pass inside the generator's step (its gradients go too)
        outs["d"].append(float(out.detach().norm()))
        bce(out, torch.ones(BATCH, 1)).backward()
        opt_g.step()

    for i in range(N):
        if _order(pattern, i) == "generator_second":
            d_step(i)
            g_step(i)
        else:
            g_step(i)
            d_step(i)
    return outs


def _output_rows(run, last: str) -> list[tuple[int, float]]:
    """(step, norm) of every output row of the model's last layer, in the order recorded."""
    rows = []
    for ev, names in run.stats(kinds=["actv"]):
        vals = np.frombuffer(ev.values, dtype="<f4").reshape(len(ev), len(ev.ops))
        slots = ev.column("slots")
        for r, name in enumerate(names):
            if name == last and SLOTS[slots[r]] == "output":
                rows.append((ev.step, float(vals[r, ev.ops.index("norm")])))
    return rows


def _check_steps(where: str, rec, foreign: bool) -> tuple:
    """The log's steps: ``(run, rank summary, steps begun, (step, skipped) of the steps ended)``, checked
    to pair up, with the last iteration's passes inside the other model's step after the last step
    (``foreign``) recorded as such, under the next step's number."""
    run = open_run(where)
    summary = summarize(run)
    (rs,) = summary.ranks
    events = list(run.events())
    began = [e.step for e in events if isinstance(e, StepBegan)]
    ended = [(e.step, e.optimizer_skipped) for e in events if isinstance(e, StepEnded) and not e.foreign_passes]
    assert rec.step_count == N
    assert rs.unended == [], render(summary)
    assert "did not end" not in render(summary)
    assert rs.closed_cleanly
    assert [s for s, _ in ended] == list(range(N))
    assert began == list(range(N + foreign))
    assert rs.foreign_passes == ([N] if foreign else [])
    assert [e.step for e in events if isinstance(e, StepEnded) and e.foreign_passes] == rs.foreign_passes
    assert ("not a step" in render(summary)) == foreign
    return run, rs, began, ended


@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("pattern", ["generator_second", "generator_first", "alternating"])
def test_each_model_of_a_gan_keeps_one_step_per_iteration_and_every_row(tmp_path, pattern, interval):
    """Two recorders, N iterations: N steps each, every StepBegan with its StepEnded (``inspect``
    reports no step begun and not ended), none taken for skipped, and every discriminator and
    generator output of every collected step recorded, those of the last iteration's pass inside the
    other model's step included (with ``step_interval`` 2: on the steps collected)."""
    gen, disc, opt_g, opt_d = _models()
    cfg = {"wg_distribution": True, "xy_distribution": True, "ops": ["norm"], "step_interval": interval}
    dirs = {"g": str(tmp_path / "g"), "d": str(tmp_path / "d")}
    with record(gen, opt_g, config=cfg, output_dir=dirs["g"]) as rec_g, \
            record(disc, opt_d, config=cfg, output_dir=dirs["d"]) as rec_d:
        outs = _train(pattern, gen, disc, opt_g, opt_d)
    # the model whose optimizer steps first in the last iteration runs in the other's step after it
    first = "d" if _order(pattern, N - 1) == "generator_second" else "g"
    for who, rec, last in (("g", rec_g, "2"), ("d", rec_d, "2")):
        run, rs, began, ended = _check_steps(dirs[who], rec, foreign=who == first)
        assert sorted(rs.steps) == list(range(N)), (who, render(summarize(run)))
        assert not any(k for _, k in ended), (who, ended)
        assert rs.skipped_steps == []
        rows = _output_rows(run, last)
        recorded = [v for s, v in rows]
        if interval == 1:  # every forward of the model, in the order it ran
            assert recorded == pytest.approx(outs[who], rel=1e-4), who
        else:
            assert {s for s, _ in rows} <= {s for s in range(N + 1) if s % interval == 0}
        if interval == 1:  # the last iteration's pass inside the other model's step, after its last step
            assert rows[-1] == (N if who == first else N - 1, pytest.approx(outs[who][-1], rel=1e-4))


def test_a_discriminator_step_skipped_by_its_loss_scaler_is_still_told_apart(tmp_path):
    """A GradScaler skips the discriminator's optimizer step at iteration 2 (inf loss): that step ends
    skipped at the next iteration's first forward, the others are steps; the generator's pass through
    the discriminator after each of its steps, the last one's included, does not fool that."""
    gen, disc, opt_g, opt_d = _models()
    cfg = {"wg_distribution": True, "xy_distribution": True, "ops": ["norm"]}
    dirs = {"g": str(tmp_path / "g"), "d": str(tmp_path / "d")}
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with record(gen, opt_g, config=cfg, output_dir=dirs["g"]) as rec_g, \
            record(disc, opt_d, config=cfg, output_dir=dirs["d"]) as rec_d:
        _train("generator_second", gen, disc, opt_g, opt_d, scaler=scaler, inf_at=2)
    _, rs, _, ended = _check_steps(dirs["d"], rec_d, foreign=True)
    assert ended == [(s, s == 2) for s in range(N)]
    assert rs.skipped_steps == [2]
    _, _, _, ended_g = _check_steps(dirs["g"], rec_g, foreign=False)
    assert ended_g == [(s, False) for s in range(N)]


def test_the_last_step_cut_short_in_a_gan_stays_open(tmp_path):
    """The discriminator's own pass of the last iteration raises before its optimizer step (a NaN
    check): that step is one cut short, and stays begun and not ended, also after the generator's
    pass through the discriminator before it."""
    gen, disc, opt_g, opt_d = _models()
    cfg = {"wg_distribution": True, "xy_distribution": True, "ops": ["norm"]}
    out_d = str(tmp_path / "d")
    with pytest.raises(FloatingPointError), record(disc, opt_d, config=cfg, output_dir=out_d):
        _train("generator_second", gen, disc, opt_g, opt_d)
        opt_d.zero_grad()
        disc(torch.randn(BATCH, 6)).sum().backward()
        raise FloatingPointError("nan loss")
    run = open_run(out_d)
    (rs,) = summarize(run).ranks
    assert rs.unended == [N]
    assert os.path.isdir(out_d)
    assert any(isinstance(e, TensorStatsRecorded) and e.step == N for e in run.events())
