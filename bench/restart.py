"""Restart benchmark: our torchrun backend vs torchrun's c10d backend, same job, same run.

Prints progress, then one JSON object on the last line:
  restart_ratio_vs_c10d   worker SIGKILL -> the next generation's first completed step, ours / c10d
                          (c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, its only clean setting on
                          torch 2.13; `--max-restarts`), median over --reps interleaved pairs (goal <= 1.0)
  rendezvous_s            per restarted generation: the last agent's next_rendezvous (from the
                          moment every node is back to its assignment; goal < 0.3 s);
                          rendezvous_wait_s: the first agent's, which also waits for the other
                          nodes to stop their workers
  standby_promotion_s     a whole node SIGKILLed (agent + worker) -> the first step completed with the
                          standby in its slot (heartbeat timeout --heartbeat-ms)
  successes / attempts    runs that finished with every step done after the kill
The job: 2 nodes x 1 gloo worker (a small DDP model, enable_resiliency capturing every step); ours
runs a third agent as the standby.

Usage: python bench/restart.py [--reps 3] [--heartbeat-ms 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import child_pythonpath  # noqa: E402

WORKER = str(ROOT / "bench" / "_restart_worker.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(backend: str, kill: str, tmp: Path, heartbeat_ms: int, steps: int) -> dict[str, object]:
    times = tmp / "times"
    times.mkdir(parents=True)
    port, run_id = _port(), f"bench-{backend}-{kill}-{os.getpid()}-{time.time_ns()}"
    nodes = 3 if backend == "lm_resiliency" else 2
    procs = []
    for n in range(nodes):
        mid = tmp / f"mid{n}"
        mid.write_text(f"{tmp.name}-node-{n}\n")
        env = {
            **os.environ,
            "PYTHONPATH": child_pythonpath(),
            "OMP_NUM_THREADS": "1",
            "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
            "LM_RESILIENCY_SHM_DIR": str(tmp / "shm"),
            "TIMES": str(times),
            "KILL": kill,
            "STEPS": str(steps),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        if backend == "lm_resiliency":
            rdzv = [
                "--nnodes=2:3",
                "--rdzv-backend=lm_resiliency",
                "--rdzv-conf="
                + ",".join(
                    [
                        f"lm_resiliency_restart_context_path={tmp / f'ctx{n}.json'}",
                        "lm_resiliency_poll_interval_ms=100",
                        f"lm_resiliency_heartbeat_timeout_ms={heartbeat_ms}",
                    ]
                ),
            ]
        else:
            rdzv = ["--nnodes=2", "--rdzv-backend=c10d"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rdzv,
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--local-addr=127.0.0.1",
            "--nproc-per-node=1",
            "--max-restarts=3",
            "--monitor-interval=0.1",
            WORKER,
        ]
        log = open(tmp / f"agent{n}.log", "wb")  # noqa: SIM115
        procs.append(
            (
                # In the bench's folder: the durable tier's ./checkpoints lands there, not where the
                # bench was started (the checkout).
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp
                ),
                log,
            )
        )
        if n == 0:
            time.sleep(0.5)  # the first agent hosts c10d's store
    try:
        deadline = time.monotonic() + 300
        for p, _ in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    kill_t, first_after, done = None, None, set()
    for f in times.glob("rank*.txt"):
        for line in f.read_text().splitlines():
            a, b, c = line.split()
            if a == "kill":
                kill_t = float(c)
    for f in times.glob("rank*.txt"):
        for line in f.read_text().splitlines():
            a, b, c = line.split()
            if a != "kill" and int(a) > 0:
                t = float(c)
                first_after = t if first_after is None else min(first_after, t)
            if a != "kill":
                done.add((f.name, int(b)))
    finished = all((f"rank{r}.txt", steps) in done for r in range(2))
    logs = "\n".join((tmp / f"agent{n}.log").read_text(errors="replace") for n in range(nodes))
    per_gen: dict[int, list[float]] = {}
    for g, x in re.findall(r"generation (\d+), slot \d+ of \d+ \(rendezvous ([\d.]+) s\)", logs):
        if int(g) > 0:
            per_gen.setdefault(int(g), []).append(float(x))
    # The last agent to arrive measures the protocol itself (everyone else was there); the first
    # also waited for the other nodes to stop their workers.
    rdzv = [min(v) for v in per_gen.values()]
    rdzv_wait = [max(v) for v in per_gen.values()]
    return {
        "recovery_s": (first_after - kill_t) if (kill_t and first_after) else None,
        "finished": finished,
        "rendezvous_s": rdzv,
        "rendezvous_wait_s": rdzv_wait,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--heartbeat-ms", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    ours, theirs, rdzv, rdzv_wait, attempts, successes = [], [], [], [], 0, 0
    with tempfile.TemporaryDirectory(prefix="lmr-bench-restart-") as d:
        tmp = Path(d)
        for i in range(args.reps):
            for backend in ("lm_resiliency", "c10d"):
                r = run(backend, "worker", tmp / f"{backend}-{i}", args.heartbeat_ms, args.steps)
                attempts += 1
                successes += int(bool(r["finished"]) and r["recovery_s"] is not None)
                (ours if backend == "lm_resiliency" else theirs).append(r["recovery_s"])
                if backend == "lm_resiliency":
                    rdzv.extend(r["rendezvous_s"])  # type: ignore[arg-type]
                    rdzv_wait.extend(r["rendezvous_wait_s"])  # type: ignore[arg-type]
                print(
                    f"rep {i} {backend}: kill -> first step {r['recovery_s']} s, finished {r['finished']}",
                    flush=True,
                )
        node = run("lm_resiliency", "node", tmp / "node", args.heartbeat_ms, args.steps)
        attempts += 1
        successes += int(bool(node["finished"]) and node["recovery_s"] is not None)
        print(
            f"node loss: kill -> first step {node['recovery_s']} s, finished {node['finished']}", flush=True
        )
    ok_ours = [x for x in ours if x is not None]
    ok_theirs = [x for x in theirs if x is not None]
    out = {
        "restart_ratio_vs_c10d": (statistics.median(ok_ours) / statistics.median(ok_theirs))
        if ok_ours and ok_theirs
        else None,
        "restart_s_ours": ok_ours,
        "restart_s_c10d": ok_theirs,
        "rendezvous_s": rdzv,
        "rendezvous_s_max": max(rdzv) if rdzv else None,
        "rendezvous_wait_s": rdzv_wait,
        "standby_promotion_s": node["recovery_s"],
        "heartbeat_timeout_s": args.heartbeat_ms / 1000,
        "successes": successes,
        "attempts": attempts,
        "goals": {"restart_ratio_vs_c10d": "<= 1.0", "rendezvous_s": "< 0.3 s each"},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
