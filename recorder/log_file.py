"""The log file itself: created exclusively as the next of its rank directory, written with as few
system calls as possible (partial writes resumed), told apart by its device and inode."""

from __future__ import annotations

import os
from typing import BinaryIO

from trainrec.schema import layout
from trainrec.schema.errors import WriterError


def write_all(f: BinaryIO, data: bytes | memoryview) -> None:
    """Write all of ``data`` to an unbuffered file (raw writes may be partial)."""
    view = memoryview(data)
    while view:
        n = f.write(view)
        if n is None:  # pragma: no cover - only for non-blocking files
            raise OSError("non-blocking write would block")
        view = view[n:]


def _iov_max() -> int:
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 16  # the POSIX minimum
    return 1024 if value <= 0 else min(value, 1024)


_IOV_MAX = _iov_max()


def writev_all(fd: int, parts: list[bytes]) -> None:
    """Write ``parts`` in order with as few system calls as possible (scatter-gather, partial writes resumed)."""
    if not hasattr(os, "writev"):  # pragma: no cover - not POSIX
        data = memoryview(b"".join(parts))
        while data:
            data = data[os.write(fd, data) :]
        return
    i = 0
    n = len(parts)
    while i < n:
        batch = parts[i : i + _IOV_MAX]
        written = os.writev(fd, batch)
        if written == sum(map(len, batch)):
            i += len(batch)
            continue
        for part in batch:  # a partial write: resume inside the first part not fully written
            if written >= len(part):
                written -= len(part)
                i += 1
            else:
                parts[i] = memoryview(part)[written:]
                break


def create_log_file(rank_dir: str) -> tuple[str, BinaryIO, int]:
    """Create the next log file of ``rank_dir`` exclusively; returns (path, unbuffered binary file, index)."""
    layout.make_dirs(rank_dir)
    for _ in range(1000):
        existing = layout.list_logs(rank_dir)
        last = layout.log_index(os.path.basename(existing[-1])) if existing else None
        index = 0 if last is None else last + 1
        path = os.path.join(rank_dir, layout.log_file_name(index))
        try:
            return path, open(path, "xb", buffering=0, opener=layout.private_opener), index  # noqa: SIM115 - owned by the writer
        except FileExistsError:
            continue
    raise WriterError(f"{rank_dir}: could not create a new log file (too many concurrent creators)")


def file_identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def close_quietly(f: BinaryIO) -> None:
    try:
        f.close()
    except OSError:
        pass
