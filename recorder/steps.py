"""The step tracker: where a training step stands between two optimizer steps.

It counts chunk 0's training forwards and notices its backward passes, and from them tells a step
whose optimizer step never ran (a GradScaler or DeepSpeed skipped it on inf/NaN gradients) from a
step that makes several passes (SAM's two, a GAN's model passed through inside another model's step,
the evaluations of ``optimizer.step(closure)``). The monitor ends steps; the tracker says when.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from trainrec.schema.events import KIND_ACTV_GRAD, KIND_GRAD_UNREDUCED

from . import zero
from .binding import OptimizerBinding
from .fused import local_tensor
from .grad_batch import queue_end_of_backward
from .step_stats import StepStats
from .targets import uninitialized

SKIPS_TO_WARN = 8  # optimizer steps in a row that never ran before a warning about grad_acc_steps


class StepTracker:
    """The skipped-step and foreign-pass state machine of one monitored model.

    Stated interface: ``binding`` (the bound optimizer); ``rows_non_finite()``: whether the gradient
    rows the step recorded so far hold inf or NaN (None: it recorded none, see :func:`rows_non_finite`);
    ``several_ranks()``: whether gradients are reduced across ranks; ``hook_failed(where, exc)`` and
    ``warn_once(key, message)``: the monitor's. ``grad_acc`` (micro steps per optimizer step) and
    ``manual`` (steps come from ``step()``: no optimizer is hooked) are set at install.
    """

    def __init__(self, binding: OptimizerBinding, rows_non_finite: Callable[[], bool | None],
                 several_ranks: Callable[[], bool], hook_failed: Callable[[str, BaseException], None],
                 warn_once: Callable[[str, str], None]) -> None:
        self.binding = binding
        self._rows_non_finite = rows_non_finite
        self._several_ranks = several_ranks
        self._hook_failed = hook_failed
        self._warn_once = warn_once
        self.grad_acc = 1
        self.manual = False
        self.forwards = 0  # training forwards of chunk 0 in this step
        self.backward_seen = False  # and whether a backward pass ran in it
        # of those forwards, how many another optimizer's step came after (other_stepped), and whether a
        # second pass of the step began (gradients cleared after a backward): a step that is still one
        # pass, every forward of it followed by another optimizer's step, has only passes of the model
        # inside another model's steps so far (a GAN's discriminator in the generator's step)
        self.foreign_forwards = 0
        self.pass_split = False
        self.skips_in_a_row = 0
        # forward-backward passes (of grad_acc forwards) the last optimizer step took; None before one ran
        self.passes: int | None = None
        # step(closure) running (between its pre- and post-step hooks): the closure's passes, which run
        # inside it, are passes of this step; the forwards of the step before its first step(closure)
        self.closure_step = False
        self.closure_forwards: int | None = None
        self._reduced_check_queued = False  # before the first optimizer step: _check_reduced_grads
        self._reduced_non_finite: bool | None = None  # its finding for the last backward pass
        self.chunk0_params: list = []  # chunk 0's trained parameters
        self._marked: list = []  # chunk 0's first and last: their backward is noticed (on_backward)
        self._mark_hooked: set[int] = set()  # ids of the parameters with the on_backward hook
        self._grad_marks: dict[int, tuple | None] = {}  # id(param) -> (weakref to .grad, its version)
        self._param_marks: dict[int, int] = {}  # id(param) -> the parameter's version at its last backward

    # ------------------------------------------------------------------ marks
    def mark(self) -> list:
        """Choose the parameters whose gradient tells that a backward ran (chunk 0's first and last made:
        a lazy module's, not made yet, takes no hook); returns those that need the :meth:`on_backward`
        hook now."""
        made = [p for p in self.chunk0_params if not uninitialized(p)]
        self._marked = list({id(q): q for q in made[:1] + made[-1:]}.values())
        new = [p for p in self._marked if id(p) not in self._mark_hooked]
        self._mark_hooked.update(map(id, new))
        return new

    def on_backward(self, param) -> None:
        """A marked parameter's gradient was accumulated."""
        self.backward_seen = True
        g = param.grad
        # which gradient this backward left, and its version: zeroed in place since means cleared
        self._grad_marks[id(param)] = None if g is None else (weakref.ref(g), g._version)
        self._param_marks[id(param)] = param._version
        if (self.passes is None and not self.manual and not self._reduced_check_queued
                and not self.closure_step):  # (a closure's pass is no step that could be skipped)
            # before the first optimizer step: the gradients (with several ranks, as the data-parallel
            # reduction leaves them) are looked at once this backward pass ends (queued from a callback:
            # after DDP's own)
            self._reduced_check_queued = True
            queue_end_of_backward(weak_call(self._queue_reduced_check))

    def _queue_reduced_check(self) -> None:
        queue_end_of_backward(weak_call(self._check_reduced_grads))

    def _check_reduced_grads(self) -> None:
        """Whether chunk 0's gradients hold an inf or NaN after the reduction (None: none to look at, as
        where DeepSpeed moved them into its partitions). Before a run's first optimizer step the passes
        per step are not known yet, and a skip decided on another rank's inf, or on a step without
        gradient rows, is told from a second pass (a GAN's, SAM's) by this alone."""
        self._reduced_check_queued = False
        try:
            # (a DTensor's own shard: no collective here; sparse and empty gradients left out)
            grads = [g for g in (local_tensor(p.grad) for p in self.chunk0_params)
                     if g is not None and g.layout is torch.strided and g.numel()]
            if not grads:
                self._reduced_non_finite = None
                return
            extremes = torch.stack([m.float().to(grads[0].device) for m in torch._foreach_norm(grads, float("inf"))])
            self._reduced_non_finite = not bool(torch.isfinite(extremes).all())  # a sync, before the first step only
        except Exception as exc:  # noqa: BLE001 - monitoring never kills training
            self._reduced_non_finite = None
            self._hook_failed("checking the reduced gradients", exc)

    def grads_cleared(self) -> bool:
        """Whether chunk 0's gradients were cleared since its last backward pass: every one set to None
        (``zero_grad()``), or those of its first and last parameters zeroed in place (their version
        counters changed; accumulation leaves them as they were)."""
        if not any(p.grad is not None for p in self.chunk0_params):
            return True
        marked = [(p.grad, self._grad_marks.get(id(p))) for p in self._marked]
        return any(g is not None for g, _ in marked) and all(
            g is None or (m is not None and m[0]() is g and g._version != m[1]) for g, m in marked)

    def weights_unchanged(self) -> bool:
        """Whether chunk 0's first and last parameters are as their last backward pass left them (an
        optimizer step, SAM's perturbation or LBFGS's line search changes their versions)."""
        marks = self._param_marks
        return all(marks.get(id(p)) == p._version for p in self._marked)

    # ------------------------------------------------------------------ the step
    def step_begins(self) -> None:
        self.forwards = 0
        self.backward_seen = False
        self.foreign_forwards = 0
        self.pass_split = False
        self.closure_forwards = None

    def forward_begins(self) -> bool:
        """A training forward of chunk 0 begins. True where it shows that the step so far is one whose
        optimizer step never ran: the caller ends that step as skipped, then calls
        :meth:`skipped_step_ended` (this forward begins the next). One more forward than ``grad_acc``
        after a backward pass, with chunk 0's gradients cleared since, is either such a step or another
        pass of this one (SAM, a GAN); :meth:`optimizer_skipped` tells which. Several forwards before one
        backward, accumulation beyond ``grad_acc`` and a closure's passes inside ``step(closure)`` go on."""
        n = self.forwards + 1
        if n > self.grad_acc and not self.closure_step and self.backward_seen and self.grads_cleared():
            if self.manual:
                self._warn_once("manual", "trainrec: a new training step seems to begin (gradients cleared after a "
                                "backward pass) but step() was not called: without an optimizer, call rec.step() "
                                "once per training step, after its backward pass and before the weights change; "
                                "until then every backward pass goes into the same step")
            elif self.binding.opt is not None:
                if self.optimizer_skipped(n):
                    return True
                self.backward_seen = False  # another pass of this step begins: its backward comes later
                self.pass_split = True
        self.forwards = n
        return False

    def skipped_step_ended(self) -> None:
        """The step :meth:`forward_begins` found skipped was ended: this forward is the next step's first."""
        self.forwards = 1
        if not self.binding.deepspeed_known:  # (DeepSpeed's flag said it: no doubt to warn of)
            self.skips_in_a_row += 1
        if self.skips_in_a_row == SKIPS_TO_WARN:
            self._warn_once("skips", f"trainrec: {SKIPS_TO_WARN} optimizer steps in a row never ran (inf/NaN "
                            f"gradients skipped by a loss scaler?); if this run accumulates gradients over more "
                            f"than grad_acc_steps={self.grad_acc} micro steps, pass the right grad_acc_steps")

    def optimizer_skipped(self, n: int) -> bool:
        """Whether the step whose gradients were cleared after its backward pass, at the beginning of its
        ``n``-th forward (``n > grad_acc``), is one whose optimizer step never ran, rather than one that
        makes several passes."""
        ds = self.binding.deepspeed()
        if ds is not None:
            # DeepSpeed's optimizer says it: its flag is set by each of its steps, on the gradients
            # reduced across ranks, alike on every rank; where its loss scaler counts its steps, a flag
            # left from an earlier step is not taken
            taken = zero.steps_taken(ds)
            if taken is not None and taken == self.binding.ds_steps:
                return False  # its step() did not run since the last training step ended: another pass
            return bool(ds.overflow)
        non_finite = self._rows_non_finite()
        if non_finite is None:
            if self.passes is None and self._reduced_non_finite is not None:
                # no rows (a step not collected) and no optimizer step yet to count passes by: the
                # gradients the last backward pass left decide
                return self._reduced_non_finite
            if self.only_foreign_passes():
                # the model's part in other models' steps, not a pass of its own: not skipped
                return False
            return n > (self.passes or 1) * self.grad_acc
        if (not non_finite and self._several_ranks() and (n - 1) % self.grad_acc == 0
                and (self.weights_unchanged() or self.binding.chain_stepped)):
            # A loss scaler decides on the reduced gradients: another rank's inf/NaN skips this rank's
            # step too, though its own rows are finite. What every rank sees alike decides instead: more
            # whole passes than the last optimizer step took, with the weights as the backward pass left
            # them (or changed by some of several optimizers given as one step); before the first
            # optimizer step, the reduced gradients themselves (_check_reduced_grads).
            if self.passes is None:
                return bool(self._reduced_non_finite)
            return not self.only_foreign_passes() and n > self.passes * self.grad_acc
        return non_finite

    def other_stepped(self, opt, *_hook_args) -> None:
        """Any optimizer's step ended: where it is not the bound one, every forward so far came before it."""
        if self.forwards and not self.binding.owns(opt):
            self.foreign_forwards = self.forwards

    def only_foreign_passes(self) -> bool:
        """Whether the step so far is one pass inside other optimizers' steps (every forward followed by
        another optimizer's step, its gradients not cleared for a pass of its own): the model's part in
        another model's training step (a GAN's discriminator in the generator's), not a step of its own."""
        return (self.binding.opt is not None and not self.pass_split and self.forwards > 0
                and self.foreign_forwards == self.forwards)

    def ends_in_foreign_passes(self) -> bool:
        """At a close without failure: the step in progress holds passes inside other optimizers' steps
        only (its own pass's skipped optimizer step excluded), to be ended as ``foreign_passes``."""
        return not self.manual and self.only_foreign_passes() and not self._rows_non_finite()

    def last_step_skipped(self) -> bool:
        """At close: the last step's optimizer step never ran and no forward came after it to notice."""
        n = self.forwards + 1
        if (self.binding.opt is None or self.manual or n <= self.grad_acc or not self.backward_seen
                or not self.grads_cleared()):
            return False
        return self.optimizer_skipped(n)

    def optimizer_step_begins(self, args: tuple, kwargs: dict) -> bool:
        """The bound optimizer's step begins with these arguments (the optimizer first); whether it is a
        ``step(closure)``, whose closure's passes run after this, inside the step."""
        closure = len(args) > 1 or bool(kwargs)
        if closure:
            closure = callable(args[1] if len(args) > 1 else kwargs.get("closure"))
            if closure and self.closure_forwards is None:
                self.closure_forwards = self.forwards
        self.closure_step = closure
        return closure

    def closure_ended(self) -> bool:
        """The optimizer step ended; whether it was a ``step(closure)``."""
        was, self.closure_step = self.closure_step, False
        return was

    def step_ends(self, optimizer_skipped: bool) -> int:
        """The training step ends; returns its micro steps for a StepEnded of a step not collected (a
        step(closure)'s passes counted, as a collected step counts its forwards)."""
        closure_forwards = self.closure_forwards
        if not optimizer_skipped:
            self.skips_in_a_row = 0
            # passes per optimizer step, lately; of a step(closure), those before it only: its closure's
            # passes (LBFGS: as many as its evaluations) say nothing of the passes a step takes outside one
            forwards = self.forwards if closure_forwards is None else closure_forwards
            self.passes = max(1, -(-forwards // self.grad_acc))
        return self.grad_acc if closure_forwards is None else max(self.grad_acc, self.forwards)


def rows_non_finite(stats: StepStats) -> bool | None:
    """Whether the gradient rows (weight and activation gradients) in ``stats`` hold inf or NaN, less the
    rows that stand for no tensor (``StatsPart.placeholder``); None where there are none, or where the
    ops cannot show it. A device's rows are read back here (a sync, only at a pass boundary)."""
    ops = stats.ops
    col = ops.index("norm") if "norm" in ops else ops.index("nans") if "nans" in ops else None
    if col is None and not {"min", "max", "mean"} & set(ops):
        return None  # zeros alone cannot show an inf or a NaN
    flags = []  # per part, on its device: whether it holds an inf or NaN
    for part in stats.parts:
        if part.kind not in (KIND_GRAD_UNREDUCED, KIND_ACTV_GRAD):
            continue
        v = part.values
        if part.placeholder:
            # NaN rows written for no tensor's values (a parameter without a gradient, the unhooked
            # slot of the first layer's input_grad): they would make every step of several passes look
            # skipped
            keep = [i for i, mark in enumerate(part.placeholder) if not mark]
            if not keep:
                continue
            v = v[keep]
        v = torch.as_tensor(v)
        if col is None:
            flags.append(~torch.isfinite(v).all())
        elif ops[col] == "nans":
            flags.append((v[:, col] != 0).any())
        else:
            flags.append(~torch.isfinite(v[:, col]).all())
    if not flags:
        return None
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).any())  # one read-back


def weak_call(method):
    """``method`` (bound) called through a weak reference to its object: a no-op once it is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        m = ref()
        return None if m is None else m(*args, **kwargs)

    return call
