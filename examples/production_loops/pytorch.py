"""A tiny causal language model under DDP, made resilient with one call to enable_resiliency.

    torchrun --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=lm_resiliency \\
        --rdzv-endpoint=127.0.0.1:29500 --rdzv-id=demo \\
        --rdzv-conf=lm_resiliency_restart_context_path=/tmp/ctx.json,\\
lm_resiliency_worker_config=examples/production_loops/policies/resiliency.toml \\
        -m examples.production_loops.pytorch --validation-output-dir /tmp/val --steps 40

CUDA + NCCL when GPUs exist, CPU + gloo otherwise. Batches are a pure function of (rank, step), so
the data position is the step: a restarted generation resumes at `LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP`
(the session's `step_count` says the same) and sees exactly the batches an uninterrupted run would.
The policy named by `LM_RESILIENCY_WORKER_CONFIG` (set by the backend) supplies the settings.

Validation output (rank 0): `generation-<g>.json` per generation (start step, recovery decision,
restart context) and `final.pt` (the model's parameters) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import enable_resiliency, load_policy, policy_kwargs

VOCAB, CONTEXT, WIDTH = 256, 32, 64


class TinyCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.embed(tokens) + self.pos[:n]
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def batch(rank: int, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    return torch.randint(0, VOCAB, (8, CONTEXT + 1), generator=g).to(device)


def main() -> int:
    def build(device: torch.device) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor], nn.Module]:
        model = nn.parallel.DistributedDataParallel(TinyCausalLM().to(device))
        return model, model, model.module

    return run(__doc__ or "", build)


def run(
    doc: str, build: Callable[[torch.device], tuple[Any, Callable[[torch.Tensor], torch.Tensor], nn.Module]]
) -> int:
    """The loop of the PyTorch and Megatron-style examples. `build(device)`, called after the seed
    is set, returns what `enable_resiliency` takes as the model, the forward (tokens -> logits) and
    the module whose state is saved as `final.pt`."""
    args, rank, device = setup(doc)
    model, forward, saved = build(device)
    opt = torch.optim.AdamW([p for p in saved.parameters()], lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    session = enable_resiliency(model, opt, opt_param_scheduler=sched, **policy_settings())
    start = record_generation(session, rank, args.validation_output_dir)
    loss = torch.tensor(0.0)
    for step in range(start + 1, args.steps + 1):
        tokens = batch(rank, step, device)
        logits = forward(tokens[:, :-1])
        loss = lm_loss(logits, tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.step_ms > 0:
            time.sleep(args.step_ms / 1000.0)
        opt.step()
        sched.step()
    return finish(session, rank, args, saved, loss)


def setup(
    doc: str, parser: argparse.ArgumentParser | None = None
) -> tuple[argparse.Namespace, int, torch.device]:
    """Every example's start: its options (`parser`, when given, holds the example's own), the
    process group (NCCL on GPUs, gloo otherwise), this rank's device, the seed."""
    ap = parser or argparse.ArgumentParser()
    ap.description, ap.formatter_class = doc, argparse.RawDescriptionHelpFormatter
    ap.add_argument("--validation-output-dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="sleep this long in every step, as a larger model's step takes (numerics unchanged)",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    return args, dist.get_rank(), device


def policy_settings() -> dict[str, Any]:
    """`enable_resiliency`'s settings from the policy the backend names (`LM_RESILIENCY_WORKER_CONFIG`);
    a capture and a check every step without one."""
    policy_path = os.environ.get("LM_RESILIENCY_WORKER_CONFIG")
    return policy_kwargs(load_policy(policy_path)) if policy_path else {"interval": 1}


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def record_generation(session: Any, rank: int, out: Path) -> int:
    """The step this generation starts at (the session's `step_count`); rank 0 writes
    `generation-<g>.json` with it, the recovery decision and the restart context."""
    generation = int(os.environ.get("LM_RESILIENCY_GENERATION", "0"))
    start = int(session.step_count)
    planned = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    if planned and planned != start:
        print(f"rank {rank}: the backend planned step {planned}, the session resumed at {start}", flush=True)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        ctx_path = os.environ.get("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT")
        doc = {
            "generation": generation,
            "start_step": start,
            "planned_step": planned,
            "recovery_decision": session.last_recovery_decision,
            "restart_context": json.loads(Path(ctx_path).read_text()) if ctx_path else None,
        }
        (out / f"generation-{generation}.json").write_text(json.dumps(doc, indent=2))
    return start


def finish(session: Any, rank: int, args: argparse.Namespace, saved: nn.Module, loss: torch.Tensor) -> int:
    """Rank 0 saves `saved`'s state as `final.pt`; the session and the process group close."""
    if rank == 0:
        state = {k: v.detach().cpu() for k, v in saved.state_dict().items()}
        torch.save(state, args.validation_output_dir / "final.pt")
        print(f"rank 0: finished {args.steps} steps, last loss {float(loss.detach()):.4f}", flush=True)
    session.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
