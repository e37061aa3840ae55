"""Resolving interned name ids while replaying a stream of events.

Name ids are assigned per log file by NamesInterned records. A :class:`NameResolver` is fed every
event of a stream in order (events of several ranks may be interleaved, as long as each rank's own
events keep their order); a FileOpened resets that rank's table, since a new file starts a new table.
"""

from __future__ import annotations

from trainrec.schema.events import Event, FileOpened, NamesInterned, TensorStatsRecorded, unpack_array


class NameResolver:
    """Per-rank name tables, maintained from the event stream."""

    def __init__(self) -> None:
        self._tables: dict[int, list[str]] = {}

    def feed(self, event: Event) -> None:
        """Update the tables from one event (cheap for every other event type)."""
        if isinstance(event, NamesInterned):
            table = self._tables.setdefault(event.rank, [])
            if event.first_id != len(table):
                # Ids are dense; a gap means a NamesInterned record was lost to corruption.
                table.extend(f"<unknown name {i}>" for i in range(len(table), event.first_id))
                del table[event.first_id :]
            table.extend(str(n) for n in event.names)
        elif isinstance(event, FileOpened):
            self._tables[event.rank] = []

    def table(self, rank: int) -> list[str]:
        return self._tables.get(rank, [])

    def name(self, rank: int, name_id: int) -> str:
        table = self._tables.get(rank, ())
        return table[name_id] if 0 <= name_id < len(table) else f"<unknown name {name_id}>"

    def names(self, event: TensorStatsRecorded) -> list[str]:
        """Names of the rows of a stats record (unknown ids resolve to a visible placeholder)."""
        table = self._tables.get(event.rank, [])
        n = len(table)
        return [table[i] if i < n else f"<unknown name {i}>" for i in unpack_array("I", event.name_ids)]

    def ids_names(self, rank: int, packed_ids: bytes) -> list[str]:
        """Names for any packed u32 id column of ``rank`` (e.g. HooksFired.module_ids)."""
        table = self._tables.get(rank, [])
        n = len(table)
        return [table[i] if i < n else f"<unknown name {i}>" for i in unpack_array("I", packed_ids)]
