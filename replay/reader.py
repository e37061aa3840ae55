"""Reading one log file: frames, then events, surviving torn tails and corruption.

:class:`LogReader` keeps its byte offset between calls. :meth:`LogReader.poll` returns only the
events that became complete since the last call, so a live tail is a loop over ``poll()``. An
incomplete last frame is not an error (the writer may still be writing); a corrupt frame in the
middle is recorded in :attr:`LogReader.problems` (path, offset, what, bytes skipped) and reading goes
on at the next valid frame. The reader never raises on arbitrary bytes after the file header and
never buffers more than the frame cap plus one read chunk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainrec.schema import codec, framing
from trainrec.schema.errors import CorruptRecordError, NotALogError, UnsupportedVersionError
from trainrec.schema.events import Event, FileClosed, FileOpened

log = logging.getLogger(__name__)

_CHUNK = 4 << 20


@dataclass(frozen=True)
class Problem:
    """Damage found in a log file."""

    path: str
    offset: int
    what: str
    skipped: int  # bytes skipped past the damage

    def __str__(self) -> str:
        return f"{self.path} at byte {self.offset}: {self.what} ({self.skipped} bytes skipped)"


class LogReader:
    """Incremental reader of one log file."""

    def __init__(self, path: str, max_frame: int = framing.MAX_FRAME) -> None:
        self.path = path
        self.max_frame = max_frame
        self.version: int | None = None
        self.header: FileOpened | None = None
        self.closed_event: FileClosed | None = None
        self.problems: list[Problem] = []
        self.frames = 0
        self._pos = 0  # file offset of self._buf[0]
        self._buf = bytearray()
        self._eof_offset = 0

    # ------------------------------------------------------------------ state
    @property
    def offset(self) -> int:
        """File offset up to which everything has been consumed."""
        return self._pos

    @property
    def pending_bytes(self) -> int:
        """Bytes after the last complete frame: a torn tail if the writer is gone."""
        return len(self._buf)

    @property
    def closed_cleanly(self) -> bool:
        return self.closed_event is not None

    # ------------------------------------------------------------------ reading
    def _read_more(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos + len(self._buf))
                chunk = f.read(_CHUNK)
        except FileNotFoundError:
            return False
        if not chunk:
            return False
        self._buf += chunk
        return True

    def _check_header(self) -> bool:
        if self.version is not None:
            return True
        while len(self._buf) < framing.FILE_HEADER_SIZE:
            if not self._read_more():
                if self._buf and not framing.FILE_MAGIC.startswith(bytes(self._buf[:8])):
                    raise NotALogError("not a trainrec log (bad magic)", self.path, 0)
                return False
        parsed = framing.decode_file_header(bytes(self._buf[: framing.FILE_HEADER_SIZE]))
        if parsed is None:
            raise NotALogError("not a trainrec log (bad magic)", self.path, 0)
        version, _flags = parsed
        if version not in framing.SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(
                f"format version {version} is not supported by this trainrec "
                f"(reads {', '.join(map(str, framing.SUPPORTED_VERSIONS))}); upgrade trainrec",
                self.path,
                8,
            )
        self.version = version
        del self._buf[: framing.FILE_HEADER_SIZE]
        self._pos = framing.FILE_HEADER_SIZE
        return True

    def poll(self) -> list[Event]:
        """Events completed since the last call (possibly none)."""
        if not self._check_header():
            return []
        out: list[Event] = []
        while True:
            self._consume(out)
            if not self._read_more():
                break
        return out

    def __iter__(self):
        """Iterate every event currently in the file, reading in chunks."""
        if not self._check_header():
            return
        while True:
            out: list[Event] = []
            self._consume(out)
            yield from out
            if not self._read_more():
                return

    def _consume(self, out: list[Event]) -> None:
        buf = self._buf
        pos = 0
        n = len(buf)
        read_frame = framing.read_frame
        max_frame = self.max_frame
        version = self.version or framing.FORMAT_VERSION
        while pos < n:
            status, payload, nxt = read_frame(buf, pos, max_frame)
            if status is framing.Frame.OK:
                self.frames += 1
                try:
                    ev = codec.decode(payload, version)
                except CorruptRecordError as exc:
                    self._problem(pos, f"undecodable record: {exc}", nxt - pos)
                else:
                    self._note(ev)
                    out.append(ev)
                pos = nxt
            elif status is framing.Frame.INCOMPLETE:
                break
            elif status is framing.Frame.BAD_PAYLOAD:
                self._problem(pos, "payload CRC mismatch", nxt - pos)
                pos = nxt
            else:
                if n - pos < framing.FRAME_HEADER_SIZE:
                    break  # a few trailing bytes: a header may still be being written
                nxt = framing.resync(buf, pos, max_frame)
                what = "frame length above the cap" if status is framing.Frame.TOO_LARGE else "bad frame header"
                self._problem(pos, what, nxt - pos)
                pos = nxt
        if pos:
            del buf[:pos]
            self._pos += pos

    def _problem(self, pos: int, what: str, skipped: int) -> None:
        p = Problem(self.path, self._pos + pos, what, skipped)
        self.problems.append(p)
        log.warning("trainrec: %s", p)

    def _note(self, ev: Event) -> None:
        if isinstance(ev, FileOpened) and self.header is None:
            self.header = ev
        elif isinstance(ev, FileClosed):
            self.closed_event = ev


def read_log(path: str) -> tuple[LogReader, list[Event]]:
    """Read a whole log file; returns the reader (header, problems, torn bytes) and its events."""
    r = LogReader(path)
    return r, r.poll()
