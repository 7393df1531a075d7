"""The SIGTERM watch takes Python's wakeup fd only when nobody holds it, and gives it back."""

from __future__ import annotations

import signal
import socket

import pytest

from lm_resiliency._sigwatch import SigtermWatch

pytestmark = pytest.mark.timeout(30)


def _noop(*_: object) -> None: ...


def test_a_wakeup_fd_held_by_another_is_left_alone() -> None:
    """An event loop's signal handlers (or the script's own) hold the wakeup fd: the watch stands
    aside and theirs stays set."""
    r, w = socket.socketpair()
    w.setblocking(False)
    before = signal.set_wakeup_fd(w.fileno())
    try:
        assert SigtermWatch.install(_noop, lambda: None) is None
        assert signal.set_wakeup_fd(w.fileno()) == w.fileno()
    finally:
        signal.set_wakeup_fd(before)
        r.close()
        w.close()


def test_close_gives_the_wakeup_fd_back_and_stops_the_thread() -> None:
    assert signal.set_wakeup_fd(-1) == -1
    watch = SigtermWatch.install(_noop, lambda: None)
    assert watch is not None
    ours = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(ours)
    assert ours != -1
    watch.close()
    assert signal.set_wakeup_fd(-1) == -1
    assert not watch._thread.is_alive()
    assert watch.claim()  # nobody claimed the signal: the handler would do the work
    assert not watch.claim()  # once
