"""Test helper: a closed log's step index rewritten (cleared, as an older writer's file; or made hostile).

The FileClosed frame that ends a log is decoded, its ``index_*`` fields replaced, encoded and framed
again at the same place: the rest of the file is byte for byte what the LogWriter wrote.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct

from logbuild import frame_spans
from trainrec.schema import codec, framing
from trainrec.schema.events import FileClosed

NO_INDEX = {"index_steps": b"", "index_offsets": b"", "index_seqs": b"", "index_low_steps": b"", "index_names": b""}


def closed_record(path: str) -> tuple[int, FileClosed]:
    """``(offset, record)`` of the FileClosed frame that ends an undamaged log."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        start, end = frame_spans(data)[-1]
    except struct.error:  # (a torn tail)
        raise ValueError(f"{path} ends in an incomplete frame") from None
    ev = codec.decode(data[start + framing.FRAME_HEADER_SIZE : end])
    if not isinstance(ev, FileClosed) or end != len(data):
        raise ValueError(f"{path} does not end with a FileClosed frame")
    return start, ev


def rewrite_index(path: str, **fields) -> None:
    """Replace index fields of the file's FileClosed (in place)."""
    start, ev = closed_record(path)
    frame = framing.encode_frame(codec.encode(dataclasses.replace(ev, **fields)))
    with open(path, "r+b") as f:
        f.truncate(start)
        f.seek(start)
        f.write(frame)


def copy_run(src: str, dst: str, **fields) -> str:
    """A copy of the run directory ``src`` at ``dst`` whose every cleanly closed log has ``fields``
    (default: no index at all, as an older writer's logs)."""
    shutil.copytree(src, dst)
    for root, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".trl"):
                try:
                    rewrite_index(os.path.join(root, name), **(fields or NO_INDEX))
                except ValueError:
                    pass  # (not closed cleanly: it has no index to change)
    return dst
