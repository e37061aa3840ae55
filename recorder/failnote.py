"""The note a log writer leaves after a write failure: a WriterFailed record in the log, else (where
its log takes nothing more) a sidecar ``<log>.failed.json``.

After a write failure the writer first tries to append a WriterFailed record to the log itself
(:func:`append_or_leave`, called by :mod:`.writer`); where the disk refuses that at close, it writes this sidecar, and where the disk
refuses the sidecar too, retries it every :data:`RETRY_S` seconds while the process runs and once at
exit, since space may return. ``trainrec check`` reads the sidecar beside a log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import BinaryIO

from trainrec.schema import codec, framing, layout
from trainrec.schema.events import Event

from .log_file import write_all

log = logging.getLogger(__name__)

FAILED_SUFFIX = ".failed.json"
RETRY_S = 2.0


def append_or_leave(f: BinaryIO, path: str, events: list[Event], seq: int, log_gone: bool, closing: bool) -> bool:
    """Append ``events`` (a WriterFailed note, at close then the FileClosed) numbered from ``seq`` to the
    log ``f`` at ``path``; True where the disk took them. Where it does not (or ``log_gone``: the file
    was removed or replaced), at close (``closing``) the sidecar of the note."""
    try:
        data = b"".join(framing.encode_frame(codec.encode(ev, seq=seq + i)) for i, ev in enumerate(events))
        if log_gone:
            raise OSError("the log file is not there")
        write_all(f, data)
        return True
    except Exception:  # noqa: BLE001 - the disk still refuses: the sidecar, at close
        if not closing:
            return False
    note = events[0]
    doc = {"log": os.path.basename(path), "error": note.error, "first_lost_seq": note.first_lost_seq,
           "discarded": note.discarded, "last_step": note.last_step, "wall": note.wall}
    leave(path, doc)
    return False


def leave(path: str, doc: dict) -> None:
    """Write the sidecar of ``path`` now, or retry it until the disk takes it."""
    if not write_sidecar(path, doc):
        _retry(path, doc)


def write_sidecar(path: str, doc: dict) -> bool:
    """Write ``<log>.failed.json`` (the writer's note where the log takes nothing more); False where the
    disk refuses it too (nothing is left behind then)."""
    import json

    side = path + FAILED_SUFFIX
    try:
        with open(side, "x", encoding="utf-8", opener=layout.private_opener) as f:
            json.dump(doc, f)
        return True
    except FileExistsError:
        return True
    except OSError as exc:
        log.debug("trainrec: %s: the sidecar cannot be written yet: %r", path, exc)
        try:
            os.unlink(side)
        except OSError:
            pass
        return False


_PENDING_SIDECARS: dict[str, dict] = {}  # log path -> note, while the disk refuses the sidecar
_pending_lock = threading.Lock()


def _retry(path: str, doc: dict) -> None:
    """Retry the sidecar every few seconds while the process runs (and once at exit): space may return."""
    with _pending_lock:
        start = not _PENDING_SIDECARS
        _PENDING_SIDECARS[path] = doc
    if start:
        threading.Thread(target=_retry_loop, daemon=True, name="trainrec-failure-note").start()


def _retry_loop() -> None:
    while True:
        time.sleep(RETRY_S)
        if write_pending():
            return


def write_pending() -> bool:
    """One try at every pending sidecar; True when none is left."""
    with _pending_lock:
        for path, doc in list(_PENDING_SIDECARS.items()):
            if write_sidecar(path, doc):
                del _PENDING_SIDECARS[path]
        return not _PENDING_SIDECARS
