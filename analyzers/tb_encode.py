"""TensorBoard ``Event`` protos as bytes, written by hand: many scalars per event, no per-value objects.

Only the fields the exports use are encoded (numbers from TensorBoard's ``.proto`` files)::

    Event       { double wall_time = 1; int64 step = 2; string file_version = 3;
                  Summary summary = 5; SessionLog session_log = 7; }
    SessionLog  { SessionStatus status = 1; string msg = 3; }            START = 1
    Summary     { repeated Value value = 1; }
    Value       { string tag = 1; float simple_value = 2; SummaryMetadata metadata = 9; TensorProto tensor = 8; }
    SummaryMetadata { PluginData plugin_data = 1; }  PluginData { string plugin_name = 1; bytes content = 2; }
    TensorProto { DataType dtype = 1; TensorShapeProto tensor_shape = 2; repeated bytes string_val = 8; }

A :class:`ScalarTemplate` is a serialized ``Summary`` with holes for the values. No tensorboard
import (tensorboardX imports torch); tests read the output with TensorBoard's ``EventAccumulator``.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["FILE_VERSION", "ScalarTemplate", "event_bytes", "text_summary"]

FILE_VERSION = "brain.Event:2"
_DT_STRING = 7
_SESSION_START = 1


def _varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negative int64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


class ScalarTemplate:
    """The serialized ``Summary`` of ``tags`` (simple values), to be filled with float32 values.

    Values are laid out grouped by the length of their tag's encoding (the order of values in a
    Summary carries no meaning), so each group is a regular ``count x (prefix + 4)`` byte matrix and
    filling a step is one strided copy per group rather than a scatter per byte.
    """

    __slots__ = ("tags", "_buf", "_groups", "size")

    def __init__(self, tags: list[str]) -> None:
        self.tags = tags
        by_len: dict[int, list[tuple[int, bytes]]] = {}
        for i, tag in enumerate(tags):
            tb = tag.encode("utf-8")
            inner = b"\x0a" + _varint(len(tb)) + tb + b"\x15"  # tag, then simple_value's key
            prefix = b"\x0a" + _varint(len(inner) + 4) + inner  # Summary.value, length-delimited
            by_len.setdefault(len(prefix), []).append((i, prefix))
        chunks: list[bytes] = []
        groups = []
        pos = 0
        for plen, items in sorted(by_len.items()):
            idx = np.array([i for i, _ in items], dtype=np.int64)
            chunks.extend(p + b"\0\0\0\0" for _, p in items)
            groups.append((pos, len(items), plen, idx))
            pos += len(items) * (plen + 4)
        self._buf = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
        self._groups = groups
        self.size = pos

    def __len__(self) -> int:
        return len(self.tags)

    def summary(self, values: np.ndarray) -> bytes:
        """The Summary bytes with ``values`` (any float array of ``len(tags)`` elements, row-major)."""
        v = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
        if len(v) != len(self.tags):
            raise ValueError(f"{len(v)} values for {len(self.tags)} tags")
        buf = self._buf
        for pos, count, plen, idx in self._groups:
            rows = buf[pos : pos + count * (plen + 4)].reshape(count, plen + 4)
            rows[:, plen:] = v[idx].view(np.uint8).reshape(count, 4)
        return buf.tobytes()


def event_bytes(
    wall: float,
    step: int | None = None,
    *,
    summary: bytes | None = None,
    file_version: str | None = None,
    session_start: bool = False,
) -> bytes:
    """A serialized ``Event``."""
    out = [b"\x09" + struct.pack("<d", float(wall))]
    if step is not None and step != 0:
        out.append(b"\x10" + _varint(int(step)))
    if file_version is not None:
        out.append(_field_bytes(3, file_version.encode("utf-8")))
    if summary is not None:
        out.append(_field_bytes(5, summary))
    if session_start:
        out.append(_field_bytes(7, b"\x08" + _varint(_SESSION_START)))
    return b"".join(out)


def text_summary(tag: str, text: str) -> bytes:
    """A ``Summary`` with one text-plugin value, as tensorboardX's ``add_text`` writes it
    (the tag gets the ``/text_summary`` suffix the same way)."""
    metadata = _field_bytes(1, _field_bytes(1, b"text"))  # plugin_data{plugin_name: "text"}
    shape = _field_bytes(2, b"\x08\x01")  # dim{size: 1}
    tensor = b"\x08" + _varint(_DT_STRING) + _field_bytes(2, shape) + _field_bytes(8, text.encode("utf-8"))
    value = _field_bytes(1, f"{tag}/text_summary".encode()) + _field_bytes(9, metadata) + _field_bytes(8, tensor)
    return _field_bytes(1, value)
