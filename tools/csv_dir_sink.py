"""CSV window files of one rank's export: :class:`CsvDirSink` writes the CSV projection into one
directory (``{kind}_{start}-{end}.csv``); a window file is created (truncated) the first time this
export touches it and appended to afterwards, so an export never mixes with an older one. A live
export adopts the window files an earlier one left and trims them back on a resume.
"""

from __future__ import annotations

import bisect
import io
import os
import re
from array import array
from collections.abc import Iterable

from trainrec.analyzers.export_csv import ops_from_header
from trainrec.schema import layout

__all__ = ["CsvDirSink"]


class CsvDirSink:
    """CSV window files of one rank in ``directory`` (see the module docstring).

    It keeps three integers per window file (start, end, last step written), so a live export's
    bookkeeping grows by no more than that per file however long training runs."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        layout.make_dirs(directory)
        # kind -> (starts, ends, last step written), ordered by start
        self._written: dict[str, tuple[array, array, array]] = {}
        self._open: dict[str, tuple[int, io.BufferedWriter, int]] = {}  # kind -> (start, file, window index)

    def path(self, kind: str, start: int, end: int) -> str:
        return os.path.join(self.directory, f"{kind}_{start}-{end}.csv")

    @property
    def kinds(self) -> list[str]:
        """The file prefixes this sink has window files of."""
        return sorted(k for k, (starts, _, _) in self._written.items() if starts)

    def adopt(self, step_count_per_record: int, kinds: Iterable[str]) -> None:
        """Take the window files of ``step_count_per_record`` steps with these prefixes already in the
        directory as this sink's own, before it writes anything (a live export going on where an earlier
        one ended): rows go on being appended to them, and a rewind trims or removes them. Their last
        steps are read when a rewind needs them."""
        spcr = step_count_per_record
        kinds = set(kinds)
        found: dict[str, list[tuple[int, int]]] = {}
        with os.scandir(self.directory) as it:
            for e in it:
                m = _WINDOW_FILE.match(e.name)
                if m is not None and m.group(1) in kinds:
                    start, end = int(m.group(2)), int(m.group(3))
                    if start % spcr == 0 and end == start + spcr - 1:
                        found.setdefault(m.group(1), []).append((start, end))
        for kind, windows in found.items():
            windows.sort()
            self._written[kind] = (array("q", [s for s, _ in windows]), array("q", [e for _, e in windows]),
                                   array("q", [_UNREAD]) * len(windows))

    def existing_ops(self, kind: str, start: int) -> tuple[str, ...] | None:
        """The ops in the header of window file ``(kind, start)`` where this sink has it (adopted, or
        written by it), else None."""
        written = self._written.get(kind)
        if written is None:
            return None
        starts, ends, _ = written
        i = bisect.bisect_left(starts, start)
        if i == len(starts) or starts[i] != start:
            return None
        try:
            with open(self.path(kind, start, ends[i]), encoding="utf-8", newline="") as f:
                return ops_from_header(f.readline())
        except (OSError, ValueError):
            return None

    def append(self, kind: str, start: int, end: int, header: str, text: bytes, step: int) -> None:
        cur = self._open.get(kind)
        if cur is not None and cur[0] != start:
            cur[1].close()
            del self._open[kind]
            cur = None
        if cur is None:
            if kind not in self._written:
                self._written[kind] = (array("q"), array("q"), array("q"))
            starts, ends, lasts = self._written[kind]
            i = bisect.bisect_left(starts, start)
            if i < len(starts) and starts[i] == start:
                f = open(self.path(kind, start, ends[i]), "ab", buffering=1 << 20)  # noqa: SIM115
            else:
                f = open(self.path(kind, start, end), "wb", buffering=1 << 20,  # noqa: SIM115 - kept open across steps
                         opener=layout.private_opener)
                f.write(header.encode("utf-8") + b"\n")
                starts.insert(i, start)
                ends.insert(i, end)
                lasts.insert(i, step)
            self._open[kind] = cur = (start, f, i)
        cur[1].write(text)
        lasts = self._written[kind][2]
        if step > lasts[cur[2]]:
            lasts[cur[2]] = step

    def rewind(self, step: int) -> list[tuple[str, int]]:
        """Drop the rows of steps >= ``step`` from the files this sink wrote; ``(kind, start)`` of the
        window files removed (a window left without rows goes too: its header may name other ops than
        the rows the resumed run writes there, and the offline export has no such file)."""
        self.flush_close()
        removed: list[tuple[str, int]] = []
        for kind, (starts, ends, lasts) in self._written.items():
            # windows do not overlap: those that begin at step or later go, the one before may hold it
            i = bisect.bisect_left(starts, step)
            if i and ends[i - 1] >= step and (lasts[i - 1] >= step or lasts[i - 1] == _UNREAD):
                lasts[i - 1] = _trim_csv(self.path(kind, starts[i - 1], ends[i - 1]), step)
            if i and lasts[i - 1] == -1:
                i -= 1
            for j in range(i, len(starts)):
                removed.append((kind, starts[j]))
                try:
                    os.remove(self.path(kind, starts[j], ends[j]))
                except FileNotFoundError:
                    pass  # removed by hand, or by an export of another launch following this directory
            del starts[i:], ends[i:], lasts[i:]
        return removed

    def flush(self) -> None:
        for _, f, _ in self._open.values():
            f.flush()

    def flush_close(self) -> None:
        for _, f, _ in self._open.values():
            f.close()
        self._open.clear()

    close = flush_close

    @property
    def files(self) -> list[str]:
        return sorted(self.path(kind, s, e) for kind, (starts, ends, _) in self._written.items()
                      for s, e in zip(starts, ends, strict=True))


_WINDOW_FILE = re.compile(r"^(.+)_(\d+)-(\d+)\.csv$")
_UNREAD = -2  # the last step of an adopted window file, not read yet


def _trim_csv(path: str, step: int) -> int:
    """Keep the header and the rows of steps < ``step`` in a window file; the last step kept (-1: none).
    The file is rewritten only where a row goes."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except FileNotFoundError:
        return -1
    rows = _csv_rows(text)
    kept = [r for r, s in rows if s is None or s < step]
    last = max((s for _, s in rows if s is not None and s < step), default=-1)
    if len(kept) < len(rows):
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.writelines(kept)
    return last


# a window file's row: vpp_stage, the name (quoted, as pandas quotes, where it holds a comma, a quote or a
# line break), the step, the values
_CSV_ROW = re.compile(r'[^,\n]*,(?:"(?:[^"]|"")*"|[^,"\n]*),([^,\n]*)[^\n]*\n?')


def _csv_rows(text: str) -> list[tuple[str, int | None]]:
    """The lines of a window file with their steps (None: the header, or a line without one); a row
    whose quoted name holds a line break is one line (``str.splitlines`` would cut it there)."""
    n = len(text)
    nl = text.find("\n")
    i = n if nl < 0 else nl + 1
    out: list[tuple[str, int | None]] = [(text[:i], None)]
    while i < n:
        m = _CSV_ROW.match(text, i)
        if m is None:  # not a row: the line as it is
            end = text.find("\n", i)
            end = n if end < 0 else end + 1
            out.append((text[i:end], None))
            i = end
            continue
        try:
            step: int | None = int(m.group(1))
        except ValueError:
            step = None
        out.append((m.group(0), step))
        i = m.end()
    return out
