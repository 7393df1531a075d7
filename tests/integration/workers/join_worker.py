"""One rank of a gloo DDP job with uneven inputs under DDP's `Join` (the PyTorch tutorial's pattern):
rank r has 4 + 3 r batches an epoch, for EPOCHS epochs; the ranks that run out shadow the others'
all-reduces. SCOUT checks every step. Writes RESULT_DIR/rank<r>.json: the fault reports and the
optimizer steps taken.

Env: RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, EPOCHS."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import enable_resiliency


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = DDP(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    reports: list[dict] = []
    session = enable_resiliency(
        model, opt, interval=1, enable_checkpoint=False, fault_callback=reports.append
    )
    for epoch in range(int(os.environ.get("EPOCHS", "3"))):
        with Join([model]):
            for i in range(4 + 3 * rank):
                g = torch.Generator().manual_seed(epoch * 1000 + i * 10 + rank)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        dist.barrier()
    dist.barrier()
    session.close()  # (its last reports delivered first)
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump({"steps": session.step_count, "faults": reports}, f, default=str)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
