"""One registry of a recording session's hook handles, by group: a group's hooks removed when their
time ends (a step's hooks at its end, the selectors' first-call checks after the first step, the
optimizer's when it is unbound), every group at close."""

from __future__ import annotations


class HookHandles:
    """Hook handles by group. :meth:`group` gives a group's live list (its owner appends to it and
    reads it on hot paths as a plain list); removing a group clears that list in place."""

    __slots__ = ("_groups",)

    def __init__(self) -> None:
        self._groups: dict[str, list] = {}

    def group(self, name: str) -> list:
        """The handles of group ``name`` (made empty on first use); the same list object for the session's life."""
        return self._groups.setdefault(name, [])

    def remove(self, name: str) -> None:
        """Remove every hook of group ``name`` (a handle removed already is left as it is)."""
        handles = self._groups.get(name)
        if handles:
            for h in handles:
                h.remove()
            handles.clear()

    def remove_all(self) -> None:
        for name in self._groups:
            self.remove(name)

    def __len__(self) -> int:
        """Handles held, all groups together (a handle in two groups counts twice)."""
        return sum(map(len, self._groups.values()))
