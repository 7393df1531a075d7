from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


class ProcessGroup:
    """Worker processes started by one test; every one is stopped when the test ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        prefix: tuple[str, ...] = (),
        cwd: Path = ROOT,
    ) -> subprocess.Popen[bytes]:
        """Start `python args...` (after `prefix`, e.g. `ip netns exec NS`, which execs into it) in
        `cwd`: a job writing relative paths (the default `./checkpoints`) writes them there."""
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
        log = open(log_path, "wb")  # noqa: SIM115 - closed with the process below
        # A session of its own: stopping the test's process stops everything it started (torchrun's
        # workers included).
        proc = subprocess.Popen(
            [*prefix, sys.executable, *args],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
        proc._log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):  # the whole session already exited
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)
            p._log.close()  # type: ignore[attr-defined]


@pytest.fixture
def processes() -> Iterator[ProcessGroup]:
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(autouse=True)
def _isolated_checkpoint_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMINI writes to /dev/shm and ./checkpoints by default: keep every test in its own folders."""
    monkeypatch.setenv("LM_RESILIENCY_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.chdir(tmp_path)


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

    return Gemini(
        rank=0,
        world_size=world,
        node_id="n",
        run_id="r",
        topology=Topology.build(["n"] * world, groups or [list(range(world))]),
        runtime=NoRuntime(),
        model=model,
        optimizer=opt,
        scheduler=None,
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
