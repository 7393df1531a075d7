from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from tests._zygote import script_or_module, start_settings_differ

ROOT = Path(__file__).resolve().parent.parent
FRESH = os.environ.get("LM_RESILIENCY_TEST_FRESH") == "1"  # every worker a fresh interpreter

# What the session's processes leave in the temporary folder goes with the session: torchrun makes a
# log folder per agent (`torchelastic_*`, never removed), a process killed by its test leaves its
# multiprocessing folder (`pymp-*`) and IPC sockets. The processes it starts read TMPDIR; this one
# (and what it forks: a data loader's workers) takes the scratch once pytest made its own folders
# (`_scratch_for_this_process`): pytest's `tmp_path`s are kept for a failure's post-mortem.
SCRATCH = tempfile.mkdtemp(prefix="lmr-tests-")
os.environ["TMPDIR"] = SCRATCH


@pytest.fixture(scope="session", autouse=True)
def _scratch_for_this_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp_path_factory.getbasetemp()  # (pytest's folders: where they always were)
    tempfile.tempdir = SCRATCH


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment: the test's, this checkout importable ahead of the caller's PYTHONPATH
    (which may be where pyzmq was installed, as on the lent GPU host), one intra-op thread, `env`."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env}


class Forked:
    """A worker forked by the zygote (`tests/_zygote.py`), with the part of `subprocess.Popen` the
    tests use. Its exit status comes from the zygote, which is its parent."""

    def __init__(self, args: list[str], conn: socket.socket) -> None:
        self.args = args
        self._conn = conn
        self._buf = b""
        self.returncode: int | None = None
        self.pid: int = self._read(timeout=60.0)["pid"]

    def _read(self, timeout: float | None) -> dict[str, Any]:
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the zygote went away while it ran {self.args}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._read(timeout)["returncode"])
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid the zygote has reaped (and the kernel may reuse)
            with contextlib.suppress(ProcessLookupError):  # reaped, the news on its way (as Popen)
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test session's preloaded Python (`tests/_zygote.py`): started on first use, stopped when
    the session ends. Its workers' environment names a stand-in Python (`tests/_zyshim.py`) as
    torchrun's PYTHON_EXEC, so that the workers torchrun starts are forks of it too.
    LM_RESILIENCY_TEST_FRESH=1 starts every worker as a fresh interpreter instead (in a torchrun
    job's environment: its workers)."""

    _instance: Zygote | None = None

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lmr-zygote-")
        self.path = os.path.join(self.dir, "sock")
        # torchrun starts its workers with PYTHON_EXEC: this stand-in has the zygote fork them.
        shim = Path(self.dir) / "python"
        shim.write_text(f"#!{sys.executable} -IS\n" + (ROOT / "tests" / "_zyshim.py").read_text())
        shim.chmod(0o755)
        self.extra = {
            "PYTHON_EXEC": str(shim),
            # The torchrun backend's control-store host too (its agents start it): a fork, not a
            # fresh interpreter importing torch for 2-3 s of every job's first rendezvous.
            "LM_RESILIENCY_STORE_HOST_PYTHON": str(shim),
            "LMR_TEST_PYTHON": sys.executable,
            "LMR_TEST_ZYGOTE": self.path,
        }
        env = {**worker_env({}), **self.extra}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_zygote.py"), self.path],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            start_new_session=True,
        )
        self.env = env
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the test zygote did not start: {line!r}")

    @classmethod
    def get(cls) -> Zygote:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @classmethod
    def stop(cls) -> None:
        z, cls._instance = cls._instance, None
        if z is not None:
            with z.proc:  # closes its pipes and waits; it keeps nothing worth an orderly exit
                z.proc.kill()
            shutil.rmtree(z.dir, ignore_errors=True)

    def takes(self, args: list[str], env: dict[str, str]) -> bool:
        """Whether a fork is what `python args` with `env` would have been: a script or a module,
        and the same settings that act at interpreter start (PYTHON*, thread pools, the loader)."""
        return script_or_module(args) and not start_settings_differ({**self.extra, **env}, self.env)

    def fork(self, args: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> Forked:
        log_path.write_bytes(b"")  # there on return, as Popen's would be
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = {"argv": args, "env": {**self.extra, **env}, "cwd": str(cwd), "log": str(log_path)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        return Forked(args, conn)


def pytest_unconfigure(config: pytest.Config) -> None:
    Zygote.stop()
    shutil.rmtree(SCRATCH, ignore_errors=True)


class ProcessGroup:
    """Worker processes started by one test; every one is stopped when the test ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes] | Forked] = []
        self.logs: list[IO[bytes]] = []

    def start(
        self,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        prefix: tuple[str, ...] = (),
        cwd: Path | None = None,
    ) -> Any:
        """Start `python args...` (after `prefix`, e.g. `ip netns exec NS`, which execs into it) in
        `cwd` (default: the log's folder, the test's own): a job writing relative paths (the default
        `./checkpoints`) writes them there, never in the checkout. A script named relative to the
        checkout (python's, or torchrun's) is found there. Without a prefix, the worker is a fork of
        the session's zygote (torch already imported)."""
        if cwd is None:
            cwd = log_path.parent
        args = [str(ROOT / a) if not os.path.isabs(a) and (ROOT / a).is_file() else a for a in args]
        full_env = worker_env(env)
        # A session of its own: stopping the test's process stops everything it started (torchrun's
        # workers included).
        if not prefix and not FRESH and Zygote.get().takes(args, full_env):
            forked = Zygote.get().fork(args, full_env, log_path, cwd)
            self.procs.append(forked)
            return forked
        log = open(log_path, "wb")  # noqa: SIM115 - closed with the process below
        self.logs.append(log)
        proc = subprocess.Popen(
            [*prefix, sys.executable, *args],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):  # the whole session already exited
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)
        for log in self.logs:
            log.close()


@pytest.fixture
def processes() -> Iterator[ProcessGroup]:
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(autouse=True)
def _isolated_checkpoint_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """GEMINI writes to /dev/shm and ./checkpoints by default: keep every test in its own folders.
    A test whose processes wrote ./checkpoints into the checkout fails, naming itself."""
    monkeypatch.setenv("LM_RESILIENCY_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.chdir(tmp_path)
    stray = ROOT / "checkpoints"
    before = stray.exists()
    yield
    assert before or not stray.exists(), f"this test's processes wrote {stray} into the checkout"


def start_runtimes(  # type: ignore[no-untyped-def]
    n: int,
    factory,
    key: bytes = b"j" * 32,
    nodes: list[str] | None = None,
    config: Any = None,
    clocks=None,
    groups: list[tuple[int, ...]] | None = None,
    peers: list[tuple[int, ...]] | None = None,
) -> list[Any]:
    """`n` rank runtimes in this process on `factory`'s transport, started and connected to each
    other. `config`: a RuntimeConfig (default: 50 ms heartbeats, 0.5 s timeout)."""
    from lm_resiliency.config import RuntimeConfig
    from lm_resiliency.runtime.node import RankRuntime

    config = config or RuntimeConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
    rts = [
        RankRuntime(
            rank=r,
            world_size=n,
            node_id=(nodes or ["n0"] * n)[r],
            key=key,
            incarnation=1,
            config=config,
            transport_factory=factory,
            clock=(clocks or [None] * n)[r],
            replica_group=next((g for g in groups or () if r in g), ()),
            peer_group=next((g for g in peers or () if r in g), ()),
        )
        for r in range(n)
    ]
    anns = [rt.start() for rt in rts]
    for rt in rts:
        rt.connect_peers(anns, announce=True)
    return rts


def lone_gemini(
    tmp_path: Path,
    model: Any,
    opt: Any,
    copier: Any = None,
    pin_memory: bool = True,
    verify_integrity: bool = False,
    world: int = 1,
    interval: int = 1,
    groups: list[list[int]] | None = None,
    **kwargs: Any,
) -> Any:
    """Rank 0's GEMINI of a one-node job with no runtime (nothing to replicate to; what the other
    ranks of a `world` hold is what a test puts in its `_inventories`). `groups`: the replica
    groups (one of every rank by default)."""
    from lm_resiliency.config import InMemoryCkptConfig
    from lm_resiliency.core.topology import Topology
    from lm_resiliency.gemini.component import Gemini

    class NoRuntime:
        alive = False

        def add_transfer_listener(self, fn: object) -> None: ...
        def add_chunk_sink(self, fn: object) -> None: ...
        def add_handler(self, tag: str, fn: object) -> None: ...
        def add_membership_listener(self, fn: object) -> None: ...

    return Gemini(
        rank=0,
        world_size=world,
        node_id="n",
        run_id="r",
        topology=Topology.build(["n"] * world, groups or [list(range(world))]),
        runtime=NoRuntime(),
        model=model,
        optimizer=opt,
        scheduler=kwargs.pop("scheduler", None),
        extra_state_fn=None,
        load_extra_state_fn=None,
        config=InMemoryCkptConfig(pin_memory=pin_memory, verify_integrity=verify_integrity),
        interval=interval,
        shm_dir=str(tmp_path),
        disk_folder=kwargs.pop("disk_folder", str(tmp_path / "checkpoints")),
        copier=copier,
        **kwargs,
    )


class Fp32StateSGD(torch.optim.Optimizer):
    """Momentum SGD that keeps its state in float32 for bfloat16 parameters (as mixed-precision
    optimizers do), loading through torch's own `load_state_dict`."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st["master"] = p.detach().float()
                    st["buf"] = torch.zeros_like(st["master"])
                st["buf"].mul_(0.9).add_(p.grad.float())
                st["master"].add_(st["buf"], alpha=-g["lr"])
                p.copy_(st["master"])
