"""How a step's rows move between devices and to the host, checked on a machine without an accelerator.

The "meta" device stands in for an accelerator: tensors there have a device other than the host's and
no data, so any copy of one to the host fails (as it would wait for the device on a GPU), and
:class:`CopySpy` sees every copy the code asks for. The host copy's CUDA event is checked with fakes of
``torch.cuda``'s stream and event.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trainrec.recorder import step_stats
from trainrec.recorder.stats import StatsEngine
from trainrec.recorder.step_state import stack_rows
from trainrec.recorder.step_stats import StatsPart, StepStats

ACCEL = torch.device("meta")
OPS = ("min", "max", "norm")


@pytest.fixture
def meta_as_cuda(monkeypatch):
    """The meta stand-in takes the asynchronous copies a CUDA device takes."""
    monkeypatch.setattr(step_stats, "ASYNC_COPY_DEVICES", frozenset({"cuda", "meta"}))


class CopySpy(TorchDispatchMode):
    """Every copy between devices: (source device, destination device, non_blocking)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            dst = kwargs.get("device") or args[0].device
            if dst != args[0].device:
                self.copies.append((args[0].device.type, torch.device(dst).type, kwargs.get("non_blocking", False)))
        elif func is torch.ops.aten.copy_.default and args[0].device != args[1].device:
            self.copies.append((args[1].device.type, args[0].device.type, bool(args[2]) if len(args) > 2 else False))
        return func(*args, **kwargs)


def test_rows_of_the_host_and_an_accelerator_are_stacked_there_without_waiting(meta_as_cuda):
    """A hook's rows, some from the host's kernel (numpy) and some from an accelerator: stacked on the
    accelerator, the host rows copied there without blocking (a blocking copy waits for the stream)."""
    spy = CopySpy()
    with spy:
        out = stack_rows([np.ones(3, dtype=np.float32), torch.zeros(3, device=ACCEL)])
    assert out.device == ACCEL and out.shape == (2, 3)
    assert spy.copies == [("cpu", "meta", True)]


def test_a_batch_of_host_and_accelerator_tensors_is_gathered_on_the_accelerator(monkeypatch, meta_as_cuda):
    """A module whose input is on the host and output on an accelerator (a model that moves its input
    in its forward, an embedding kept on the host): the rows go together on the accelerator; a copy of
    the accelerator's rows to the host waits for the device inside the hook, even with non_blocking
    (pageable memory)."""

    def fake_group(self, xs, device, scales):
        return torch.full((len(xs), len(self.ops)), 1.0 if device.type == "cpu" else 2.0, device=device)

    monkeypatch.setattr(StatsEngine, "_group", fake_group)
    eng = StatsEngine(OPS)
    spy = CopySpy()
    with spy:
        rows = eng._compute([torch.ones(4), None, torch.ones(4, device=ACCEL), torch.ones(2)])
    assert rows.device == ACCEL and rows.shape == (4, 3)
    assert all(src == "cpu" and dst == "meta" and nb for src, dst, nb in spy.copies), spy.copies


def test_a_step_with_rows_on_several_devices_is_gathered_without_waiting(meta_as_cuda):
    """Rows of the host (the one-pass kernel's numpy arrays) and of an accelerator in one step: one
    tensor on the accelerator, so the step still makes a single asynchronous copy to the host (a
    blocking ``.cpu()`` of each device's rows waits for it at every collected step)."""
    st = StepStats(OPS)
    st.add(StatsPart("actv", np.ones((2, 3), dtype=np.float32), [0, 1]))
    st.add(StatsPart("grad_unreduced", torch.zeros(1, 3, device=ACCEL), [2]))
    spy = CopySpy()
    with spy:
        values = step_stats._concat([p.values for p in st.parts], 3)
    assert values.device == ACCEL and values.shape == (3, 3)
    assert all(dst != "cpu" and nb for _, dst, nb in spy.copies), spy.copies


class _FakeValues:
    """A step's rows on CUDA device 1 (what finish() reads of them)."""

    shape = (2, 3)
    dtype = torch.float32
    is_cuda = True
    device = torch.device("cuda", 1)


class _FakeHost:
    def __init__(self, log: list) -> None:
        self.log = log

    def copy_(self, src, non_blocking=False):
        self.log.append(("copy", src.device, non_blocking))
        return self


@pytest.mark.parametrize("current", [0, 1])
def test_host_copy_event_is_recorded_on_the_stream_of_the_rows_device(monkeypatch, current):
    """The copy to the host runs on the current stream of the rows' device; its event must be recorded
    on that stream, not on the current device's (a model on cuda:1 in a process whose current device is
    cuda:0): else the writer thread may read the pinned buffer before the copy has landed."""
    log: list = []

    class FakeEvent:
        def __init__(self, **kwargs) -> None:
            pass

        def record(self, stream=None):
            log.append(("record", stream))

    def current_stream(device=None):
        d = torch.device("cuda", current) if device is None else torch.device(device)
        return ("stream", d)

    monkeypatch.setattr(step_stats, "_concat", lambda rows, nops: _FakeValues())
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _FakeHost(log))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    st = StepStats(OPS)
    st.add(StatsPart("actv", None, [0, 1]))
    hs = st.finish(5)
    monkeypatch.undo()
    assert log == [("copy", torch.device("cuda", 1), True), ("record", ("stream", torch.device("cuda", 1)))]
    assert hs.event is not None


def test_host_copy_event_waits_without_spinning(monkeypatch):
    """The writer thread waits on the host copy's event for up to a step of the device's work: a CUDA
    event made without ``blocking=True`` spins a core meanwhile (the default scheduling where the
    process has no more CUDA contexts than cores), against the training thread and data loaders."""
    made: list = []

    class FakeEvent:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

        def record(self, stream=None):
            pass

    monkeypatch.setattr(step_stats, "_concat", lambda rows, nops: _FakeValues())
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _FakeHost([]))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    st = StepStats(OPS)
    st.add(StatsPart("actv", None, [0, 1]))
    st.finish(5)
    monkeypatch.undo()
    assert made == [{"blocking": True}]


class _FakeMpsValues(_FakeValues):
    is_cuda = False
    device = torch.device("mps")


def test_host_copy_from_an_accelerator_without_a_cuda_event_completes_before_it_is_read(monkeypatch):
    """Without a CUDA event to wait on (MPS, NPU), a non-blocking copy to the host may still be in flight
    when the writer thread reads the rows (torch documents non_blocking device-to-host copies as
    needing a sync before the values are read): that copy blocks."""
    log: list = []
    monkeypatch.setattr(step_stats, "_concat", lambda rows, nops: _FakeMpsValues())
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _FakeHost(log))
    st = StepStats(OPS)
    st.add(StatsPart("actv", None, [0, 1]))
    hs = st.finish(5)
    monkeypatch.undo()
    assert log == [("copy", torch.device("mps"), False)] and hs.event is None


def test_copies_to_a_device_are_asynchronous_only_where_that_is_safe(monkeypatch):
    """Host rows go to CUDA without blocking (the driver stages pageable memory before the call returns),
    but not to other accelerators, where a non-blocking copy from pageable memory is not safe everywhere
    (CPU to MPS gives wrong values, pytorch/pytorch#139550)."""
    spy = CopySpy()
    with spy:
        step_stats.to_device(torch.ones(3), ACCEL)
    assert spy.copies == [("cpu", "meta", False)]
    monkeypatch.setattr(step_stats, "ASYNC_COPY_DEVICES", frozenset({"cuda", "meta"}))
    spy = CopySpy()
    with spy:
        step_stats.to_device(torch.ones(3), ACCEL)
    assert spy.copies == [("cpu", "meta", True)]


def test_mg_direction_of_a_model_on_two_devices(meta_as_cuda):
    """mg_direction's values, each on its gradient's device, go together on one device before they are
    stacked (torch.stack of values on two devices raised at every collected step of a model split over
    devices)."""
    from types import SimpleNamespace

    from trainrec.recorder.context import RecordingContext
    from trainrec.recorder.optim_rows import OptimizerRows

    grads = [torch.ones(4), torch.ones(4, device=ACCEL)]
    moms = [torch.ones(4), torch.ones(4, device=ACCEL)]
    context = RecordingContext(StatsEngine(OPS), False, hook_failed=None)
    context.params = [SimpleNamespace(param=torch.zeros(4)) for _ in grads]
    binding = SimpleNamespace(adam=SimpleNamespace(
        adam_family=True, stepped=True,
        lookup=lambda params, host_steps=True: [(i, m, m, 1.0, {}) for i, m in enumerate(moms)]))
    ownership = SimpleNamespace(own_grad_lists=lambda partitioned_only=False: ([0, 1], grads))
    added: list = []
    rows = SimpleNamespace(add_rows=lambda st, kind, rows, indices: added.append((kind, rows, indices)))
    OptimizerRows(context, ownership, binding, rows).mg_direction_rows(None)
    (kind, rows, indices), = added
    assert rows.shape == (2, len(OPS)) and rows.device == ACCEL and indices == [0, 1]
