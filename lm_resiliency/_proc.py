"""Process helpers with no dependencies (imported at worker start-up)."""

from __future__ import annotations

import os
import signal

__all__ = ["continue_stopped_children", "host_key", "pid_alive", "pid_exited"]


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


def continue_stopped_children(parent: int | None = None) -> list[int]:
    """SIGCONT every child of `parent` (default: this process) that a job-control signal stopped
    (SIGSTOP, SIGTSTP: state T), and return their pids. A stopped process takes no signal but
    SIGKILL: torchrun's SIGTERM would wait its whole shutdown timeout on it before killing it, and
    the worker could not flush on the way out. A process stopped by a tracer (state t: a debugger)
    is left alone. Empty where /proc is unavailable."""
    parent = os.getpid() if parent is None else parent
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    woken = []
    for pid in pids:
        got = _stat(pid)
        if got is None or got[1] != parent or got[0] != b"T":
            continue
        try:
            os.kill(int(pid), signal.SIGCONT)
        except OSError:  # it ended meanwhile
            continue
        woken.append(int(pid))
    return woken


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
