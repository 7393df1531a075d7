"""CPU demo of the torchrun backend: synthetic nodes on one host, faults injected from outside.

    python -m examples.torchrun_demo [--steps 150]

Runs examples/production_loops/pytorch.py (a tiny causal LM under DDP, gloo) twice with
`torchrun --rdzv-backend=lm_resiliency`, each node its own torchrun agent with its own machine-id
file: first uninterrupted (2 nodes), then with 2 active nodes and 1 parked standby, where the demo
SIGKILLs one worker during generation 0 (its node restarts in place from shared memory) and then a
whole node -- agent and worker -- during generation 1 (the standby takes its slot and pulls its state
from a peer replica). It prints what the leader decided per generation and whether the final model is
bitwise the uninterrupted one; exit status 0 only when it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "examples" / "production_loops" / "policies" / "resiliency.toml"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    try:
        raw = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in raw.split()]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def launch(work: Path, name: str, nodes: int, steps: int) -> tuple[list[subprocess.Popen[bytes]], Path]:
    port, run_id = _port(), f"demo-{name}-{os.getpid()}"
    val = work / name / "validation"
    procs = []
    for n in range(nodes):
        mid = work / name / f"machine-id-{n}"
        mid.parent.mkdir(parents=True, exist_ok=True)
        mid.write_text(f"demo-{name}-node-{n}\n")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
            "LM_RESILIENCY_SHM_DIR": str(work / name / "shm"),
        }
        conf = ",".join(
            [
                f"lm_resiliency_restart_context_path={work / name / f'context-{n}.json'}",
                f"lm_resiliency_worker_config={POLICY}",
                "lm_resiliency_poll_interval_ms=100",
                "lm_resiliency_heartbeat_timeout_ms=2000",
            ]
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2:3",
            "--nproc-per-node=1",
            "--rdzv-backend=lm_resiliency",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--local-addr=127.0.0.1",
            f"--rdzv-conf={conf}",
            "--max-restarts=10",
            "--monitor-interval=0.1",
            "-m",
            "examples.production_loops.pytorch",
            "--validation-output-dir",
            str(val),
            "--steps",
            str(steps),
        ]
        log = open(work / name / f"agent-{n}.log", "wb")  # noqa: SIM115 - closed by the OS at exit
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        time.sleep(0.3)  # arrival order: the last node parks as the standby
    return procs, val


def wait_for(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float = 180.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if all(p.poll() is not None for p in procs):
            return False
        time.sleep(0.1)
    return False


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 240.0) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(None)
    return codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs) and print its path")
    args = ap.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="lmr-torchrun-demo-"))
    try:
        print("1/2 uninterrupted run (2 nodes) ...", flush=True)
        procs, base_val = launch(work, "baseline", 2, args.steps)
        if any(c != 0 for c in finish(procs)):
            print(f"the uninterrupted run failed; logs in {work / 'baseline'}", flush=True)
            return 1
        print("2/2 faulted run (2 active nodes + 1 standby) ...", flush=True)
        procs, val = launch(work, "faulted", 3, args.steps)
        injected = []
        if wait_for(val / "generation-0.json", procs):
            time.sleep(1.5)
            victims = [c for c in _children(procs[1].pid) if b"production_loops" in _cmdline(c)]
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            injected.append({"fault": "worker SIGKILL", "node": "demo-faulted-node-1", "pids": victims})
            print(f"   injected: SIGKILL of node 1's worker {victims}", flush=True)
        if wait_for(val / "generation-1.json", procs):
            time.sleep(1.5)
            os.killpg(procs[0].pid, signal.SIGKILL)
            injected.append({"fault": "node SIGKILL (agent + worker)", "node": "demo-faulted-node-0"})
            print("   injected: SIGKILL of node 0 (agent and worker)", flush=True)
        codes = finish(procs)
        gens = []
        for f in sorted(val.glob("generation-*.json"), key=lambda p: int(p.stem.split("-")[1])):
            doc = json.loads(f.read_text())
            ctx = doc.get("restart_context") or {}
            gens.append(
                {
                    "generation": doc["generation"],
                    "resumed_at_step": doc["start_step"],
                    "failure_kind": ctx.get("failure_kind", "none"),
                    "reason_code": ctx.get("reason_code", "startup"),
                    "culprits": ctx.get("culprits", []),
                    "admitted": ctx.get("admitted", []),
                    "restored_from": (doc.get("recovery_decision") or {}).get("reason"),
                    "leader": ctx.get("leader"),
                }
            )
        a = torch.load(base_val / "final.pt") if (base_val / "final.pt").exists() else None
        b = torch.load(val / "final.pt") if (val / "final.pt").exists() else None
        equal = a is not None and b is not None and all(torch.equal(a[k], b[k]) for k in a)
        summary = {
            "steps": args.steps,
            "injected": injected,
            "generations": gens,
            "agent_exit_codes": codes,
            "final_state_bitwise_equal_to_uninterrupted": equal,
        }
        for g in gens:
            why = f"{g['failure_kind']}/{g['reason_code']}"
            print(
                f"   generation {g['generation']}: resumed at step {g['resumed_at_step']} ({why}, "
                f"culprits {g['culprits']}, admitted {g['admitted']})",
                flush=True,
            )
        print(json.dumps(summary, indent=2))
        ok = equal and len(injected) == 2 and len(gens) == 3
        if args.keep or not ok:
            print(f"logs: {work}")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
