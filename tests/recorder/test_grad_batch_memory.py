"""The weight-gradient batch (recorder/grad_batch.py) must not keep alive gradients their owner drops.

DDP with ``gradient_as_bucket_view=True`` and ``zero_grad()`` (set_to_none, the default) gets a fresh
gradient from autograd at every backward pass, copies it into its bucket in its own hook, right after
the monitor's, and points ``.grad`` at the bucket view: the fresh tensor is then freed, unless the
monitor's batch still holds it. A batch held to the end of the backward pass would keep a second copy
of every gradient alive on the device (a model's whole gradient size, on every collected step); it is
measured once its gradients hold ``PENDING_FLUSH_BYTES``.
"""

from __future__ import annotations

import weakref

from trainmon_util import ALL_OPS, loss_of, make
from trainrec.recorder import TrainerMon, grad_batch


def test_gradients_swapped_out_by_their_owner_are_not_kept_to_the_end_of_backward(tmp_path, monkeypatch):
    monkeypatch.setattr(grad_batch, "PENDING_FLUSH_BYTES", 1)
    mon = TrainerMon({"wg_distribution": True, "ops": ALL_OPS, "format": "csv"}, live_export=False,
                     output_dir=str(tmp_path / "out"))
    model, opt = make(0)
    mon.session.step_hooks.list_hooks_off = True  # the Python hooks, as distributed runs get them
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=1, optimizer=opt)
    params = [p for p in model.parameters() if p.requires_grad]
    made: list = []
    alive: list = []

    def as_ddp_bucket_view(p):  # runs after the monitor's hook, as DDP's
        made.append(weakref.ref(p.grad))
        p.grad = p.grad.clone()  # .grad becomes the bucket's view; autograd's tensor is dropped
        if len(made) == len(params) - 1:
            alive.append(sum(r() is not None for r in made))

    for p in params:
        p.register_post_accumulate_grad_hook(as_ddp_bucket_view)
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    mon.close()
    assert len(made) == len(params)
    assert alive == [0]
