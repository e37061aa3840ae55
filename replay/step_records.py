"""The step records (StepBegan, StepEnded) decoded without the codec's generic walk, for the reader.

A third of a run's frames are these small records, and the codec's generic path (tag peek, the
per-field type table, the keyword dict, the event's check) costs several times msgpack's own unpack of
them. :func:`decode_record` (and :func:`decode_record_columnar`, which also sends stats records to
:func:`~trainrec.replay.stats_columns.decode_columns`) unpacks a step record of exactly the writer's
layout under the codec's limits, checks what the codec checks (exact field types, envelope bounds,
``StepEnded.check``) and builds the same frozen event. Anything else (another record, an older or
newer layout, a field of another type the codec would still accept, anything wrong) goes to
:func:`trainrec.schema.codec.decode`: errors, upgrades and defaults stay the codec's, word for word.
"""

from __future__ import annotations

import dataclasses

import msgpack
from trainrec.schema import codec
from trainrec.schema.events import MAX_MICRO_STEPS, MAX_STEP, MAX_WORLD_SIZE, StepBegan, StepEnded
from trainrec.schema.framing import FORMAT_VERSION, MAX_FRAME

from .stats_columns import decode_columns

__all__ = ["decode_record", "decode_record_columnar"]

_MAX_SEQ = 1 << 63
_BEGAN = b"\x95\xa2" + StepBegan.TAG.encode()  # a fixarray of 5: the tag and the envelope
_ENDED = b"\x9a\xa2" + StepEnded.TAG.encode()  # a fixarray of 10: the tag, the envelope, 5 fields
_STATS = b"\xa2ts"  # (after the array's header: stats_columns checks the rest)
_BEGAN_TYPES = (str, int, int, int, float)
_ENDED_TYPES = (str, int, int, int, float, float, bool, int, bool, bool)
# the fields of StepEnded after the envelope, in wire order (a test holds them to the class)
ENDED_FIELDS = ("duration", "collected", "micro_steps", "optimizer_skipped", "foreign_passes")
_SMALL = 64  # longest payload taken here: a step record of this layout is at most 60 bytes
_unpackb = msgpack.unpackb
_LIMITS = dict(raw=False, use_list=False, strict_map_key=False, max_bin_len=MAX_FRAME, max_str_len=codec.MAX_STR,
               max_array_len=codec.MAX_VALUES["se"], max_map_len=codec.MAX_VALUES["se"], max_ext_len=1024)
# The events are built by setting their slots, as their __init__ would (without its keyword parsing):
# only while the classes hold exactly these fields (a field appended later sends them to the codec).
_ENVELOPE = ("seq", "rank", "step", "wall")
_FAST = (tuple(f.name for f in dataclasses.fields(StepBegan)) == _ENVELOPE
         and tuple(f.name for f in dataclasses.fields(StepEnded)) == (*_ENVELOPE, *ENDED_FIELDS))
_new = object.__new__
_seq, _rank, _step, _wall = (getattr(StepBegan, name).__set__ for name in _ENVELOPE)
_duration, _collected, _micro, _skipped, _foreign = (getattr(StepEnded, name).__set__ for name in ENDED_FIELDS)


def decode_record(payload, version: int = FORMAT_VERSION):
    """What :func:`trainrec.schema.codec.decode` makes of ``payload`` (the same event, or its
    CorruptRecordError), step records of the writer's layout without the codec's generic walk."""
    head = payload[:4]
    if head == _BEGAN or head == _ENDED:
        ev = _step_record(payload, head, version)
        if ev is not None:
            return ev
    return codec.decode(payload, version)


def decode_record_columnar(payload, version: int = FORMAT_VERSION):
    """:func:`decode_record`, stats records as :func:`~trainrec.replay.stats_columns.decode_columns` makes them."""
    head = payload[:4]
    if head[1:] == _STATS:
        return decode_columns(payload, version)
    if head == _BEGAN or head == _ENDED:
        ev = _step_record(payload, head, version)
        if ev is not None:
            return ev
    return codec.decode(payload, version)


def _step_record(payload, head, version: int):
    """The step record of ``payload`` when it is of the writer's layout and checks out, else None."""
    if len(payload) > _SMALL or version != FORMAT_VERSION or not _FAST:
        return None
    upgrades = codec.UPGRADES  # (a record the codec upgrades is the codec's)
    if upgrades and ((version, StepBegan.TAG) in upgrades or (version, StepEnded.TAG) in upgrades):
        return None
    try:
        wire = _unpackb(payload, **_LIMITS)
    except Exception:  # noqa: BLE001 - the codec says what is wrong, in its own words
        return None
    types = tuple(map(type, wire))
    began = head == _BEGAN
    if types != (_BEGAN_TYPES if began else _ENDED_TYPES):
        return None
    _, seq, rank, step, wall = wire[:5]
    if not (-1 <= seq < _MAX_SEQ and -1 <= rank < MAX_WORLD_SIZE and -1 <= step < MAX_STEP):
        return None
    if began:
        ev = _new(StepBegan)
    elif not 0 <= wire[7] <= MAX_MICRO_STEPS:  # (StepEnded.check)
        return None
    else:
        ev = _new(StepEnded)
        _duration(ev, wire[5])
        _collected(ev, wire[6])
        _micro(ev, wire[7])
        _skipped(ev, wire[8])
        _foreign(ev, wire[9])
    _seq(ev, seq)
    _rank(ev, rank)
    _step(ev, step)
    _wall(ev, wall)
    return ev
