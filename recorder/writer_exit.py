"""The log writers of a process, closed as the process ends: at exit, on SIGTERM (the step in
progress written first, then the previous handler or the default disposition), and disowned in a
forked child. :class:`~.writer.LogWriter` adds itself to :data:`live_writers` while it is open."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

from . import failnote

log = logging.getLogger("trainrec.recorder.writer")

_CLOSE_TIMEOUT = 10.0  # seconds a close at exit or on SIGTERM waits for the worker
live_writers: weakref.WeakSet = weakref.WeakSet()  # every LogWriter open in this process


def _close_all(reason: str = "exit") -> None:
    """Close every writer still open in this process (at exit, on SIGTERM); never raises."""
    for w in list(live_writers):
        try:
            w.close(reason=reason, timeout=_CLOSE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - never fail interpreter exit or a signal handler
            log.error("trainrec: closing %s at %s failed: %r", w.path, reason, exc)


atexit.register(failnote.write_pending)  # (runs after _close_all: registered first)
atexit.register(_close_all, "exit")

_SIGTERM_FLUSH_TIMEOUT = 2.0  # seconds a SIGTERM with a previous handler waits for each writer to write out


def _flush_all(timeout: float) -> None:
    """Write out what every open writer holds (before a previous SIGTERM handler runs); never raises."""
    for w in list(live_writers):
        try:
            w.flush(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - never fail a signal handler
            log.debug("trainrec: flushing %s at SIGTERM failed: %r", w.path, exc)


def _after_fork_in_child() -> None:
    if _SIGTERM_WATCH:  # the parent's watcher pipe: a SIGTERM of this child must not reach the parent's watcher
        import signal

        try:
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            pass
        for fd in _SIGTERM_WATCH:
            try:
                os.close(fd)
            except OSError:
                pass
        _SIGTERM_WATCH.clear()
    for w in list(live_writers):
        w.disown_in_fork_child()
    live_writers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Weak references to callables run on SIGTERM before the writers close (a monitor writes the step in
# progress with them): see before_sigterm_close.
_BEFORE_SIGTERM_CLOSE: list = []


def before_sigterm_close(method) -> None:
    """Run the bound ``method`` on SIGTERM before the writers close, for as long as its object lives."""
    _BEFORE_SIGTERM_CLOSE[:] = [r for r in _BEFORE_SIGTERM_CLOSE if r() is not None]
    _BEFORE_SIGTERM_CLOSE.append(weakref.WeakMethod(method))


def install_sigterm_handler() -> bool:
    """On SIGTERM, close every live writer and hand the signal on to the previous disposition.

    With the default disposition the process then dies of SIGTERM as it would have, also where its main
    thread is blocked in C (:func:`_watch_sigterm`). A previous Python handler runs after the writers
    wrote out what they hold: where it raises, they close with reason ``sigterm``; where it returns, the
    process and the recording go on. Only from the main thread; returns False elsewhere, and where
    SIGTERM is ignored (nothing installed). Installing twice is a no-op."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "_trainrec", False):
        return True
    if previous == signal.SIG_IGN:
        return False

    def close_all() -> None:
        for ref in list(_BEFORE_SIGTERM_CLOSE):
            fn = ref()
            if fn is not None:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - the writers close whatever happens
                    log.debug("trainrec: a SIGTERM callback failed", exc_info=True)
        _close_all(reason="sigterm")

    handled = threading.Event()

    def handler(signum, frame):
        handled.set()
        if not callable(previous):
            close_all()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        # the process may go on: what the writers hold is written out first (a handler that ends the
        # process with os._exit loses nothing), and they stay open unless the handler ends it
        _flush_all(_SIGTERM_FLUSH_TIMEOUT)
        try:
            previous(signum, frame)
        except BaseException:
            close_all()
            raise

    handler._trainrec = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, handler)
    if not callable(previous):  # the process is to die of SIGTERM, also where its main thread cannot run Python
        _watch_sigterm(handled, close_all)
    return True


# A watcher thread for SIGTERM where the process is to die of it: Python runs signal handlers on the main
# thread between bytecodes, which a main thread blocked in C (a collective waiting on a hung peer) never
# reaches, so the handler would keep the process alive until a later SIGKILL. Python's C-level handler
# writes the signal to its wakeup fd at once; where the handler has not run _SIGTERM_WATCH_GRACE_S later,
# the watcher writes the step, closes the logs (at most _SIGTERM_WATCH_CLOSE_S) and ends the process.
_SIGTERM_WATCH: list[int] = []  # the watcher pipe's two fds, while one is installed
_SIGTERM_WATCH_GRACE_S = 2.0
_SIGTERM_WATCH_CLOSE_S = 10.0


def _watch_sigterm(handled: threading.Event, close_all: Callable[[], None]) -> None:
    """Install the SIGTERM watcher (see above); not where the wakeup fd is someone else's (an asyncio loop
    running on the main thread), which is left to them."""
    import signal

    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (OSError, ValueError) as exc:
        log.debug("trainrec: no SIGTERM watcher: %r", exc)
        return
    if old != -1:
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    _SIGTERM_WATCH[:] = [r, w]

    def watch() -> None:
        while True:
            try:
                got = os.read(r, 256)
            except InterruptedError:
                continue
            except OSError:
                return  # closed (a forked child's copy)
            if not got:
                return
            if signal.SIGTERM not in got or handled.wait(_SIGTERM_WATCH_GRACE_S):
                continue
            closer = threading.Thread(target=close_all, daemon=True, name="trainrec-sigterm-close")
            closer.start()
            closer.join(_SIGTERM_WATCH_CLOSE_S)
            _die_of(signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="trainrec-sigterm").start()


def _die_of(signum: int) -> None:
    """End the process by signal ``signum`` from a thread that is not the main one (Python lets only the
    main thread change a disposition: the C library's ``signal`` does it here); by exit status 128 +
    ``signum`` where that fails."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signum, None)  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(5.0)
    except Exception:  # noqa: BLE001 - the process ends either way
        pass
    os._exit(128 + signum)
