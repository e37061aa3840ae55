"""Reading one log file: frames, then events, surviving torn tails and corruption.

:class:`LogReader` keeps its byte offset between calls: :meth:`LogReader.poll` reads the bytes
appended since the last call and returns the events completed since then, so a live tail is a loop
over ``poll()``. A clean end, an incomplete last frame (pending, not an error) and damage in the
middle (a :class:`~trainrec.replay.problems.Problem`, then resynchronisation) are kept apart, and
reading a file whole or while it grows gives the same events and problems. Every case, and why:
``docs/log-format.md``, "How the reader handles damage".

Never raises on arbitrary bytes after the 16-byte file header (a bad magic raises
:class:`NotALogError`, an unknown version :class:`UnsupportedVersionError`); never holds more than
the frame cap plus one read chunk in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from trainrec.schema import framing
from trainrec.schema.errors import FormatError, NotALogError, UnsupportedVersionError
from trainrec.schema.events import Event, FileClosed, FileOpened, WriterFailed

from .problems import Problem
from .record_stream import RecordStream
from .sequence import SeqGap

_CHUNK = 4 << 20
_HEAD_CHUNK = 64 << 10


class LogReader:
    """Incremental reader of one log file.

    ``poll()`` returns new events as a list; iterating the reader yields them chunk by chunk. Both
    continue where the previous call stopped. A missing file reads as empty (a follower may see it
    before it exists); an unreadable one raises :class:`FormatError` naming the path. ``columnar``: stats
    records come as :class:`~trainrec.replay.stats_columns.StatsColumns` (decoded straight into columns).
    Step records are decoded by :mod:`trainrec.replay.step_records` (the codec's events, built faster).
    """

    def __init__(self, path: str, max_frame: int = framing.MAX_FRAME, chunk_size: int = _CHUNK,
                 columnar: bool = False) -> None:
        self.path = path
        self._records = RecordStream(path, max_frame, columnar)  # (header, close, numbers, names, damage)
        self.max_frame = max_frame
        self.chunk_size = max(4096, chunk_size)
        self.version: int | None = None
        self.flags = 0
        self.events_read = 0
        self.bytes_read = 0  # bytes read from the file, its header included (a step selection reads only some)
        self._stop = None  # where reading stops (read_span), or None: the end of the file
        self._pos = 0  # file offset of self._buf[0]
        self._buf = b""  # bytes read but not consumed yet (an incomplete frame)
        self._need = 0  # bytes still missing from the pending frame, when its header is known
        self._scan_abs = 0  # file offset up to which the pending bytes were searched for a later frame
        self._eof = False  # the last read reached the end of the file as it was then
        self._short_header = 0  # bytes of a file header still being written

    # ------------------------------------------------------------------ state
    @property
    def offset(self) -> int:
        """File offset up to which everything has been consumed."""
        return self._pos

    @property
    def pending_bytes(self) -> int:
        """Bytes after the last complete frame: a torn tail if the writer is gone."""
        return len(self._buf) + self._short_header

    @property
    def header(self) -> FileOpened | None:
        """The file's FileOpened record (its first), once read."""
        return self._records.header

    @property
    def closed_event(self) -> FileClosed | None:
        """The file's FileClosed record, once read."""
        return self._records.closed_event

    @property
    def failure(self) -> WriterFailed | None:
        """The writer's own word that it failed to write, if the file holds it."""
        return self._records.failure

    @property
    def closed_cleanly(self) -> bool:
        return self._records.closed_event is not None

    @property
    def frames(self) -> int:
        """Frames whose header and payload CRCs checked out."""
        return self._records.frames

    @property
    def problems(self) -> list[Problem]:
        """Damage found, in file order (the first MAX_LISTED)."""
        return self._records.damage.problems

    @property
    def unlisted_problems(self) -> int:
        """Problems past the first MAX_LISTED, only counted (gaps: see :attr:`unlisted_gaps`)."""
        return self._records.damage.unlisted_problems

    @property
    def unlisted_skipped(self) -> int:
        """Bytes skipped by the unlisted problems."""
        return self._records.damage.unlisted_skipped

    @property
    def lost_frames(self) -> int:
        """Frames missing according to the sequence numbers (damaged or cut out)."""
        return self._records.sequence.lost

    @property
    def gaps(self) -> list[SeqGap]:
        """Jumps in the sequence numbers (the first MAX_LISTED of them)."""
        return self._records.sequence.gaps

    @property
    def unlisted_gaps(self) -> int:
        return self._records.sequence.unlisted_gaps

    @property
    def unlisted_lost(self) -> int:
        return self._records.sequence.unlisted_lost

    @property
    def duplicates(self) -> int:
        """Frames dropped as duplicates of frames read before."""
        return self._records.sequence.duplicates

    @property
    def at_eof(self) -> bool:
        """The last read reached the end of the file as it was at that moment."""
        return self._eof

    # ------------------------------------------------------------------ reading
    def poll(self, max_bytes: int | None = None) -> list[Event]:
        """Events completed since the last call (possibly none). ``max_bytes``: read about that many
        more bytes of the file at most, or the rest of a longer frame (a follower's backlog in steps of
        bounded memory); :attr:`at_eof` then says whether the call reached the end."""
        out: list[Event] = []
        for batch in self._batches(self.chunk_size, None, max_bytes):
            out.extend(batch)
        return out

    def __iter__(self) -> Iterator[Event]:
        """Iterate every event currently in the file (from where the reader stands), chunk by chunk."""
        for batch in self._batches(self.chunk_size, None, None):
            yield from batch

    def head(self, max_events: int = 4, max_bytes: int = 1 << 20) -> list[Event]:
        """The first events of the file, reading as little as possible (at most about ``max_bytes``)."""
        out: list[Event] = []
        for batch in self._batches(_HEAD_CHUNK, max_events, max_bytes):
            out.extend(batch)
        return out[:max_events]

    def head_while(self, keep_going, max_bytes: int = 64 << 20) -> list[Event]:
        """Events from the start up to and including the first for which ``keep_going(event)`` is
        false, reading the file lazily in small chunks (at most about ``max_bytes``)."""
        out: list[Event] = []
        for batch in self._batches(_HEAD_CHUNK, None, max_bytes):
            for ev in batch:
                out.append(ev)
                if not keep_going(ev):
                    return out
        return out

    def read_span(self, start: int, stop: int, seq: int) -> Iterator[Event]:
        """The events of the frames in bytes ``[start, stop)``, the first numbered ``seq``: where a step
        index says a selection's records are (:mod:`trainrec.replay.stepindex` checks the boundaries)."""
        if self._buf:
            self._records.problem(self._pos, "a step index span ended inside a frame", len(self._buf))
        self._buf, self._need = b"", 0
        self._pos = self._scan_abs = start
        self._records.sequence.restart(seq)
        self._stop = stop
        try:
            for batch in self._batches(self.chunk_size, None, None):
                yield from batch
        finally:
            self._stop = None

    def note(self, what: str) -> None:
        """A problem of the file found outside the frames read (a step index that does not fit it)."""
        self._records.problem(0, what, 0, lost=False)

    def _read(self, size: int) -> bytes | None:
        """Up to ``size`` bytes after what was read so far; None when there is nothing (yet).

        The file is opened for each read and closed at once, so a reader paused in the middle of
        an iteration (e.g. while ranks are merged) holds no file descriptor.
        """
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed right below
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise FormatError(f"cannot read log file ({exc.strerror or exc})", self.path) from None
        with f:
            try:
                if not self._check_header(f):
                    return None
                at = self._pos + len(self._buf)
                if self._stop is not None:
                    size = min(size, self._stop - at)
                    if size <= 0:
                        return None
                f.seek(at)
                return f.read(size) or None
            except OSError as exc:
                raise FormatError(
                    f"cannot read log file ({exc.strerror or exc})", self.path, self._pos + len(self._buf)
                ) from None

    def _batches(self, chunk: int, max_events: int | None, max_bytes: int | None) -> Iterator[list[Event]]:
        got = 0
        read_bytes = 0
        self._eof = False
        while True:
            size = max(chunk, self._need)
            if max_bytes is not None:  # the budget's rest, or the rest of the pending frame if longer
                size = min(size, max(max_bytes - read_bytes, self._need, 4096))
            data = self._read(size)
            if data is None:
                self._eof = True
                return
            self.bytes_read += len(data)
            self._buf = self._buf + data if self._buf else data
            out: list[Event] = []
            self._consume(out)
            if out:
                got += len(out)
                yield out
            read_bytes += len(data)
            if (max_events is not None and got >= max_events) or (max_bytes is not None and read_bytes >= max_bytes):
                return

    def _check_header(self, f) -> bool:
        if self.version is not None:
            return True
        head = f.read(framing.FILE_HEADER_SIZE)
        self._short_header = len(head)
        if len(head) < framing.FILE_HEADER_SIZE:
            if head and not framing.FILE_MAGIC.startswith(head[:8]):
                raise NotALogError("not a trainrec log (bad magic)", self.path, 0)
            return False  # empty or still being created
        parsed = framing.decode_file_header(head)
        if parsed is None:
            raise NotALogError("not a trainrec log (bad magic)", self.path, 0)
        version, flags = parsed
        if version not in framing.SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(
                f"format version {version} is not supported by this trainrec "
                f"(reads {', '.join(map(str, framing.SUPPORTED_VERSIONS))}); upgrade trainrec",
                self.path,
                8,
            )
        self._short_header = 0
        self.version = version
        self.flags = flags
        self.bytes_read += len(head)
        if self._pos < framing.FILE_HEADER_SIZE:  # (read_span may have placed the reader already)
            self._pos = framing.FILE_HEADER_SIZE
            self._scan_abs = self._pos
        if flags & ~framing.KNOWN_FLAGS:
            self._records.problem(12, f"file header flags 0x{flags:08x} set bits this format does not define (a damaged "
                          "header?); the records are read as they are", 0, lost=False)
        return True

    def _consume(self, out: list[Event]) -> None:
        """Decode every complete frame of the buffer into ``out``; keep the incomplete rest."""
        base = self._pos
        pos, retry_from, self._need = self._records.consume(self._buf, base, self._scan_abs,
                                                            self.version or framing.FORMAT_VERSION, out)
        if retry_from is not None:
            self._scan_abs = base + retry_from
        self.events_read += len(out)
        if pos:
            self._buf = self._buf[pos:]
            self._pos = base + pos
            if self._scan_abs < self._pos:
                self._scan_abs = self._pos

def read_log(path: str) -> tuple[LogReader, list[Event]]:
    """Read a whole log file; returns the reader (header, problems, torn bytes) and its events.

    Raises :class:`NotALogError` for a missing file or one that is not a trainrec log.
    """
    r = LogReader(path)
    events = r.poll()
    if r.version is None and not os.path.exists(path):
        raise NotALogError("no such log file", path)
    return r, events


def read_head(path: str, max_events: int = 4, max_bytes: int = 1 << 20) -> tuple[LogReader, list[Event]]:
    """The reader and the first ``max_events`` events of a file, reading only its beginning."""
    r = LogReader(path)
    return r, r.head(max_events, max_bytes)
