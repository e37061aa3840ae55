"""The FileOpened record that heads every log file: who wrote it (host, pid, process identity), with
which versions of trainrec and torch, and where it sits among its rank directory's files."""

from __future__ import annotations

import os
import socket
import sys
import time

from trainrec.schema import framing, procid
from trainrec.schema.events import FileOpened


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("trainrec")
    except Exception:  # noqa: BLE001 - not installed (running from a checkout)
        return "0.1.0"


__version__ = _package_version()


def _torch_version() -> str:
    mod = sys.modules.get("torch")  # never import torch here: seconds of start-up
    if mod is not None:
        return str(getattr(mod, "__version__", ""))
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001 - torch absent
        return ""


def file_header(rank_dir: str, file_index: int, pid: int, *, rank: int, world_size: int, run_id: str,
                pp_stage: int, group_mates: tuple) -> FileOpened:
    """The FileOpened record (sequence number 0) of the ``file_index``-th log of ``rank_dir``, written now
    by process ``pid``."""
    now = time.time()
    return FileOpened(
        seq=0,
        rank=rank,
        step=-1,
        wall=now,
        run_id=run_id,
        world_size=world_size,
        host=socket.gethostname(),
        pid=pid,
        start_time=now,
        trainrec_version=__version__,
        torch_version=_torch_version(),
        format_version=framing.FORMAT_VERSION,
        file_index=file_index,
        dir_name=os.path.basename(os.path.abspath(rank_dir)),
        pp_stage=pp_stage,
        group_mates=tuple(group_mates),
        writer_id=procid.new_writer_id(),
        proc_start=procid.start_ticks(pid),
        boot_id=procid.boot_id(),
    )
