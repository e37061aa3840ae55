"""Stats records decoded straight into their columns, for replay that works on whole series.

:func:`decode_columns` stands in for :func:`trainrec.schema.codec.decode` in a
:class:`~trainrec.replay.reader.LogReader` opened with ``columnar=True``: a
:class:`~trainrec.schema.events.TensorStatsRecorded` payload laid out as the writer writes it becomes
a :class:`StatsColumns` (the record's fields as they are on the wire, checked as the codec and
``TensorStatsRecorded.check`` check them, without building the frozen event or walking its fields one
by one). Every other payload, and any stats payload this path does not recognise or finds wrong, goes
to the codec: errors, unknown tags, older layouts and upgrades stay the codec's, word for word.
"""

from __future__ import annotations

import numpy as np
from trainrec.schema import codec
from trainrec.schema.events import MAX_STEP, MAX_WORLD_SIZE, SLOTS, TensorStatsRecorded
from trainrec.schema.framing import FORMAT_VERSION

__all__ = ["StatsColumns", "decode_columns"]

_TAG = TensorStatsRecorded.TAG
_HEAD = b"\xa2" + _TAG.encode()  # after the array's 1-byte header: the tag, a fixstr of 2
_MAX_SEQ = 1 << 63
_ITEM = {"f": 4, "d": 8}
_NUMPY = {"f": np.dtype("<f4"), "d": np.dtype("<f8")}
_SLOT_BYTES = bytes(range(len(SLOTS)))  # (translate deletes them: what is left is no slot)
_FLAG_BYTES = b"\x00\x01"
# the exact type of each wire element (tag, envelope, then the fields below; the last may be absent)
_TYPES = (str, int, int, int, float, str, tuple, str, bytes, bytes, bytes, bytes, bytes, bytes, bytes)
_TYPES_14 = _TYPES[:14]  # (a record of an older writer: no placeholders)
_GOOD_OPS: set[tuple] = set()  # op lists found to be names without repeats (a few per run, short ones)
# the fields of TensorStatsRecorded after the envelope, in wire order (a test holds them to the class)
_FIELDS = ("kind", "ops", "dtype", "name_ids", "values", "micro_steps", "call_ids", "slots", "vpp_stages",
           "placeholders")


class StatsColumns:
    """One stats record as its columns: the fields of :class:`TensorStatsRecorded` (same names, same
    values as the codec gives; treat them as read-only) plus numpy views of its packed arrays. It has
    passed every check the event's decoding makes, so :meth:`check` finds nothing."""

    __slots__ = ("seq", "rank", "step", "wall", *_FIELDS)
    TAG = _TAG

    def __init__(self, wire: tuple) -> None:
        (_, self.seq, self.rank, self.step, self.wall, self.kind, self.ops, self.dtype, self.name_ids, self.values,
         self.micro_steps, self.call_ids, self.slots, self.vpp_stages) = wire[:14]
        self.placeholders = wire[14] if len(wire) > 14 else b""

    def __len__(self) -> int:
        return len(self.name_ids) // 4

    def __repr__(self) -> str:
        return f"<StatsColumns rank={self.rank} step={self.step} kind={self.kind!r} rows={len(self)}>"

    def check(self) -> str | None:
        """None: checked when it was decoded (the event's check, for code that takes either)."""
        return None

    def matrix(self) -> np.ndarray:
        """The values as a read-only ``rows x ops`` array of the recorded dtype (no copy)."""
        return np.frombuffer(self.values, _NUMPY[self.dtype]).reshape(len(self), len(self.ops))

    def ids(self) -> np.ndarray:
        """The rows' interned name ids (u32, no copy)."""
        return np.frombuffer(self.name_ids, "<u4")

    def event(self) -> TensorStatsRecorded:
        """The frozen event the codec would have decoded."""
        return TensorStatsRecorded(seq=self.seq, rank=self.rank, step=self.step, wall=self.wall,
                                   **{name: getattr(self, name) for name in _FIELDS})


def decode_columns(payload, version: int = FORMAT_VERSION):
    """A :class:`StatsColumns` for a stats payload of the current layout that checks out, else what
    :func:`trainrec.schema.codec.decode` makes of the payload (an event, or its CorruptRecordError)."""
    if payload[1:4] != _HEAD or version != FORMAT_VERSION or (version, _TAG) in codec.UPGRADES:
        return codec.decode(payload, version)
    try:
        wire = codec.unpack_wire(payload, _TAG)
    except Exception:  # noqa: BLE001 - the codec says what is wrong, in its own words
        return codec.decode(payload, version)
    if _fits(wire):
        return StatsColumns(wire)
    return codec.decode(payload, version)


def _fits(wire) -> bool:
    """Whether ``wire`` is a stats record of the layout this path knows (14 fields, or 15 with
    placeholders), every field of its exact type, consistent as ``TensorStatsRecorded.check`` wants.
    False sends the payload to the codec, which accepts it in another form or says what is wrong."""
    if type(wire) is not tuple:
        return False
    types = tuple(map(type, wire))
    if (types != _TYPES and types != _TYPES_14) or wire[0] != _TAG:
        return False
    _, seq, rank, step, _, _, ops, dtype, ids, values, micro, calls, slots, vpp = wire[:14]
    flags = wire[14] if len(wire) > 14 else b""
    if not (-1 <= seq < _MAX_SEQ and -1 <= rank < MAX_WORLD_SIZE and -1 <= step < MAX_STEP):
        return False
    item = _ITEM.get(dtype)
    n, odd = divmod(len(ids), 4)
    if item is None or odd or len(values) != n * len(ops) * item:
        return False
    try:
        known = ops in _GOOD_OPS
    except TypeError:  # (an op that is a map: the codec says what is wrong)
        return False
    if not known:
        if not all(type(op) is str and op for op in ops) or len(set(ops)) != len(ops):
            return False
        if len(_GOOD_OPS) < 64 and sum(map(len, ops)) <= 1024:  # (bounded: logs are untrusted)
            _GOOD_OPS.add(ops)
    if (micro and len(micro) != 2 * n) or (calls and len(calls) != 4 * n) or (slots and len(slots) != n) \
            or (vpp and len(vpp) != n) or (flags and len(flags) != n):
        return False
    return not ((slots and slots.translate(None, _SLOT_BYTES)) or (flags and flags.translate(None, _FLAG_BYTES)))
