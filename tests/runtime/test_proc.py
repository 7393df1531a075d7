"""Process helpers on real processes: the children this test starts, stopped and continued."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from lm_resiliency import _proc
from lm_resiliency._proc import StoppedMates, children, continue_stopped_children

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


def _until(pid: int, pred: object, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while not pred(_state(pid)):  # type: ignore[operator]
        assert time.monotonic() < deadline, _state(pid)
        time.sleep(0.01)  # polling the kernel's view of a process we signalled
    return _state(pid)


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait(10)


def test_only_stopped_children_are_continued(spawned: list[subprocess.Popen[bytes]]) -> None:
    """Of three children, the one SIGSTOPped is continued (it then runs and takes signals again); a
    running one and a grandchild stopped under it are left alone."""
    code = "import sys, time; time.sleep(120)"
    stopped = subprocess.Popen([sys.executable, "-c", code])
    running = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {code!r}]); "
            "time.sleep(120)",
        ]
    )
    spawned += [stopped, running]
    os.kill(stopped.pid, signal.SIGSTOP)
    _until(stopped.pid, lambda s: s == "T")
    assert continue_stopped_children() == [stopped.pid]
    _until(stopped.pid, lambda s: s != "T")
    assert continue_stopped_children() == []
    # The grandchild is its parent's to continue, not ours.
    deadline = time.monotonic() + 20
    while not (kids := list(children(running.pid))):
        assert time.monotonic() < deadline
        time.sleep(0.01)  # waiting for the child to start its own
    grandchild = kids[0]
    try:
        os.kill(grandchild, signal.SIGSTOP)
        _until(grandchild, lambda s: s == "T")
        assert continue_stopped_children() == []
        assert continue_stopped_children(running.pid) == [grandchild]
    finally:
        os.kill(grandchild, signal.SIGKILL)
    # A stopped process takes SIGTERM only once continued: this is what the agent relies on.
    os.kill(stopped.pid, signal.SIGSTOP)
    _until(stopped.pid, lambda s: s == "T")
    stopped.terminate()
    with pytest.raises(subprocess.TimeoutExpired):
        stopped.wait(0.5)
    assert continue_stopped_children() == [stopped.pid]
    assert stopped.wait(20) == -signal.SIGTERM


@pytest.mark.parametrize("lists", ["kernel lists", "scan"])
def test_stopped_workers_are_continued_once_a_sibling_worker_has_ended(
    spawned: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch, lists: str
) -> None:
    """torchrun stops a worker group when one worker exits: a stopped sibling is continued then
    (whether the ended one is reaped or still a zombie), and not while its siblings all live, nor
    when a child that is no worker ends (the agent's control-store host; it lacks the workers'
    environment marker). Children are found in the kernel's per-thread lists, or by a scan of
    /proc where a kernel keeps none."""
    if lists == "scan":
        monkeypatch.setattr(_proc, "_listed_children", lambda parent: None)
    else:
        assert _proc._listed_children(os.getpid()) is not None
    code = "import time; time.sleep(120)"
    env = {**os.environ, "TEST_WORKER_MARK": "run-1"}
    stopped, mate, other = (subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3))
    helper = subprocess.Popen([sys.executable, "-c", code])
    spawned += [stopped, mate, other, helper]
    deadline = time.monotonic() + 20
    while not all(_proc._has_env(p.pid, b"TEST_WORKER_MARK") for p in (stopped, mate, other)):
        assert time.monotonic() < deadline
        time.sleep(0.01)  # until every child has exec'd (its own environment)
    mates = StoppedMates(b"TEST_WORKER_MARK")
    assert mates.check() == []
    assert {stopped.pid, mate.pid, other.pid, helper.pid} <= children().keys()
    os.kill(stopped.pid, signal.SIGSTOP)
    _until(stopped.pid, lambda s: s == "T")
    assert children()[stopped.pid] == b"T"
    assert mates.check() == [] and mates.check() == []  # stopped, every sibling alive: left so
    helper.kill()
    helper.wait(10)
    assert mates.check() == []  # not a worker
    mate.kill()
    mate.wait(10)  # reaped: gone from /proc
    assert mates.check() == [stopped.pid]
    _until(stopped.pid, lambda s: s != "T")
    assert mates.check() == []
    os.kill(stopped.pid, signal.SIGSTOP)
    _until(stopped.pid, lambda s: s == "T")
    assert mates.check() == []  # the sibling that ended is not counted twice
    os.kill(other.pid, signal.SIGKILL)
    _until(other.pid, lambda s: s == "Z")  # ended, not reaped yet
    assert mates.check() == [stopped.pid]


def test_a_stopped_worker_is_continued_once_the_jobs_end_has_begun(
    spawned: list[subprocess.Popen[bytes]],
) -> None:
    """A worker stopped while its siblings all live is continued once `ending()` says a rank of
    the job closed its session at its script's end; `ending` is asked only while one is stopped."""
    code = "import time; time.sleep(120)"
    env = {**os.environ, "TEST_WORKER_MARK": "run-1"}
    stopped, mate = (subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2))
    spawned += [stopped, mate]
    deadline = time.monotonic() + 20
    while not all(_proc._has_env(p.pid, b"TEST_WORKER_MARK") for p in (stopped, mate)):
        assert time.monotonic() < deadline
        time.sleep(0.01)  # until every child has exec'd (its own environment)
    asked: list[bool] = []
    ending = [False]

    def job_ending() -> bool:
        asked.append(ending[0])
        return ending[0]

    mates = StoppedMates(b"TEST_WORKER_MARK")
    assert mates.check(job_ending) == [] and asked == []  # nobody stopped: not asked
    os.kill(stopped.pid, signal.SIGSTOP)
    _until(stopped.pid, lambda s: s == "T")
    assert mates.check(job_ending) == [] and asked == [False]
    ending[0] = True
    assert mates.check(job_ending) == [stopped.pid]
    _until(stopped.pid, lambda s: s != "T")


def test_threads_cpu_time_counts_the_scripts_threads_and_not_the_skipped_ones() -> None:
    import threading

    spun, release = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait(30)  # alive: its time stays in the sum

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert spun.wait(30)
        assert t.native_id is not None
        everything = _proc.threads_cpu_s(set())
        without = _proc.threads_cpu_s({t.native_id})
        assert everything is not None and without is not None
        assert everything - without >= 0.25  # (clock ticks: 10 ms at most each way)
        with open("/proc/self/comm", "rb") as f:
            comm = f.read().strip()
        named = _proc.threads_cpu_s(set(), (comm,))  # the spinner has the process's name
        assert named is not None and named <= everything - 0.25
    finally:
        release.set()
        t.join(30)


def test_threads_cpu_time_counts_the_programs_the_script_runs(spawned: list[subprocess.Popen[bytes]]) -> None:
    """A script waiting for a program it runs (an upload by a command-line tool) is at work: the
    program's CPU time counts, while it runs and once it ended and was waited for."""
    code = (
        "import sys, time\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "print('spun', flush=True); sys.stdin.read()"
    )
    before = _proc.threads_cpu_s(set())
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    spawned.append(child)
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline() == b"spun\n"  # (a blocking read: this process spends nothing)
    running = _proc.threads_cpu_s(set())
    child.stdin.close()
    child.wait(30)
    child.stdout.close()
    ended = _proc.threads_cpu_s(set())
    assert before is not None and running is not None and ended is not None
    assert running - before >= 0.25 and ended >= running - 0.02


def test_a_thread_in_one_sleep_is_told_from_one_that_waits_or_sleeps_and_looks_again() -> None:
    """`thread_sleep`: a thread in `time.sleep` sleeps, with its switch count unchanged while the
    sleep lasts; one that waits on an event does not sleep; a loop of short sleeps switches."""
    seen: dict[str, Any] = {}
    go, done = threading.Event(), threading.Event()

    def sleeper() -> None:
        go.wait()
        time.sleep(2.0)  # (the sleep the test looks at, not a synchronisation)
        done.wait()

    def poller() -> None:
        while not done.is_set():
            time.sleep(0.01)

    t = threading.Thread(target=sleeper)
    p = threading.Thread(target=poller)
    t.start()
    p.start()
    try:
        deadline = time.monotonic() + 10
        while (got := _proc.thread_sleep(t.native_id)) is None or got[0]:  # waits on `go`: no sleep
            assert got is not None and time.monotonic() < deadline
        seen["waiting"] = got
        go.set()
        while not (got := _proc.thread_sleep(t.native_id)) or not got[0]:
            assert time.monotonic() < deadline
        # (The count may still rise once as the thread goes to sleep: it switches out then.)
        seen["looks"] = [_proc.thread_sleep(t.native_id) for _ in range(400)][200:]
        first_poll = _proc.thread_sleep(p.native_id)
        assert first_poll is not None
        while (got := _proc.thread_sleep(p.native_id)) is None or got[1] == first_poll[1]:
            assert time.monotonic() < deadline
        seen["poll"] = (first_poll, got)
    finally:
        done.set()
        t.join(5)
        p.join(5)
    assert seen["waiting"][0] is False
    looks = seen["looks"]
    assert looks[0][0] and all(x == looks[0] for x in looks)  # one sleep: the count stays
    (_, before), (_, after) = seen["poll"]
    assert after > before


def test_a_forked_process_looks_at_its_own_main_thread() -> None:
    """`main_thread_id` in a fork: Python 3.11 keeps the parent's id in `threading.main_thread()`
    (a training process forked by its launcher then judged a thread that was not its own: its
    sleep after the loop was not seen, and it was named hung)."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # (Python 3.12 warns of a fork beside threads; this one execs nothing)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # (no pytest machinery here: write the facts and leave at once)
        try:
            got = _proc.main_thread_id()
            sleep = _proc.thread_sleep(got) if got is not None else None
            os.write(w, json.dumps([got, os.getpid(), sleep is not None]).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            got, child, read = json.loads(f.read())
    finally:
        os.waitpid(pid, 0)
    assert got == child and read
    assert _proc.main_thread_id() == threading.main_thread().native_id
