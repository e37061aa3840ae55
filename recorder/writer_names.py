"""The ids one log file gives names (:meth:`LogWriter.intern`): dense, per file, stable for the
writer's life, and every new batch announced in the log (NamesInterned, and a NamesRepeated copy)
before its ids are handed out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from trainrec.schema.events import Event, NamesInterned, NamesRepeated


class FileNameIds:
    """Name -> id of one log file. ``announce`` queues a name table on the writer (never dropped);
    ``repeat``: each table also in a frame of its own, so one damaged frame costs no name."""

    def __init__(self, rank: int, repeat: bool, announce: Callable[[Event], None]) -> None:
        self._rank = rank
        self._repeat = repeat
        self._announce = announce
        self._table: dict = {}
        self._lock = threading.Lock()

    def ids(self, names: Iterable, step: int, check: Callable[[], None]) -> list[int]:
        """Ids of ``names``, new ones announced first; ``check`` raises where the writer takes nothing
        more (called before anything is announced)."""
        if not isinstance(names, (list, tuple)):
            names = list(names)
        table = self._table
        try:
            return [table[n] for n in names]
        except KeyError:
            pass
        with self._lock:
            check()
            out: list[int] = []
            new: dict = {}
            first = len(table)
            for n in names:
                i = table.get(n)
                if i is None:
                    i = new.get(n)
                    if i is None:
                        i = new[n] = first + len(new)
                out.append(i)
            if new:
                wall = time.time()
                self._announce(NamesInterned(rank=self._rank, step=step, wall=wall, first_id=first, names=tuple(new)))
                if self._repeat:
                    self._announce(NamesRepeated(rank=self._rank, step=step, wall=wall, first_id=first,
                                                 names=tuple(new)))
                # Published only after the announcement is queued, so that another thread's fast
                # path never hands out an id whose NamesInterned would come after its use.
                table.update(new)
            return out
