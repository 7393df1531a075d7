"""The test zygote's workers are what `python SCRIPT` would have been (tests/_zygote.py): the
multi-process tests rely on exit codes, signals, atexit, sessions and environments being the same."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import FRESH, Forked, ProcessGroup, Zygote, worker_env

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(FRESH, reason="LM_RESILIENCY_TEST_FRESH=1: no worker is forked"),
]

PROBE = textwrap.dedent(
    """
    import atexit, json, os, signal, sys, threading, time
    mode = sys.argv[1]
    out = os.environ["PROBE_OUT"]

    def bye():
        with open(out + ".atexit", "w") as f:
            f.write("ran")

    atexit.register(bye)
    if mode == "facts":
        import helper_next_to_the_script  # the script's folder is first on sys.path
        facts = {
            "argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "env": os.environ.get("PROBE_ENV"),
            "leader": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
            "sigterm": str(signal.getsignal(signal.SIGTERM)),
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigchld": str(signal.getsignal(signal.SIGCHLD)), "wakeup": signal.set_wakeup_fd(-1),
            "shm": os.environ.get("LM_RESILIENCY_SHM_DIR"), "path0": sys.path[0],
        }
        with open(out, "w") as f:
            json.dump(facts, f)
        print("to the log")
    elif mode == "exit":
        sys.exit(3)
    elif mode == "raise":
        sys.excepthook = lambda *a: (open(out + ".hook", "w").write(str(a[1])), sys.__excepthook__(*a))
        raise ValueError("uncaught here")
    elif mode == "thread":
        def late():
            time.sleep(0.5)
            with open(out + ".thread", "w") as f:
                f.write("joined")
        threading.Thread(target=late).start()
    elif mode == "wait":
        signal.pause()
    """
)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "helper_next_to_the_script.py").write_text("")
    script = tmp_path / "bin" / "probe.py"
    script.write_text(PROBE)
    return script


def _start(processes: ProcessGroup, probe: Path, mode: str, tmp_path: Path) -> Forked:
    env = {"PROBE_OUT": str(tmp_path / f"{mode}.json"), "PROBE_ENV": "given"}
    proc = processes.start([str(probe), mode], env, tmp_path / f"{mode}.log", cwd=tmp_path)
    assert isinstance(proc, Forked), "a plain script is forked from the zygote"
    return proc


def test_a_forked_worker_has_its_own_argv_cwd_env_session_and_fresh_signals(
    processes: ProcessGroup, probe: Path, tmp_path: Path
) -> None:
    proc = _start(processes, probe, "facts", tmp_path)
    assert proc.wait(timeout=30) == 0
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts == {
        "argv": [str(probe), "facts"],
        "cwd": str(tmp_path),
        "name": "__main__",
        "env": "given",
        "leader": True,
        "stdin": "",
        "sigterm": str(signal.SIG_DFL),
        "sigint": True,
        "sigchld": str(signal.SIG_DFL),
        "wakeup": -1,
        "shm": os.environ["LM_RESILIENCY_SHM_DIR"],
        "path0": str(probe.parent),
    }
    assert (tmp_path / "facts.log").read_text() == "to the log\n"
    assert (tmp_path / "facts.json.atexit").read_text() == "ran"


def test_a_forked_worker_exits_as_an_interpreter_would(
    processes: ProcessGroup, probe: Path, tmp_path: Path
) -> None:
    procs = {m: _start(processes, probe, m, tmp_path) for m in ("exit", "raise", "thread")}
    assert procs["exit"].wait(timeout=30) == 3
    assert procs["raise"].wait(timeout=30) == 1
    assert "ValueError: uncaught here" in (tmp_path / "raise.log").read_text()
    assert (tmp_path / "raise.json.hook").read_text() == "uncaught here"
    assert procs["thread"].wait(timeout=30) == 0
    assert (tmp_path / "thread.json.thread").read_text() == "joined"  # joined before the exit
    assert all((tmp_path / f"{m}.json.atexit").exists() for m in procs)


def test_a_signalled_forked_worker_reports_the_signal_like_popen(
    processes: ProcessGroup, probe: Path, tmp_path: Path
) -> None:
    proc = _start(processes, probe, "wait", tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    proc.terminate()  # wherever it is, from the fork on: SIGTERM's default ends it
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.kill()  # after its end: a no-op, never a signal to a reused pid


def test_settings_read_at_interpreter_start_get_a_fresh_interpreter(
    processes: ProcessGroup, probe: Path, tmp_path: Path
) -> None:
    zygote = Zygote.get()
    base = worker_env({})
    assert zygote.takes([str(probe)], base) and zygote.takes(["-m", "mod"], base)
    assert not zygote.takes([str(probe)], {**base, "OMP_NUM_THREADS": "4"})
    assert not zygote.takes([str(probe)], {**base, "PYTHONPATH": "/elsewhere"})
    assert not zygote.takes(["-c", "pass"], base)
    proc = processes.start(["-c", "import sys; sys.exit(5)"], {}, tmp_path / "c.log")
    assert not isinstance(proc, Forked) and proc.wait(timeout=30) == 5
