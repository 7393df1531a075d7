"""One asyncio event loop on one daemon thread, reached from other threads only through this class.

`LoopThread` is a context manager: entering starts the thread and its root task group, leaving
cancels every task, waits for them, and joins the thread (within `close(timeout)`). The training
thread uses `submit` (fire and forget, never blocks) or `call` (wait for a coroutine's result).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from lm_resiliency.errors import RuntimeClosedError

__all__ = ["LoopThread"]

log = logging.getLogger(__name__)
T = TypeVar("T")
RESTART_RESET_S = 10.0  # a `forever` task that ran this long before failing starts its count afresh
RESTART_MAX_PAUSE_S = 1.0  # the longest pause before it is started again


class LoopThread:
    """A daemon thread that runs an anyio task group on asyncio until closed."""

    def __init__(
        self,
        name: str = "lm-resiliency-runtime",
        cleanup: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        """`cleanup` runs in the loop after every task was cancelled (close sockets there)."""
        self._name = name
        self._cleanup = cleanup
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: TaskGroup | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._closed = False
        self._startup_error: BaseException | None = None
        self.crashed: BaseException | None = None
        self.restarts = 0  # `forever` tasks started again after they failed

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> LoopThread:
        if self._thread is not None:
            raise RuntimeError("LoopThread already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def _run(self) -> None:
        try:
            anyio.run(self._main, backend="asyncio")
        except BaseException as exc:  # a task crashed the loop: record it for the owner to see
            self.crashed = exc
            log.error("runtime loop %s stopped with an error: %r", self._name, exc)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._ready.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            if self._cleanup is not None:
                with anyio.CancelScope(shield=True):
                    await self._cleanup()

    def close(self, timeout: float = 1.0) -> None:
        """Cancel every task and join the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop, thread = self._loop, self._thread
        if loop is not None and self._stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already finished
                loop.call_soon_threadsafe(self._stop.set)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("runtime thread %s did not stop within %.1fs", self._name, timeout)

    def __enter__(self) -> LoopThread:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # -- bridges -----------------------------------------------------------------------------------
    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._closed or self._loop is None or not self.alive:
            raise RuntimeClosedError(f"runtime {self._name} is closed")
        return self._loop

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` soon in the loop thread. Thread-safe; never blocks; no result."""
        self._require_loop().call_soon_threadsafe(fn, *args)

    def spawn(
        self,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        *args: Any,
        name: str | None = None,
        forever: bool = False,
    ) -> None:
        """Start `fn(*args)` as a task of the root task group. From the loop thread, call it from a
        task; from another thread it is scheduled and this returns at once.

        A task that raises ends the whole loop (the task group's rule), and with it every other
        task: the rank's heartbeats, so peers would call a healthy rank dead. A `forever` task (a
        loop that must not end: receive, publish, timers) is instead logged and started again,
        after a pause that grows with failures in a row, until the loop closes."""
        if forever:
            fn, args = self._supervised, (fn, name or getattr(fn, "__name__", "task"), *args)
        if self._tg is None:
            raise RuntimeClosedError(f"runtime {self._name} is not running")
        if self.in_loop_thread():
            self._tg.start_soon(fn, *args, name=name)
            return

        async def _start() -> None:
            assert self._tg is not None
            self._tg.start_soon(fn, *args, name=name)

        self.run_coroutine(_start())

    async def _supervised(self, fn: Callable[..., Coroutine[Any, Any, Any]], name: str, *args: Any) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            try:
                await fn(*args)
                return
            except Exception:  # (cancellation is a BaseException: closing ends the task)
                failures = 1 if time.monotonic() - started > RESTART_RESET_S else failures + 1
                self.restarts += 1
                log.exception(
                    "runtime %s: task %s failed (%d in a row); restarting it", self._name, name, failures
                )
            await anyio.sleep(min(RESTART_MAX_PAUSE_S, 0.01 * 2**failures))

    def run_coroutine(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; return a thread-safe future."""
        try:
            loop = self._require_loop()
        except RuntimeClosedError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout: float | None = 30.0) -> T:
        """Run `await fn(*args)` in the loop thread and wait for its result (not from the loop thread)."""
        if self.in_loop_thread():
            raise RuntimeError("LoopThread.call() from the loop thread would deadlock")
        fut = self.run_coroutine(fn(*args))
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(
                f"runtime call {getattr(fn, '__name__', fn)} timed out after {timeout}s"
            ) from None
