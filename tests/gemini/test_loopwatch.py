"""LoopWatch: the back edge of the loop that took a step (lm_resiliency.gemini.loopwatch)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import pytest

from lm_resiliency.gemini.loopwatch import LoopWatch

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def watch() -> Any:
    w = LoopWatch()
    yield w
    w.disarm()
    assert sys.gettrace() is None


def test_a_for_loops_edge_comes_after_the_work_that_follows_the_step(watch: LoopWatch) -> None:
    """The step in a helper (its frame returns first), in a `with` block (whose exit is on an
    earlier line), then a counter and a loop of its own after it: the edge is the next iteration's
    start, after all of them, and the last iteration has one too (the header ends the loop)."""
    seen: list[tuple[str, int]] = []
    state = {"n": 0}

    def step() -> None:
        assert watch.arm(lambda: seen.append(("edge", state["n"])))

    for i in range(3):
        seen.append(("top", i))
        with contextlib.nullcontext():
            step()
        state["n"] += 1
        for _ in range(2):  # a loop after the step is not its loop
            state["n"] += 0
    assert seen == [("top", 0), ("edge", 1), ("top", 1), ("edge", 2), ("top", 2), ("edge", 3)]
    assert not watch.armed and sys.gettrace() is None  # nothing left tracing


def test_a_while_loops_edge_comes_before_its_next_iteration(watch: LoopWatch) -> None:
    seen: list[tuple[str, int]] = []
    state = {"n": 0}
    while state["n"] < 3:
        seen.append(("top", state["n"]))
        assert watch.arm(lambda: seen.append(("edge", state["n"])))
        state["n"] += 1
    # (The last iteration's edge depends on how the interpreter lays out the loop's condition.)
    assert seen[:5] == [("top", 0), ("edge", 1), ("top", 1), ("edge", 2), ("top", 2)]


def test_a_step_in_a_helper_called_once_climbs_to_the_callers_loop(watch: LoopWatch) -> None:
    seen: list[str] = []

    def train_step() -> None:
        assert watch.arm(lambda: seen.append("edge"))
        seen.append("helper's own work after the step")

    for _ in range(2):
        train_step()
        seen.append("loop's work after the step")
    assert seen == ["helper's own work after the step", "loop's work after the step", "edge"] * 2


def test_another_tracer_is_left_alone(watch: LoopWatch) -> None:
    """A debugger or a coverage tool traces: the watch stands aside (the capture is then taken at
    the step) and the tracer stays as it was."""

    def tracer(frame: Any, event: str, arg: Any) -> None:
        return None

    sys.settrace(tracer)
    try:
        assert not LoopWatch.available()
        assert not watch.arm(lambda: None)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_an_edge_callback_that_raises_never_reaches_the_loop(watch: LoopWatch) -> None:
    def boom() -> None:
        raise RuntimeError("capture failed")

    done = []
    for i in range(2):
        if i == 0:
            assert watch.arm(boom)
        done.append(i)
    assert done == [0, 1] and sys.gettrace() is None
