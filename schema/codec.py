"""The one codec between events and bytes (msgpack). Nothing else calls msgpack for log records.

Wire form of an event: ``[tag, seq, rank, step, wall, *fields]``, fields in declaration order.

Decoding is defensive, because logs are untrusted input: payloads are size-capped, every field's type
is checked against its declaration, the values one record may hold are capped per record type (a
valid-CRC frame of 64 MiB of one-byte integers would otherwise become a gigabyte of Python objects:
see :data:`MAX_VALUES`), an unknown tag becomes :class:`UnknownEvent` (skipped by
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
# Per tag, for the common case (msgpack makes exact types): the exact types each field may have, and
# the indexes of its float fields and of its list or map fields (converted or walked after the check).
_EXACT = {
    tag: (tuple(frozenset(t) for t in types),
          tuple(i for i, t in enumerate(types) if t[0] is float),
          tuple(i for i, t in enumerate(types) if t[0] is tuple or t[0] is dict))
    for tag, (_, types, _) in _LAYOUTS.items()
}
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


# Values (msgpack objects: array elements, map keys and values) one record may hold, by tag: what
# bounds a reader's memory to a small multiple of the frame cap on any input. Statistics and hook
# firings travel as bytes, so their records hold a few dozen values; name tables and module trees
# one per name (a model of a million modules is far beyond any trained today).
MAX_VALUES_DEFAULT = 1 << 20
MAX_VALUES: dict[str, int] = {
    tag: 4096 for tag in ("ts", "hf", "sb", "se", "fc", "rd", "hx", "wf", "mx")  # (no list of ranks or names)
}
# Lengths of one string, array or map (msgpack's own limits, checked before anything is built).
MAX_STR = 1 << 20
MAX_CONTAINER = 1 << 20


class _TooManyValues(Exception):
    pass


def peek_tag(payload) -> str:
    """The tag of a wire list (``[tag, ...]``: an array header, then a short string), or "" (without
    decoding the rest: a reader looking for one record type skips the others by it)."""
    b = bytes(payload[:16])
    if not b:
        return ""
    h = b[0]
    i = 1 if 0x90 <= h <= 0x9F else 3 if h == 0xDC else 5 if h == 0xDD else -1
    if i < 0 or i >= len(b) or not 0xA0 <= b[i] <= 0xBF:
        return ""
    n = b[i] - 0xA0
    try:
        return b[i + 1 : i + 1 + n].decode("ascii")
    except UnicodeDecodeError:
        return ""


def _unpack(payload, budget: int):
    """msgpack.unpackb with every limit set; raises _TooManyValues past ``budget`` values."""
    if len(payload) <= budget:  # every msgpack value takes a byte at least: no count needed
        return msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=False,
                               max_bin_len=MAX_FRAME, max_str_len=MAX_STR, max_array_len=budget,
                               max_map_len=budget, max_ext_len=1024)
    left = [budget]

    def counted_list(items):
        left[0] -= len(items)
        if left[0] < 0:
            raise _TooManyValues
        return items

    def counted_map(items):
        left[0] -= 2 * len(items)
        if left[0] < 0:
            raise _TooManyValues
        return items

    return msgpack.unpackb(
        payload,
        raw=False,
        use_list=False,
        strict_map_key=False,
        list_hook=counted_list,
        object_hook=counted_map,
        max_bin_len=MAX_FRAME,
        max_str_len=MAX_STR,
        max_array_len=min(MAX_CONTAINER, budget),
        max_map_len=min(MAX_CONTAINER, budget),
        max_ext_len=1024,
    )


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


def unpack_wire(payload, peeked: str):
    """The msgpack object of one payload whose tag is ``peeked`` (:func:`peek_tag`), under the limits
    :func:`decode` applies, without building an event: for a reader that checks one record type's
    fields itself (:mod:`trainrec.replay.stats_columns`). Raises CorruptRecordError as decode does."""
    budget = MAX_VALUES.get(peeked, MAX_VALUES_DEFAULT)
    try:
        return _unpack(payload, budget)
    except _TooManyValues:
        raise CorruptRecordError(f"record {peeked!r} holds more than {budget} values (the most one of its type may)") from None
    except ValueError as exc:
        if "exceeds max_" not in str(exc):
            raise CorruptRecordError(f"payload is not msgpack (ValueError: {exc!r})") from None
        # (msgpack's length limit, found at the length before anything is built)
        raise CorruptRecordError(f"record {peeked or '?'!r}: a length beyond what it may hold ({exc})") from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CorruptRecordError(f"payload is not msgpack ({exc.__class__.__name__}: {exc!r})") from None


def decode(payload: bytes, version: int = FORMAT_VERSION) -> Event:
    """Decode one payload. Raises CorruptRecordError (without path/offset; the reader adds them)."""
    wire = unpack_wire(payload, peek_tag(payload))
    if not isinstance(wire, tuple) or len(wire) < 1 + _N_ENV or not isinstance(wire[0], str):
        raise CorruptRecordError("payload is not a [tag, seq, rank, step, wall, ...] array")
    tag = wire[0]
    env = wire[1 : 1 + _N_ENV]
    if not (type(env[0]) is int and type(env[1]) is int and type(env[2]) is int and type(env[3]) is float):
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
    exact, floats, containers = _EXACT[tag]
    if upgrade is None and len(values) >= len(names) and all(map(frozenset.__contains__, exact, map(type, values))):
        # every field there, of an exact type: built without the field-by-field walk below
        kwargs = dict(zip(names, values, strict=False))  # (fields a later version appended: left out)
        for i in floats:
            kwargs[names[i]] = float(values[i])
        for i in containers:
            v = values[i]
            if v and not _depth_ok(v):
                raise CorruptRecordError(f"record {tag!r}: field {names[i]!r} nests deeper than {MAX_DEPTH} levels")
        return _built(tag, env, kwargs)
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
    return _built(tag, env, kwargs)


def _built(tag: str, env: tuple, kwargs: dict) -> Event:
    event = TAGS[tag](seq=env[0], rank=env[1], step=env[2], wall=float(env[3]), **kwargs)
    problem = event.check()
    if problem:
        raise CorruptRecordError(f"record {tag!r}: {problem}")
    return event
