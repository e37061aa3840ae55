"""The output directory of an export: made, or replaced where ``--force`` is given and it holds a
previous trainrec export (its marker file, :data:`MARKER`, says what was exported from where), and
taken back when an export wrote nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from trainrec.schema import layout
from trainrec.schema.errors import TrainrecError

log = logging.getLogger(__name__)

MARKER = layout.EXPORT_MARKER


def prepare_output(out: str, force: bool, record: dict) -> None:
    try:
        _prepare_output(out, force, record)
    except OSError as exc:
        raise TrainrecError(f"cannot prepare output directory {out}: {exc.strerror or exc}"
                            f"{f' ({exc.filename})' if exc.filename and exc.filename != out else ''}") from exc


def _prepare_output(out: str, force: bool, record: dict) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainrecError(f"output {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not force:
            raise TrainrecError(f"output directory {out} exists and is not empty; choose another, or pass --force "
                                "to replace a previous trainrec export there")
        if not os.path.isfile(os.path.join(out, MARKER)):
            raise TrainrecError(f"output directory {out} is not empty and holds no trainrec export ({MARKER} "
                                "missing); refusing to mix or delete files there, choose another directory")
        _clear_dir(out)
    layout.make_dirs(out)
    with open(os.path.join(out, MARKER), "w", encoding="utf-8", opener=layout.private_opener) as f:
        json.dump(record, f, indent=2)
        f.write("\n")



def _clear_dir(path: str) -> None:
    """Remove everything inside ``path`` (not following links), keeping the directory."""
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.remove(entry.path)



def _remove_output(out: str, created: bool) -> None:
    """Take back what :func:`prepare_output` and an export that wrote nothing left in ``out`` (the
    directory itself where this export created it; else it was empty, or a previous export that
    ``--force`` cleared)."""
    try:
        if created:
            shutil.rmtree(out)
        else:
            _clear_dir(out)
    except OSError as exc:
        log.warning("trainrec export: could not remove %s: %s", out, exc)
