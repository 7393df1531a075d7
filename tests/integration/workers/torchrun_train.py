"""A plain DDP script under real torchrun: one call to enable_resiliency, nothing else.

In torchrun's first attempt with CRASH set, rank 1 dies at step 12; torchrun (`--max-restarts`)
restarts the worker group and the session resumes from shared memory. Rank 0 saves the final model.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import enable_resiliency

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.1), nn.Linear(64, 16))
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
session = enable_resiliency(model, opt, interval=1)
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
print(
    f"rank {rank} attempt {restart} starts at step {session.step_count} (recovered {session.recovered_step})",
    flush=True,
)
for step in range(session.step_count + 1, 21):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank * 1000 + step))
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if os.environ.get("CRASH") and restart == 0 and rank == 1 and step == 12:
        session.gemini.drain(10)
        os._exit(17)
if rank == 0:
    torch.save(dict(model.state_dict()), os.environ["OUT"])
session.close()
dist.destroy_process_group()
