"""What the trainer integrations share: the recorder they open, and the note that lets a resumed launch
append to the same run.

A run is continued by the recorder's ``append_output`` (the rank directory's time stamp) and
``start_iteration`` (the step training resumes at): the recorder then writes a ``RunResumed`` and
replay lets the new launch supersede whatever the old one recorded from that step on. What the
integrations add is remembering *which* rank directory, next to the trainer's checkpoint.
"""

from __future__ import annotations

import json
import logging
import os

from trainrec.recorder.config import MonitorConfig, load_config, parse_config, replace
from trainrec.recorder.native import DEFAULT_CONFIG, Recorder
from trainrec.schema import layout

log = logging.getLogger(__name__)

NOTE_VERSION = 1


def resolved_config(config, append_stamp: str | None) -> MonitorConfig | dict | str | None:
    """``config`` as ``record()`` takes it, set to append to the rank directory stamped ``append_stamp``."""
    if append_stamp is None:
        return config
    if config is None:
        cfg = parse_config(dict(DEFAULT_CONFIG), "DEFAULT_CONFIG")
    elif isinstance(config, MonitorConfig):
        cfg = config
    elif isinstance(config, dict):
        cfg = parse_config(dict(config), "config dict")
    else:  # a path: a resumed launch applies it as it is now (not watched: dynamic mode is off)
        cfg = load_config(os.fspath(config))
    return replace(cfg, append_output=(append_stamp, append_stamp))


def open_recorder(model, optimizer, config, output_dir: str | None, *, grad_acc_steps: int, start_step: int,
                  append_to: tuple[str, str] | None = None) -> Recorder:
    """A :class:`~trainrec.recorder.native.Recorder` that starts counting at ``start_step``; with
    ``append_to`` (:func:`append_target`), into that run's rank directory."""
    append_stamp = None
    if append_to is not None:
        output_dir, append_stamp = append_to
    return Recorder(model, optimizer, resolved_config(config, append_stamp), output_dir,
                    grad_acc_steps=max(1, int(grad_acc_steps or 1)), start_iteration=int(start_step))


def run_note(recorder: Recorder, step: int) -> dict:
    """What a checkpoint keeps of the run: the rank directory (its stamp) and the step saved."""
    rank_dir = recorder.rank_dir or ""
    parsed = layout.parse_rank_dir(os.path.basename(rank_dir.rstrip(os.sep)))
    return {"version": NOTE_VERSION, "rank_dir": rank_dir, "stamp": parsed[0] if parsed else None,
            "rank": recorder.session.rank, "run_id": recorder.session.run_id, "step": int(step)}


def note_path(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, f"trainrec-rank{rank}.json")


def write_note(checkpoint_dir: str, note: dict) -> None:
    os.makedirs(checkpoint_dir, exist_ok=True)
    with open(note_path(checkpoint_dir, note["rank"]), "w", encoding="utf-8") as f:
        json.dump(note, f)


def append_target(note: dict | None, where: str) -> tuple[str, str] | None:
    """``(output directory, stamp)`` of the rank directory a resumed launch appends to, where ``note``
    names one that is still there; otherwise None (a new run), with a warning saying why."""
    if not note:
        log.warning("trainrec: training resumes from a checkpoint that holds no trainrec note (%s): "
                    "recording into a new run", where)
        return None
    rank_dir, stamp = note.get("rank_dir"), note.get("stamp")
    if not isinstance(stamp, str) or not isinstance(rank_dir, str) or not os.path.isdir(rank_dir):
        log.warning("trainrec: the run the checkpoint names (%s) is not there any more: recording into a new run",
                    rank_dir)
        return None
    return os.path.dirname(os.path.abspath(rank_dir.rstrip(os.sep))), stamp


def read_note(checkpoint_dir: str, rank: int) -> dict | None:
    try:
        with open(note_path(checkpoint_dir, rank), encoding="utf-8") as f:
            note = json.load(f)
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None
