"""The tiny causal language model as a DeepSpeed engine, made resilient with one call.

    torchrun --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=lm_resiliency \\
        --rdzv-endpoint=127.0.0.1:29500 --rdzv-id=demo \\
        --rdzv-conf=lm_resiliency_restart_context_path=/tmp/ctx.json,\\
lm_resiliency_worker_config=examples/production_loops/policies/resiliency.toml \\
        -m examples.production_loops.deepspeed --validation-output-dir /tmp/val --steps 40

Needs DeepSpeed (`pip install deepspeed`; tested with 0.19.8, on CPU with gloo as on GPUs with NCCL).
`deepspeed.initialize` builds the engine from a config: torch's AdamW, DeepSpeed's WarmupDecayLR over
the run, ZeRO stage `--zero-stage` (0, 1 or 2), `--bf16` for bf16 weights (with ZeRO 1 or 2), two
micro-batches a step
(`engine.backward` and `engine.step` on each; the engine steps its optimizer and scheduler at the
second). `enable_resiliency(engine)` takes apart what the engine owns (module, optimizer, scheduler,
data-parallel group, progress counters). Everything else is the PyTorch example's loop (`pytorch.py`):
data as a pure function of (rank, step), resumption at the session's `step_count`, the same validation
output (`generation-<g>.json`, and `final.pt` with the engine's module state).

The default is ZeRO stage 0, where every rank holds the whole optimizer state: SCOUT compares the
reduced gradients, the parameters and the optimizer state between replicas, so every campaign surface
is seen. With ZeRO 1 or 2 each rank holds only its partition of the optimizer state, the fp32 master
weights and (ZeRO-2) the reduced gradients, and nothing else holds it: a fault in a partition reaches
every rank alike through the gather that follows. SCOUT finds a change at rest there (between steps),
not a gradient damaged within a step, which a campaign's gradient fault targets.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import time

import torch

from examples.production_loops.pytorch import (
    TinyCausalLM,
    batch,
    finish,
    lm_loss,
    policy_settings,
    record_generation,
    setup,
)
from lm_resiliency import enable_resiliency

MICRO_BATCHES = 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=0)
    ap.add_argument("--bf16", action="store_true", help="bf16 weights (needs --zero-stage 1 or 2)")
    args, rank, device = setup(__doc__ or "", ap)
    if args.bf16 and args.zero_stage == 0:
        ap.error("--bf16 needs --zero-stage 1 or 2 (DeepSpeed's bf16 without ZeRO is not captured)")
    import deepspeed  # (after the process group: the engine takes the one made)

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if device.type == "cpu":
        # On CPU, DeepSpeed's communication setup compiles a shared-memory all-reduce that only its
        # inference path uses: ~25 s of C++ in each fresh environment, and a failure where no
        # compiler is installed. Training needs none of it.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    micro = batch(rank, 1, device).shape[0] // MICRO_BATCHES
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 3e-3,
                "warmup_num_steps": max(1, args.steps // 10),
                "total_num_steps": max(2, args.steps),
            },
        },
        "zero_optimization": {"stage": args.zero_stage},
        "bf16": {"enabled": bool(args.bf16)},
        "steps_per_print": 10**9,
    }
    lm = TinyCausalLM().to(device)
    engine, *_ = deepspeed.initialize(model=lm, model_parameters=lm.parameters(), config=config)
    session = enable_resiliency(engine, **policy_settings())
    start = record_generation(session, rank, args.validation_output_dir)
    loss = torch.tensor(0.0)
    for step in range(start + 1, args.steps + 1):
        tokens = batch(rank, step, device)
        for mb in tokens.chunk(MICRO_BATCHES):
            loss = lm_loss(engine(mb[:, :-1]), mb)
            engine.backward(loss)
            if args.step_ms > 0:
                time.sleep(args.step_ms / 1000.0 / MICRO_BATCHES)
            engine.step()
    return finish(session, rank, args, engine.module, loss)


if __name__ == "__main__":
    raise SystemExit(main())
