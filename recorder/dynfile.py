"""Watching the config file: a watchdog observer on its directory and a loader thread.

The observer thread only wakes the loader (other files and our own reads are ignored). The loader
waits until the file is quiet for ``settle`` seconds, reads it stably (stat, read, stat agree),
parses and validates it, and publishes each new :class:`.dynfile_state.FileState` through
``publish``; a file that does not parse gets ``invalid_grace`` more seconds. Where watchdog cannot
observe (no inotify, a missing directory, a network filesystem) the loader stats the file every
``poll_interval`` seconds instead, and says so once. A health check every ``health_interval``
notices a directory deleted or replaced and re-arms the watch. The loader also performs the
``"switch": false`` write-back, so the training thread never waits on the filesystem."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .config import read_regular_file
from .dynfile_state import (
    INVALID,
    MISSING,
    MISSING_ID,
    UNREADABLE,
    FileState,
    content_hash,
    parse_state,
    state_identity,
)
from .jsonedit import atomic_write

log = logging.getLogger(__name__)

NETWORK_FS = ("nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "lustre", "gpfs", "ceph", "9p", "afs", "beegfs")
REARM_BACKOFF = 30.0  # seconds between two attempts to watch with watchdog again after a failure


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


class ConfigFileLoader:
    """The observer and loader threads of one config file; results go to ``publish``."""

    def __init__(
        self,
        path: str,
        *,
        validate: Callable[[dict], Any],
        publish: Callable[[FileState], None],
        on_write_back_failed: Callable[[str], None],
        rank: int = 0,
        settle: float = 0.05,
        invalid_grace: float = 0.3,
        poll_interval: float = 0.5,
        health_interval: float = 1.0,
        use_watchdog: bool = True,
    ) -> None:
        self.path = os.path.abspath(path)
        self._dir = os.path.dirname(self.path)
        self._validate = validate
        self._publish_cb = publish
        self._on_write_back_failed = on_write_back_failed
        self.rank = rank
        self._settle = settle
        self._grace = invalid_grace
        self._poll_interval = poll_interval
        self._health_interval = health_interval
        self._use_watchdog = use_watchdog
        self.latest: FileState | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dirty = False
        self._requests: collections.deque = collections.deque()
        self._observer: Any = None
        self.mode = "off"  # "watchdog", "poll" (fallback, re-arms when it can), "poll-only"
        self._dir_id: tuple | None = None
        self._dir_gone = False
        self._last_sig: tuple | None = None
        self._next_health = 0.0
        self._next_stat = 0.0
        self._next_arm = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Schedule the observer (or choose polling), read the file once, start the loader thread."""
        if self._thread is not None:
            return
        if not self._use_watchdog:
            self.mode = "poll-only"
        else:
            fstype = filesystem_type(self._dir)
            if fstype.split(".")[0] in NETWORK_FS or fstype.startswith("fuse."):
                self.mode = "poll-only"
                log.warning(
                    "trainrec: %s is on a %s filesystem, where inotify does not see changes made on other "
                    "hosts; checking its mtime/size/inode every %.2g s instead",
                    self.path,
                    fstype,
                    self._poll_interval,
                )
            elif os.path.islink(self.path):
                # an edit of the link's target (elsewhere), or the link made to point at another file
                # (Kubernetes' ConfigMap volumes swap a `..data` link), is no event on the link's path
                self.mode = "poll-only"
                log.info(
                    "trainrec: %s is a symbolic link (to %s); checking its target's mtime/size/inode every "
                    "%.2g s instead of watching the directory",
                    self.path,
                    os.path.realpath(self.path),
                    self._poll_interval,
                )
            elif not self._arm(initial=True):
                self.mode = "poll"
        self._load()
        self._thread = threading.Thread(
            target=self._run, name=f"trainrec-config-rank{self.rank}", daemon=True
        )
        self._thread.start()

    def request_write_back(self, applied_hash: str, data: bytes) -> None:
        """Write ``data`` over the file (atomically) if it still has the content ``applied_hash``."""
        self._requests.append((applied_hash, data))
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads, after pending write-backs."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._disarm()

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
            if initial or self.mode != "poll":
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
        self.mode = "watchdog"
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
            timeout = self._health_interval if self.mode == "watchdog" else self._poll_interval
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
        if self.mode == "watchdog":
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
                self.mode = "poll"
                self._load()
                return
            log.warning("trainrec: the directory of %s was replaced; watching the new one", self.path)
            if not self._arm():
                self.mode = "poll"
            self._load()
        else:
            if now < self._next_stat:
                return
            self._next_stat = now + self._poll_interval
            if (
                self.mode == "poll"
                and self._use_watchdog
                and now >= self._next_arm
                and os.path.isdir(self._dir)
            ):
                if self._arm():
                    log.info("trainrec: watching %s with watchdog again", self._dir)
                    self._load()
                    return
                self._next_arm = now + REARM_BACKOFF  # e.g. inotify watches exhausted: do not spin
            try:
                sig = _stat_sig(os.stat(self.path))
            except OSError:
                sig = None
            if sig != self._last_sig:
                self._load()

    def _load(self) -> None:
        """Read, parse and validate the file; publish the result if it is a new state."""
        obs = self._read()
        if obs is None:
            return
        latest = self.latest
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
        self.latest = obs
        self._publish_cb(obs)

    def _read(self) -> FileState | None:
        """One stable read of the file (stat, read, stat agree); None if it kept changing."""
        path = self.path
        for _ in range(5):
            try:
                st1 = os.stat(path)
                data = read_regular_file(path)  # a FIFO or device would block this thread for good
                st2 = os.stat(path)
            except FileNotFoundError:
                self._last_sig = None
                where = "it was deleted" if os.path.isdir(self._dir) else "its directory does not exist"
                return FileState(MISSING, MISSING_ID, message=f"config file {path} does not exist ({where})")
            except IsADirectoryError:
                self._last_sig = None
                return FileState(MISSING, MISSING_ID, message=f"config file {path} is a directory")
            except OSError as exc:
                self._last_sig = None
                reason = exc.strerror or repr(exc)
                ident = state_identity(reason.encode(), -1)
                return FileState(UNREADABLE, ident, message=f"cannot read config file {path}: {reason}")
            if _stat_sig(st1) == _stat_sig(st2) and len(data) == st2.st_size:
                self._last_sig = _stat_sig(st2)
                return parse_state(path, data, st2.st_mtime_ns, self._validate)
            if self._stop.wait(self._settle):
                return None
        self._last_sig = None  # still changing: the next event or stat check reads it again
        return None

    def _write_back(self, applied_hash: str, data: bytes) -> None:
        """Loader thread: write ``"switch": false`` back if the file still holds what was applied."""
        path = self.path
        try:
            with open(path, "rb") as f:
                current = f.read()
        except FileNotFoundError:
            log.info("trainrec: %s no longer exists; not writing switch=false back", path)
            return
        except OSError as exc:
            self._write_back_failed(exc)
            return
        if content_hash(current) != applied_hash:
            log.info("trainrec: %s changed since it was applied; leaving it as it is (no switch=false)", path)
            return

        def unchanged() -> bool:  # again, right before the rename: an edit saved meanwhile is kept
            try:
                with open(path, "rb") as f:
                    return content_hash(f.read()) == applied_hash
            except OSError:
                return False

        try:
            written = atomic_write(path, data, precondition=unchanged)
        except OSError as exc:
            self._write_back_failed(exc)
            return
        if written is None:
            log.info("trainrec: %s changed while switch=false was being written; leaving it as it is", path)
            return
        log.info("trainrec: wrote switch=false back to %s", path)

    def _write_back_failed(self, exc: OSError) -> None:
        reason = (
            f"could not write switch=false back to {self.path}: {exc.strerror or repr(exc)}; "
            "it still says switch=true, so the next start needs an edit"
        )
        log.warning("trainrec: %s", reason)
        self._on_write_back_failed(reason)


class _Handler:
    """watchdog handler: wakes the loader for events on our path (or the directory's deletion)."""

    def __init__(self, loader: ConfigFileLoader) -> None:
        self._w = loader
        self._path = loader.path
        self._dir = loader._dir

    def dispatch(self, event: Any) -> None:
        src = event.src_path
        if src == self._path or getattr(event, "dest_path", "") == self._path:
            self._w._on_fs_event(False)
        elif src == self._dir and event.event_type in ("deleted", "moved"):
            self._w._on_fs_event(True)
