"""The job bench/restart.py restarts: a small DDP model with enable_resiliency, one timestamp per step.

Appends `generation step unix_time` lines to $TIMES/rank<r>.txt. In the first generation, rank
KILL_RANK SIGKILLs itself (KILL=worker) or its node's agent (KILL=node) right after step KILL_AT.
"""

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import InMemoryCkptConfig, enable_resiliency

dist.init_process_group("gloo")
rank = dist.get_rank()
gen = int(os.environ.get("LM_RESILIENCY_GENERATION") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
session = enable_resiliency(model, opt, interval=1, checkpoint=InMemoryCkptConfig(disk_flush_interval=10**6))
steps, kill_at = int(os.environ.get("STEPS", "30")), int(os.environ.get("KILL_AT", "10"))
kill, kill_rank = os.environ.get("KILL", ""), int(os.environ.get("KILL_RANK", "1"))
log = open(os.path.join(os.environ["TIMES"], f"rank{rank}.txt"), "a")  # noqa: SIM115
for step in range(session.step_count + 1, steps + 1):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank * 1000 + step))
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    log.write(f"{gen} {step} {time.time():.6f}\n")
    log.flush()
    if gen == 0 and kill and rank == kill_rank and step == kill_at:
        session.gemini.drain(10)
        log.write(f"kill {step} {time.time():.6f}\n")
        log.flush()
        if kill == "node":
            os.kill(int(os.environ["LM_RESILIENCY_AGENT_PID"]), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
session.close()
dist.destroy_process_group()
