"""One state of the config file as the dynamic-config loader reads it: :class:`FileState` (valid,
invalid, missing or unreadable, with an identity that is the same on every host for the same content
and mtime), and :func:`parse_state`, which decodes, parses and validates the bytes read."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainrec.schema.errors import ConfigError

VALID = "valid"
INVALID = "invalid"
MISSING = "missing"
UNREADABLE = "unreadable"
_MASK = (1 << 62) - 1
MISSING_ID = 1


@dataclass(frozen=True)
class FileState:
    """One state of the config file as read by the loader thread (immutable: handed across threads).

    ``identity`` (62-bit, never 0) is the same on every host for the same content and mtime.
    """

    kind: str
    identity: int
    content_hash: str = ""
    text: str | None = None
    raw: dict | None = None
    config: Any = None
    switch: bool = False
    message: str = ""
    key: str | None = None


def content_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def state_identity(data: bytes, mtime_ns: int) -> int:
    h = hashlib.blake2b(data, digest_size=8)
    h.update(mtime_ns.to_bytes(16, "little", signed=True))
    return (int.from_bytes(h.digest(), "little") & _MASK) | 2  # never 0 (unset) or 1 (missing)


def parse_state(path: str, data: bytes, mtime_ns: int, validate: Callable[[dict], Any]) -> FileState:
    """The state of the config file holding ``data`` (modified at ``mtime_ns``), ``validate`` applied to it."""
    ident = state_identity(data, mtime_ns)
    chash = content_hash(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return FileState(INVALID, ident, chash, message=f"{path}: not UTF-8 text (byte {exc.start})")
    if not text.lstrip("\ufeff").strip():
        # truncated by an editor or a script still writing it (or left so): say that, not a JSON position
        return FileState(INVALID, ident, chash, text, message=f"{path}: the file is empty")
    try:
        raw = json.loads(text[1:] if text.startswith("\ufeff") else text)
    except json.JSONDecodeError as exc:
        return FileState(
            INVALID,
            ident,
            chash,
            text,
            message=f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
        )
    except RecursionError:
        return FileState(INVALID, ident, chash, text, message=f"{path}: JSON nested too deeply")
    if not isinstance(raw, dict):
        return FileState(
            INVALID,
            ident,
            chash,
            text,
            message=f"{path}: expected a JSON object, got {type(raw).__name__}",
        )
    switch = raw.get("switch", False)
    if not isinstance(switch, bool):
        return FileState(
            INVALID,
            ident,
            chash,
            text,
            raw,
            message=f"{path}: config key 'switch': expected true or false, got {switch!r}",
            key="switch",
        )
    try:
        config = validate(raw)
    except ConfigError as exc:
        message = str(exc) if exc.source else f"{path}: {exc}"
        return FileState(INVALID, ident, chash, text, raw, message=message, key=exc.key or "")
    except Exception as exc:  # noqa: BLE001 - a validator bug must not reach the training loop
        return FileState(
            INVALID, ident, chash, text, raw, message=f"{path}: validating failed: {exc!r}", key=""
        )
    return FileState(VALID, ident, chash, text, raw, config, switch)
