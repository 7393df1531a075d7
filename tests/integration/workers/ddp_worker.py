"""One rank of a 4-process DDP job on gloo, instrumented with enable_resiliency.

Started by tests/integration/test_ddp_session.py (and bench/transport.py) with:
    RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, STEPS, LM_RESILIENCY_MACHINE_ID_PATH
It trains, records what its runtime saw, signals `trained/<rank>` in the store, then waits to see
rank `KILL_RANK` die (the test kills it) and writes `<RESULT_DIR>/rank<r>.json`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import RuntimeConfig, enable_resiliency


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps = int(os.environ.get("STEPS", "20"))
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))
    result_dir = os.environ["RESULT_DIR"]
    timeout_s = float(os.environ.get("HB_TIMEOUT_S", "1.0"))
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    faults: list[dict[str, object]] = []
    node_reported = threading.Event()  # the last report a death brings: its node fell silent

    def on_fault(report: dict[str, object]) -> None:
        faults.append(report)
        if report.get("reason") == "node_silent":
            node_reported.set()

    t_enable = time.monotonic()
    session = enable_resiliency(
        model,
        opt,
        interval=1,
        runtime=RuntimeConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=timeout_s),
        fault_callback=on_fault,
    )
    all_live = session.wait_for(lambda v: len(v.live) == world, timeout=5.0)
    t_live = time.monotonic() - t_enable
    gen = torch.Generator().manual_seed(100 + rank)
    immediate, waited_max, late = 0, 0.0, 0
    for step in range(1, steps + 1):
        x = torch.randn(32, 64, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert session.step_count == step
        if step >= 2:
            # Every peer's telemetry of the previous step must be here by the end of this one.
            def have_prev(v: object, s: int = step) -> bool:
                return all(v.telemetry_step(r) >= s - 1 for r in range(world))  # type: ignore[attr-defined]

            t0 = time.monotonic()
            if have_prev(session.cluster_view()):
                immediate += 1
            elif session.wait_for(have_prev, timeout=1.0):
                waited_max = max(waited_max, time.monotonic() - t0)
            else:
                late += 1
    view = session.cluster_view()
    result: dict[str, object] = {
        "rank": rank,
        "all_live": all_live,
        "time_to_all_live_s": t_live,
        "telemetry_immediate": immediate,
        "telemetry_waited_max_s": waited_max,
        "telemetry_late": late,
        "checked_steps": steps - 1,
        "peer_steps": {str(r): view.telemetry_step(r) for r in range(world)},
        "topology_digest": session.topology.digest(),
        "replica_groups": [list(g) for g in session.topology.replica_groups],
        "nodes": list(session.topology.nodes()),
        "final_param_sum": float(sum(p.double().sum() for p in model.parameters())),
    }

    def write_result() -> None:
        tmp = os.path.join(result_dir, f"rank{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(result_dir, f"rank{rank}.json"))

    tcp_router = next(e for e in session.runtime.announcement.router if e.startswith("tcp://"))
    store.set(f"test/router/{rank}", tcp_router.encode())
    if kill_rank >= 0 and rank == kill_rank:
        # The test kills this rank as soon as it signals: its result is on disk before that.
        result["faults"] = faults
        write_result()
        store.set(f"test/trained/{rank}", b"1")
        store.wait([f"test/killed/{kill_rank}"], datetime.timedelta(seconds=60))  # killed while waiting
        return 3
    store.set(f"test/trained/{rank}", b"1")
    if kill_rank >= 0:
        # Wait for the test to mark the rank as killed, then for our runtime to notice.
        store.wait([f"test/killed/{kill_rank}"], datetime.timedelta(seconds=60))
        noticed = session.wait_for(lambda v: kill_rank not in v.live, timeout=timeout_s * 5 + 5)
        result["noticed_death"] = noticed and node_reported.wait(timeout_s + 5)
        result["noticed_at_wall"] = time.time()
        result["dead_state"] = session.cluster_view().peers[kill_rank].state.value
        result["forged_rejected"] = session.cluster_view().stats["rejected_auth"]
        result["live_after"] = sorted(session.cluster_view().live)
    result["faults"] = faults
    write_result()
    if kill_rank >= 0:
        # A survivor that closes sends a genuine goodbye: wait until every survivor has recorded
        # what it saw, so none records a peer that left on purpose as gone.
        store.set(f"test/recorded/{rank}", b"1")
        survivors = [r for r in range(world) if r != kill_rank]
        store.wait([f"test/recorded/{r}" for r in survivors], datetime.timedelta(seconds=60))
    session.close()
    # gloo's teardown with a dead peer is not what this test is about; leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
