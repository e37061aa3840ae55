"""The one codec between events and bytes (msgpack). Nothing else calls msgpack for log records.

Wire form of an event: ``[tag, seq, rank, step, wall, *fields]``, fields in declaration order.

Decoding is defensive, because logs are untrusted input: payloads are size-capped, every field's type
is checked against its declaration, an unknown tag becomes :class:`UnknownEvent` (skipped by
consumers), and a known tag that does not decode raises :class:`CorruptRecordError`. Records written
by older format versions go through :data:`UPGRADES` before they are built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import msgpack

from .errors import CorruptRecordError
from .events import MAX_STEP, MAX_WORLD_SIZE, TAGS, Event, UnknownEvent
from .framing import FORMAT_VERSION, MAX_FRAME

_ENVELOPE = ("seq", "rank", "step", "wall")
_N_ENV = len(_ENVELOPE)

# Accepted Python types per annotation (annotations are strings under `from __future__ import annotations`).
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (float, int),
    "str": (str,),
    "bytes": (bytes,),
    "bool": (bool, int),
    "tuple": (tuple, list),
    "dict": (dict,),
}


def _layout(cls: type[Event]) -> tuple[tuple[str, ...], tuple[tuple[type, ...], ...], tuple]:
    names, types, defaults = [], [], []
    for f in dataclasses.fields(cls):
        if f.name in _ENVELOPE:
            continue
        names.append(f.name)
        types.append(_TYPES[str(f.type)])
        if f.default is not dataclasses.MISSING:
            defaults.append(f.default)
        else:
            defaults.append(f.default_factory())  # type: ignore[misc]
    return tuple(names), tuple(types), tuple(defaults)


_LAYOUTS = {tag: _layout(cls) for tag, cls in TAGS.items()}
_ENV_TYPES = ((int,), (int,), (int,), (float, int))
# Envelope bounds: (lowest, highest) of seq, rank and step.
_MAX_SEQ = 1 << 63
_ENV_BOUNDS = ((-1, _MAX_SEQ - 1), (-1, MAX_WORLD_SIZE - 1), (-1, MAX_STEP - 1))
# Nesting of list and map fields (configs, io specs): deeper is corrupt, and would exhaust a consumer's
# recursion (msgpack itself nests up to 1024 levels).
MAX_DEPTH = 32


def _depth_ok(value: tuple | dict, depth: int = 0) -> bool:
    """Whether a decoded list or map (msgpack makes exact tuples and dicts) nests at most MAX_DEPTH
    levels. The element types are taken in one C-level pass: a flat field of 12,000 names is not
    walked in Python."""
    if depth > MAX_DEPTH:
        return False
    items = (*value.keys(), *value.values()) if type(value) is dict else value
    kinds = set(map(type, items))
    if tuple not in kinds and dict not in kinds:
        return True
    return all(_depth_ok(v, depth + 1) for v in items if type(v) is tuple or type(v) is dict)


# (format_version, tag) -> function rewriting an old wire list into the current one.
UPGRADES: dict[tuple[int, str], Callable[[list], list]] = {}

def _default(obj):
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, memoryview):
        return obj.tobytes()
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in a trainrec record")


def encode(event: Event, seq: int | None = None) -> bytes:
    """Encode one event to its msgpack payload; ``seq`` overrides the event's own (the writer's count)."""
    cls = type(event)
    names = _LAYOUTS[cls.TAG][0]
    wire = [cls.TAG, event.seq if seq is None else seq, event.rank, event.step, event.wall]
    wire.extend(getattr(event, n) for n in names)
    return msgpack.packb(wire, use_bin_type=True, default=_default)


def decode(payload: bytes, version: int = FORMAT_VERSION) -> Event:
    """Decode one payload. Raises CorruptRecordError (without path/offset; the reader adds them)."""
    try:
        wire = msgpack.unpackb(
            payload,
            raw=False,
            use_list=False,
            strict_map_key=False,
            max_bin_len=MAX_FRAME,
            max_str_len=MAX_FRAME,
            max_array_len=MAX_FRAME,
            max_map_len=MAX_FRAME,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CorruptRecordError(f"payload is not msgpack ({exc.__class__.__name__}: {exc!r})") from None
    if not isinstance(wire, tuple) or len(wire) < 1 + _N_ENV or not isinstance(wire[0], str):
        raise CorruptRecordError("payload is not a [tag, seq, rank, step, wall, ...] array")
    tag = wire[0]
    env = wire[1 : 1 + _N_ENV]
    for value, types, name in zip(env, _ENV_TYPES, _ENVELOPE, strict=False):
        if not isinstance(value, types):
            raise CorruptRecordError(f"record {tag!r}: envelope field {name!r} has type {type(value).__name__}")
    if not (-1 <= env[0] < _MAX_SEQ and -1 <= env[1] < MAX_WORLD_SIZE and -1 <= env[2] < MAX_STEP):
        for value, (lo, hi), name in zip(env, _ENV_BOUNDS, _ENVELOPE, strict=False):
            if not lo <= value <= hi:
                raise CorruptRecordError(f"record {tag!r}: envelope field {name!r} is {value}, outside {lo}..{hi}")
    layout = _LAYOUTS.get(tag)
    if layout is None:
        return UnknownEvent(
            seq=env[0], rank=env[1], step=env[2], wall=float(env[3]), tag=tag, fields=wire[1 + _N_ENV :]
        )
    upgrade = UPGRADES.get((version, tag))
    if upgrade is not None:
        wire = tuple(upgrade(list(wire)))
    names, types, defaults = layout
    values = wire[1 + _N_ENV :]
    kwargs = {}
    for i, name in enumerate(names):
        if i < len(values):
            v = values[i]
            if not isinstance(v, types[i]):
                raise CorruptRecordError(
                    f"record {tag!r}: field {name!r} has type {type(v).__name__}, expected {types[i][0].__name__}"
                )
            t = types[i][0]
            if t is float:
                v = float(v)
            elif t is tuple and type(v) is list:  # (an upgraded record's)
                v = tuple(v)
            if (t is tuple or t is dict) and v and not _depth_ok(v):
                raise CorruptRecordError(f"record {tag!r}: field {name!r} nests deeper than {MAX_DEPTH} levels")
            kwargs[name] = v
        else:
            kwargs[name] = defaults[i]
    cls = TAGS[tag]
    event = cls(seq=env[0], rank=env[1], step=env[2], wall=float(env[3]), **kwargs)
    problem = event.check()
    if problem:
        raise CorruptRecordError(f"record {tag!r}: {problem}")
    return event
