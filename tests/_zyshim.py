"""What torchrun starts as a worker's Python in the test suite (`PYTHON_EXEC`): it asks the
session's zygote (`tests/_zygote.py`, torch already imported) to fork the worker, and stands in for
it to torchrun; where a fork would not be what `python ARGS...` is here, it execs that Python.

torchrun's agent sees this process as its worker:
- its stdin, stdout and stderr are handed to the fork (SCM_RIGHTS);
- the signals torchrun sends (to this process group) are passed on to the fork's group;
- it stops when the fork stops (a worker that SIGSTOPped itself), and a SIGCONT to it continues
  the fork;
- it ends as the fork ended: the same exit code, or killed by the same signal;
- if it dies (SIGKILL, or with its agent: the parent-death signal a worker of the lm_resiliency
  backend asks for), the zygote SIGKILLs the fork's group.

Run as `#!PYTHON -IS` (no site, no environment: stdlib only, about 15 ms) from the copy the
session's `Zygote` writes and names in PYTHON_EXEC; the real interpreter's path is in
LMR_TEST_PYTHON, the zygote's socket in LMR_TEST_ZYGOTE. (Stdlib only: `_die_with_agent` is
`lm_resiliency.worker_boot.die_with_agent` without the package's import.)
"""

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys

RELAYED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)


def _fresh() -> None:
    python = os.environ["LMR_TEST_PYTHON"]
    os.execv(python, [python, *sys.argv[1:]])


def _die_with_agent() -> None:
    """What `lm_resiliency.worker_boot.die_with_agent` does in a fresh worker, for this stand-in."""
    agent = os.environ.get("LM_RESILIENCY_AGENT_PID", "")
    if not agent.isdigit():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != int(agent):
        os._exit(1)


def main() -> None:
    args = sys.argv[1:]
    unbuffered = bool(args) and args[0] == "-u"
    if unbuffered:
        args = args[1:]
    path = os.environ.get("LMR_TEST_ZYGOTE", "")
    if not path or os.environ.get("LM_RESILIENCY_TEST_FRESH") == "1":
        _fresh()
    _die_with_agent()
    pid: list[int] = []
    early: list[int] = []

    def relay(sig: int, _frame: object) -> None:
        if not pid:
            early.append(sig)
            return
        try:
            os.killpg(pid[0], sig)
        except ProcessLookupError:  # not yet its own group, or gone (its end is on its way)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid[0], sig)

    for sig in RELAYED:
        signal.signal(sig, relay)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = {
            "argv": args,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "unbuffered": unbuffered,
            "shim": True,
        }
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    except OSError:
        conn.close()
        _fresh()
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = conn.recv(4096)
            if not chunk:
                sys.stderr.write("lm-resiliency tests: the zygote went away while it ran a worker\n")
                os._exit(70)
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        msg = json.loads(line)
        if "fresh" in msg:
            conn.close()
            _fresh()
        elif "pid" in msg:
            pid.append(int(msg["pid"]))
            for sig in early:
                relay(sig, None)
        elif "stopped" in msg:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif "returncode" in msg:
            code = int(msg["returncode"])
            if code < 0:
                with contextlib.suppress(OSError, ValueError):  # SIGKILL keeps its default anyway
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
                code = 128 - code
            os._exit(code)


if __name__ == "__main__":
    main()
