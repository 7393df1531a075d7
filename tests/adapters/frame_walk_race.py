"""Run by test_collector: a collection inside `thread_stack_files`'s walk up another thread's stack,
whose finalizer releases the GIL long enough for that thread to return from the frame whose
object the walk is making, and to push other frames where it was. Prints the files walked; a
corrupted walk fails (a dict or list where a frame was) or crashes."""

import gc
import sys
import threading
import time

from lm_resiliency.adapters.base import thread_stack_files

waiting, go, done = threading.Event(), threading.Event(), threading.Event()


def inner() -> None:
    waiting.set()
    go.wait()


def middle() -> int:
    inner()
    return 1


def churn(n: int) -> list[int]:
    return [*churn(n - 1), n] if n else [0]


def outer() -> None:
    middle()
    while not done.is_set():  # frames pushed where middle's and inner's were
        churn(20)


class Finalizer:
    """Cyclic garbage whose finalizer, run by a collection inside the walk once it has read the
    first frame, lets the other thread go and releases the GIL; elsewhere it leaves the same
    garbage for the next collection."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_name != "thread_stack_files":
            caller = caller.f_back
        if caller is not None and caller.f_locals.get("files") and not go.is_set():
            go.set()
            time.sleep(0.3)
        else:
            Finalizer()


thread = threading.Thread(target=outer, daemon=True)
thread.start()
waiting.wait()
Finalizer()
gc.set_threshold(1, 10**6, 10**6)  # a collection at every allocation the collector tracks
files = thread_stack_files(thread.ident)
gc.set_threshold(700, 10, 10)
assert go.is_set(), "no collection ran inside thread_stack_files"
go.set()
again = [thread_stack_files(thread.ident) for _ in range(3)]
done.set()
thread.join()
assert files.count(__file__) == 3 and files[-1].endswith("threading.py"), files  # inner, middle, outer
print("walked", len(files))
