"""Process helpers on real processes: the children this test starts, stopped and continued."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from lm_resiliency._proc import continue_stopped_children

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
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait(10)


def test_only_stopped_children_are_continued(children: list[subprocess.Popen[bytes]]) -> None:
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
    children += [stopped, running]
    os.kill(stopped.pid, signal.SIGSTOP)
    _until(stopped.pid, lambda s: s == "T")
    assert continue_stopped_children() == [stopped.pid]
    _until(stopped.pid, lambda s: s != "T")
    assert continue_stopped_children() == []
    # The grandchild is its parent's to continue, not ours.
    deadline = time.monotonic() + 20
    while not (kids := _kids(running.pid)):
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


def _kids(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2 :].split()[1]) == pid:
                out.append(int(d))
    return out
