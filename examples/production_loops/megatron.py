"""The tiny causal language model as Megatron-style model chunks, made resilient with one call.

    torchrun --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=lm_resiliency \\
        --rdzv-endpoint=127.0.0.1:29500 --rdzv-id=demo \\
        --rdzv-conf=lm_resiliency_restart_context_path=/tmp/ctx.json,\\
lm_resiliency_worker_config=examples/production_loops/policies/resiliency.toml \\
        -m examples.production_loops.megatron --validation-output-dir /tmp/val --steps 40

The model is two chunks, as Megatron's virtual pipeline hands them to its loop: the embedding and
the first transformer layer, then the second layer and the output head, each wrapped in
DistributedDataParallel, called one after the other for each of two microbatches per step.
`enable_resiliency` takes the list (framework "megatron", detected), with a torch AdamW over the
chunks' parameters: megatron-core is not needed, and its own optimizer wrappers are not captured
yet (they keep fp32 main parameters outside the torch optimizer's state; see
`lm_resiliency.adapters.megatron`). Everything else is the PyTorch example's loop (`pytorch.py`):
data as a pure function of (rank, step), resumption at the session's `step_count`, the same
validation output (`generation-<g>.json`, and `final.pt` with both chunks' state, keys `0.*`, `1.*`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from examples.production_loops.pytorch import CONTEXT, TinyCausalLM, run


class FirstChunk(nn.Module):
    def __init__(self, lm: TinyCausalLM) -> None:
        super().__init__()
        self.embed, self.pos, self.layer = lm.embed, lm.pos, lm.blocks.layers[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        return self.layer(self.embed(tokens) + self.pos[:n], src_mask=_mask(n, tokens.device), is_causal=True)


class LastChunk(nn.Module):
    def __init__(self, lm: TinyCausalLM) -> None:
        super().__init__()
        self.layer, self.head = lm.blocks.layers[1], lm.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(h, src_mask=_mask(h.shape[1], h.device), is_causal=True))


def _mask(n: int, device: torch.device) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(min(n, CONTEXT), device=device)


def main() -> int:
    def build(device: torch.device) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor], nn.Module]:
        lm = TinyCausalLM().to(device)
        chunks = [nn.parallel.DistributedDataParallel(c) for c in (FirstChunk(lm), LastChunk(lm))]

        def forward(tokens: torch.Tensor) -> torch.Tensor:  # two microbatches, chunk by chunk
            return torch.cat([chunks[1](chunks[0](mb)) for mb in tokens.chunk(2)])

        return chunks, forward, nn.ModuleList([c.module for c in chunks])

    return run(__doc__ or "", build)


if __name__ == "__main__":
    raise SystemExit(main())
