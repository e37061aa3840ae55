"""Resolving interned name ids while replaying a stream of events.

Name ids are assigned per log file by NamesInterned records. A :class:`NameResolver` is fed every
event of a stream in order (events of several ranks may be interleaved, as long as each rank's own
events keep their order); a FileOpened resets that rank's table, since a new file starts a new table.

Ids are dense per file. A gap (a NamesInterned record lost to damage, or a corrupt ``first_id``) is
not filled: the names past it are kept aside by id, so memory stays proportional to the names
actually recorded, and ids in the gap resolve to the visible placeholder ``<unknown name ID>``.
"""

from __future__ import annotations

from trainrec.schema.events import Event, FileOpened, NamesInterned, TensorStatsRecorded, unpack_array


def unknown_name(name_id: int) -> str:
    """The placeholder shown for an id no NamesInterned record of the file assigned."""
    return f"<unknown name {name_id}>"


class _Table:
    __slots__ = ("dense", "sparse")

    def __init__(self) -> None:
        self.dense: list[str] = []  # ids 0..len-1
        self.sparse: dict[int, str] = {}  # ids past a gap

    def assign(self, first: int, names) -> None:
        dense, sparse = self.dense, self.sparse
        if first <= len(dense):
            del dense[first:]  # ids re-assigned (never done by the writer): the later record wins
            dense.extend(str(n) for n in names)
            while sparse and len(dense) in sparse:
                dense.append(sparse.pop(len(dense)))
        else:
            sparse.update(zip(range(first, first + len(names)), map(str, names), strict=False))

    def name(self, name_id: int) -> str:
        if 0 <= name_id < len(self.dense):
            return self.dense[name_id]
        return self.sparse.get(name_id) or unknown_name(name_id)


_EMPTY = _Table()


class NameResolver:
    """Per-rank name tables, maintained from the event stream."""

    def __init__(self) -> None:
        self._tables: dict[int, _Table] = {}
        self._generation = 0

    def feed(self, event: Event) -> None:
        """Update the tables from one event (cheap for every other event type)."""
        if isinstance(event, NamesInterned):
            table = self._tables.get(event.rank)
            if table is None:
                table = self._tables[event.rank] = _Table()
            table.assign(event.first_id, event.names)
            self._generation += 1
        elif isinstance(event, FileOpened):
            self._tables[event.rank] = _Table()
            self._generation += 1

    @property
    def generation(self) -> int:
        """Changes whenever a table may have changed (a key for caches of resolved names)."""
        return self._generation

    def table(self, rank: int) -> list[str]:
        """The names of ids ``0..len-1`` of ``rank`` (ids past a gap are only found by :meth:`name`)."""
        return self._tables.get(rank, _EMPTY).dense

    def name(self, rank: int, name_id: int) -> str:
        return self._tables.get(rank, _EMPTY).name(name_id)

    def names(self, event: TensorStatsRecorded) -> list[str]:
        """Names of the rows of a stats record (unknown ids resolve to a visible placeholder)."""
        return self.ids_names(event.rank, event.name_ids)

    def ids_names(self, rank: int, packed_ids: bytes) -> list[str]:
        """Names for any packed u32 id column of ``rank`` (e.g. HooksFired.module_ids)."""
        table = self._tables.get(rank, _EMPTY)
        ids = unpack_array("I", packed_ids)
        try:  # (ids are u32: only an id past the dense table fails, in C, without a Python max)
            return list(map(table.dense.__getitem__, ids))
        except IndexError:
            return [table.name(i) for i in ids]
