"""One rank of a 3-rank gloo job: gradients reduced in the canonical layout, whatever DDP's buckets.

One model trained for a few iterations (DDP rebuilds its buckets after the first) and the same model
wrapped in a fresh DDP at every iteration, as a resumed run is (DDP's initial layout), both reduced
through `CanonicalReduction`; their gradients are compared bitwise. The same pair without our
reduction (plain DDP) is recorded for reference.

Env: RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, STEPS. Writes RESULT_DIR/rank<r>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency.adapters.canonical import CanonicalReduction


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(96, 384), nn.Tanh(), nn.Linear(384, 256), nn.LayerNorm(256), nn.Linear(256, 96)
    )


def canonical(model: nn.Module, world: int, **ddp_kwargs: Any) -> tuple[nn.Module, CanonicalReduction]:
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    reduction = CanonicalReduction.for_ddp(ddp)

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        bucket.buffer().mul_(1.0 / world)
        return reduction.reduce(bucket, None)

    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    ddp.register_comm_hook(None, hook)
    return ddp, reduction


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    # A run that has trained (DDP rebuilt its buckets after its first iteration) against the same
    # model wrapped afresh at every step (a resumed run: DDP's initial layout for that iteration).
    warm, r_warm = canonical(build(), world, bucket_cap_mb=0.05)
    warm_plain = nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=0.05)
    result: dict[str, Any] = {"rank": rank, "equal": [], "plain_equal": [], "fresh_paths": []}
    for step in range(int(os.environ["STEPS"])):
        fresh, r_fresh = canonical(build(), world, bucket_cap_mb=0.05)
        fresh_plain = nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=0.05)
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 96)
        grads = {}
        for name, m in {
            "warm": warm,
            "fresh": fresh,
            "warm_plain": warm_plain,
            "fresh_plain": fresh_plain,
        }.items():
            m.zero_grad()
            (m(x).pow(2).sum() * (rank + 1.37)).backward()
            grads[name] = [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]
        result["equal"].append(all(map(torch.equal, grads["warm"], grads["fresh"])))
        result["plain_equal"].append(all(map(torch.equal, grads["warm_plain"], grads["fresh_plain"])))
        result["fresh_paths"].append([r_fresh.in_place, r_fresh.staged])
    result["warm_paths"] = [r_warm.in_place, r_warm.staged]
    out = os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
