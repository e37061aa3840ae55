"""The collection parts of a recording, made together: weight gradients before reduction
(:mod:`.grad_batch`), this rank's gradients (:mod:`.dedup`), reduced gradients and parameters
(:mod:`.reduced`) and optimizer rows (:mod:`.optim_rows`), all adding rows through :mod:`.step_rows`.
The monitor calls them at the optimizer's pre- and post-step hooks."""

from __future__ import annotations

from trainrec.schema.events import KIND_PARAM

from .attach import StepHooks
from .binding import OptimizerBinding
from .context import RecordingContext
from .dedup import GradOwnership
from .grad_batch import GradBatch
from .optim_rows import OptimizerRows
from .reduced import ReducedRows
from .step_rows import StepRows
from .step_state import StepState
from .steps import StepTracker


class Collection:
    """``grad_batch`` (:class:`GradBatch`), ``ownership`` (:class:`GradOwnership`), ``reduced``
    (:class:`ReducedRows`) and ``optimizer`` (:class:`OptimizerRows`) over one ``context``."""

    def __init__(self, context: RecordingContext, binding: OptimizerBinding, steps: StepTracker,
                 step_hooks: StepHooks) -> None:
        rows = StepRows(context)
        self.grad_batch = GradBatch(context, step_hooks, steps, rows)
        self.ownership = GradOwnership(context, binding)
        self.reduced = ReducedRows(context, self.ownership, binding, rows)
        self.optimizer = OptimizerRows(context, self.ownership, binding, rows)

    def pre_step(self, st: StepState, cfg, first: bool, closure: bool) -> tuple | None:
        """The optimizer pre-step's rows of step ``st``: the gradient batch settled, reduced gradients,
        parameters and mg_direction. ``first``: this call begins the step (not a later param group's,
        which adds its partitioned pieces only). For a ``step(closure)`` the gradients come later
        (:meth:`closure_rows`): returns mg_direction's momenta before the update, else None."""
        if first:
            self.grad_batch.settle()
        momenta = None
        if closure:
            momenta = self.optimizer.momenta(snapshot=True) if cfg.mg_direction else None
        elif cfg.wg_distribution:
            self.reduced.reduced_grads(st, partitioned_only=not first)
        if first and cfg.param_distribution:
            self.reduced.param_rows(st, KIND_PARAM, *self.reduced.param_pieces())
        if cfg.mg_direction and not closure:
            self.optimizer.mg_direction_rows(st, partitioned_only=not first)
        return momenta

    def closure_rows(self, st: StepState, cfg, first: bool, momenta: tuple | None) -> None:
        """At the post-step hook of ``step(closure)``: the rows :meth:`pre_step` leaves to it, of the
        gradients the closure's last evaluation left; mg_direction with ``momenta`` as pre_step kept them."""
        self.grad_batch.settle()
        if cfg.wg_distribution:
            self.reduced.reduced_grads(st, partitioned_only=not first)
        if cfg.mg_direction and momenta is not None:
            self.optimizer.mg_direction_rows(st, partitioned_only=not first, momenta=momenta)
