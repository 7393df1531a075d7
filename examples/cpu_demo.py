"""CPU demo: a 4-rank DDP job on 2 synthetic nodes, instrumented with one call to enable_resiliency.

    python -m examples.cpu_demo [--steps 30] [--kill-rank 3] [--slow-rank 2]

Each rank trains a small MLP with gloo, GEMINI capturing every step into shared memory and
replicating it to the other node, SCOUT comparing what the replicas compute and how long they take.
Midway, one rank's forward pass is slowed 3x for a few steps (SCOUT names it a compute straggler);
after training, one rank is SIGKILLed and the others name it from heartbeat silence alone. The demo
prints what rank 0's runtime saw and a JSON summary, and exits non-zero if anything it shows did not
happen.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    from lm_resiliency import RuntimeConfig, enable_resiliency

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps, kill = int(os.environ["DEMO_STEPS"]), int(os.environ["DEMO_KILL"])
    slow = int(os.environ["DEMO_SLOW"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["DEMO_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    faults: list[dict[str, object]] = []
    reported = threading.Event()  # the kill's process_failure report came (on the runtime thread)

    def on_fault(report: dict[str, object]) -> None:
        faults.append(report)
        if report.get("kind") == "process_failure" and report.get("failed_ranks") == [kill]:
            reported.set()

    session = enable_resiliency(
        model,
        opt,
        interval=1,
        fault_callback=on_fault,
        runtime=RuntimeConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0),
    )
    session.wait_for(lambda v: len(v.live) == world, 10.0)
    if rank == slow:
        import time as _time

        def slow_forward(module: object, args: object, out: object) -> None:
            if steps // 3 <= session.step_count < steps // 3 + 6:
                _time.sleep(0.05)  # an injected fault: SCOUT is not told

        model.module[0].register_forward_hook(slow_forward)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(64, 128, generator=gen)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % 10 == 0:
            v = session.cluster_view()
            cells = []
            for r, p in sorted(v.peers.items()):
                t = p.telemetry
                cells.append(
                    f"r{r}:{p.state.value} step {v.telemetry_step(r)}"
                    + (f" {t.step_s * 1e3:.1f}ms (comm {t.comm_s * 1e3:.1f})" if t else "")
                )
            print(f"[rank 0 view @ step {session.step_count}] " + " | ".join(cells), flush=True)
    store.set(f"demo/trained/{rank}", b"1")
    if rank == kill:
        store.wait(["demo/never"], datetime.timedelta(seconds=120))  # the demo kills us here
        return 1
    t0 = time.monotonic()
    noticed = session.wait_for(lambda v: kill not in v.live, 10.0)
    after = time.monotonic() - t0
    # Its report follows the view by a moment (a summary written at once could miss it).
    reported.wait(10.0)
    gem = session.gemini
    gem.drain(30)
    summary = {
        "rank": rank,
        "steps": session.step_count,
        "gemini": {
            "captures": gem.stats.captures,
            "replicated": gem.stats.replicated,
            "replicas_held": gem.stats.replicas_received,
            "bytes_in_shm_on_node": gem.held_bytes(),
        },
        "noticed_kill": noticed,
        "noticed_after_s": round(after, 3),
        "faults": faults,
        "topology": {
            "nodes": list(session.topology.nodes()),
            "replica_groups": [list(g) for g in session.topology.replica_groups],
            "digest": session.topology.digest(),
        },
        "auth": {
            k: session.cluster_view().stats[k] for k in ("accepted", "rejected_auth", "rejected_replay")
        },
    }
    store.set(f"demo/summary/{rank}", json.dumps(summary).encode())
    session.close()
    os._exit(0)  # skip gloo teardown with a dead peer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--kill-rank", type=int, default=3)
    ap.add_argument("--slow-rank", type=int, default=2)
    args = ap.parse_args()
    if os.environ.get("DEMO_ROLE") == "worker":
        return worker()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tmp = Path(tempfile.mkdtemp(prefix="lmr-demo-"))
    procs = []
    try:
        for r in range(args.world):
            mid = tmp / f"machine-id-{r // 2}"
            mid.write_text(f"demo-node-{r // 2}\n")
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1",
                "DEMO_ROLE": "worker",
                "RANK": str(r),
                "WORLD_SIZE": str(args.world),
                "DEMO_PORT": str(store.port),
                "DEMO_STEPS": str(args.steps),
                "DEMO_KILL": str(args.kill_rank),
                "DEMO_SLOW": str(args.slow_rank),
                "LM_RESILIENCY_SHM_DIR": str(tmp / "shm"),
                "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
            }
            # In the demo's own folder: GEMINI's durable tier (./checkpoints) lands there, not in
            # the checkout.
            procs.append(subprocess.Popen([sys.executable, "-m", "examples.cpu_demo"], env=env, cwd=tmp))
        print(f"started {args.world} ranks on 2 synthetic nodes; training {args.steps} steps", flush=True)
        keys = [f"demo/trained/{r}" for r in range(args.world)]
        deadline = time.monotonic() + 300
        while not store.check(keys):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                print("a rank failed before the end of training", file=sys.stderr)
                return 1
            time.sleep(0.05)
        print(f"SIGKILL rank {args.kill_rank}", flush=True)
        procs[args.kill_rank].send_signal(signal.SIGKILL)
        survivors = [r for r in range(args.world) if r != args.kill_rank]
        for r in survivors:
            procs[r].wait(timeout=60)
        summaries = [json.loads(store.get(f"demo/summary/{r}")) for r in survivors]

        def named(s: dict[str, object], kind: str) -> list[object]:
            return [f["failed_ranks"] for f in s["faults"] if f["kind"] == kind]  # type: ignore[attr-defined,index]

        ok = all(
            s["noticed_kill"]
            and named(s, "process_failure") == [[args.kill_rank]]
            and named(s, "straggler") == [[args.slow_rank]]
            and s["gemini"]["captures"] > 0
            for s in summaries
        )
        for s in summaries:
            print(
                f"rank {s['rank']}: compute straggler named {named(s, 'straggler')}; "
                f"rank {args.kill_rank} named dead after {s['noticed_after_s']}s; GEMINI {s['gemini']}",
                flush=True,
            )
        print(json.dumps({"ok": ok, "killed_rank": args.kill_rank, "summaries": summaries}))
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
