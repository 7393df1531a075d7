"""One rank of a 3-node gloo DDP job, each node in its own network namespace (see test_links.py).

Env: RANK, WORLD_SIZE, MASTER_ADDR, STORE_PORT, RESULT_DIR, DURATION_S, plus
LM_RESILIENCY_BIND_HOST, LM_RESILIENCY_MACHINE_ID_PATH and GLOO_SOCKET_IFNAME. Trains until rank 0
says stop (after DURATION_S of training; the flag travels in the gradients' all-reduce) and writes
RESULT_DIR/rank<r>.json with every fault report.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import ReplayHarnessConfig, RuntimeConfig, enable_resiliency


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["STORE_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    faults: list[dict[str, object]] = []
    session = enable_resiliency(
        model,
        opt,
        interval=1,
        enable_checkpoint=False,
        fault_callback=faults.append,
        replay=ReplayHarnessConfig(link_probe_interval_s=0.25, straggler_confirmations=3),
        runtime=RuntimeConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0),
    )
    duration = float(os.environ["DURATION_S"])
    t0 = time.monotonic()
    step = 0
    while True:
        step += 1
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank * 1009 + step))
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        stop = torch.tensor([1.0 if rank == 0 and time.monotonic() - t0 > duration else 0.0])
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
    dist.barrier()
    time.sleep(0.5)  # bounded grace for the last votes in flight, not a synchronisation
    out = os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"rank": rank, "steps": step, "faults": faults}, f)
    os.replace(out + ".tmp", out)
    session.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
