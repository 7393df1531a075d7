"""A plain DDP job that knows nothing of faults: a campaign reaches it through
LM_RESILIENCY_FAULT_CAMPAIGN. Env: RANK, WORLD_SIZE, STORE_PORT, STEPS, RESULT_DIR, REPORT_DIR;
CHECKPOINT=1 (GEMINI on), FSDP=1 (the model sharded by FSDP2 instead), AWAIT_REPORT_S (wait that
long for a report after the loop), WAIT_FOR_RANK0=1 (stay until rank 0 wrote its result). Writes
rank<R>.json (steps done, fault reports) when its loop ends."""

from __future__ import annotations

import datetime
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import ReplayHarnessConfig, enable_resiliency


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    if os.environ.get("FSDP") == "1":  # FSDP2: each rank holds a shard (64 rows over 3: uneven)
        from torch.distributed.fsdp import fully_shard

        model: nn.Module = fully_shard(net)
    else:
        model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    session = enable_resiliency(
        model,
        opt,
        interval=1,
        enable_checkpoint=os.environ.get("CHECKPOINT") == "1",
        replay=ReplayHarnessConfig(report_dir=os.environ["REPORT_DIR"]),
    )
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(session.step_count, int(os.environ["STEPS"])):
        x = torch.randn(16, 32, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Every rank's last step is in before any rank reads what was found.
    dist.barrier()
    deadline = time.monotonic() + float(os.environ.get("AWAIT_REPORT_S", "0"))
    while not session.fault_reports and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for SCOUT's verdict, which arrives on its own thread
    if os.environ.get("WAIT_FOR_RANK0") == "1":  # alive (not closed) until rank 0 has reported
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(os.environ["RESULT_DIR"], "rank0.json")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)  # polling a file rank 0 writes atomically
    result = {"steps": session.step_count, "reports": session.fault_reports}
    gem = session.gemini
    if gem is not None:
        result["gemini"] = {
            "captures": gem.stats.captures,
            "skipped_busy": gem.stats.skipped_busy,
            "replication_failures": gem.stats.replication_failures,
            "newest": gem.newest_recoverable_step("latest"),
            "replicas": {o: list(steps) for o, steps in gem.inventory().replicas.items()},
        }
    session.close()
    out = os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json")
    with open(out + ".tmp", "w") as fh:
        json.dump(result, fh)
    os.replace(out + ".tmp", out)
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
