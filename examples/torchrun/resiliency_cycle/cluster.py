"""Synthetic nodes on one host: one torchrun agent per node (`--rdzv-backend=lm_resiliency`), each with
its own machine-id file, running `examples.production_loops.<framework>`. Shared by the CPU demo and the
pressure orchestrator.

The agents run under this Python, or the one `LM_RESILIENCY_EXAMPLES_PYTHON` names (an interpreter
or a wrapper that runs `python ARGS...` as its own process, signals and exit status included, as
torchrun's `PYTHON_EXEC` does for workers: the test suite's stand-in that forks an interpreter with
torch already imported)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
POLICY = ROOT / "examples" / "production_loops" / "policies" / "resiliency.toml"

__all__ = ["POLICY", "ROOT", "children", "cmdline", "finish", "free_port", "launch", "wait_for"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    try:
        raw = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in raw.split()]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def launch(
    work: Path,
    name: str,
    nodes: int,
    steps: int,
    *,
    min_nodes: int | None = None,
    policy: Path = POLICY,
    framework: str = "pytorch",
    env: Mapping[str, str] | None = None,
    gpus: list[int] | None = None,
    step_ms: float = 0.0,
    loop_args: Sequence[str] = (),
) -> tuple[list[subprocess.Popen[bytes]], Path]:
    """Start `nodes` agents (the first `min_nodes` train, the others park as standbys); return them
    and the validation folder the loop writes to. Node n's files live in `work/name`, the loop's
    working folder. `step_ms`: each step of the loop takes that much longer (the loop's
    `--step-ms`); `loop_args`: more of the loop's options (DeepSpeed's `--zero-stage 1`)."""
    port, run_id = free_port(), f"{name}-{os.getpid()}-{time.monotonic_ns() % 1_000_000}"
    min_nodes = nodes if min_nodes is None else min_nodes
    base = work / name
    val = base / "validation"
    base.mkdir(parents=True, exist_ok=True)
    procs = []
    for n in range(nodes):
        mid = base / f"machine-id-{n}"
        mid.write_text(f"{name}-node-{n}\n")
        node_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
            "LM_RESILIENCY_SHM_DIR": str(base / "shm"),
            **(env or {}),
        }
        if gpus is not None:
            node_env["CUDA_VISIBLE_DEVICES"] = str(gpus[n])
        conf = ",".join(
            [
                f"lm_resiliency_restart_context_path={base / f'context-{n}.json'}",
                f"lm_resiliency_worker_config={policy}",
                "lm_resiliency_poll_interval_ms=100",
                "lm_resiliency_heartbeat_timeout_ms=2000",
            ]
        )
        cmd = [
            os.environ.get("LM_RESILIENCY_EXAMPLES_PYTHON") or sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={min_nodes}:{nodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=lm_resiliency",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--local-addr=127.0.0.1",
            f"--rdzv-conf={conf}",
            "--max-restarts=10",
            "--monitor-interval=0.1",
            "-m",
            f"examples.production_loops.{framework}",
            "--validation-output-dir",
            str(val),
            "--steps",
            str(steps),
            *(["--step-ms", str(step_ms)] if step_ms > 0 else []),
            *loop_args,
        ]
        log = open(base / f"agent-{n}.log", "wb")  # noqa: SIM115 - closed by the OS at exit
        procs.append(
            subprocess.Popen(
                cmd,
                env=node_env,
                # The run's own folder: the loop's relative paths (the durable tier's ./checkpoints,
                # shared by the run's nodes as shared storage would be) land there, not in the
                # checkout (every run of the demo or of pressure left its steps in ./checkpoints).
                cwd=base,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a node's agent and workers: one group to kill
                preexec_fn=_die_with_parent,
            )
        )
        time.sleep(0.3)  # arrival order: the last nodes park as standbys
    return procs, val


def _die_with_parent() -> None:
    """In the agent before exec: SIGKILL it when the launcher dies (Linux), so no node outlives a
    launcher that was killed (its workers die with their agent already)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def wait_for(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float = 180.0) -> bool:
    """Whether `path` appeared before every agent ended or the timeout passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if all(p.poll() is not None for p in procs):
            return False
        time.sleep(0.1)  # polling a file the loop writes
    return False


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 240.0) -> list[int | None]:
    """Each agent's exit code; one still running at the timeout is killed (its code: None)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p, code in zip(procs, codes, strict=True):
        if code is None:
            stop(p)
    return codes


def stop(p: subprocess.Popen[bytes]) -> None:
    """Kill an agent's whole session (its workers too) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
