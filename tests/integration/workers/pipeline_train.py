"""A pipeline-parallel job under `torchrun --rdzv-backend=lm_resiliency`: 2 stages per node
(torch.distributed.pipelining, GPipe, 4 microbatches; stage = local rank), data parallel across
the nodes by the script's own all-reduce of each stage's gradients over its replica group (given as
`group=`, or with NO_GROUP=1 none: no replicas known). Faults come from a campaign
(LM_RESILIENCY_FAULT_CAMPAIGN). Every rank writes its parameters to OUT.rank<r>; rank 0 writes each
generation's start to OUT.gen<g>.json.
"""

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from lm_resiliency import ReplayHarnessConfig, enable_resiliency

STEPS = int(os.environ.get("STEPS", "16"))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
gen = int(os.environ.get("LM_RESILIENCY_GENERATION", "0"))
mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "pp"))
dp, pp = mesh["dp"], mesh["pp"]
first = pp.get_local_rank() == 0
torch.manual_seed(0)
layers = [nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3)]
part = nn.Sequential(*(layers[:2] if first else layers[2:]))
stage = PipelineStage(part, pp.get_local_rank(), 2, torch.device("cpu"), group=pp.get_group())
schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
opt = torch.optim.AdamW(part.parameters(), lr=1e-2)
session = enable_resiliency(
    part,
    opt,
    group=None if os.environ.get("NO_GROUP") else dp.get_group(),
    interval=1,
    replay=ReplayHarnessConfig(hang_stall_threshold_s=float(os.environ.get("HANG_S", "30"))),
)
start = session.step_count
if rank == 0:
    with open(f"{os.environ['OUT']}.gen{gen}.json", "w") as f:
        json.dump({"generation": gen, "start": start, "decision": session.last_recovery_decision}, f)
for step in range(start + 1, STEPS + 1):
    g = torch.Generator().manual_seed(dp.get_local_rank() * 1000 + step)
    x = torch.randn(16, 12, generator=g)
    opt.zero_grad()
    if first:
        schedule.step(x)
    else:
        schedule.step(target=x[:, :3].argmax(1), losses=[])
    for p in part.parameters():
        dist.all_reduce(p.grad, group=dp.get_group())
        p.grad.div_(dp.size())
    opt.step()
torch.save({n: p.detach().clone() for n, p in part.named_parameters()}, f"{os.environ['OUT']}.rank{rank}")
session.close()
dist.destroy_process_group()
