"""SIGTERM while the main thread is blocked in native code.

Python runs a handler installed with `signal.signal` on the main thread, between bytecodes. While
the main thread waits in a collective (a hang, a desync: gloo's or NCCL's wait, in C++, never back
in the interpreter until it times out) the handler does not run, so a worker that the default
disposition would have ended at once lives on until torchrun's shutdown timeout (30 s) kills it
with SIGKILL: the restart waits that long, and nothing is flushed and no goodbye said. Python's
C-level handler also writes the signal's number to the wakeup fd (`signal.set_wakeup_fd`), from
whichever thread took the signal: a watcher thread reads it and, when the handler has not started
within `grace_s`, does the handler's work itself and ends the process by SIGTERM, as the default
disposition would have.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

__all__ = ["SigtermWatch"]

log = logging.getLogger(__name__)

_current: SigtermWatch | None = None  # the installed watch (one process, one wakeup fd)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) shares the socket but not the watcher thread: a signal
    it takes would be read by its parent's watcher, which would take it for its own."""
    watch = _current
    if watch is None:
        return
    with contextlib.suppress(ValueError, OSError):
        now = signal.set_wakeup_fd(-1)
        if now != watch._wsock.fileno():
            signal.set_wakeup_fd(now)


os.register_at_fork(after_in_child=_after_fork_in_child)


class SigtermWatch:
    """Takes over a SIGTERM whose Python handler (`handler`) does not start within `grace_s`.

    The handler and the watcher each call `claim()` before the work: the first one does it, the
    other leaves it alone (the watcher still ends the process once the work is done)."""

    def __init__(
        self,
        handler: Callable[..., object],
        work: Callable[[], None],
        grace_s: float,
        socks: tuple[socket.socket, socket.socket],
    ) -> None:
        self._handler = handler
        self._work = work
        self._grace_s = grace_s
        self._rsock, self._wsock = socks
        self._lock = threading.Lock()
        self._claimed = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="lm-resiliency-sigterm", daemon=True)

    @classmethod
    def install(
        cls, handler: Callable[..., object], work: Callable[[], None], grace_s: float = 1.0
    ) -> SigtermWatch | None:
        """Take the wakeup fd (main thread only) and start watching; None where it is taken already
        (an event loop's signal handlers, the script's own): the handler alone then, as before."""
        rsock, wsock = socket.socketpair()
        wsock.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            rsock.close()
            wsock.close()
            return None
        if previous != -1:
            signal.set_wakeup_fd(previous)
            rsock.close()
            wsock.close()
            return None
        global _current
        watch = _current = cls(handler, work, grace_s, (rsock, wsock))
        watch._thread.start()
        return watch

    def claim(self) -> bool:
        with self._lock:
            if self._claimed.is_set():
                return False
            self._claimed.set()
            return True

    def close(self) -> None:
        """Give the wakeup fd back (when it is still ours; main thread only) and stop watching."""
        global _current
        self._closed = True
        if _current is self:
            _current = None
        try:
            current = signal.set_wakeup_fd(-1)
        except ValueError:
            # Not the main thread: the fd stays set, so its socket stays open (the next signal's
            # byte would land in whatever file took a closed socket's number); the watcher idles.
            return
        if current != self._wsock.fileno():
            signal.set_wakeup_fd(current)  # someone else's since (ours is not theirs to restore)
        with contextlib.suppress(OSError):
            self._rsock.shutdown(socket.SHUT_RDWR)  # wakes the watcher
        self._thread.join(5.0)
        self._rsock.close()
        self._wsock.close()

    def _watch(self) -> None:
        while not self._closed:
            try:
                got = self._rsock.recv(64)
            except OSError:
                return
            if not got:
                return
            if signal.SIGTERM not in got or self._closed:
                continue
            # The handler starts at the main thread's next bytecode: soon, unless it waits in
            # native code. And only while it is still the handler (the script may have put its own).
            if self._claimed.wait(self._grace_s) or self._closed:
                continue
            if signal.getsignal(signal.SIGTERM) is not self._handler or not self.claim():
                continue
            log.warning(
                "SIGTERM: the main thread did not take it within %.1f s (it waits in native code, a "
                "collective perhaps); handled on a thread of lm-resiliency's instead",
                self._grace_s,
            )
            try:
                self._work()
            except Exception:
                log.exception("handling SIGTERM off the main thread failed")
            finally:
                _die_by_sigterm()


def _die_by_sigterm() -> None:
    """End the process as SIGTERM's default disposition does (status -15 to its parent): Python may
    change a signal's disposition on the main thread only, libc's `signal` on any."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signal.SIGTERM, None)  # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(5.0)
    finally:
        os._exit(128 + signal.SIGTERM)
