"""The rows of one collected step, from the hooks and the optimizer step to the writer thread.

:class:`StepStats` gathers the rows of one step (per kind, with name ids, micro steps, call ids,
slots and vpp stages), concatenates them into a single tensor and moves it to the host once
(``non_blocking`` into pinned memory plus a CUDA event, recorded on the stream of the rows' device,
where the device is CUDA). Rows of several devices (a model split over GPUs, host rows among a
device's) are gathered on the first accelerator (non-blocking copies to CUDA), here and in the hooks:
a blocking copy to the host waits for the device, and a non-blocking one may be read before it has
landed. The event objects are built later from :class:`HostStats` on the writer thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from trainrec.schema.events import KINDS, TensorStatsRecorded

from . import fused


@dataclass
class StatsPart:
    """Rows of one kind computed together, with their per-row metadata (monitor-local name ids).

    ``placeholder``: per row, True where the row is a NaN row the recorder wrote for a tensor it did not
    measure (None: a parameter without a gradient, the unhooked slot of an activation gradient pair;
    empty: a parameter of no elements; or one the engine failed on), so that a reader of the step's
    rows (the skipped-step check) tells them from a tensor holding NaN; ``()`` where no row is one.
    Written to the log (``TensorStatsRecorded.placeholders``), where anomaly detection skips those
    rows. Set on every kind the statistics engine measures (weight gradients, unreduced and reduced,
    activations and their gradients, parameters) through :func:`placeholders`; not on optimizer state."""

    kind: str
    values: torch.Tensor | np.ndarray  # [rows, ops] float32; numpy from the hooks' kernel path
    name_ids: Sequence[int]
    micro_steps: Sequence[int] = ()
    call_ids: Sequence[int] = ()
    slots: Sequence[int] = ()
    vpp_stages: Sequence[int] = ()
    placeholder: Sequence[bool] = ()


def placeholders(tensors: Sequence[torch.Tensor | None], rows=None, failed: Sequence[int] = ()) -> tuple:
    """:attr:`StatsPart.placeholder` of the rows :meth:`StatsEngine.rows` gave ``tensors``: True for None
    and empty tensors (a DTensor: this rank's shard) and for the positions in ``failed``; ``()`` where
    none is. ``rows``: those rows, which settle it at once where they are the kernel's numpy array
    without a NaN (the common case: one check per batch, no Python step per tensor; rows in a tensor,
    which may be on a device, are not read: a sync there)."""
    if not failed and isinstance(rows, np.ndarray) and not np.isnan(rows).any():
        return ()
    marks = tuple(t is None or not fused.local_tensor(t).numel() for t in tensors)
    if failed:
        marks = tuple(m or i in failed for i, m in enumerate(marks))
    return marks if any(marks) else ()


@dataclass
class HostStats:
    """One step's statistics on the host (after ``wait()``), laid out by kind."""

    step: int
    ops: tuple
    values: torch.Tensor  # [rows, ops] float32, host (pinned on CUDA) or device for api format
    event: object | None
    kinds: list = field(default_factory=list)  # (kind, start, stop)
    name_ids: np.ndarray = None  # type: ignore[assignment]
    micro_steps: np.ndarray = None  # type: ignore[assignment]
    call_ids: np.ndarray = None  # type: ignore[assignment]
    slots: np.ndarray = None  # type: ignore[assignment]
    vpp_stages: np.ndarray = None  # type: ignore[assignment]
    placeholders: np.ndarray | None = None  # u8 per row (StatsPart.placeholder); None where no row is one

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
        return self.values.numpy()


class StepStats:
    """Collects the parts of one step; :meth:`finish` makes one tensor and one host copy."""

    def __init__(self, ops: tuple) -> None:
        self.ops = ops
        self.parts: list[StatsPart] = []

    def add(self, part: StatsPart) -> None:
        self.parts.append(part)

    def __bool__(self) -> bool:
        return bool(self.parts)

    def finish(self, step: int, to_host: bool = True) -> HostStats:
        order = {k: i for i, k in enumerate(KINDS)}
        parts = sorted(self.parts, key=lambda p: order.get(p.kind, len(order)))
        kinds = []
        start = 0
        name_ids, micro, calls, slots, vpp = array("I"), array("H"), array("I"), array("B"), array("B")
        marks = None  # (made at the first part with placeholder rows: most steps have none)
        for p in parts:
            k = len(p.name_ids)
            if kinds and kinds[-1][0] == p.kind:
                kinds[-1] = (p.kind, kinds[-1][1], start + k)
            else:
                kinds.append((p.kind, start, start + k))
            start += k
            name_ids.extend(p.name_ids)
            micro.extend(p.micro_steps or (0,) * k)
            calls.extend(p.call_ids or (0xFFFFFFFF,) * k)
            slots.extend(p.slots or (0,) * k)
            vpp.extend(p.vpp_stages or (0,) * k)
            if p.placeholder:
                if marks is None:
                    marks = array("B", bytes(len(name_ids) - k))
                marks.extend(map(bool, p.placeholder))
            elif marks is not None:
                marks.extend(bytes(k))
        values = _concat([p.values for p in parts], len(self.ops))
        event = None
        if to_host and values.device.type != "cpu":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
            # without a CUDA event to wait on (MPS, NPU) the copy blocks: a non-blocking one to the host
            # may still be in flight when the writer thread reads it
            host.copy_(values, non_blocking=values.is_cuda)
            if values.is_cuda:
                # the copy runs on the current stream of the rows' device, which need not be the current
                # device (a model on cuda:1): the event goes on that stream, or it may complete first.
                # blocking: the writer thread that waits on it sleeps instead of spinning a core
                event = torch.cuda.Event(blocking=True)
                event.record(torch.cuda.current_stream(values.device))
            values = host
        return HostStats(
            step=step, ops=self.ops, values=values, event=event, kinds=kinds,
            name_ids=np.frombuffer(name_ids, dtype=np.uint32), micro_steps=np.frombuffer(micro, dtype=np.uint16),
            call_ids=np.frombuffer(calls, dtype=np.uint32), slots=np.frombuffer(slots, dtype=np.uint8),
            vpp_stages=np.frombuffer(vpp, dtype=np.uint8),
            placeholders=None if marks is None else np.frombuffer(marks, dtype=np.uint8),
        )


def _concat(rows: list, nops: int) -> torch.Tensor:
    """One ``[rows, ops]`` float32 tensor of the parts' rows (numpy arrays from the hooks' kernel path,
    tensors from the others): one numpy concatenation when all are on the host, else on the device."""
    if not rows:
        return torch.empty((0, nops))
    if all(isinstance(r, np.ndarray) or r.device.type == "cpu" for r in rows):
        return torch.from_numpy(np.concatenate([r if isinstance(r, np.ndarray) else r.numpy() for r in rows]))
    tensors = [torch.from_numpy(r) if isinstance(r, np.ndarray) else r for r in rows]
    if len({t.device for t in tensors}) > 1:
        # (a model split over devices, host rows among a device's): on one accelerator, without waiting
        # for any, so the step still makes one asynchronous copy to the host
        dev = gather_device(t.device for t in tensors)
        tensors = [to_device(t, dev) for t in tensors]
    return torch.cat(tensors)


def gather_device(devices) -> torch.device:
    """Where rows of several devices go together: the first accelerator among ``devices`` (a copy there
    from the host or from another accelerator starts without waiting for a device, while one to the
    host waits for the device, or, ``non_blocking``, may be read before it has landed), the host where
    all are on it."""
    devices = list(devices)
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else torch.device("cpu"))


# Device types a copy goes to without blocking (from pageable host memory, the driver stages it before
# the call returns; between devices, torch orders the two streams). Elsewhere it blocks: a non-blocking
# copy from the host is not safe on every accelerator (CPU to MPS gives wrong values, pytorch#139550).
ASYNC_COPY_DEVICES = frozenset({"cuda"})


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; on CUDA without blocking the host (a blocking copy syncs the stream)."""
    return t if t.device == device else t.to(device, non_blocking=device.type in ASYNC_COPY_DEVICES)


def build_stats_events(
    hs: HostStats, rank: int, file_ids: np.ndarray, wall: float
) -> list[TensorStatsRecorded]:
    """TensorStatsRecorded per kind (writer thread). ``file_ids`` maps monitor-local to per-file ids."""
    arr = np.ascontiguousarray(hs.wait(), dtype="<f4")
    out = []
    ids = file_ids[hs.name_ids].astype("<u4") if len(hs.name_ids) else hs.name_ids.astype("<u4")
    marks = hs.placeholders
    for kind, a, b in hs.kinds:
        calls = hs.call_ids[a:b]
        out.append(TensorStatsRecorded(
            rank=rank, step=hs.step, wall=wall, kind=kind, ops=hs.ops, dtype="f",
            name_ids=ids[a:b].tobytes(), values=arr[a:b].tobytes(),
            micro_steps=_or_empty(hs.micro_steps[a:b], "<u2"),
            call_ids=b"" if (calls == 0xFFFFFFFF).all() else calls.astype("<u4").tobytes(),
            slots=_or_empty(hs.slots[a:b], "u1"),
            vpp_stages=_or_empty(hs.vpp_stages[a:b], "u1"),
            placeholders=b"" if marks is None else _or_empty(marks[a:b], "u1"),
        ))
    return out


def _or_empty(col: np.ndarray, dtype: str) -> bytes:
    return b"" if not col.any() else col.astype(dtype).tobytes()
