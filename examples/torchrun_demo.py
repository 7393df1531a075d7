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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from examples.torchrun.resiliency_cycle import cluster
from examples.torchrun.resiliency_cycle.cluster import children, cmdline, finish, wait_for

# The faulted run's steps take at least this long (a sleep in each; the numerics are unchanged), so
# the kills, 1.5 s into a generation, land mid-run however fast the machine trains the tiny model.
# Before, on an idle 2-core machine the 150 steps could end first (2 of 3 runs: exit 1).
STEP_MS = 25.0


def launch(
    work: Path, name: str, nodes: int, steps: int, step_ms: float = 0.0
) -> tuple[list[subprocess.Popen[bytes]], Path]:
    return cluster.launch(work, name, nodes, steps, min_nodes=2, step_ms=step_ms)


def training(procs: list[subprocess.Popen[bytes]]) -> list[tuple[int, list[int]]]:
    """(node, its workers' pids) for each node whose agent runs workers now: the active ones. Which
    nodes park as standbys is the order their agents registered in, not the order they started
    in (before, the demo took node 1 for active and node 0 for the standby's opposite: on a loaded
    machine node 1 could be the standby, and the kills missed)."""
    out = []
    for n, p in enumerate(procs):
        workers = [c for c in children(p.pid) if b"production_loops" in cmdline(c)]
        if workers:
            out.append((n, workers))
    return out or [(0, [])]


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
        procs, val = launch(work, "faulted", 3, args.steps, STEP_MS)
        injected = []
        if wait_for(val / "generation-0.json", procs):
            time.sleep(1.5)
            n, victims = training(procs)[-1]
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            injected.append({"fault": "worker SIGKILL", "node": f"demo-faulted-node-{n}", "pids": victims})
            print(f"   injected: SIGKILL of node {n}'s worker {victims}", flush=True)
        if wait_for(val / "generation-1.json", procs):
            time.sleep(1.5)
            n = training(procs)[0][0]
            os.killpg(procs[n].pid, signal.SIGKILL)
            injected.append({"fault": "node SIGKILL (agent + worker)", "node": f"demo-faulted-node-{n}"})
            print(f"   injected: SIGKILL of node {n} (agent and worker)", flush=True)
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
