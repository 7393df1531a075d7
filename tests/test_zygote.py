"""The test zygote's workers are what `python SCRIPT` would have been (tests/_zygote.py): the
multi-process tests rely on exit codes, signals, atexit, sessions and environments being the same."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

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


# What torchrun does with PYTHON_EXEC: `PYTHON_EXEC -u SCRIPT ARGS...`, a session of its own.
SHIMMED = textwrap.dedent(
    """
    import json, os, signal, sys, time
    mode = sys.argv[1]
    if mode == "term":  # (before the facts: the test signals once it has read them)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    facts = {
        "forked": "torch" in sys.modules, "argv": sys.argv, "cwd": os.getcwd(),
        "env": os.environ.get("PROBE_ENV"), "through": sys.stdout.write_through,
        "boot": getattr(sys.modules.get("sitecustomize"), "__file__", None),
        "pid": os.getpid(), "stdin": sys.stdin.read(),
    }
    print(json.dumps(facts))
    if mode == "exit":
        sys.exit(3)
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "term":
        signal.pause()
    elif mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        print("continued")
    elif mode == "wait":
        signal.pause()
    """
)


def _shim(probe_dir: Path, mode: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    script = probe_dir / "shimmed.py"
    script.write_text(SHIMMED)
    zygote = Zygote.get()
    full = {**worker_env({}), **zygote.extra, "PROBE_ENV": "given", **(env or {})}
    return subprocess.Popen(
        [zygote.extra["PYTHON_EXEC"], "-u", str(script), mode],
        env=full,
        cwd=probe_dir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _facts(proc: subprocess.Popen[bytes]) -> dict:
    assert proc.stdout is not None
    return dict(json.loads(proc.stdout.readline()))


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _gone(pid: int) -> bool:
    try:
        return _state(pid) == "Z"
    except FileNotFoundError:
        return True


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_worker_torchrun_starts_is_forked_and_ends_as_the_fork_ended(tmp_path: Path) -> None:
    """Its stand-in hands its stdio and `-u` on, and exits with the fork's code or signal."""
    for mode, code in (("exit", 3), ("kill", -signal.SIGKILL)):
        proc = _shim(tmp_path, mode)
        try:
            facts = _facts(proc)
            assert facts["forked"] and facts["through"] and facts["pid"] != proc.pid, facts
            assert facts["argv"] == [str(tmp_path / "shimmed.py"), mode] and facts["cwd"] == str(tmp_path)
            assert facts["env"] == "given" and facts["stdin"] == "" and facts["boot"] is None
            assert proc.wait(timeout=30) == code
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]


def test_signals_to_the_stand_in_reach_the_fork_and_its_stop_shows(tmp_path: Path) -> None:
    """torchrun's SIGTERM (to the stand-in's group) is the fork's; a fork that stopped itself shows
    its stand-in stopped (state T, which the agent looks for), and a SIGCONT to the stand-in
    continues it."""
    term = _shim(tmp_path, "term")
    stop = _shim(tmp_path, "stop")
    try:
        _facts(term)
        os.killpg(term.pid, signal.SIGTERM)
        assert term.wait(timeout=30) == 7
        worker = _facts(stop)["pid"]
        _until(lambda: _state(stop.pid) == "T", "the stand-in shows its fork's stop")
        assert _state(worker) == "T"
        os.kill(stop.pid, signal.SIGCONT)
        assert stop.stdout is not None and stop.stdout.readline() == b"continued\n"
        assert stop.wait(timeout=30) == 0
    finally:
        for p in (term, stop):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            p.stdout.close()  # type: ignore[union-attr]


def test_a_stand_in_that_dies_takes_its_fork_with_it(tmp_path: Path) -> None:
    """torchrun's last resort is SIGKILL, and a worker of the lm_resiliency backend dies with its
    agent: either way the stand-in dies, and the fork must not outlive it."""
    proc = _shim(tmp_path, "wait")
    try:
        worker = _facts(proc)["pid"]
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        _until(lambda: _gone(worker), "the fork ends with its stand-in")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "env",
    [{"OMP_NUM_THREADS": "4"}, {"PYTHONPATH": "/elsewhere"}, {"LM_RESILIENCY_TEST_FRESH": "1"}],
    ids=["threads", "path", "asked"],
)
def test_a_worker_a_fork_would_not_match_gets_a_fresh_interpreter(
    tmp_path: Path, env: dict[str, str]
) -> None:
    if "PYTHONPATH" in env:  # still this checkout first: only the rest differs
        env = {"PYTHONPATH": os.pathsep.join([worker_env({})["PYTHONPATH"], env["PYTHONPATH"]])}
    proc = _shim(tmp_path, "exit", env)
    try:
        facts = _facts(proc)
        assert not facts["forked"] and facts["through"] and facts["pid"] == proc.pid, facts
        assert proc.wait(timeout=60) == 3
    finally:
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


def test_a_backend_worker_runs_the_backends_sitecustomize_as_a_fresh_one_would(tmp_path: Path) -> None:
    """The lm_resiliency backend puts its `_boot` folder first on its workers' PYTHONPATH."""
    import lm_resiliency

    boot = Path(lm_resiliency.__file__).resolve().parent / "_boot"
    path = os.pathsep.join([str(boot), worker_env({})["PYTHONPATH"]])
    proc = _shim(tmp_path, "exit", {"PYTHONPATH": path})
    try:
        facts = _facts(proc)
        assert facts["forked"] and facts["boot"] == str(boot / "sitecustomize.py"), facts
        assert proc.wait(timeout=30) == 3
    finally:
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


def test_a_worker_ends_with_its_zygote(probe: Path, tmp_path: Path) -> None:
    """However its test or stand-in fared, no fork outlives the zygote (which ends with the session)."""
    zygote = Zygote()  # (its own: the session's serves the other tests)
    with zygote.proc:
        try:
            env = {**worker_env({}), "PROBE_OUT": str(tmp_path / "wait.json")}
            worker = zygote.fork([str(probe), "wait"], env, tmp_path / "wait.log", tmp_path)
            with worker._conn:
                zygote.proc.kill()
                zygote.proc.wait()
                _until(lambda: _gone(worker.pid), "the fork ends with its zygote")
        finally:
            zygote.proc.kill()
            shutil.rmtree(zygote.dir, ignore_errors=True)
