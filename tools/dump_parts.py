"""``trainrec dump -j N``: the JSON lines of a run rendered by rank partition, then merged.

Rendering is the cost of a dump, and it is per rank. Each part writes its ranks' events with their
merge key ``(step reached, rank, position)`` (as :meth:`trainrec.replay.run.Run.events` merges) into
a spool file; the parent merges the spools by that total order, so stdout is the serial dump's.
"""

from __future__ import annotations

import heapq
import os
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence

import orjson
from trainrec.replay.discover import RunInfo
from trainrec.replay.names import NameResolver
from trainrec.replay.render import event_dict, stat_lines
from trainrec.replay.run import Run
from trainrec.replay.stepindex import in_ranges
from trainrec.schema.events import TensorStatsRecorded

from .partition import partition_ranks, rank_bytes, run_parts, sub_info

__all__ = ["damage_notes", "dump_parts", "render"]

_HEAD = struct.Struct("<qqqI")  # step reached, rank, position, bytes of lines


def render(ev, resolver: NameResolver, wanted, ranks, kinds, per_record: bool, steps=None) -> list[bytes]:
    """The lines of one event (none when a filter leaves it out); ``resolver`` must have been fed it.
    ``steps``: step ranges ``(first, last or None)`` to print."""
    t = type(ev)
    if (wanted is not None and t not in wanted) or (ranks is not None and ev.rank not in ranks):
        return []
    if steps is not None and not in_ranges(steps, ev.step):
        return []
    if t is TensorStatsRecorded:
        if kinds is not None and ev.kind not in kinds:
            return []
        if not per_record:
            return list(stat_lines(ev, resolver.names(ev)))
    return [orjson.dumps(event_dict(ev, resolver))]


def damage_notes(run: Run, ranks: Sequence[int]) -> list[str]:
    """What was skipped, is inconsistent or is incomplete in the files of ``ranks``, in file order."""
    readers = run.readers_of(ranks)
    notes = []
    for r in ranks:
        for path in run.files(r):
            err = run.file_errors.get(path)
            if err is not None:
                notes.append(f"skipped {path}: {err}")
            reader = readers.get(path)
            if reader is None:
                continue
            notes.extend(str(p) for p in reader.problems[:5])
            if len(reader.problems) > 5:
                notes.append(f"... {len(reader.problems) - 5} more in {reader.path} (trainrec check)")
            if reader.pending_bytes:
                notes.append(f"{reader.path} ends in an incomplete record ({reader.pending_bytes} bytes: still being "
                             "written, or the run crashed); everything before it is printed")
    return notes


def _keyed(run: Run, rank: int, steps=None) -> Iterator[tuple]:
    step, i = -1, 0
    for ev in run.events(rank=rank, steps=steps):
        if ev.step > step:
            step = ev.step
        i += 1
        yield step, rank, i, ev


def spool_ranks(info: RunInfo, ranks: Sequence[int], path: str, wanted, only, kinds, per_record: bool,
                steps=None) -> list[str]:
    """Render ``ranks`` into the spool file ``path`` (a part's work); returns its damage notes."""
    run = Run(info)
    resolver = NameResolver()
    with open(path, "wb") as f:
        for step, rank, i, ev in heapq.merge(*(_keyed(run, r, steps) for r in ranks)):
            resolver.feed(ev)
            lines = render(ev, resolver, wanted, only, kinds, per_record, steps)
            if lines:
                data = b"\n".join(lines) + b"\n"
                f.write(_HEAD.pack(step, rank, i, len(data)))
                f.write(data)
    return damage_notes(run, ranks)


def _spooled(path: str) -> Iterator[tuple]:
    with open(path, "rb") as f:
        while True:
            head = f.read(_HEAD.size)
            if not head:
                return
            step, rank, i, n = _HEAD.unpack(head)
            yield step, rank, i, f.read(n)


def dump_parts(run: Run, ranks: Sequence[int], jobs: int, write: Callable[[bytes], None], wanted, only, kinds,
               per_record: bool, steps=None) -> list[str]:
    """Write the dump of ``ranks`` with ``jobs`` processes; returns the damage notes."""
    groups = partition_ranks(run, ranks, jobs * 4)
    weights = [sum(rank_bytes(run, r) for r in g) for g in groups]
    with tempfile.TemporaryDirectory(prefix="trainrec-dump-") as tmp:
        paths = [os.path.join(tmp, f"part{i}.spool") for i in range(len(groups))]
        args = [(sub_info(run, g), g, p, wanted, only, kinds, per_record, steps)
                for g, p in zip(groups, paths, strict=True)]
        notes = run_parts(spool_ranks, args, weights, jobs, "dump")
        out: list[bytes] = []
        size = 0
        for *_, data in heapq.merge(*(_spooled(p) for p in paths)):
            out.append(data)
            size += len(data)
            if size >= 1 << 20:
                write(b"".join(out))
                out.clear()
                size = 0
        if out:
            write(b"".join(out))
    return [n for part in notes for n in part]
