"""Recording of ``torch.distributed`` collective and point-to-point calls (``cc_distribution``).

As the reference does, the functions named in :data:`WRAPPED` are replaced in ``torch.distributed``
and ``torch.distributed.distributed_c10d`` by a wrapper that tells every installed
:class:`CollectiveRecorder` about the call, then calls the original. The wrappers go in with the
first recorder and come out with the last (unless replaced since). Calls issued from C++ (DDP, FSDP)
or through a reference saved before the monitor was made are not seen (docs/postmortem.md).

Per call, on the calling thread: :class:`CollectiveCalled` at issue, before it can block, and in
statistics mode :class:`CollectiveCompleted` after a synchronous call returns. The call is "in
flight" (for the stall watchdog) until the original returns."""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from trainrec.schema.events import CollectiveCalled, CollectiveCompleted

log = logging.getLogger(__name__)

# the functions wrapped, and the argument naming the peer (src/dst) where the call has one
WRAPPED = {
    "all_reduce": None, "all_gather": None, "all_gather_into_tensor": None, "reduce_scatter": None,
    "reduce_scatter_tensor": None, "broadcast": "src", "barrier": None, "all_to_all": None,
    "all_to_all_single": None, "send": "dst", "recv": "src", "isend": "dst", "irecv": "src", "reduce": "dst",
    "gather": "dst", "scatter": "src",
}
_REDUCING = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce")
_ALWAYS_ASYNC = ("isend", "irecv")
LOG_ONLY_EXIT = "exit after the first monitor step when cc_log_only"
# frames of these directories are not a call site (torch's own, and the recorder's)
_SKIP_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)


@dataclass
class CallInFlight:
    """A call between its issue and its return, as the stall watchdog reports it."""

    op: str
    group_ranks: tuple
    seq: int
    t0: float  # time.perf_counter() at issue
    thread: int


class CollectiveRecorder:
    """One monitor's recording of collectives: ``emit`` hands an event to its log, ``step()`` is the
    current step, ``collecting()`` whether the step is collected (statistics are taken on those only)."""

    def __init__(self, options: dict, *, rank: int, emit: Callable, step: Callable[[], int],
                 collecting: Callable[[], bool], ops: tuple = ("norm",), eps: float = 1e-8) -> None:
        self.rank = rank
        self._emit = emit
        self._step = step
        self._collecting = collecting
        self.log_only = bool(options.get("cc_log_only"))
        self.metadata_only = bool(options.get("cc_metadata_only")) or self.log_only
        self.pre_hook = bool(options.get("cc_pre_hook")) and not self.metadata_only
        self._patterns = [re.compile(p) for p in options.get("cc_codeline", [])]
        self._want_site = bool(self._patterns) or self.log_only
        self.ops = tuple(ops)
        self._engine = None
        if not self.metadata_only:
            from .stats import StatsEngine

            self._engine = StatsEngine(self.ops, eps)
        self._groups: dict[int, tuple] = {}  # id(group) -> (group, name, ranks, seq counter)
        self._in_flight: dict[int, CallInFlight] = {}  # thread id -> its call in flight
        self.last: CallInFlight | None = None  # the last call issued
        self._log_only_steps: dict[tuple, int] = {}  # cc_log_only: (op, ranks, dtypes, site) -> calls
        self._log_only_first: int | None = None
        self.closed = False

    # ------------------------------------------------------------------ lifetime
    def install(self) -> None:
        if not torch.distributed.is_available():  # (a torch built without it: nothing to record)
            log.warning("trainrec: cc_distribution is on, but this torch has no torch.distributed: no collective "
                        "is recorded")
            return
        _install(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _uninstall(self)
            if self._engine is not None:
                self._engine.release()

    def in_flight(self) -> CallInFlight | None:
        """The call in flight on the main thread, else the oldest one in flight on any thread."""
        calls = dict(self._in_flight)
        main = calls.get(threading.main_thread().ident)
        if main is not None:
            return main
        return min(calls.values(), key=lambda c: c.t0, default=None)

    # ------------------------------------------------------------------ per call
    def issue(self, name: str, fn_params: dict, args: tuple, kwargs: dict) -> tuple | None:
        """Record the issue of a call; returns what :meth:`done` needs, or None."""
        group = _arg(args, kwargs, fn_params, "group")
        entry = self._groups.get(id(group))
        if entry is None or entry[0] is not group:
            entry = self._groups[id(group)] = _describe_group(group)
        _, group_name, ranks, counter = entry
        seq = next(counter)
        tensors = _tensors(args, kwargs)
        step = self._step()
        site = _call_site(self._patterns) if self._want_site else ""
        if site is None:  # cc_codeline given and no frame of the call's stack matches: counted, not recorded
            call = CallInFlight(name, ranks, seq, time.perf_counter(), threading.get_ident())
            self._in_flight[call.thread] = self.last = call
            return (call, None, None)
        if self.log_only:
            self._log_only(name, ranks, tensors, site, step)
        peer_arg = WRAPPED[name]
        peer = _arg(args, kwargs, fn_params, peer_arg) if peer_arg else None
        if name in _REDUCING:
            op = _arg(args, kwargs, fn_params, "op")
            reduce_op = "SUM" if op is None else str(op).rsplit(".", 1)[-1]
        else:
            reduce_op = ""
        stats = self._engine is not None and self._collecting()
        pre = b""
        if stats and self.pre_hook and tensors:
            pre = self._values(tensors)
        fields = {"rank": self.rank, "step": step, "wall": time.time(), "op": name, "group": group_name,
                  "group_ranks": ranks, "group_seq": seq, "shapes": tuple([tuple(t.shape) for t in tensors]),
                  "dtypes": tuple([_DTYPES.get(t.dtype) or _dtype_name(t.dtype) for t in tensors]),
                  "async_op": name in _ALWAYS_ASYNC or bool(_arg(args, kwargs, fn_params, "async_op")),
                  "peer": peer if isinstance(peer, int) else -1, "reduce_op": reduce_op, "codeline": site}
        if pre:
            fields.update(ops=self.ops, pre_values=pre)
        self._emit(functools.partial(_called, fields))  # (the event is made on the writer's thread)
        call = CallInFlight(name, ranks, seq, time.perf_counter(), threading.get_ident())
        self._in_flight[call.thread] = self.last = call
        post = stats and tensors and not (name in _ALWAYS_ASYNC or _arg(args, kwargs, fn_params, "async_op"))
        return (call, group_name, tensors if post else None)

    def done(self, token: tuple) -> None:
        call, group_name, tensors = token
        if self._in_flight.get(call.thread) is call:
            del self._in_flight[call.thread]
        if tensors is not None:
            self._emit(CollectiveCompleted(rank=self.rank, step=self._step(), wall=time.time(), op=call.op,
                                           group=group_name, group_seq=call.seq,
                                           duration=time.perf_counter() - call.t0, ops=self.ops,
                                           values=self._values(tensors)))

    def _values(self, tensors: list) -> bytes:
        rows = self._engine.compute([t.detach() for t in tensors])
        return rows.to(torch.float32).cpu().contiguous().numpy().tobytes()

    def _log_only(self, name: str, ranks: tuple, tensors: list, site: str, step: int) -> None:
        """cc_log_only, as the reference: the calls of the first step are logged (op, group, dtypes, call
        site) and the run ends at the first call of the step after it, on every rank alike."""
        if self._log_only_first is None:
            self._log_only_first = step
        if step == self._log_only_first:
            key = (name, ranks, tuple(str(t.dtype)[6:] for t in tensors), site)
            self._log_only_steps[key] = self._log_only_steps.get(key, 0) + 1
            return
        lines = [f"  {op} group {list(r)} dtypes {list(d)} at {s} (x{n})"
                 for (op, r, d, s), n in self._log_only_steps.items()]
        log.warning("trainrec: cc_log_only: the collectives of step %d on rank %d:\n%s", self._log_only_first,
                    self.rank, "\n".join(lines) or "  (none)")
        raise RuntimeError(LOG_ONLY_EXIT)


def _called(fields: dict) -> tuple:
    return (CollectiveCalled(**fields),)


_DTYPES: dict = {}


def _dtype_name(dtype) -> str:
    name = _DTYPES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _arg(args: tuple, kwargs: dict, params: dict, name: str):
    """The value of parameter ``name`` of a call (None where not given); ``params``: name -> position."""
    if kwargs and name in kwargs:
        return kwargs[name]
    i = params.get(name)
    return args[i] if i is not None and i < len(args) else None


def _tensors(args: tuple, kwargs: dict) -> list:
    """The tensor arguments of a call in order, those of a list argument in place."""
    out = []
    for v in (itertools.chain(args, kwargs.values()) if kwargs else args):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _describe_group(group) -> tuple:
    import torch.distributed as dist

    g = group if group is not None else dist.group.WORLD
    try:
        ranks = tuple(dist.get_process_group_ranks(g))
    except Exception:  # noqa: BLE001 - not initialised, or not a group: the call itself will say so
        ranks = ()
    name = getattr(g, "group_name", "") or ""
    return (group, str(name), ranks, itertools.count())


def _call_site(patterns: list) -> str | None:
    """The innermost frame outside torch and trainrec as ``file.py[line]``; with ``patterns``
    (cc_codeline), None where no such frame of the stack, as ``path[line]``, matches one."""
    f = sys._getframe(1)
    site = ""
    matched = not patterns
    while f is not None:
        path = f.f_code.co_filename
        if not path.startswith(_SKIP_DIRS):
            where = f"{path}[{f.f_lineno}]"
            if not site:
                site = f"{os.path.basename(path)}[{f.f_lineno}]"
            if not matched and any(p.search(where) for p in patterns):
                matched = True
            if matched:
                break
        f = f.f_back
    return site if matched else None


# ---------------------------------------------------------------------------------------- the wrappers
_recorders: list[CollectiveRecorder] = []  # installed, in order; the wrappers read it (copied on change)
_originals: dict[str, Callable] = {}
_wrappers: dict[str, Callable] = {}
_local = threading.local()  # depth: a wrapped function calling another is recorded once
_lock = threading.Lock()


def _modules() -> tuple:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    return (dist, c10d)


def _make_wrapper(name: str, fn: Callable) -> Callable:
    params = {p: i for i, p in enumerate(inspect.signature(fn).parameters)}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        recorders = _recorders
        if not recorders or getattr(_local, "depth", 0):
            return fn(*args, **kwargs)
        _local.depth = 1
        try:
            tokens = []
            for rec in recorders:
                try:
                    tokens.append((rec, rec.issue(name, params, args, kwargs)))
                except RuntimeError as exc:
                    if str(exc) == LOG_ONLY_EXIT:
                        raise
                    log.warning("trainrec: recording %s failed: %r", name, exc)
                except Exception as exc:  # noqa: BLE001 - monitoring never breaks a collective
                    log.warning("trainrec: recording %s failed: %r", name, exc)
            try:
                return fn(*args, **kwargs)
            finally:
                for rec, token in tokens:
                    if token is not None:
                        try:
                            rec.done(token)
                        except Exception as exc:  # noqa: BLE001
                            log.warning("trainrec: recording %s failed: %r", name, exc)
        finally:
            _local.depth = 0

    wrapper._trainrec_original = fn  # type: ignore[attr-defined]
    return wrapper


def _install(rec: CollectiveRecorder) -> None:
    global _recorders
    with _lock:
        if not _wrappers:
            mods = _modules()
            for name in WRAPPED:
                fn = getattr(mods[0], name, None)
                if fn is None:
                    continue
                _originals[name] = fn
                _wrappers[name] = w = _make_wrapper(name, fn)
                for m in mods:
                    if getattr(m, name, None) is fn:
                        setattr(m, name, w)
        _recorders = [*_recorders, rec]


def _uninstall(rec: CollectiveRecorder) -> None:
    global _recorders
    with _lock:
        _recorders = [r for r in _recorders if r is not rec]
        if _recorders or not _wrappers:
            return
        for m in _modules():  # (one replaced again since, by someone else, keeps ours under it: it passes through)
            for name, w in _wrappers.items():
                if getattr(m, name, None) is w:
                    setattr(m, name, _originals[name])
        _wrappers.clear()
        _originals.clear()

def installed() -> bool:
    """Whether the wrappers are in place (tests)."""
    return bool(_wrappers) and any(getattr(_modules()[0], n, None) is w for n, w in _wrappers.items())
