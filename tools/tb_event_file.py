"""TensorBoard event files as the exports write them: TFRecord-framed events (little-endian length,
masked CRC32C) in ``events.out.tfevents.{time}.{host}[.{suffix}]``, starting with the file version
event, as tensorboardX does. CRC32C comes from the ``crc32c`` package (tensorboardX's own
accelerator) with a pure-Python fallback.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from trainrec.analyzers.tb_encode import FILE_VERSION, event_bytes
from trainrec.schema import layout

log = logging.getLogger(__name__)

__all__ = ["TbEventFile", "masked_crc32c", "tb_file_name"]

try:  # the C implementation tensorboardX itself uses when present
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - crc32c is a declared dependency
    _crc32c = None


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE: list[int] | None = None


def crc32c(data: bytes) -> int:
    if _crc32c is not None:
        return _crc32c(data)
    global _TABLE
    if _TABLE is None:
        log.warning("trainrec: the crc32c package is missing; TensorBoard files are written slowly")
        _TABLE = _make_table()
    table = _TABLE
    c = 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    x = crc32c(data)
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tb_file_name(start_time: float, host: str, suffix: str = "") -> str:
    name = f"events.out.tfevents.{int(start_time)}.{host or socket.gethostname()}"
    return f"{name}.{suffix}" if suffix else name


class TbEventFile:
    """A TensorBoard event file: ``write(event_bytes)`` appends one TFRecord."""

    def __init__(self, path: str, wall: float | None = None, *, append: bool = False) -> None:
        """``append``: add to the file where it exists (it has its file version event already)."""
        layout.make_dirs(os.path.dirname(path) or ".")
        self.path = path
        if append and os.path.isfile(path) and os.path.getsize(path) > 0:
            self._f = open(path, "ab", buffering=1 << 20)  # noqa: SIM115 - closed in close()
            return
        self._f = open(path, "wb", buffering=1 << 20, opener=layout.private_opener)  # noqa: SIM115 - closed in close()
        self.write(event_bytes(time.time() if wall is None else wall, file_version=FILE_VERSION))

    def write(self, data: bytes) -> None:
        header = len(data).to_bytes(8, "little")
        self._f.write(header)
        self._f.write(masked_crc32c(header).to_bytes(4, "little"))
        self._f.write(data)
        self._f.write(masked_crc32c(data).to_bytes(4, "little"))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> TbEventFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
