"""One rank of a 2-rank gloo DDP job whose gradients are not plain dense real tensors.

Env: RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, KIND ("complex": complex64 parameters, whose gradients
DDP hands a comm hook as real views; "sparse": an Embedding(sparse=True), whose gradient DDP hands a
comm hook alone, as a sparse tensor, before dense layers, trained by SGD with momentum; "own-hook":
the script registers a DDP comm hook of its own, fp16 compression, after enable_resiliency; after
training, the script registers one more in this kind and "complex": refused, as DDP takes one
only). The same model is trained twice from the same seed and data: as plain DDP, then as DDP with
enable_resiliency (fingerprints and captures every step). Writes a JSON report.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

from lm_resiliency import enable_resiliency

STEPS = 6


def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if kind == "complex":
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8, dtype=torch.complex64))
        return model, torch.optim.Adam(model.parameters(), lr=0.1)
    if kind == "own-hook":
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        )
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)
    # Dense layers after it share DDP's buckets (the sparse gradient has one of its own); SGD's
    # momentum for the embedding is a sparse tensor in the optimizer's state.
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Embedding(64, 8, sparse=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(kind: str, model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(rank * 1000 + step)
        if kind == "complex":
            loss = model(torch.randn(4, 8, dtype=torch.complex64, generator=g)).abs().pow(2).mean()
        elif kind == "own-hook":
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        else:
            loss = model(torch.randint(0, 64, (4, 3), generator=g)).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kind = os.environ["KIND"]
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    plain, plain_opt = build(kind)
    if kind == "own-hook":
        plain.register_comm_hook(None, fp16_compress_hook)
    train(kind, plain, plain_opt, rank)
    model, opt = build(kind)
    faults: list[dict] = []
    refused = ""
    with enable_resiliency(model, opt, interval=1, fault_callback=faults.append) as session:
        if kind == "own-hook":  # after enable_resiliency: the script's hook is the one DDP uses
            model.register_comm_hook(None, fp16_compress_hook)
        scout, last = session.scout, threading.Event()
        mark = scout.on_certified

        def certified(step: int) -> None:
            mark(step)
            if step == STEPS:
                last.set()

        scout.on_certified = certified
        train(kind, model, opt, rank)
        if kind in ("own-hook", "complex"):  # DDP already holds one: the script's, or ours
            try:
                model.register_comm_hook(None, fp16_compress_hook)  # a second one, as DDP refuses
            except RuntimeError as exc:
                refused = str(exc)
        assert session.gemini.drain(30) and last.wait(30), f"step {STEPS} not certified: {faults}"
        report = {
            "rank": rank,
            "steps": session.step_count,
            "faults": faults,
            "certified": [s for s in range(1, STEPS + 1) if scout.certified(s)],
            "captures": session.gemini.stats.captures,
            "capture_failures": session.gemini.stats.capture_failures,
            "refused": refused,
            "hooks": [h.__qualname__ for h, _ in getattr(model, "_comm_hooks", [])],
            "equal_to_plain_ddp": all(
                torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True)
            ),
        }
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    # Every DDP goes before the process group (as canonical_worker.py): torch 2.13 with gloo aborts
    # at exit now and then ("terminate called without an active exception") when DDP instances
    # outlive destroy_process_group. Seen once in a clean-clone CI run of this test.
    del model, plain, opt, plain_opt, session
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
