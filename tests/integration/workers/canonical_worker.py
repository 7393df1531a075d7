"""One rank of a 3-rank gloo job: gradients reduced in the canonical layout, whatever DDP's buckets.

One model trained for a few iterations (DDP rebuilds its buckets after the first) and the same model
wrapped in a fresh DDP at every iteration, as a resumed run is (DDP's initial layout), both reduced
through `CanonicalReduction`; their gradients are compared bitwise. The same pair without our
reduction (plain DDP) is recorded for reference. Then DDP's other modes (unused parameters, static
graph, gradients as bucket views, gradient accumulation, buckets of two dtypes): warm against fresh
bitwise, and ours against plain DDP up to rounding.

Env: RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, STEPS. Writes RESULT_DIR/rank<r>.json.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
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


class Branchy(nn.Module):
    """A float64 layer among float32 ones (separate buckets per dtype) and a branch unused on
    odd steps (DDP's find_unused_parameters path)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(96, 192)
        self.b = nn.Linear(192, 192).double()
        self.c = nn.Linear(192, 96)
        self.side = nn.Linear(96, 96)
        self.use_side = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(self.b(torch.tanh(self.a(x)).double()).float())
        return h + self.side(x) if self.use_side else h


VARIANTS: dict[str, tuple[Any, dict[str, Any], int]] = {  # model, DDP options, micro-batches
    "unused_parameters": (Branchy, {"find_unused_parameters": True}, 1),
    "static_graph": (build, {"static_graph": True}, 1),
    "bucket_view": (build, {"gradient_as_bucket_view": True}, 1),
    "accumulation": (build, {}, 3),
    "mixed_dtypes": (Branchy, {}, 1),
}


def run_variant(name: str, rank: int, world: int, steps: int) -> dict[str, list[bool]]:
    """Warm against fresh (bitwise) and ours against plain DDP (close: the same average)."""
    make, kwargs, micro = VARIANTS[name]
    opts = {"bucket_cap_mb": 0.05, **kwargs}
    warm, _ = canonical(make(), world, **opts)
    plain = nn.parallel.DistributedDataParallel(make(), **opts)
    out: dict[str, list[bool]] = {"equal": [], "close": []}
    for step in range(steps):
        fresh, _ = canonical(make(), world, **opts)
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(48, 96, generator=g) * torch.logspace(-3, 3, 96)
        grads = {}
        for key, m in {"warm": warm, "fresh": fresh, "plain": plain}.items():
            if isinstance(m.module, Branchy):
                m.module.use_side = name != "unused_parameters" or step % 2 == 0
            m.zero_grad()
            for j, part in enumerate(x.chunk(micro)):
                sync = j == micro - 1
                with contextlib.nullcontext() if sync else m.no_sync():
                    (m(part).pow(2).sum() * (rank + 1.37) / micro).backward()
            grads[key] = [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
        out["equal"].append(all(_same(a, b) for a, b in zip(grads["warm"], grads["fresh"], strict=True)))
        out["close"].append(all(_close(a, b) for a, b in zip(grads["warm"], grads["plain"], strict=True)))
    return out


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal up to the rounding of a sum in another order (relative to the tensor's scale: an
    element that cancels out can differ by more than its own magnitude's epsilon)."""
    if a is None or b is None:
        return a is None and b is None
    return bool((a - b).abs().max() <= 1e-5 * a.abs().max())


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


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
        result["fresh_peak_staging"] = r_fresh.peak_staging_bytes
    result["warm_paths"] = [r_warm.in_place, r_warm.staged]
    result["grad_bytes"] = sum(p.numel() * p.element_size() for p in warm.parameters())
    result["variants"] = {name: run_variant(name, rank, world, 4) for name in VARIANTS}
    out = os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    # Every DDP goes before the process group: torch 2.13 with gloo aborts at exit now and then
    # ("terminate called without an active exception", after all Python code ran) when DDP
    # instances outlive destroy_process_group (plain DDP too, without our reduction).
    del warm, warm_plain, fresh, fresh_plain, m, r_warm, r_fresh
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
