"""The note a log writer leaves where its log takes nothing more: a sidecar ``<log>.failed.json``.

After a write failure the writer first tries to append a WriterFailed record to the log itself (see
:mod:`.writer`); where the disk refuses that at close, it writes this sidecar, and where the disk
refuses the sidecar too, retries it every :data:`RETRY_S` seconds while the process runs and once at
exit, since space may return. ``trainrec check`` reads the sidecar beside a log.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from trainrec.schema import layout

log = logging.getLogger(__name__)

FAILED_SUFFIX = ".failed.json"
RETRY_S = 2.0


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
