"""Process helpers with no dependencies (imported at worker start-up)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

__all__ = [
    "StoppedMates",
    "children",
    "continue_stopped_children",
    "host_key",
    "main_thread_id",
    "pid_alive",
    "pid_exited",
    "thread_sleep",
    "threads_cpu_s",
]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_exited(pid: int) -> bool:
    """Whether process `pid` of this pid namespace has ended: no such process, or a zombie its
    parent has not reaped yet (a SIGKILLed torchrun worker stays one until the agent polls it).
    Unknown (no /proc) counts as not ended."""
    got = _stat(str(pid))
    if got is None:  # gone, or hidden from us (/proc mounted with hidepid): the kernel says which
        return not pid_alive(pid)
    return got[0] in (b"Z", b"X")


def _stat(pid: str) -> tuple[bytes, int] | None:
    """(state, parent pid) of process `pid` from /proc; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) S ppid ...": the state follows the last ')' (comm may hold any byte).
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return fields[0], int(fields[1])
    except (IndexError, ValueError):
        return None


def children(parent: int | None = None) -> dict[int, bytes]:
    """{pid: state} of the children of `parent` (default: this process): their state letter as
    /proc has it (R, S, T for stopped, Z for ended and not reaped, ...). Read from the kernel's
    per-thread children lists where it keeps them, else by a scan of /proc. Empty where /proc is
    unavailable."""
    parent = os.getpid() if parent is None else parent
    pids = _listed_children(parent)
    if pids is None:
        try:
            pids = [d for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return {}
    out = {}
    for pid in pids:
        got = _stat(pid)
        if got is not None and got[1] == parent:
            out[int(pid)] = got[0]
    return out


def _listed_children(parent: int) -> list[str] | None:
    """The pids in /proc/<parent>/task/*/children (a child is listed under the thread that forked
    it); None where the kernel keeps no such lists."""
    try:
        tasks = os.listdir(f"/proc/{parent}/task")
    except OSError:
        return None
    pids: list[str] = []
    for tid in tasks:
        try:
            with open(f"/proc/{parent}/task/{tid}/children", "rb") as f:
                pids += f.read().decode().split()
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{parent}/task/{tid}"):
                continue  # the thread ended
            return None  # a kernel without CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return pids


def continue_stopped_children(parent: int | None = None) -> list[int]:
    """SIGCONT every child of `parent` (default: this process) that a job-control signal stopped
    (SIGSTOP, SIGTSTP: state T), and return their pids. A stopped process takes no signal but
    SIGKILL: torchrun's SIGTERM would wait its whole shutdown timeout on it before killing it, and
    the worker could not flush on the way out. A process stopped by a tracer (state t: a debugger)
    is left alone. Empty where /proc is unavailable."""
    return _continue([pid for pid, state in children(parent).items() if state == b"T"])


def _continue(pids: list[int]) -> list[int]:
    woken = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:  # it ended meanwhile
            continue
        woken.append(pid)
    return woken


class StoppedMates:
    """Continues the stopped children of `parent` once one of their siblings has ended.

    torchrun stops a worker group as soon as one worker exits (a crash, a kill): it sends SIGTERM
    to the others and waits its shutdown timeout (30 s) before SIGKILL. A stopped sibling takes
    the SIGTERM only once continued; continuing it at once makes the restart wait for nothing and
    lets the worker flush on its way out. Only children whose environment holds `marker` (a
    variable torchrun gives its workers) count: the agent has others (the control store's host it
    started, a zombie for a while when another agent's came first). Call `check()` periodically;
    it returns the pids it continued.

    `ending()` (asked only while a worker is stopped) says the job's end has begun elsewhere (a
    rank closed its session at its script's end): nobody will wait for a stopped worker in a
    collective any more, and one that stopped after its last step is continued to end as well.
    Before, with the job's other workers waiting at their close, it stayed stopped until their wait
    ran out (outsider 58: 134 s for a run of 16)."""

    def __init__(self, marker: bytes, parent: int | None = None) -> None:
        self.marker, self.parent = marker, parent
        self._seen: set[int] = set()  # the workers that lived at the last check

    def check(self, ending: Callable[[], bool] | None = None) -> list[int]:
        kids = children(self.parent)
        # (A child is read again until it shows the marker: between its fork and its exec it has
        # the agent's environment.)
        workers = {
            pid: s
            for pid, s in kids.items()
            if pid in self._seen or (s not in (b"Z", b"X") and _has_env(pid, self.marker))
        }
        ended = bool(self._seen - workers.keys()) or any(s in (b"Z", b"X") for s in workers.values())
        self._seen = {pid for pid, s in workers.items() if s not in (b"Z", b"X")}
        stopped = [pid for pid, s in workers.items() if s == b"T"]
        if not stopped or not (ended or (ending is not None and ending())):
            return []
        return _continue(stopped)


def _has_env(pid: int, name: bytes) -> bool:
    """Whether process `pid` started with environment variable `name` (False when unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return any(v.startswith(name + b"=") for v in f.read().split(b"\0"))
    except OSError:
        return False


def host_key() -> str:
    """What two processes share exactly when one can see the other's pid: the kernel's boot id (one
    per host and boot; containers on a host share it) and the pid namespace. "" when unknown (not
    Linux): peers then never judge each other by pid. A machine id is not enough: container images
    often carry the same /etc/machine-id on every host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{ns}" if boot else ""


def _cpu_ticks(stat: bytes, children: bool) -> int:
    """utime + stime (+ cutime + cstime: its children that ended and were waited for) of a stat line."""
    fields = stat[stat.rfind(b")") + 2 :].split()  # state, ppid, ... utime (12th), stime, cutime, cstime
    try:
        return int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    except (IndexError, ValueError):
        return 0


def threads_cpu_s(skip_ids: set[int], skip_names: tuple[bytes, ...] = ()) -> float | None:
    """CPU seconds (user + system) of this process's threads but those whose native id is in
    `skip_ids` or whose kernel name starts with one of `skip_names`, and of its descendants (those
    alive, and those that ended and were waited for): a script that waits for a program it runs
    (an upload by `aws s3 cp`) is at work. None where /proc is unavailable. A thread that ended
    takes its time out of the sum."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    ticks = 0
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks += _cpu_ticks(stat, True) - _cpu_ticks(stat, False)  # (the threads are read below)
    except OSError:
        pass
    todo, seen = list(children()), set[int]()
    while todo and len(seen) < 4096:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ticks += _cpu_ticks(f.read(), True)
        except OSError:
            continue  # it ended
        todo += children(pid)
    for tid in tasks:
        if int(tid) in skip_ids:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        if skip_names and stat[stat.find(b"(") + 1 : stat.rfind(b")")].startswith(skip_names):
            continue
        ticks += _cpu_ticks(stat, False)
    return ticks / os.sysconf("SC_CLK_TCK")


# Syscalls a thread sleeps in for a set time (`time.sleep`: clock_nanosleep; Python 3.10's is a
# select with no descriptors), by machine: a thread's syscall number is what the kernel shows where
# its `wchan` is hidden.
_SLEEPS = {"x86_64": {35, 230}, "aarch64": {101, 115}}
_NO_FD_SELECTS = {"x86_64": {23, 270}, "aarch64": {72}}


def main_thread_id() -> int | None:
    """The kernel's id of this process's main thread (what `thread_sleep` takes). In a forked
    process, Python before 3.12 keeps the parent's in `threading.main_thread().native_id`: a
    training process forked by its launcher (a fork server, a zygote) would look at a thread that
    is not its own. On Linux the main thread leads its thread group, its id the pid: when the
    recorded one is no thread of this process, that is the one."""
    import threading

    recorded = threading.main_thread().native_id
    if recorded is not None and (recorded == os.getpid() or os.path.isdir(f"/proc/self/task/{recorded}")):
        return recorded
    return os.getpid() if os.path.isdir("/proc/self/task") else recorded


def thread_sleep(tid: int) -> tuple[bool, int] | None:
    """(whether thread `tid` of this process sleeps for a set time now, as `time.sleep` does; its
    voluntary context switches so far): one long sleep leaves the count as it was, a loop that
    sleeps and looks again raises it. None where /proc cannot say."""
    base = f"/proc/self/task/{tid}"
    try:
        with open(f"{base}/status", "rb") as f:
            lines = f.read().splitlines()
        switches = next(int(x.split()[1]) for x in lines if x.startswith(b"voluntary_ctxt_switches:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        with open(f"{base}/wchan", "rb") as f:
            wchan = f.read().strip()
    except OSError:
        wchan = b""
    if wchan not in (b"", b"0"):
        return b"nanosleep" in wchan, switches
    machine = os.uname().machine
    try:
        with open(f"{base}/syscall", "rb") as f:
            fields = f.read().split()
        nr = int(fields[0])
        nfds = int(fields[1], 16) if len(fields) > 1 else -1
    except (OSError, ValueError, IndexError):  # ("running" where it runs: no number)
        return False, switches
    return nr in _SLEEPS.get(machine, ()) or (nr in _NO_FD_SELECTS.get(machine, ()) and nfds == 0), switches
