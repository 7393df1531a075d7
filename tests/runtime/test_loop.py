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
