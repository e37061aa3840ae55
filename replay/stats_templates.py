"""Stats records of a layout read before, decoded from the bytes that vary (for the columnar reader).

A run's stats records repeat one layout per (rank, kind) step after step: the same rank, kind, ops,
dtype, name ids and flag columns, the same lengths; only the sequence number, the step, the wall time
and the values change. :class:`StatsTemplates` keeps the constant bytes of payloads that the full path
(:func:`~trainrec.replay.stats_columns.decode_columns`) made into a
:class:`~trainrec.replay.stats_columns.StatsColumns`. A later payload of the same length whose constant
bytes are those byte for byte, and whose varying fields have the same msgpack types, is that record
with its own seq, step, wall and values: what msgpack and the checks would make of it (the same
structure, the same lengths, fields of the same types and in range), without either. Anything else is
left to the full path (``match`` returns None).
"""

from __future__ import annotations

import struct

import msgpack
from trainrec.schema import codec
from trainrec.schema.framing import FORMAT_VERSION

from .stats_columns import StatsColumns

__all__ = ["StatsTemplates"]

_TAG = StatsColumns.TAG
# msgpack classes of a non-negative int the writer writes (smallest encoding): type byte -> data bytes;
# 0 stands for a positive fixint (the value is the type byte); all are below every cap (seq 2**63, step 2**53)
_UINT_WIDTH = {0: 0, 0xCC: 1, 0xCD: 2, 0xCE: 4}
_FLOAT64 = 0xCB
_double = struct.Struct(">d").unpack_from
_MAX_TEMPLATES = 64  # per reader (a few per kind over a file's life); past it the set starts again
_MAX_PER_LENGTH = 4
_MAX_CONSTANT = 1 << 16  # constant bytes kept per template at most (logs are untrusted)


def _packb(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _uint_class(encoded: bytes) -> int | None:
    b = encoded[0]
    if b < 0x80:
        return 0
    return b if b in _UINT_WIDTH and len(encoded) == 1 + _UINT_WIDTH[b] else None


class _Template:
    """The constant bytes of one layout and where its varying fields sit (offsets in the payload)."""

    __slots__ = ("lead", "seq_class", "rank_at", "rank_bytes", "step_at", "step_class", "wall_at", "middle",
                 "values_at", "values_end", "tail", "rank", "fields", "extra")

    def __init__(self, lead: bytes, seq_class: int, rank_bytes: bytes, step_class: int, middle: bytes,
                 values_len: int, tail: bytes, cols: StatsColumns, extra: bool) -> None:
        self.lead = lead
        self.seq_class = seq_class
        self.rank_at = len(lead) + 1 + _UINT_WIDTH[seq_class]
        self.rank_bytes = rank_bytes
        self.step_at = self.rank_at + len(rank_bytes)
        self.step_class = step_class
        self.wall_at = self.step_at + 1 + _UINT_WIDTH[step_class]
        self.middle = middle
        self.values_at = self.wall_at + 9 + len(middle)
        self.values_end = self.values_at + values_len
        self.tail = tail
        self.rank = cols.rank
        self.fields = (cols.kind, cols.ops, cols.dtype, cols.name_ids)
        self.extra = (cols.micro_steps, cols.call_ids, cols.slots, cols.vpp_stages) + ((cols.placeholders,) if extra else ())


class StatsTemplates:
    """The layouts of the stats records one reader has decoded in full (bounded in number and size)."""

    def __init__(self) -> None:
        self._by_length: dict[int, list[_Template]] = {}
        self._count = 0

    def learn(self, payload, cols: StatsColumns) -> None:
        """Keep the layout of ``payload``, which the full path decoded into ``cols``, when it is the
        writer's own encoding of those fields (else nothing: such payloads stay on the full path)."""
        length = len(payload)
        same = self._by_length.get(length, [])
        if len(same) >= _MAX_PER_LENGTH or length > _MAX_CONSTANT + len(cols.values):
            return
        payload = bytes(payload)
        extra = payload[0] == 0x9F  # (15 fields: placeholders; 0x9E: 14, an older writer's)
        lead = payload[:4]
        try:
            seq, rank, step, wall = _packb(cols.seq), _packb(cols.rank), _packb(cols.step), _packb(cols.wall)
            middle = b"".join(map(_packb, (cols.kind, cols.ops, cols.dtype, cols.name_ids)))
            values = _packb(cols.values)
            tail = b"".join(map(_packb, (cols.micro_steps, cols.call_ids, cols.slots, cols.vpp_stages)
                                + ((cols.placeholders,) if extra else ())))
        except Exception:  # noqa: BLE001 - fields msgpack does not take back: no template, nothing else
            return
        seq_class, step_class = _uint_class(seq), _uint_class(step)
        if seq_class is None or step_class is None or wall[0] != _FLOAT64 or len(wall) != 9:
            return
        middle += values[: len(values) - len(cols.values)]  # (the values' bin header)
        if lead + seq + rank + step + wall + middle + cols.values + tail != payload:
            return  # (not the canonical encoding: the offsets would not hold)
        if self._count >= _MAX_TEMPLATES:
            self._by_length.clear()
            self._count = 0
            same = []
        same.append(_Template(lead, seq_class, rank, step_class, middle, len(cols.values), tail, cols, extra))
        self._by_length[length] = same
        self._count += 1

    def match(self, buf: bytes, start: int, stop: int, version: int) -> StatsColumns | None:
        """The record of the payload ``buf[start:stop]`` when it has a known layout, else None."""
        same = self._by_length.get(stop - start)
        if same is None or version != FORMAT_VERSION or (codec.UPGRADES and (version, _TAG) in codec.UPGRADES):
            return None
        for t in same:
            if not buf.startswith(t.lead, start):
                continue
            seq = _uint(buf, start + len(t.lead), t.seq_class)
            if seq is None or not buf.startswith(t.rank_bytes, start + t.rank_at):
                continue
            step = _uint(buf, start + t.step_at, t.step_class)
            at = start + t.wall_at
            if step is None or buf[at] != _FLOAT64 or not buf.startswith(t.middle, at + 9) \
                    or not buf.startswith(t.tail, start + t.values_end):
                continue
            return StatsColumns((_TAG, seq, t.rank, step, _double(buf, at + 1)[0], *t.fields,
                                 buf[start + t.values_at : start + t.values_end], *t.extra))
        return None


def _uint(buf: bytes, i: int, cls: int) -> int | None:
    """The int at ``buf[i]`` when its type byte is of class ``cls`` (see _UINT_WIDTH), else None."""
    b = buf[i]
    if cls == 0:
        return b if b < 0x80 else None
    if b != cls:
        return None
    if cls == 0xCD:
        return buf[i + 1] << 8 | buf[i + 2]
    if cls == 0xCC:
        return buf[i + 1]
    return int.from_bytes(buf[i + 1 : i + 5], "big")
