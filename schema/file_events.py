"""Events of the log file's own structure: its header and its clean close (with the file's step index),
the name tables that intern tensor and module names, and the resume that continues a run in a new file.
Listed and re-exported by :mod:`.events` with every other event type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .envelope import Event, _check_counts, _check_ranks
from .vocab import MAX_NAME_ID, MAX_STEP, MAX_WORLD_SIZE


@dataclass(frozen=True, slots=True, kw_only=True)
class FileOpened(Event):
    """First record of every log file: who wrote it and with what."""

    TAG: ClassVar[str] = "fo"
    run_id: str = ""
    world_size: int = 1
    host: str = ""
    pid: int = 0
    start_time: float = 0.0
    trainrec_version: str = ""
    torch_version: str = ""
    format_version: int = 1
    file_index: int = 0
    dir_name: str = ""
    pp_stage: int = 0
    group_mates: tuple = ()
    # The writer's identity (appended later; "" and 0 in an older writer's file): a random nonce no
    # other writer shares, and the process's start time (clock ticks since boot) and boot id, which
    # tell the writer from a later process that got its pid (see trainrec.schema.procid).
    writer_id: str = ""
    proc_start: int = 0
    boot_id: str = ""

    def check(self) -> str | None:
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            return f"world size {self.world_size} is outside 1..{MAX_WORLD_SIZE}"
        if not 0 <= self.pp_stage < MAX_WORLD_SIZE:
            return f"pipeline stage {self.pp_stage} is outside 0..{MAX_WORLD_SIZE - 1}"
        if self.file_index < 0:
            return f"file index {self.file_index} is negative"
        return _check_ranks(self.group_mates, "group_mates")


@dataclass(frozen=True, slots=True, kw_only=True)
class FileClosed(Event):
    """Last record of a cleanly closed file.

    The ``index_*`` fields (appended later: empty in older writers' files) are the file's step index.
    Segment ``k`` starts at byte ``index_offsets[k]`` with the frame of sequence number ``index_seqs[k]``,
    the first whose step ``index_steps[k]`` is above every step before it; it runs to the next segment
    (the last one to this record), none of its frames has a higher step, and ``index_low_steps[k]`` is
    the lowest step >= 0 among them. ``index_names``: the offsets of the frames of name tables. Packed
    little-endian, 'q' (steps) and 'Q' (offsets, seqs). Untrusted: replay checks it against the file
    (:mod:`trainrec.replay.stepindex`) and reads the whole file where it does not fit."""

    TAG: ClassVar[str] = "fc"
    records: int = 0
    dropped: int = 0
    reason: str = "close"
    index_steps: bytes = b""
    index_offsets: bytes = b""
    index_seqs: bytes = b""
    index_low_steps: bytes = b""
    index_names: bytes = b""

    def check(self) -> str | None:
        return _check_counts(self, "records", "dropped")


@dataclass(frozen=True, slots=True, kw_only=True)
class NamesInterned(Event):
    """Assigns ids ``first_id, first_id+1, ...`` to ``names``, for the rest of this file."""

    TAG: ClassVar[str] = "nm"
    first_id: int = 0
    names: tuple = ()

    def check(self) -> str | None:
        if not 0 <= self.first_id <= MAX_NAME_ID:
            return f"first name id {self.first_id} is outside 0..{MAX_NAME_ID} (ids are u32)"
        if self.first_id + len(self.names) > MAX_NAME_ID + 1:
            return f"{len(self.names)} names from id {self.first_id} run past the last u32 id"
        for n in self.names:
            if type(n) is not str:
                return f"a name is {type(n).__name__} {n!r}, not a string"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class NamesRepeated(Event):
    """A copy of an earlier NamesInterned of the same file (same ``first_id`` and ``names``), in a frame
    of its own: where the original's frame was damaged, its names are still known. A reader takes from
    it only ids it has not been given yet."""

    TAG: ClassVar[str] = "nr"
    first_id: int = 0
    names: tuple = ()

    def check(self) -> str | None:
        return NamesInterned.check(self)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResumed(Event):
    """Training resumed into an existing run; this file continues it from ``step``."""

    TAG: ClassVar[str] = "rr"
    previous_files: tuple = ()
    last_step: int = -1
    reason: str = ""

    def check(self) -> str | None:
        if not -1 <= self.last_step < MAX_STEP:
            return f"last step {self.last_step} is outside -1..{MAX_STEP - 1}"
        return None
