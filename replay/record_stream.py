"""The records of one log file's frames, in file order (what :class:`~trainrec.replay.reader.LogReader`
makes of the bytes it reads): each frame checked whole, decoded, numbered, and accounted for.

:class:`RecordStream` owns what the records say about their file: its header (FileOpened), its close
(FileClosed), the writer's failure, the sequence numbers (:mod:`trainrec.replay.sequence`), the name ids
interned (:mod:`trainrec.replay.name_ranges`) and the damage found (:mod:`trainrec.replay.problems`).
A frame that does not check out whole stops the loop; :func:`~trainrec.replay.frame_search.damaged_frame`
says what is wrong with it. Stats records of a layout decoded before come from
:mod:`trainrec.replay.stats_templates`, frames in order are numbered in bulk (``Sequence.took``).
"""

from __future__ import annotations

import struct
import zlib

from trainrec.schema import framing
from trainrec.schema.events import (
    Event,
    FileClosed,
    FileOpened,
    HooksFired,
    NamesInterned,
    NamesRepeated,
    StepBegan,
    StepEnded,
    TensorStatsRecorded,
    WriterFailed,
)

from .frame_search import damaged_frame
from .name_ranges import NameRanges
from .problems import MAX_LISTED, ProblemLog
from .sequence import DUPLICATE, Sequence
from .stats_columns import StatsColumns
from .stats_templates import StatsTemplates
from .step_records import decode_record, decode_record_columnar

__all__ = ["RecordStream"]

_HDR = struct.Struct("<IIII")
_HDR_SIZE = framing.FRAME_HEADER_SIZE
_MAGIC = framing.FRAME_MAGIC
_crc32 = zlib.crc32
_AFTER_CLOSE = "records after the FileClosed record, ignored (a file ends at its close)"
_DUPLICATE = ("duplicate frame(s) dropped: records this file holds already, again (a block written twice, "
              "as by a copy tool that retried it)")
_NAMED = frozenset((NamesInterned, TensorStatsRecorded, HooksFired, StatsColumns))  # records using name ids
_STATS = frozenset((TensorStatsRecorded, StatsColumns))
_PLAIN = frozenset((StepBegan, StepEnded))  # records the reader keeps no account of


class RecordStream:
    """The records of one file's frames, fed buffer by buffer (:meth:`consume`); ``columnar``: stats
    records as :class:`~trainrec.replay.stats_columns.StatsColumns`."""

    def __init__(self, path: str, max_frame: int, columnar: bool) -> None:
        self.path = path
        self.max_frame = max_frame
        self._decode = decode_record_columnar if columnar else decode_record
        self._templates = StatsTemplates() if columnar else None  # (layouts of stats records decoded before)
        self.header: FileOpened | None = None
        self.closed_event: FileClosed | None = None
        self.failure: WriterFailed | None = None  # the writer's own word that it failed to write
        self.damage = ProblemLog(path)
        self.sequence = Sequence(path, MAX_LISTED)
        self.frames = 0  # frames whose header and payload CRCs checked out
        self._names = NameRanges()
        self._lost = False  # a frame of this file could not be read: later unknown name ids follow from it
        self._rank_reported = False

    def consume(self, buf: bytes, base: int, scan_from: int, version: int,
                out: list[Event]) -> tuple[int, int | None, int]:
        """Decode every complete frame of ``buf`` (at file offset ``base``) into ``out``. Returns ``(pos,
        retry_from, need)``: where the incomplete rest of ``buf`` starts, and for a frame that may still
        be being written where the search for a later frame starts again (None: as before; ``scan_from``
        is where it stopped) and how many of its bytes are missing."""
        n = len(buf)
        pos = 0
        with memoryview(buf) as mv:
            while True:
                pos = self._frames(buf, mv, pos, base, version, out)
                if n - pos < _HDR_SIZE:
                    return pos, None, 0
                what, nxt, retry_from, need = damaged_frame(buf, pos, self.max_frame, scan_from - base)
                if what is None:  # (wait for more bytes: the writer may still be writing)
                    return pos, retry_from, need
                self.problem(base + pos, what, nxt - pos)
                pos = nxt

    def _frames(self, buf: bytes, mv: memoryview, pos: int, base: int, version: int, out: list[Event]) -> int:
        """Decode the frames from ``pos`` on into ``out`` up to the first that does not check out whole
        (damaged, or not all there yet), or the end; returns where that one starts."""
        n = len(buf)
        max_frame = self.max_frame
        unpack = _HDR.unpack_from
        crc = _crc32
        decode = self._decode
        templates = self._templates
        match = None if templates is None else templates.match
        known_ids = self._names.known_ids
        sequence = self.sequence
        first = due = sequence.due()
        in_order: list[int] = []  # payload CRCs of the frames numbered from ``first`` on, in order
        taken = in_order.append
        append = out.append
        h = self.header
        own_rank = None if h is None or self._rank_reported else h.rank
        closed = self.closed_event is not None
        frames = 0
        try:
            while n - pos >= _HDR_SIZE:
                magic, length, pcrc, hcrc = unpack(buf, pos)
                start = pos + _HDR_SIZE
                stop = start + length
                if (magic != _MAGIC or length > max_frame or stop > n or crc(mv[pos : pos + 12]) != hcrc
                        or crc(mv[start:stop]) != pcrc):
                    break
                frames += 1
                ev = None if match is None else match(buf, start, stop, version)
                if ev is None:
                    payload = mv[start:stop]
                    try:
                        ev = decode(payload, version)
                    except Exception as exc:  # noqa: BLE001 - untrusted input: any decode failure is damage
                        self.problem(base + pos, f"undecodable record: {exc}", stop - pos)
                        pos = stop
                        continue
                    if templates is not None and type(ev) is StatsColumns:
                        templates.learn(payload, ev)
                if closed:
                    # the writer writes nothing after FileClosed: frames there (a log appended to
                    # again, e.g. concatenated with a copy) would replay twice; one region of damage
                    self.problem(base + pos, _AFTER_CLOSE, stop - pos)
                    pos = stop
                    continue
                if ev.seq == due:  # (in order, as nearly every frame is: taken in bulk)
                    due += 1
                    taken(pcrc)
                else:
                    sequence.took(first, in_order)
                    in_order.clear()
                    verdict = sequence.check(ev.seq, pcrc, base + pos)
                    first = due = sequence.due()
                    if verdict is not None:
                        if verdict is DUPLICATE:
                            self.problem(base + pos, _DUPLICATE, stop - pos, lost=False)
                            pos = stop
                            continue
                        if verdict.lost:
                            self._lost = True
                if own_rank is not None and ev.rank != own_rank:
                    # (kept, as an unknown name id: merged with the others under the rank it names)
                    self._rank_reported = True
                    own_rank = None
                    self.problem(base + pos, f"inconsistent record: rank {ev.rank} in the log of rank {h.rank} "
                                  "(later ones of this file are not reported)", 0)
                t = type(ev)
                if t in _PLAIN or (t in _STATS and ev.name_ids in known_ids):  # (as nearly every record)
                    pass  # (a column of ids all interned before: nothing to check, see NameRanges)
                elif t is FileOpened:
                    if h is None:
                        self.header = h = ev
                        own_rank = None if self._rank_reported else h.rank
                elif t is FileClosed:
                    self.closed_event = ev
                    closed = True
                    sequence.took(first, in_order)
                    in_order.clear()
                    sequence.forget()  # (nothing follows)
                elif t is WriterFailed:
                    self.failure = ev
                elif t is NamesRepeated:
                    out.extend(self._names.repeated_names(ev))
                    pos = stop
                    continue
                elif t in _NAMED:
                    what = self._names.names_problem(ev, self._lost)
                    if what is not None:
                        self.problem(base + pos, f"inconsistent record: {what}", 0)
                append(ev)
                pos = stop
        finally:
            sequence.took(first, in_order)
            self.frames += frames
        return pos

    def problem(self, offset: int, what: str, skipped: int, lost: bool = True) -> None:
        """Record damage; ``lost``: its skipped bytes held records of the file (not a duplicate's)."""
        if self.damage.add(offset, what, skipped) and skipped and lost:
            self._lost = True
