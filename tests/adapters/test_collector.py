"""The collector pause around our calls into the interpreter that must not start a collection."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lm_resiliency.adapters.base import collector_paused, thread_stack_files

pytestmark = pytest.mark.timeout(30)


def test_stack_files_are_read_with_the_collector_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """sys._current_frames() holds the thread-list lock while it makes frame objects; a collection
    inside it (a finalizer releasing the GIL) can deadlock with a thread that is ending."""
    seen: list[bool] = []
    real = sys._current_frames

    def frames():  # type: ignore[no-untyped-def]
        seen.append(gc.isenabled())
        return real()

    monkeypatch.setattr(sys, "_current_frames", frames)
    assert gc.isenabled()
    files = thread_stack_files(threading.get_ident())
    assert seen == [False] and gc.isenabled()
    assert files[0] == __file__  # innermost first: this test's frame
    assert thread_stack_files(None) == [] and thread_stack_files(-1) == []


def test_pauses_overlap_across_threads_and_keep_a_disabled_collector_off() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()  # the last one out turns it back on
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_a_collection_inside_the_walk_cannot_leave_a_frame_pointing_at_a_returned_one() -> None:
    """Each `f_back` of another thread's running frame makes its frame object; a collection started
    by that allocation may run a finalizer that releases the GIL, and the other thread may return
    from that very frame meanwhile. Before, the walk ran with the collector on: the object was
    left pointing into freed stack, and the walk read a dict or a list where the frame was (a
    worker's progress task did, then died of SIGSEGV). In a process of its own: the corruption it
    guards against may crash it."""
    script = Path(__file__).with_name("frame_walk_race.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=25, check=False
    )
    assert done.returncode == 0 and done.stdout.startswith("walked "), done.stdout + done.stderr
