"""A plain accelerate loop: one call records it.

::

    from trainrec.integrations.accelerate import record_accelerated

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with record_accelerated(accelerator, model, optimizer, config={"wg_distribution": True}) as rec:
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).loss)
                optimizer.step()
                optimizer.zero_grad()

It is ``trainrec.recorder.record`` with what the accelerator knows filled in: the model unwrapped
from accelerate's wrappers (DDP, ``torch.compile``), so names are the model's own; the torch optimizer
inside accelerate's ``AcceleratedOptimizer`` (hooked where the real step happens: accelerate skips it
on the micro steps that only accumulate); and ``gradient_accumulation_steps`` micro steps per step.
Each process records its own rank's log. Importing this module does not import accelerate.
"""

from __future__ import annotations

from trainrec.recorder.native import Recorder

__all__ = ["record_accelerated"]


def record_accelerated(accelerator, model, optimizer=None, config=None, output_dir: str | None = None, *,
                       start_step: int = 0) -> Recorder:
    """A :class:`~trainrec.recorder.native.Recorder` of ``model`` and ``optimizer`` as ``accelerator``
    prepared them; ``start_step``: the step a resumed loop starts at (see ``record``'s ``start_iteration``)."""
    return Recorder(accelerator.unwrap_model(model), optimizer, config, output_dir,
                    grad_acc_steps=max(1, int(accelerator.gradient_accumulation_steps)),
                    start_iteration=start_step)
