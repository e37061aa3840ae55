"""Dynamic start/stop: watch the monitor's config file and hand validated changes to the training thread.

With ``DYNAMIC_MONITOR=true`` a user switches monitoring on in the middle of a run by editing
``config.json`` (``"switch": true``); it switches itself off after ``collect_times`` collections and
``"switch": false`` is written back into the file, ready for the next start.

Threads and handoff::

    watchdog observer thread        loader thread ("trainrec-config")        training thread
    inotify event on the dir  --->  settle, stable read, parse, validate --> poll(step) at each step end:
    (matching our path only)        publish an immutable _Observation        compare a counter (free),
                                    (attribute swap + counter bump)          decide, emit events, return
                                    write "switch": false back on request    ConfigUpdate | None

The observer and loader threads only read, parse and validate; nothing they do touches the recorder.
Every decision (apply, reject, stop) is taken by the training thread inside :meth:`poll`, which is
where events are emitted, so they carry the step at which they took effect. An update returned by
``poll(n)`` is applied by the recorder from step ``n + 1``.

Identity of a file state: the content's hash plus its mtime, so ``touch config.json`` (the reference's
documented way to restart) is a change, while a re-read of the same file is not. First start:
``"switch": true`` in the file at start-up starts monitoring at the first poll, no change needed;
later starts need a change whose content says ``"switch": true``. A change to ``"switch": false``
while monitoring stops it (the reference ignores it; its own weakness list asks for this). An invalid
change (bad JSON, a ConfigError, an unreadable or deleted file) has no effect; when monitoring, the
old config goes on. Each gets one warning naming the problem and one event, per change, never per
step.

Several ranks, one file: every rank's loader reads the file at its own moment, so each rank votes
with the identity of its latest state in a tiny ``all_reduce(MAX)`` of ``[id, -id, -interval]`` on a
gloo group; a state is decided only when every rank voted for it (max == min), at the same step on
all ranks. The collective is launched asynchronously and harvested at the next sync step, and the
sync interval adapts to the step time (about ``sync_period`` seconds, the minimum proposed by any
rank), so its cost per step is amortised to almost nothing. The first round is synchronous so that
the first start happens at the same step as in a single process.

When watchdog cannot observe (inotify unavailable or exhausted, the directory missing, a network
filesystem whose remote changes inotify never sees) the loader thread stats the file every
``poll_interval`` seconds instead (mtime, size, inode), and says so once. It never runs on the
training thread. A health check (one ``stat`` of the directory per ``health_interval`` seconds)
notices a directory that was deleted or replaced and watches the new one.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainrec.schema.errors import ConfigError
from trainrec.schema.events import ConfigChanged, ConfigRejected, Event

from .jsonedit import atomic_write, set_top_level

log = logging.getLogger(__name__)

VALID = "valid"
INVALID = "invalid"
MISSING = "missing"
UNREADABLE = "unreadable"

_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "lustre", "gpfs", "ceph", "9p", "afs", "beegfs")
_NO_SYNC = 1 << 62
_MASK = (1 << 62) - 1
_MISSING_ID = 1
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


@dataclass(frozen=True)
class _Observation:
    """One state of the config file as read by the loader thread (immutable: handed across threads)."""

    kind: str
    identity: int
    content_hash: str = ""
    text: str | None = None
    raw: dict | None = None
    config: Any = None
    switch: bool = False
    message: str = ""
    key: str | None = None


def _content_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _identity(data: bytes, mtime_ns: int) -> int:
    h = hashlib.blake2b(data, digest_size=8)
    h.update(mtime_ns.to_bytes(16, "little", signed=True))
    return (int.from_bytes(h.digest(), "little") & _MASK) | 2  # never 0 (unset) or 1 (missing)


def _changed_keys(old: dict | None, new: dict) -> tuple:
    old = old or {}
    keys = set(old) | set(new)
    return tuple(sorted(k for k in keys if old.get(k, _MISSING_KEY) != new.get(k, _MISSING_KEY)))


def filesystem_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mounts), or "" if unknown."""
    real = os.path.realpath(path)
    best, fstype = -1, ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best:
                    best, fstype = len(mnt), parts[2]
    except OSError:
        return ""
    return fstype


def _stat_sig(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class DynamicConfigWatcher:
    """Watch ``path`` for changes and hand validated ones to the training thread at step boundaries.

    Parameters:
        path: the config file (a JSON object).
        validate: ``callable(raw dict) -> config``; raises :class:`ConfigError` naming the key.
        emit: ``callable(event)`` writing an event to this rank's log (called on the training thread).
        rank: this process's rank (events' envelope).
        writes_back: whether this rank writes ``"switch": false`` back (exactly one rank should).
        group: a gloo process group over which ranks agree on the step a change applies at. None:
            the default group when torch.distributed is initialized with several ranks and a gloo
            backend, else a new gloo group created by :meth:`start` (which every rank then must
            call, in the same order relative to other group creations), else no agreement (one
            process).
        settle: seconds without a new file event before a read (coalesces an editor's several writes).
        invalid_grace: extra seconds to wait for the rest of a file that does not parse yet.
        sync_period: target seconds between two agreement rounds (several ranks only).
        max_sync_interval: at most this many steps between two rounds.
        poll_interval: seconds between two stats of the file when watchdog cannot observe.
        health_interval: seconds between two checks that the watched directory is still the same.
        use_watchdog: False forces the stat fallback (tests, or filesystems you know inotify misses).

    ``poll(step)`` must be called at every step end on every rank with the same step numbers.
    """

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
        sync_period: float = 0.5,
        max_sync_interval: int = 1000,
        poll_interval: float = 0.5,
        health_interval: float = 1.0,
        use_watchdog: bool = True,
    ) -> None:
        self.path = os.path.abspath(path)
        self._dir = os.path.dirname(self.path)
        self._validate = validate
        self._emit = emit
        self.rank = rank
        self._writes_back = writes_back
        self._group = group
        self._settle = settle
        self._grace = invalid_grace
        self._sync_period = sync_period
        self._max_interval = max(1, int(max_sync_interval))
        self._poll_interval = poll_interval
        self._health_interval = health_interval
        self._use_watchdog = use_watchdog

        # Loader -> training thread handoff: the loader publishes, then bumps _gen; poll compares.
        self._latest: _Observation | None = None
        self._notices: collections.deque = collections.deque()
        self._gen = 0
        self._seen = 0
        self._next_sync = _NO_SYNC
        # Training-thread state.
        self._agreed_identity = 0
        self._last_raw: dict | None = None
        self._applied: _Observation | None = None
        self._applied_step = -1
        self._active = False
        self._own_hash: str | None = None
        self._sync: _Agreement | None = None
        # Loader-thread state.
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dirty = False
        self._requests: collections.deque = collections.deque()
        self._observer: Any = None
        self._mode = "off"  # "watchdog", "poll" (fallback, re-arms when it can), "poll-only"
        self._dir_id: tuple | None = None
        self._dir_gone = False
        self._last_sig: tuple | None = None
        self._next_health = 0.0
        self._next_stat = 0.0
        self._thread: threading.Thread | None = None
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
        return self._mode

    def start(self) -> None:
        """Start watching: schedule the observer, read the file once, start the loader thread."""
        if self._thread is not None:
            return
        self._setup_sync()
        if not self._use_watchdog:
            self._mode = "poll-only"
        else:
            fstype = filesystem_type(self._dir)
            if fstype.split(".")[0] in _NETWORK_FS or fstype.startswith("fuse."):
                self._mode = "poll-only"
                log.warning(
                    "trainrec: %s is on a %s filesystem, where inotify does not see changes made on other "
                    "hosts; checking its mtime/size/inode every %.2g s instead",
                    self.path,
                    fstype,
                    self._poll_interval,
                )
            elif not self._arm(initial=True):
                self._mode = "poll"
        self._load()
        self._thread = threading.Thread(
            target=self._run, name=f"trainrec-config-rank{self.rank}", daemon=True
        )
        self._thread.start()
        if self._sync is not None:
            self._next_sync = -_NO_SYNC

    def poll(self, step: int) -> ConfigUpdate | None:
        """Training thread, at every step end: the update to apply from ``step + 1``, if any."""
        if step < self._next_sync and self._gen == self._seen:
            return None
        return self._poll_slow(step)

    def collection_finished(self, step: int) -> None:
        """``collect_times`` collections are done: monitoring is off; write ``"switch": false`` back."""
        applied = self._applied
        self._active = False
        if applied is None or applied.text is None:
            return
        try:
            new_text = set_top_level(applied.text, "switch", False)
        except ValueError as exc:  # cannot happen for a validated object; never stop training for it
            log.warning("trainrec: cannot rewrite %s: %s", self.path, exc)
            return
        data = new_text.encode("utf-8")
        self._own_hash = _content_hash(data)
        if self._writes_back:
            self._requests.append((applied.content_hash, data, step))
            self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads (after any pending write-back) and finish the collective in flight."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._disarm()
        if self._sync is not None:
            self._sync.close(timeout)

    def __enter__(self) -> DynamicConfigWatcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ training thread
    def _poll_slow(self, step: int) -> ConfigUpdate | None:
        self._seen = self._gen
        while self._notices:
            self._send(self._notices.popleft()(step))
        if self._sync is None:
            obs = self._latest
            if obs is None or obs.identity == self._agreed_identity:
                return None
            return self._decide(obs, step)
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
            self._sync = None
            self._next_sync = _NO_SYNC
            self._latest = None
            return None
        self._next_sync = step + interval
        if obs is None or obs.identity == self._agreed_identity:
            return None
        return self._decide(obs, step)

    def _decide(self, obs: _Observation, step: int) -> ConfigUpdate | None:
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
            if self._active and self._applied is not None and obs.content_hash == self._applied.content_hash:
                log.info("trainrec: %s was saved without changes; monitoring goes on", self.path)
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
                step + 1,
                ", ".join(changed) or "nothing but the file's time",
            )
            return ConfigUpdate(obs.config, obs.content_hash, changed, obs.raw, True, step)
        if self._active:
            self._active = False
            self._applied = None  # stopped by the user: nothing to write back
            self._say(
                logging.INFO, "trainrec: %s: switch is false; monitoring stops after step %d", self.path, step
            )
            return ConfigUpdate(obs.config, obs.content_hash, changed, obs.raw, False, step)
        return None

    def _reject(self, obs: _Observation, step: int) -> None:
        if self._active:
            tail = f"monitoring goes on with the config applied at step {self._applied_step}"
        else:
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

    def _setup_sync(self) -> None:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is a dependency
            return
        if not (dist.is_available() and dist.is_initialized()):
            if self._group is not None:
                raise ValueError("a group was given but torch.distributed is not initialized")
            return
        group = self._group
        if group is None:
            if dist.get_world_size() <= 1:
                return
            if dist.get_backend() == "gloo":
                group = dist.group.WORLD
            else:
                group = dist.new_group(backend="gloo")
        if dist.get_world_size(group) <= 1:
            return
        self._sync = _Agreement(group, self._sync_period, self._max_interval)

    # ------------------------------------------------------------------ watching (observer + loader)
    def _arm(self, initial: bool = False) -> bool:
        """Schedule a watchdog observer on the directory; False (after one message) if impossible."""
        try:
            from watchdog.events import (
                DirDeletedEvent,
                DirMovedEvent,
                FileAttribEvent,
                FileClosedEvent,
                FileCreatedEvent,
                FileDeletedEvent,
                FileModifiedEvent,
                FileMovedEvent,
            )
            from watchdog.observers import Observer

            st = os.stat(self._dir)
            observer = Observer()
            observer.schedule(
                _Handler(self),
                self._dir,
                recursive=False,
                event_filter=[
                    FileModifiedEvent,
                    FileClosedEvent,
                    FileCreatedEvent,
                    FileDeletedEvent,
                    FileMovedEvent,
                    FileAttribEvent,
                    DirDeletedEvent,
                    DirMovedEvent,
                ],
            )
            observer.daemon = True
            observer.start()
        except Exception as exc:  # noqa: BLE001 - any failure means: fall back to stat polling
            if initial or self._mode != "poll":
                log.warning(
                    "trainrec: cannot watch %s with watchdog (%s); checking its mtime/size/inode every %.2g s "
                    "instead",
                    self._dir,
                    exc,
                    self._poll_interval,
                )
            return False
        self._observer = observer
        self._dir_id = (st.st_dev, st.st_ino)
        self._dir_gone = False
        self._mode = "watchdog"
        self._next_health = time.monotonic() + self._health_interval
        return True

    def _disarm(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            try:
                observer.stop()
                observer.join(2.0)
            except Exception:  # noqa: BLE001 - an observer whose directory vanished may complain
                log.debug("trainrec: stopping the config observer failed", exc_info=True)

    def _on_fs_event(self, dir_deleted: bool) -> None:
        """Observer thread: something happened to our file (or the directory went away)."""
        if dir_deleted:
            self._dir_gone = True
        self._dirty = True
        self._wake.set()

    def _run(self) -> None:
        failures = 0
        while True:
            timeout = self._health_interval if self._mode == "watchdog" else self._poll_interval
            self._wake.wait(timeout)
            stopping = self._stop.is_set()
            try:
                self._wake.clear()
                if self._dirty and not stopping:
                    self._settle_events()
                    self._load()
                while self._requests:
                    self._write_back(*self._requests.popleft())
                if stopping:
                    return
                self._housekeeping()
                failures = 0
            except Exception:  # noqa: BLE001 - the loader must outlive any surprise
                failures += 1
                if failures == 1:
                    log.exception("trainrec: the config loader failed; it keeps going")
                if stopping:
                    return
                self._stop.wait(min(5.0, 0.1 * failures))

    def _settle_events(self) -> None:
        """Wait until no new event arrived for ``settle`` seconds (at most 20 settle periods)."""
        deadline = time.monotonic() + 20 * self._settle
        while time.monotonic() < deadline and not self._stop.is_set():
            self._dirty = False
            self._wake.clear()
            if not self._wake.wait(self._settle) or not self._dirty:
                return  # quiet for a settle period (or woken by a write-back request, not the file)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if self._mode == "watchdog":
            if now < self._next_health:
                return
            self._next_health = now + self._health_interval
            try:
                st = os.stat(self._dir)
                same = (st.st_dev, st.st_ino) == self._dir_id
            except OSError:
                st, same = None, False
            observer = self._observer
            alive = (
                observer is not None and observer.is_alive() and all(e.is_alive() for e in observer.emitters)
            )
            if same and alive and not self._dir_gone:
                return
            self._disarm()
            if st is None:
                log.info(  # the rejection of the missing file is the user's message
                    "trainrec: the directory of %s was removed; checking every %.2g s until it is back",
                    self.path,
                    self._poll_interval,
                )
                self._mode = "poll"
                self._load()
                return
            log.warning("trainrec: the directory of %s was replaced; watching the new one", self.path)
            if not self._arm():
                self._mode = "poll"
            self._load()
        else:
            if now < self._next_stat:
                return
            self._next_stat = now + self._poll_interval
            if self._mode == "poll" and self._use_watchdog and os.path.isdir(self._dir):
                if self._arm():
                    log.info("trainrec: watching %s with watchdog again", self._dir)
                    self._load()
                    return
            try:
                sig = _stat_sig(os.stat(self.path))
            except OSError:
                sig = None
            if sig != self._last_sig:
                self._load()

    def _publish(self, obs: _Observation) -> None:
        self._latest = obs
        self._gen += 1

    def _load(self) -> None:
        """Read, parse and validate the file; publish the result if it is a new state."""
        obs = self._read()
        if obs is None:
            return
        latest = self._latest
        if latest is not None and latest.identity == obs.identity:
            return
        if obs.kind == INVALID and obs.key is None and self._grace > 0:
            # Possibly half-written (an editor saving in two writes): give the rest a moment.
            if self._stop.wait(self._grace):
                return
            try:
                sig = _stat_sig(os.stat(self.path))
            except OSError:
                sig = None
            if sig != self._last_sig or self._dirty:
                self._dirty = True
                self._wake.set()
                return
        self._publish(obs)

    def _read(self) -> _Observation | None:
        """One stable read of the file (stat, read, stat agree); None if it kept changing."""
        path = self.path
        for _ in range(5):
            try:
                st1 = os.stat(path)
                with open(path, "rb") as f:
                    data = f.read()
                st2 = os.stat(path)
            except FileNotFoundError:
                self._last_sig = None
                where = "its directory was removed" if not os.path.isdir(self._dir) else "it was deleted"
                return _Observation(
                    MISSING, _MISSING_ID, message=f"config file {path} does not exist ({where})"
                )
            except IsADirectoryError:
                self._last_sig = None
                return _Observation(MISSING, _MISSING_ID, message=f"config file {path} is a directory")
            except OSError as exc:
                self._last_sig = None
                reason = exc.strerror or repr(exc)
                ident = _identity(reason.encode(), -1)
                return _Observation(UNREADABLE, ident, message=f"cannot read config file {path}: {reason}")
            if _stat_sig(st1) == _stat_sig(st2) and len(data) == st2.st_size:
                self._last_sig = _stat_sig(st2)
                return self._parse(data, st2.st_mtime_ns)
            if self._stop.wait(self._settle):
                return None
        self._last_sig = None  # still changing: the next event or stat check reads it again
        return None

    def _parse(self, data: bytes, mtime_ns: int) -> _Observation:
        path = self.path
        ident = _identity(data, mtime_ns)
        chash = _content_hash(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return _Observation(INVALID, ident, chash, message=f"{path}: not UTF-8 text (byte {exc.start})")
        try:
            raw = json.loads(text[1:] if text.startswith("\ufeff") else text)
        except json.JSONDecodeError as exc:
            return _Observation(
                INVALID,
                ident,
                chash,
                text,
                message=f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
            )
        except RecursionError:
            return _Observation(INVALID, ident, chash, text, message=f"{path}: JSON nested too deeply")
        if not isinstance(raw, dict):
            return _Observation(
                INVALID,
                ident,
                chash,
                text,
                message=f"{path}: expected a JSON object, got {type(raw).__name__}",
            )
        switch = raw.get("switch", False)
        if not isinstance(switch, bool):
            return _Observation(
                INVALID,
                ident,
                chash,
                text,
                raw,
                message=f"{path}: config key 'switch': expected true or false, got {switch!r}",
                key="switch",
            )
        try:
            config = self._validate(raw)
        except ConfigError as exc:
            message = str(exc) if exc.source else f"{path}: {exc}"
            return _Observation(INVALID, ident, chash, text, raw, message=message, key=exc.key or "")
        except Exception as exc:  # noqa: BLE001 - a validator bug must not reach the training loop
            return _Observation(
                INVALID, ident, chash, text, raw, message=f"{path}: validating failed: {exc!r}", key=""
            )
        return _Observation(VALID, ident, chash, text, raw, config, switch)

    def _write_back(self, applied_hash: str, data: bytes, step: int) -> None:
        """Loader thread: write ``"switch": false`` back if the file still holds what was applied."""
        path = self.path
        try:
            with open(path, "rb") as f:
                current = f.read()
        except FileNotFoundError:
            log.info("trainrec: %s no longer exists; not writing switch=false back", path)
            return
        except OSError as exc:
            self._write_back_failed(exc, step)
            return
        if _content_hash(current) != applied_hash:
            log.info("trainrec: %s changed since it was applied; leaving it as it is (no switch=false)", path)
            return
        try:
            atomic_write(path, data)
        except OSError as exc:
            self._write_back_failed(exc, step)
            return
        log.info("trainrec: wrote switch=false back to %s", path)

    def _write_back_failed(self, exc: OSError, step: int) -> None:
        reason = (
            f"could not write switch=false back to {self.path}: {exc.strerror or repr(exc)}; "
            "it still says switch=true, so the next start needs an edit"
        )
        log.warning("trainrec: %s", reason)
        self._notices.append(
            lambda at: ConfigRejected(
                rank=self.rank, step=at, wall=time.time(), path=self.path, reason=reason, keys=("switch",)
            )
        )
        self._gen += 1


class _Handler:
    """watchdog handler: wakes the loader for events on our path (or the directory's deletion)."""

    def __init__(self, watcher: DynamicConfigWatcher) -> None:
        self._w = watcher
        self._path = watcher.path
        self._dir = watcher._dir

    def dispatch(self, event: Any) -> None:
        src = event.src_path
        if src == self._path or getattr(event, "dest_path", "") == self._path:
            self._w._on_fs_event(False)
        elif src == self._dir and event.event_type in ("deleted", "moved"):
            self._w._on_fs_event(True)


class _Agreement:
    """Rounds of ``all_reduce(MAX, [id, -id, -interval])``: decide a state when all ranks saw it."""

    def __init__(self, group: Any, sync_period: float, max_interval: int) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._period = sync_period
        self._max = max_interval
        self._tensor = torch.zeros(3, dtype=torch.int64)
        self._values = self._tensor.numpy()
        self._work: Any = None
        self._voted: _Observation | None = None
        self._last_time = 0.0
        self._last_step = 0
        self._disagree_since: float | None = None
        self._warned = False

    def _launch(self, step: int, latest: _Observation | None) -> None:
        now = time.monotonic()
        steps = step - self._last_step
        if self._work is None or steps <= 0:
            interval = 1
        else:
            per_step = (now - self._last_time) / steps
            interval = self._max if per_step <= 0 else max(1, min(self._max, int(self._period / per_step)))
        self._last_time, self._last_step = now, step
        ident = latest.identity if latest is not None else 0
        self._values[0] = ident
        self._values[1] = -ident
        self._values[2] = -interval
        self._voted = latest
        self._work = self._dist.all_reduce(
            self._tensor, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True
        )

    def round(self, step: int, latest: _Observation | None) -> tuple[_Observation | None, int]:
        """Harvest the round in flight (the first one synchronously), launch the next one."""
        if self._work is None:
            self._launch(step, latest)
        self._work.wait()
        hi, neg_lo, neg_interval = (int(v) for v in self._values)
        voted = self._voted
        self._launch(step, latest)
        agreed = hi == -neg_lo and hi != 0
        if not agreed:
            now = time.monotonic()
            if self._disagree_since is None:
                self._disagree_since = now
            elif now - self._disagree_since > 30.0 and not self._warned:
                self._warned = True
                log.warning(
                    "trainrec: ranks have read different states of the config file for 30 s; a change applies "
                    "only once every rank has read it (is the file on a filesystem all hosts share?)"
                )
            return None, 1
        self._disagree_since = None
        return voted, max(1, -neg_interval)

    def close(self, timeout: float) -> None:
        work, self._work = self._work, None
        if work is None:
            return
        try:
            import datetime

            work.wait(datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - peers may be gone at shutdown
            log.debug("trainrec: the last config agreement round did not finish", exc_info=True)
