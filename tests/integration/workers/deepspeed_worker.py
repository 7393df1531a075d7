"""One rank of a DeepSpeed job (data-parallel engine, ZeRO stage 0, fp32, torch AdamW, DeepSpeed's
WarmupLR, 2 micro-batches a step) with lm-resiliency passed the engine.

Env: RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, STEPS, the LM_RESILIENCY_* variables of the test;
PAUSE_RANK/PAUSE_AT: that rank says so at that step and waits to be killed; FLIP_RANK/FLIP_AT: that
rank flips a bit of a weight after that step (with ZeRO: of its master weights' partition, or of its
copy of the weight with FLIP_WHAT=weight); AWAIT_SDC=1: every rank waits for an SDC verdict (a
campaign's) at the end; ZERO_STAGE: the engine's ZeRO stage (a stage this
version does not capture is refused: the refusal is written as the report; PASS_MODULE=1 passes
the engine's module and optimizer instead of the engine, which is refused too). Writes the final
module, optimizer, scheduler and engine counters to RESULT_DIR/final-rank<r>.pt and a JSON report.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.config import RuntimeConfig
from lm_resiliency.errors import UnsupportedFrameworkError

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps = int(os.environ["STEPS"])
    pause_rank, pause_at = int(os.environ.get("PAUSE_RANK", "-1")), int(os.environ.get("PAUSE_AT", "-1"))
    flip_rank, flip_at = int(os.environ.get("FLIP_RANK", "-1")), int(os.environ.get("FLIP_AT", "-1"))
    generation = int(os.environ.get("LM_RESILIENCY_GENERATION", "0"))
    out = os.environ["RESULT_DIR"]
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import deepspeed  # (after the process group: the engine takes the one made)

    # Its shared-memory all-reduce serves inference only (`inference_all_reduce`); building it is a
    # C++ compile of ~25 s in each fresh environment, which is not what these tests are about. (The
    # module by its name: `deepspeed.comm.torch` as an attribute is the torch package.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 16))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 8},
        },
        "zero_optimization": {"stage": int(os.environ.get("ZERO_STAGE", "0"))},
        "steps_per_print": 10**9,
    }
    if os.environ.get("BF16") == "1":
        config["bf16"] = {"enabled": True}
    if os.environ.get("FP32_GRADS") == "1":  # (with bf16 and ZeRO-1: DeepSpeed's BF16_Optimizer)
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    faults: list[dict[str, object]] = []
    seen = {"micro_batches": 0}
    # PASS_MODULE=1: the engine's module and optimizer passed, as for plain PyTorch (refused)
    given = (net, engine.optimizer) if os.environ.get("PASS_MODULE") == "1" else (engine,)
    try:
        session = enable_resiliency(
            *given,
            interval=1,
            checkpoint=InMemoryCkptConfig(replication_chunk_size=1 << 16),
            extra_state_fn=lambda: dict(seen),
            load_extra_state_fn=seen.update,
            fault_callback=faults.append,
            runtime=RuntimeConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0),
        )
    except (UnsupportedFrameworkError, TypeError) as exc:
        with open(os.path.join(out, f"report-g{generation}-rank{rank}.json"), "w") as f:
            json.dump({"refused": str(exc)}, f)
        return 0
    start = session.step_count
    assert engine.global_steps == start, (engine.global_steps, start)
    assert seen["micro_batches"] == 2 * start, (seen, start)
    for step in range(start + 1, steps + 1):
        for micro in range(2):
            g = torch.Generator().manual_seed(rank * 100_003 + step * 10 + micro)
            x = torch.randn(4, 16, generator=g)
            if os.environ.get("BF16") == "1":
                x = x.to(torch.bfloat16)
            loss = (engine(x) - x).pow(2).mean()
            engine.backward(loss)
            seen["micro_batches"] += 1
            engine.step()
        assert engine.global_steps == session.step_count == step, (engine.global_steps, session.step_count)
        if generation == 0 and rank == flip_rank and step == flip_at:
            with torch.no_grad():  # silent data corruption of one weight, after the step
                zero = int(os.environ.get("ZERO_STAGE", "0"))
                if zero and os.environ.get("FLIP_WHAT") != "weight":  # its partition of the master weights
                    flipped = engine.optimizer.single_partition_of_fp32_groups[0]
                else:  # its copy of a weight (with ZeRO: the next gather overwrites it)
                    flipped = net[0].weight
                flipped.view(-1).view(torch.int32)[5] ^= 1 << 22
        if generation == 0 and rank == pause_rank and step == pause_at:
            session.gemini.drain(30)
            store.set(f"test/paused/{rank}", b"1")
            store.wait(["test/never"], datetime.timedelta(seconds=300))  # killed here
    if flip_rank >= 0 or os.environ.get("AWAIT_SDC") == "1":  # every rank waits (bounded) for the verdict
        deadline = time.monotonic() + 30
        while not any(f["kind"] == "sdc" for f in faults) and time.monotonic() < deadline:
            time.sleep(0.01)  # the verdict arrives on the runtime thread
    session.gemini.drain(30)
    dist.barrier()
    final = {
        "module": net.state_dict(),
        # (ZeRO's: this rank's partition of the state and of the fp32 master weights)
        "optimizer": {
            k: v
            for k, v in engine.optimizer.state_dict().items()
            if k in ("state", "param_groups", "base_optimizer_state", "single_partition_of_fp32_groups")
        },
        "scheduler": engine.lr_scheduler.state_dict(),
        "counters": [engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps],
    }
    torch.save(final, os.path.join(out, f"final-rank{rank}.pt"))
    report = {
        "rank": rank,
        "recovered_step": session.recovered_step,
        "decision": session.last_recovery_decision,
        "faults": [{k: f.get(k) for k in ("kind", "failed_ranks", "steps", "reason")} for f in faults],
        "replica_group": list(session.scout.group),
        "certified": list(session.gemini.inventory().certified),
    }
    with open(os.path.join(out, f"report-g{generation}-rank{rank}.json"), "w") as f:
        json.dump(report, f, default=str)
    session.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
