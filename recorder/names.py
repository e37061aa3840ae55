"""Names of modules and parameters as the monitor records them, and target matching.

``squash_name`` shortens ``encoder.layers.0.self_attn`` to ``0.self_attn``. Unlike the reference's
unanchored regexes, the patterns match whole dot-separated segments, and a name whose short form is
not unique (among modules, or parameters, of one model chunk) keeps its full name. First match wins:

1. a segment ``layer`` or ``layers`` followed by more segments: keep what follows it;
2. a segment ``embedding`` or ``embeddings`` followed by more segments: keep what follows it;
3. a segment starting with ``final``, ``output`` or ``norm``: keep from that segment on.

A target names a module (its full or squashed name, optionally with a ``"{vpp}:"`` prefix) or a
parameter prefix on segment boundaries (``layers.1`` is not ``layers.10``); ``""`` selects all."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def squash(name: str) -> str:
    """The squashed form of one name (without collision handling)."""
    if not name:
        return name
    segs = name.split(".")
    n = len(segs)
    for i, s in enumerate(segs):
        if s in ("layer", "layers") and i + 1 < n:
            return ".".join(segs[i + 1 :])
    for i, s in enumerate(segs):
        if s in ("embedding", "embeddings") and i + 1 < n:
            return ".".join(segs[i + 1 :])
    for i, s in enumerate(segs):
        if s.startswith(("final", "output", "norm")):
            return ".".join(segs[i:])
    return name


def squash_all(names: Iterable[str], enabled: bool = True) -> dict[str, str]:
    """Map each full name to its recorded name; colliding squashed names fall back to full names."""
    names = list(dict.fromkeys(names))
    if not enabled:
        return {n: n for n in names}
    out = {n: squash(n) for n in names}
    while True:
        owners: dict[str, list[str]] = {}
        for full, short in out.items():
            owners.setdefault(short, []).append(full)
        clashes = [fulls for fulls in owners.values() if len(fulls) > 1]
        if not clashes:
            return out
        changed = False
        for fulls in clashes:
            for full in fulls:
                if out[full] != full:
                    out[full] = full
                    changed = True
        if not changed:  # two different full names cannot be equal; defensive stop
            return out


def _forms(full: str, short: str, vpp: int) -> tuple[str, ...]:
    return (full, short, f"{vpp}:{full}", f"{vpp}:{short}")


def module_matches(target: str, full: str, short: str, vpp: int) -> bool:
    """A module target matches the module's full or squashed name exactly (with or without vpp prefix)."""
    return target == "" or target in _forms(full, short, vpp)


def param_matches(target: str, full: str, short: str, vpp: int) -> bool:
    """A parameter target matches a name equal to it or starting with it plus a dot."""
    if target == "":
        return True
    for form in _forms(full, short, vpp):
        if form == target or form.startswith(target + "."):
            return True
    return False


class NameTable:
    """Names of recorded tensors and modules, interned to local ids (rows carry ids), and the ids the
    current log file gave them (each name announced once per file)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self.file_ids = np.zeros(0, dtype=np.uint32)  # replaced, never changed in place, when names are added

    def intern(self, name: str) -> int:
        i = self._ids.get(name)
        if i is None:
            i = len(self.names)
            self.names.append(name)
            self._ids[name] = i
        return i

    def new_file(self) -> None:
        """A new log file: every name is announced to it again."""
        self.file_ids = np.zeros(0, dtype=np.uint32)

    def sync(self, writer, step: int) -> None:
        """Announce the names added since to ``writer`` (None: no log, the local ids stand)."""
        n = len(self.file_ids)
        if n == len(self.names):
            return
        new = self.names[n:]
        ids = writer.intern(new, step) if writer is not None else list(range(n, len(self.names)))
        self.file_ids = np.concatenate([self.file_ids, np.asarray(ids, dtype=np.uint32)])
