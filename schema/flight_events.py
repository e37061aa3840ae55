"""Events of what happens around the training step's calls: collectives issued and completed, a step
that stalls, the exception that ends a recording, and the API level's torch calls. Listed and
re-exported by :mod:`.events` with every other event type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .envelope import Event, _check_counts, _check_ranks
from .vocab import DIR_BACKWARD, DIR_FORWARD, MAX_WORLD_SIZE, unpack_array


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCalled(Event):
    """A ``torch.distributed`` collective or point-to-point call issued on this rank (``cc_distribution``),
    written when it is issued (``wall``), before it can block.

    - ``group``, ``group_ranks``: the process group's name and its global ranks in group order;
    - ``group_seq``: this rank's recorded calls on that group, numbered from 0;
    - ``shapes``, ``dtypes``: the tensor arguments in call order (a list argument's in place);
    - ``peer``: the global rank of ``src``/``dst`` (-1 none); ``reduce_op``: the reduction's name;
    - ``codeline``: the user's call site (``file.py[23]``) where asked for;
    - ``pre_values``: statistics before the call (``cc_pre_hook``), row-major float32
      ``len(shapes) x len(ops)``, empty where not taken (those after: :class:`CollectiveCompleted`)."""

    TAG: ClassVar[str] = "co"
    op: str = ""
    group: str = ""
    group_ranks: tuple = ()
    group_seq: int = 0
    shapes: tuple = ()
    dtypes: tuple = ()
    async_op: bool = False
    peer: int = -1
    reduce_op: str = ""
    codeline: str = ""
    ops: tuple = ()
    pre_values: bytes = b""

    def check(self) -> str | None:
        if self.group_seq < 0:
            return f"group_seq {self.group_seq} is negative"
        if not -1 <= self.peer < MAX_WORLD_SIZE:
            return f"peer {self.peer} is outside -1..{MAX_WORLD_SIZE - 1}"
        if len(self.dtypes) != len(self.shapes):
            return f"{len(self.dtypes)} dtypes for {len(self.shapes)} shapes"
        for shape in self.shapes:
            if not isinstance(shape, (tuple, list)) or any(type(d) is not int or d < 0 for d in shape):
                return f"shape {shape!r} is not a list of sizes"
        if self.pre_values and len(self.pre_values) != 4 * len(self.shapes) * len(self.ops):
            return f"pre_values holds {len(self.pre_values)} bytes for {len(self.shapes)} tensors x {len(self.ops)} ops"
        return _check_ranks(self.group_ranks, "group_ranks")


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCompleted(Event):
    """A synchronous collective call of :class:`CollectiveCalled` (same ``group`` and ``group_seq``)
    returned after ``duration`` seconds; ``values`` are the statistics of its tensors then (row-major
    float32 ``tensors x len(ops)``). Written in ``cc_distribution``'s statistics mode only."""

    TAG: ClassVar[str] = "cd"
    op: str = ""
    group: str = ""
    group_seq: int = 0
    duration: float = 0.0
    ops: tuple = ()
    values: bytes = b""

    def check(self) -> str | None:
        if self.group_seq < 0:
            return f"group_seq {self.group_seq} is negative"
        if self.ops and len(self.values) % (4 * len(self.ops)):
            return f"values holds {len(self.values)} bytes, not whole rows of {len(self.ops)} float32"
        return None

@dataclass(frozen=True, slots=True, kw_only=True)
class StallDetected(Event):
    """The stall watchdog found the current step running for ``elapsed`` seconds, past ``threshold``
    (a multiple of ``median_step``, the median of the recent steps, or a floor); ``count`` numbers the
    reports of this stall (it is reported again while it lasts).

    ``stacks`` is every thread's Python stack as :mod:`faulthandler` prints it; ``modules`` the model's
    modules whose forward is on the main thread's stack, outermost first. The last hook that fired
    (``hook_module`` empty where none has in this step; ``hook_direction`` DIR_FORWARD/DIR_BACKWARD) and
    the collective call in flight (``collective_op`` empty where none is; its ``collective_seq`` on
    ``collective_group_ranks``, for ``collective_elapsed`` seconds) are what the recorder knew then."""

    TAG: ClassVar[str] = "sl"
    elapsed: float = 0.0
    median_step: float = 0.0
    threshold: float = 0.0
    count: int = 1
    stacks: str = ""
    modules: tuple = ()
    hook_module: str = ""
    hook_direction: int = DIR_FORWARD
    hook_micro_step: int = 0
    hook_call_id: int = -1
    collective_op: str = ""
    collective_group_ranks: tuple = ()
    collective_seq: int = -1
    collective_elapsed: float = 0.0

    def check(self) -> str | None:
        if self.hook_direction not in (DIR_FORWARD, DIR_BACKWARD):
            return f"direction {self.hook_direction} is neither forward (0) nor backward (1)"
        return _check_ranks(self.collective_group_ranks, "collective_group_ranks") or _check_counts(self, "count")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExceptionRaised(Event):
    """An exception ended the recording (uncaught, or out of the monitor's ``with`` block): its type and
    message (``error``), the model's modules whose forward it came out of (``modules``, outermost
    first, empty where it came from none) and its traceback as Python prints it (the last lines kept)."""

    TAG: ClassVar[str] = "xr"
    error: str = ""
    modules: tuple = ()
    traceback: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiCallsRecorded(Event):
    """The API calls (torch functions, tensor methods) of one pass of a model chunk at the API level
    (``api_xy``), columnar; every field's layout is in docs/log-format.md, "ApiCallsRecorded".

    - per call: ``name_ids`` (``Functional.linear.0.forward``), ``module_ids``, ``positions`` (hook
      firings before it), ``port_counts``; with stacks, ``stack_depths``;
    - per port (inputs, outputs, keyword inputs): ``port_ids``, ``type_ids``, ``dtype_ids``, ``ndims``
      (255: no shape), ``requires_grad`` (2: not a tensor), a row of ``values``; ``dims`` and
      ``stack_frames`` concatenated;
    - ``direction`` (appended): DIR_BACKWARD for the gradients through micro step ``micro_step``'s
      calls, ports ``input.i``/``output.i`` as the reference's; older records read as forward;
    - ``module_*`` (appended; forward records): the monitored module calls the API calls nest under,
      with the dtype and shape of their ``input.0`` and ``output.0``. Empty in older records."""

    TAG: ClassVar[str] = "ap"
    micro_step: int = 0
    vpp_stage: int = 0
    ops: tuple = ()
    dtype: str = "f"
    name_ids: bytes = b""
    module_ids: bytes = b""
    positions: bytes = b""
    port_counts: bytes = b""
    port_ids: bytes = b""
    type_ids: bytes = b""
    dtype_ids: bytes = b""
    ndims: bytes = b""
    dims: bytes = b""
    requires_grad: bytes = b""
    values: bytes = b""
    stack_depths: bytes = b""
    stack_frames: bytes = b""
    direction: int = DIR_FORWARD
    module_calls: bytes = b""
    module_positions: bytes = b""
    module_dtype_ids: bytes = b""
    module_ndims: bytes = b""
    module_dims: bytes = b""

    def __len__(self) -> int:
        return len(self.name_ids) // 4

    def check(self) -> str | None:
        if self.direction not in (DIR_FORWARD, DIR_BACKWARD):
            return f"direction {self.direction} is neither forward (0) nor backward (1)"
        if self.dtype not in ("f", "d"):
            return f"unknown value dtype {self.dtype!r}"
        n, rest = divmod(len(self.name_ids), 4)
        if rest:
            return "name_ids is not a whole number of u32"
        for arr, size, label in ((self.module_ids, 4, "module_ids"), (self.positions, 4, "positions"),
                                 (self.port_counts, 2, "port_counts")):
            if len(arr) != n * size:
                return f"{label} has {len(arr) / size:g} entries for {n} calls"
        if self.stack_depths and len(self.stack_depths) != n * 2:
            return f"stack_depths has {len(self.stack_depths) / 2:g} entries for {n} calls"
        frames = sum(unpack_array("H", self.stack_depths)) if self.stack_depths else 0
        if len(self.stack_frames) != frames * 4:
            return f"stack_frames has {len(self.stack_frames) / 4:g} entries for {frames} frames"
        ports = sum(unpack_array("H", self.port_counts))
        for arr, size, label in ((self.port_ids, 4, "port_ids"), (self.type_ids, 4, "type_ids"),
                                 (self.dtype_ids, 4, "dtype_ids"), (self.ndims, 1, "ndims"),
                                 (self.requires_grad, 1, "requires_grad")):
            if len(arr) != ports * size:
                return f"{label} has {len(arr) / size:g} entries for {ports} ports"
        dims = sum(d for d in self.ndims if d != 255)
        if len(self.dims) != dims * 8:
            return f"dims has {len(self.dims) / 8:g} entries for {dims} dimensions"
        item = 4 if self.dtype == "f" else 8
        if len(self.values) != ports * len(self.ops) * item:
            return f"{len(self.values)} value bytes for {ports} ports x {len(self.ops)} ops"
        return self._check_module_calls()

    def _check_module_calls(self) -> str | None:
        m, rest = divmod(len(self.module_calls), 4)
        if rest:
            return "module_calls is not a whole number of u32"
        for arr, size, per_call, label in ((self.module_positions, 4, 1, "module_positions"),
                                           (self.module_dtype_ids, 4, 2, "module_dtype_ids"),
                                           (self.module_ndims, 1, 2, "module_ndims")):
            if len(arr) != m * size * per_call:
                return f"{label} has {len(arr) / size:g} entries for {m} module calls (want {m * per_call})"
        dims = sum(d for d in self.module_ndims if d != 255)
        if len(self.module_dims) != dims * 8:
            return f"module_dims has {len(self.module_dims) / 8:g} entries for {dims} dimensions"
        return None
