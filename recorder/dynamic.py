"""Dynamic start/stop: watch the monitor's config file and hand validated changes to the training thread.

With ``DYNAMIC_MONITOR=true`` a user starts monitoring mid-run by editing ``"switch": true`` into
``config.json``; it stops after ``collect_times`` collections and ``"switch": false`` is written back.

Threads: a watchdog observer wakes a loader thread (:mod:`.dynfile`), which reads, parses and
validates the file and publishes an immutable state; the training thread's :meth:`poll` at each step
end takes every decision (apply, reject, stop) and emits its events, so they carry the step they took
effect at (an update from ``poll(n)`` applies from step ``n + 1``). With several ranks, the step is
agreed on by :mod:`.dynsync`; :mod:`.jsonedit` rewrites ``"switch"``. The rules (what counts as a
change, first start, invalid edits): docs/recorder-internals.md, "Dynamic config"."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainrec.schema.errors import ConfigError
from trainrec.schema.events import ConfigChanged, ConfigRejected, Event

from .dynfile import ConfigFileLoader, filesystem_type
from .dynfile_state import INVALID, MISSING, UNREADABLE, FileState, content_hash
from .dynsync import StepAgreement, resolve_group
from .jsonedit import set_top_level

__all__ = ["ConfigUpdate", "DynamicConfigWatcher", "filesystem_type"]

log = logging.getLogger(__name__)

_NO_SYNC = 1 << 62
_MISSING_KEY = object()


@dataclass(frozen=True)
class ConfigUpdate:
    """A config change every rank agreed on, to apply from the step after the ``poll`` that returned it.

    ``switch`` False means: monitoring is on and the file now says ``"switch": false``; stop now.
    """

    config: Any
    content_hash: str
    changed_keys: tuple
    raw: dict
    switch: bool = True
    step: int = -1


def _changed_keys(old: dict | None, new: dict) -> tuple:
    old = old or {}
    keys = set(old) | set(new)
    return tuple(sorted(k for k in keys if old.get(k, _MISSING_KEY) != new.get(k, _MISSING_KEY)))


class DynamicConfigWatcher:
    """Watch ``path`` for changes and hand validated ones to the training thread at step boundaries.

    ``validate(raw) -> config`` and ``check(config) -> first step | None`` (training thread, before a
    ``switch: true``) raise :class:`ConfigError`; ``emit(event)`` writes to this rank's log;
    ``writes_back``: this rank writes ``"switch": false`` back (one rank should). ``group``: the gloo
    group the ranks agree over (None: the default gloo group, else one :meth:`start` makes on every
    rank, else none). Seconds: ``settle``, ``invalid_grace``, ``sync_period`` (``max_sync_interval``
    steps at most), ``poll_interval``, ``health_interval``; ``use_watchdog=False`` forces stat polling.

    ``poll(step)`` must be called at every step end on every rank with the same step numbers."""

    def __init__(
        self,
        path: str,
        *,
        validate: Callable[[dict], Any],
        emit: Callable[[Event], None],
        rank: int,
        writes_back: bool,
        group: Any = None,
        settle: float = 0.05,
        invalid_grace: float = 0.3,
        sync_period: float = 1.0,
        max_sync_interval: int = 1000,
        poll_interval: float = 0.5,
        health_interval: float = 1.0,
        use_watchdog: bool = True,
        check: Callable[[Any], int | None] | None = None,
    ) -> None:
        self._check = check
        self._loader = ConfigFileLoader(
            path,
            validate=validate,
            publish=self._publish,
            on_write_back_failed=self._write_back_failed,
            rank=rank,
            settle=settle,
            invalid_grace=invalid_grace,
            poll_interval=poll_interval,
            health_interval=health_interval,
            use_watchdog=use_watchdog,
        )
        self.path = self._loader.path
        self._emit = emit
        self.rank = rank
        self._writes_back = writes_back
        self._group = group
        self._sync_period = sync_period
        self._max_interval = max(1, int(max_sync_interval))
        # Loader -> training thread handoff: the loader publishes, then bumps _gen; poll compares.
        self._latest: FileState | None = None
        self._notices: collections.deque = collections.deque()
        self._gen = 0
        self._seen = 0
        self._next_sync = _NO_SYNC
        # Training-thread state.
        self._agreed_identity = 0
        self._last_raw: dict | None = None
        self._applied: FileState | None = None
        self._applied_step = -1
        self._active = False
        self._own_hash: str | None = None
        self._sync: StepAgreement | None = None
        self._started = False
        self._disabled = False
        self._closed = False
        self._emit_failed = False

    # ------------------------------------------------------------------ public API
    @property
    def active(self) -> bool:
        """True between an applied ``switch: true`` update and its stop / collection_finished."""
        return self._active

    @property
    def mode(self) -> str:
        """How the file is watched: "watchdog", "poll" (fallback) or "poll-only"."""
        return self._loader.mode

    def start(self) -> None:
        """Start watching: agree on a group, schedule the observer, read the file once, start the loader."""
        if self._started:
            return
        self._started = True
        group = resolve_group(self._group)
        if group is not None:
            self._sync = StepAgreement(group, self._sync_period, self._max_interval)
        self._loader.start()
        if self._sync is not None:
            self._next_sync = -_NO_SYNC

    def join_group(self) -> bool:
        """torch.distributed was initialized after :meth:`start` (msprobe's documentation makes the
        monitor first): agree over its group from now on, as a watcher started after it would. Every
        rank calls it, in the same order relative to other group creations (it may make a gloo group).
        True where it now agrees with other ranks."""
        if not self._started or self._sync is not None or self._disabled or self._closed:
            return self._sync is not None
        group = resolve_group(self._group)
        if group is None:
            return False
        self._sync = StepAgreement(group, self._sync_period, self._max_interval)
        self._next_sync = -_NO_SYNC
        return True

    def poll(self, step: int) -> ConfigUpdate | None:
        """Training thread, at every step end: the update to apply from ``step + 1``, if any."""
        if step < self._next_sync and self._gen == self._seen:
            return None
        return self._poll_slow(step)

    def collection_finished(self, step: int) -> None:
        """``collect_times`` collections are done: monitoring is off; write ``"switch": false`` back."""
        applied = self._applied
        self._active = False
        self._say(logging.INFO, "trainrec: %s: collect_times reached; monitoring stops after step %d", self.path, step)
        if applied is None or applied.text is None:
            return
        try:
            new_text = set_top_level(applied.text, "switch", False)
        except ValueError as exc:  # cannot happen for a validated object; never stop training for it
            log.warning("trainrec: cannot rewrite %s: %s", self.path, exc)
            return
        data = new_text.encode("utf-8")
        self._own_hash = content_hash(data)
        if self._writes_back:
            self._loader.request_write_back(applied.content_hash, data)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads (after any pending write-back) and finish the collective in flight."""
        if self._closed:
            return
        self._closed = True
        self._loader.close(timeout)
        if self._sync is not None:
            self._sync.close(timeout)

    def __enter__(self) -> DynamicConfigWatcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ training thread
    def _publish(self, state: FileState) -> None:
        """Loader thread: hand a new file state over (attribute swap, then the counter poll compares)."""
        self._latest = state
        self._gen += 1

    def _write_back_failed(self, reason: str) -> None:
        """Loader thread: the write-back failed; the training thread records it at the next poll."""
        self._notices.append(reason)
        self._gen += 1

    def _poll_slow(self, step: int) -> ConfigUpdate | None:
        self._seen = self._gen
        while self._notices:
            reason = self._notices.popleft()
            self._send(
                ConfigRejected(
                    rank=self.rank,
                    step=step,
                    wall=time.time(),
                    path=self.path,
                    reason=reason,
                    keys=("switch",),
                )
            )
        if self._disabled:
            return None
        if self._sync is None:
            obs = self._latest
        else:
            if step < self._next_sync:
                return None
            try:
                obs, interval = self._sync.round(step, self._latest)
            except Exception as exc:  # noqa: BLE001 - a broken group must not stop training from here
                log.error(
                    "trainrec: rank %d: agreeing on config changes failed (%r); dynamic config is off on this rank",
                    self.rank,
                    exc,
                )
                self._disabled = True
                self._next_sync = _NO_SYNC
                return None
            self._next_sync = step + interval
        if obs is None or obs.identity == self._agreed_identity:
            return None
        return self._decide(obs, step)

    def _decide(self, obs: FileState, step: int) -> ConfigUpdate | None:
        self._agreed_identity = obs.identity
        if obs.kind in (MISSING, UNREADABLE):
            self._reject(obs, step)
            return None
        changed = _changed_keys(self._last_raw, obs.raw) if obs.raw is not None else ()
        self._send(
            ConfigChanged(
                rank=self.rank,
                step=step,
                wall=time.time(),
                path=self.path,
                content_hash=obs.content_hash,
                changed_keys=changed,
            )
        )
        if obs.kind == INVALID:
            if self._active and obs.raw is not None and obs.raw.get("switch", False) is False:
                # the file says switch false: stop, whatever else is wrong in it (said now, checked
                # again when it is switched on)
                self._reject(obs, step, f"switch is false: monitoring stops after step {step}")
                self._last_raw = obs.raw
                return self._switched_off(obs, changed, step)
            self._reject(obs, step)
            return None
        self._last_raw = obs.raw
        if self._own_hash is not None and obs.content_hash == self._own_hash:
            self._own_hash = None
            if not obs.switch:
                log.debug("trainrec: %s: saw our own write-back of switch=false", self.path)
                return None
        self._own_hash = None
        if obs.switch:
            if self._active and self._applied is not None and obs.raw == self._applied.raw:
                # the same values (saved again, re-created, re-indented): the collection goes on, its
                # collect_times count too; the write-back compares against the file as it is now
                self._applied = obs
                log.info("trainrec: %s was saved without changes; monitoring goes on", self.path)
                return None
            first_step = step + 1
            if self._check is not None:
                try:
                    # what needs the model (targets that match nothing in it); the first step collected
                    first_step = self._check(obs.config) or first_step
                except ConfigError as exc:
                    message = str(exc) if exc.source else f"{self.path}: {exc}"
                    self._reject(dataclasses.replace(obs, kind=INVALID, message=message, key=exc.key or ""), step)
                    return None
            first = self._applied is None
            self._active = True
            self._applied = obs
            self._applied_step = step
            self._say(
                logging.INFO,
                "trainrec: %s: %s; monitoring from step %d (changed: %s)",
                self.path,
                "switch is true" if first else "config changed",
                first_step,
                ", ".join(changed) or "nothing but the file's time",
            )
            return ConfigUpdate(obs.config, obs.content_hash, changed, obs.raw, True, step)
        if self._active:
            return self._switched_off(obs, changed, step)
        return None

    def _switched_off(self, obs: FileState, changed: tuple, step: int) -> ConfigUpdate:
        self._active = False
        self._applied = None  # stopped by the user: nothing to write back
        self._say(logging.INFO, "trainrec: %s: switch is false; monitoring stops after step %d", self.path, step)
        return ConfigUpdate(obs.config, obs.content_hash, changed, obs.raw, False, step)

    def _reject(self, obs: FileState, step: int, tail: str | None = None) -> None:
        if tail is None and self._active:
            tail = f"monitoring goes on with the config in effect since step {self._applied_step + 1}"
        elif tail is None:
            tail = "monitoring stays off"
        reason = f"{obs.message}; {tail}"
        self._say(logging.WARNING, "trainrec: %s", reason)
        self._send(
            ConfigRejected(
                rank=self.rank,
                step=step,
                wall=time.time(),
                path=self.path,
                content_hash=obs.content_hash,
                reason=reason,
                keys=(obs.key,) if obs.key else (),
            )
        )

    def _send(self, event: Event) -> None:
        try:
            self._emit(event)
        except Exception as exc:  # noqa: BLE001 - a failed log write must not stop training
            if not self._emit_failed:
                self._emit_failed = True
                log.error("trainrec: could not record %s: %r", type(event).__name__, exc)

    def _say(self, level: int, msg: str, *args: Any) -> None:
        # Every rank decides the same thing at the same step; one of them says it at full level.
        log.log(level if self._writes_back or self._sync is None else logging.DEBUG, msg, *args)
