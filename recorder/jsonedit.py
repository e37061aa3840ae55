"""Rewrite one top-level value of a user's JSON config file, keeping everything else as they wrote it.

The dynamic mode writes ``"switch": false`` back once ``collect_times`` collections are done, into a
file the user formatted by hand. First try: replace the value token of every top-level ``"switch"``
member and nothing else. Where that is impossible (no such member, or an object/array value), dump
the document again with the user's key order, indentation, line ending and final newline. Either
result is parsed again and compared with the intended document. :func:`atomic_write` then replaces
the file: a fsynced temporary in the same directory with the original's permission bits, renamed
over the target (through a symlink to its real path), and the directory fsynced."""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from typing import Any

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+', re.S)
_INDENT = re.compile(r"\n([ \t]+)\S")
_BOM = "\ufeff"


def _value_spans(text: str, key: str) -> list[tuple[int, int]] | None:
    """Spans of the scalar values of top-level ``key`` members; None if one is not a scalar.

    ``text`` must be valid JSON whose top level is an object.
    """
    depth = 0
    expect_key = False
    pending_key: str | None = None
    after_colon = False
    spans: list[tuple[int, int]] = []
    pos = 0
    for m in _TOKEN.finditer(text):
        if text[pos : m.start()].strip():
            return None  # something the tokenizer does not understand: do not edit textually
        pos = m.end()
        tok = m.group()
        if after_colon:
            after_colon = False
            if depth == 1 and pending_key == key:
                if tok in ("{", "["):
                    return None
                spans.append((m.start(), m.end()))
            pending_key = None
        if tok in ("{", "["):
            depth += 1
            expect_key = tok == "{" and depth == 1
        elif tok in ("}", "]"):
            depth -= 1
        elif tok == ",":
            expect_key = depth == 1
        elif tok == ":":
            after_colon = True
        elif expect_key and depth == 1 and tok.startswith('"'):
            pending_key = json.loads(tok)
            expect_key = False
    if text[pos:].strip():
        return None
    return spans


def detect_indent(text: str) -> int | str | None:
    """The indentation of ``text``: a number of spaces, a tab string, or None for a one-line document."""
    m = _INDENT.search(text)
    if m is None:
        return None
    ws = m.group(1)
    if "\t" in ws:
        return "\t" * ws.count("\t")
    return len(ws)


def redump(text: str, doc: dict[str, Any]) -> str:
    """``doc`` dumped in the style of ``text`` (indentation, line ending, final newline, ASCII-ness)."""
    indent = detect_indent(text)
    body = json.dumps(doc, indent=indent, ensure_ascii=text.isascii())
    if "\r\n" in text:
        body = body.replace("\n", "\r\n")
    stripped = text.rstrip(" \t")
    if stripped.endswith("\r\n"):
        body += "\r\n"
    elif stripped.endswith("\n"):
        body += "\n"
    return body


def set_top_level(text: str, key: str, value: bool | int | float | str | None) -> str:
    """Return ``text`` with top-level ``key`` set to the JSON scalar ``value``.

    ``text`` must be a JSON object. The edit is textual when every ``key`` member holds a scalar,
    else the document is re-dumped in the original's style (see :func:`redump`). Raises ValueError
    when ``text`` is not a JSON object.
    """
    bom = text.startswith(_BOM)
    body = text[1:] if bom else text
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("the config's top level is not a JSON object")
    wanted = dict(doc)
    wanted[key] = value
    literal = json.dumps(value, ensure_ascii=body.isascii())
    spans = _value_spans(body, key)
    out = None
    if spans:
        parts = []
        last = 0
        for start, end in spans:
            parts.append(body[last:start])
            parts.append(literal)
            last = end
        parts.append(body[last:])
        candidate = "".join(parts)
        try:
            if json.loads(candidate) == wanted:
                out = candidate
        except ValueError:
            out = None
    if out is None:
        out = redump(body, wanted)
    return _BOM + out if bom else out


def atomic_write(path: str, data: bytes, *, fsync: bool = True, precondition=None) -> str | None:
    """Replace ``path`` by ``data`` atomically; returns the real path written.

    Readers see either the old or the new content, never a mix. A symlink is followed (its target is
    replaced, the link stays). The new file keeps the old one's permission bits. ``precondition``
    (a callable) is asked once the new content is written and flushed, right before the rename: False
    leaves the file as it is and returns None. Files have no compare-and-swap; this keeps the window in
    which a concurrent edit is lost to the rename alone, not the write and fsync before it.
    """
    real = os.path.realpath(path)
    directory = os.path.dirname(real) or "."
    try:
        mode = stat.S_IMODE(os.stat(real).st_mode)
    except FileNotFoundError:
        mode = None
    fd, tmp = tempfile.mkstemp(
        prefix="." + os.path.basename(real) + ".", suffix=".trainrec-tmp", dir=directory
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            if fsync:
                os.fsync(f.fileno())
        if precondition is not None and not precondition():
            os.unlink(tmp)
            return None
        os.replace(tmp, real)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        try:
            dfd = os.open(directory, os.O_RDONLY)
        except OSError:
            return real
        try:
            os.fsync(dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)
    return real
