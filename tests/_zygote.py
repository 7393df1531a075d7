"""A Python with torch (DDP's torch._dynamo included) and lm_resiliency already imported, that forks
the test suite's worker processes.

Importing them costs a fresh interpreter about 4 s of CPU, most of a multi-process test's CPU on a
2-core machine. Here they are imported once per test session; each worker is a fork of this process
that becomes what `python SCRIPT ARGS...` or `python -m MODULE ARGS...` would have been: its own
session (process group), the test's cwd and environment, fresh signal dispositions, and a normal
interpreter exit (uncaught errors through `sys.excepthook`, `atexit`, non-daemon threads joined).

Protocol (a Unix stream socket; one connection per worker): the client sends one JSON line
`{"argv": [...], "env": {...}, "cwd": "...", ...}`; this process answers `{"pid": N}` after the
fork and `{"returncode": R}` (`Popen.returncode`'s convention) once it has reaped the worker.
- A test's own worker (`"log": PATH`): its output goes to the log file, stdin from /dev/null.
- A worker torchrun starts (`"shim": true`, from `tests/_zyshim.py`, its stand-in): its stdin,
  stdout and stderr come with the request (SCM_RIGHTS), `"unbuffered"` is python's -u. This
  process answers `{"fresh": WHY}` instead of forking where the fork would not be what
  `python ARGS` is for the stand-in (another namespace, limits, start-up environment, or a
  PYTHONPATH this process did not start with), runs the lm_resiliency backend's worker
  `sitecustomize` as that Python would have at start, tells the stand-in when the worker stops
  (`{"stopped": SIG}`), continues the stand-in when the worker is continued, and SIGKILLs the
  worker's group when the stand-in's connection closes first (it died).
Run as `python tests/_zygote.py SOCKET_PATH`; it prints `ready` once it listens and ends when its
stdin closes (the test session ended, however it ended).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from lm_resiliency.worker_boot import die_with_agent  # (the parent-death signal workers ask for)

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
# Settings that act when an interpreter starts: a fork has this process's.
AT_START = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC", "TORCH_CPP_", "TORCH_LOGS", "TORCHDYNAMO")
NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")


class Worker:
    def __init__(self, conn: socket.socket, shim: int | None) -> None:
        self.conn = conn
        self.shim = shim  # the stand-in's pid, for a worker torchrun started


def _boot_dir() -> str:
    """Where the lm_resiliency torchrun backend's worker `sitecustomize` is (it puts it first on
    its workers' PYTHONPATH)."""
    import lm_resiliency

    return str(Path(str(lm_resiliency.__file__)).resolve().parent / "_boot")


def _process_view(pid: int | str) -> dict[str, Any]:
    """What a fork inherits from this process that a fresh `python` inherits from its parent."""
    view: dict[str, Any] = {}
    for ns in NAMESPACES:
        with contextlib.suppress(OSError):
            view[ns] = os.readlink(f"/proc/{pid}/ns/{ns}")
    with contextlib.suppress(OSError):
        view["limits"] = Path(f"/proc/{pid}/limits").read_text()
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        view["status"] = [
            ln for ln in status if ln.startswith(("Umask", "Uid", "Gid", "Groups", "Cpus_allowed:"))
        ]
    with contextlib.suppress(OSError):
        view["nice"] = os.getpriority(os.PRIO_PROCESS, 0 if pid == "self" else int(pid))
    return view


def script_or_module(argv: list[str]) -> bool:
    """Whether `python argv...` runs a script or a module (what a fork can become)."""
    return bool(argv) and (not argv[0].startswith("-") or (argv[0] == "-m" and len(argv) >= 2))


def start_settings_differ(env: dict[str, str], own: dict[str, str], but: str = "") -> list[str]:
    """The settings that act at interpreter start (`AT_START`) on which `env` and `own` differ,
    `but` aside."""
    keys = {k for k in (*env, *own) if k.startswith(AT_START) and k != but}
    return sorted(k for k in keys if env.get(k) != own.get(k))


def _why_fresh(request: dict[str, Any], peer: int, own: dict[str, Any]) -> str | None:
    """None where a fork is what `python ARGS` would be for the stand-in `peer`; else why not."""
    argv = request["argv"]
    if not script_or_module(argv):
        return f"not a script or a module: {argv[:2]}"
    if "sitecustomize" in sys.modules:
        return "this process ran a sitecustomize of its own"
    env = request["env"]
    differ = start_settings_differ(env, dict(os.environ), but="PYTHONPATH")
    if differ:
        return f"start-up settings differ: {differ}"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    mine = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths not in (mine, [_boot_dir(), *mine]):
        return "another PYTHONPATH"
    if _process_view(peer) != own:
        return "another namespace, limit, identity or CPU set"
    return None


def _peer_pid(conn: socket.socket) -> int:
    pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid)


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
    workers: dict[int, Worker] = {}
    pending: dict[socket.socket, tuple[bytes, list[int]]] = {}  # requests not read in full yet
    own = _process_view("self")
    zygote = os.getpid()
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    def answer(conn: socket.socket, msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the client is gone: nothing to tell
            conn.sendall(json.dumps(msg).encode() + b"\n")

    def close(conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()

    def reap() -> None:
        flags = os.WNOHANG | os.WUNTRACED | os.WCONTINUED
        while True:
            try:
                pid, status = os.waitpid(-1, flags)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = workers.get(pid)
            if os.WIFSTOPPED(status):
                if w is not None and w.shim is not None:
                    answer(w.conn, {"stopped": os.WSTOPSIG(status)})
            elif os.WIFCONTINUED(status):
                if w is not None and w.shim is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.shim, signal.SIGCONT)
            else:
                workers.pop(pid, None)
                if w is not None:
                    answer(w.conn, {"returncode": os.waitstatus_to_exitcode(status)})
                    close(w.conn)

    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _addr = srv.accept()
                pending[conn] = (b"", [])
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return None
            elif key.data == "signal":
                with contextlib.suppress(BlockingIOError):
                    while wake_r.recv(256):
                        pass
                reap()
            elif isinstance(key.data, tuple):  # a stand-in's connection: it only ever closes
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                if conn.recv(4096):
                    continue
                pid = key.data[1]
                close(conn)
                if pid in workers:  # the stand-in died (SIGKILL, its agent's death): so does the worker
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:  # (not yet its own group)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
            else:
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
                got, held = pending[conn]
                got, held = got + data, held + fds
                if not data:
                    pending.pop(conn)
                    for fd in held:
                        os.close(fd)
                    close(conn)
                    continue
                pending[conn] = (got, held)
                if b"\n" not in got:
                    continue
                pending.pop(conn)
                request = json.loads(got)
                shim = _peer_pid(conn) if request.get("shim") else None
                if shim is not None:
                    why = _why_fresh(request, shim, own) if len(held) == 3 else "no stdio came"
                    if why is not None:
                        for fd in held:
                            os.close(fd)
                        answer(conn, {"fresh": why})
                        close(conn)
                        continue
                    request["boot"] = os.environ.get("PYTHONPATH", "") != request["env"].get("PYTHONPATH", "")
                sel.unregister(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    sel.close()
                    for c in (srv, wake_r, wake_w, conn, *(w.conn for w in workers.values()), *pending):
                        c.close()
                    for _got, other in pending.values():
                        for fd in other:
                            os.close(fd)
                    request["fds"] = held
                    request["zygote"] = zygote
                    return dict(request)
                for fd in held:
                    os.close(fd)
                workers[pid] = Worker(conn, shim)
                answer(conn, {"pid": pid})
                if shim is not None:
                    sel.register(conn, selectors.EVENT_READ, ("watch", pid))


def _std_streams(unbuffered: bool) -> None:
    """python -u: stdout and stderr unbuffered (their text layers write through)."""
    if not unbuffered:
        return
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding=old.encoding,
            errors=old.errors,
            write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _sitecustomize(paths: list[str]) -> None:
    """What `site` does at start: import the first `sitecustomize` on the path."""
    for p in paths:
        f = Path(p) / "sitecustomize.py"
        if not f.is_file():
            continue
        spec = importlib.util.spec_from_file_location("sitecustomize", f)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as exc:  # as site.execsitecustomize says it
            sys.stderr.write(
                f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n"
            )
        return


def _become(request: dict[str, Any]) -> tuple[str, str]:
    """Turn this fork into the requested worker, up to running its code."""
    os.setsid()
    # Ends with the zygote (which ends with the test session): no worker outlives the suite, even
    # one whose test or stand-in could not stop it.
    die_with_agent(int(request["zygote"]))
    fds = request.get("fds") or []
    if fds:
        for want, fd in enumerate(fds):
            os.dup2(fd, want)
        for fd in fds:
            if fd > 2:
                os.close(fd)
    else:
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
    _std_streams(bool(request.get("unbuffered")))
    # A worker that dies of a native crash (SIGSEGV, SIGABRT) leaves every thread's Python stack in
    # its log, for the test that saw it die (its exit status is the signal's, as before).
    faulthandler.enable(all_threads=True)
    argv = list(request["argv"])
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in pythonpath]
    if request.get("boot"):
        sys.path[:] = [*pythonpath, *base]
        _sitecustomize(pythonpath)
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
