from __future__ import annotations

import threading
import time

import anyio
import anyio.lowlevel
import pytest

from lm_resiliency.errors import RuntimeClosedError
from lm_resiliency.runtime.loop import LoopThread

pytestmark = pytest.mark.timeout(30)


def _runtime_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lm-resiliency")]


def test_start_call_submit_and_close_within_a_second() -> None:
    before = set(threading.enumerate())
    loop = LoopThread()
    with loop:
        assert loop.thread is not None and loop.thread.daemon

        async def double(x: int) -> int:
            await anyio.lowlevel.checkpoint()
            return 2 * x

        assert loop.call(double, 21) == 42
        seen = threading.Event()
        loop.submit(seen.set)
        assert seen.wait(5)

        async def forever() -> None:
            await anyio.sleep_forever()

        loop.spawn(forever)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.0  # a task still running is cancelled, not waited for
    assert set(threading.enumerate()) - before == set()  # nothing we started is left
    loop.close()  # idempotent
    with pytest.raises(RuntimeClosedError):
        loop.submit(print)


def test_cleanup_runs_after_tasks_are_cancelled() -> None:
    order: list[str] = []

    async def cleanup() -> None:
        order.append("cleanup")

    loop = LoopThread(cleanup=cleanup)
    with loop:

        async def task() -> None:
            try:
                await anyio.sleep_forever()
            finally:
                order.append("task-cancelled")

        loop.spawn(task)
        loop.call(anyio.sleep, 0.01)
    assert order == ["task-cancelled", "cleanup"]


def test_crashing_task_is_recorded_not_hidden() -> None:
    loop = LoopThread()
    loop.start()

    async def boom() -> None:
        raise ValueError("boom")

    loop.spawn(boom)
    assert loop.thread is not None
    loop.thread.join(5)
    assert isinstance(loop.crashed, BaseException) and "boom" in repr(loop.crashed)
    loop.close()


def test_call_from_loop_thread_is_refused_and_timeouts_surface() -> None:
    with LoopThread() as loop:

        async def inner() -> str:
            try:
                loop.call(anyio.sleep, 0)
            except RuntimeError as exc:
                return str(exc)
            return "no error"

        assert "deadlock" in loop.call(inner)

        with pytest.raises(TimeoutError):
            loop.call(anyio.sleep, 5, timeout=0.05)


def test_a_forever_task_that_fails_is_started_again_and_the_loop_lives_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A task's exception would end the task group, so every task (heartbeats included): a healthy
    rank would fall silent. A `forever` task is logged and started again; a plain one still ends
    the loop (the owner sees `crashed`)."""
    runs: list[int] = []
    again = threading.Event()

    async def flaky(tag: int) -> None:
        runs.append(tag)
        if len(runs) < 3:
            raise SystemError("Objects/tupleobject.c:927: bad argument to internal function")
        again.set()
        await anyio.sleep_forever()

    with LoopThread(name="lm-resiliency-flaky") as loop:
        loop.spawn(flaky, 7, name="flaky", forever=True)
        assert again.wait(10)
        assert runs == [7, 7, 7] and loop.restarts == 2 and loop.alive
        seen = threading.Event()
        loop.submit(seen.set)
        assert seen.wait(5)
    assert sum("task flaky failed" in r.getMessage() for r in caplog.records) == 2

    async def fails() -> None:
        raise ValueError("not supervised")

    loop = LoopThread(name="lm-resiliency-plain")
    with loop:
        loop.spawn(fails)
        assert loop.thread is not None
        loop.thread.join(10)
        assert not loop.alive and "not supervised" in repr(loop.crashed)
