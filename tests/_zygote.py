"""A Python with torch (DDP's torch._dynamo included) and lm_resiliency already imported, that forks
the test suite's worker processes.

Importing them costs a fresh interpreter about 4 s of CPU, most of a multi-process test's CPU on a
2-core machine. Here they are imported once per test session; each worker is a fork of this process
that becomes what `python SCRIPT ARGS...` or `python -m MODULE ARGS...` would have been: its own
session (process group), its output in the log file, stdin from /dev/null, the test's cwd and
environment, fresh signal dispositions, and a normal interpreter exit (uncaught errors through
`sys.excepthook`, `atexit`, non-daemon threads joined).

Protocol (a Unix stream socket; one connection per worker): the test sends one JSON line
`{"argv": [...], "env": {...}, "cwd": "...", "log": "..."}`; this process answers `{"pid": N}` after
the fork and `{"returncode": R}` (`Popen.returncode`'s convention) once it has reaped the worker.
Run as `python tests/_zygote.py SOCKET_PATH`; it prints `ready` once it listens and ends when its
stdin closes (the test session ended, however it ended).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from typing import Any

# What the workers import; torch._dynamo because DistributedDataParallel.__init__ imports it.
PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.nn.parallel",
    "lm_resiliency.adapters.torchrun",
    "lm_resiliency.api",
    "lm_resiliency.faults.inject",
)


def _serve(path: str) -> dict[str, Any] | None:
    """Accept launch requests until told to stop (returns None) or, in a forked worker, return its
    request."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # SIGTERM keeps its default: a fork is born with it
    signal.set_wakeup_fd(wake_w.fileno())
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "signal")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    workers: dict[int, socket.socket] = {}  # pid -> the test's connection for it
    pending: dict[socket.socket, bytes] = {}  # connections whose request line is incomplete
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    def answer(conn: socket.socket, msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the test is gone: nothing to tell
            conn.sendall(json.dumps(msg).encode() + b"\n")

    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _addr = srv.accept()
                pending[conn] = b""
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return None
            elif key.data == "signal":
                with contextlib.suppress(BlockingIOError):
                    while wake_r.recv(256):
                        pass
                while True:  # reap every worker that ended
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = workers.pop(pid, None)
                    if conn is not None:
                        answer(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                        conn.close()
            else:
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                data = conn.recv(1 << 20)
                if not data:
                    sel.unregister(conn)
                    pending.pop(conn, None)
                    conn.close()
                    continue
                pending[conn] += data
                if b"\n" not in pending[conn]:
                    continue
                request = json.loads(pending.pop(conn))
                sel.unregister(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    sel.close()
                    for c in (srv, wake_r, wake_w, conn, *workers.values(), *pending):
                        c.close()
                    return dict(request)
                workers[pid] = conn
                answer(conn, {"pid": pid})


def _become(request: dict[str, Any]) -> tuple[str, str]:
    """Turn this fork into the requested worker, up to running its code."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY)  # the test made it
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = list(request["argv"])
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in pythonpath]
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[:] = [os.getcwd(), *pythonpath, *base]
        return "module", argv[1]
    script = os.path.abspath(argv[0])
    sys.argv = argv
    sys.path[:] = [os.path.dirname(script), *pythonpath, *base]
    return "script", script


if __name__ == "__main__":
    for name in PRELOAD:
        importlib.import_module(name)
    got = _serve(sys.argv[1])
    if got is not None:  # a forked worker: run its code as the interpreter's last act
        kind, what = _become(got)
        del got
        if kind == "module":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(what, run_name="__main__")
