"""An unmodified DDP (or, with WRAP=fsdp2, FSDP2) script: it never imports lm_resiliency. Under the
backend with a worker policy it is instrumented automatically; it reads only the step to resume at
(its data position).

COMPILE=1 compiles the model whole (`torch.compile`, the aot_eager backend: no C++ compiler needed).

READ=params: the final state is read from the parameters as they are, not from `state_dict()`.
READ=early: the script counts its parameters after it makes its optimizer, before its scheduler.

The final state holds the optimizer's learning rate and the schedule's position too.

In generation 0, rank FAULT_RANK (1) raises an uncaught RuntimeError after step FAULT_STEP (10) when
FAULT=raise, or SIGTERMs itself there when FAULT=term, or with FAULT=node its whole node dies there
once every rank's capture of the step is replicated (its agent SIGKILLed; the parent-death signal
ends it). FAULT=twice: the rank steps its optimizer once more there (no collective pairs it with
its peers: in the last step, nothing compares it after)."""

import json
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
gen = int(os.environ.get("LM_RESILIENCY_GENERATION", "0"))
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
if os.environ.get("WRAP") == "fsdp2":  # every layer and the root sharded with fully_shard
    from torch.distributed.fsdp import fully_shard

    for layer in (net[0], net[2], net):
        fully_shard(layer)
    model: nn.Module = net
else:
    model = nn.parallel.DistributedDataParallel(net)
held = model
if os.environ.get("COMPILE") == "1":
    model = torch.compile(model, backend="aot_eager")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
if os.environ.get("READ") == "early":
    print(f"rank {rank}: {sum(p.numel() for p in model.parameters())} parameters", flush=True)
warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=3)
decay = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[3])
start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
out = os.environ["OUT"]
if rank == 0:
    with open(f"{out}.gen{gen}.json", "w") as f:
        json.dump({"generation": gen, "start": start}, f)
fault_step = int(os.environ.get("FAULT_STEP", "10"))
fault_rank = int(os.environ.get("FAULT_RANK", "1"))
for step in range(start + 1, 25):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank * 1000 + step))
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if gen > 0 or step != fault_step:
        continue
    if os.environ.get("FAULT") == "node":  # once every rank's capture of the step is in place
        from lm_resiliency.api import open_session  # (the fault's own: the script's state never is)

        open_session().gemini.drain(10)  # type: ignore[union-attr]
        dist.barrier()
    if rank != fault_rank:
        continue
    if os.environ.get("FAULT") == "raise":
        raise RuntimeError(f"injected: the loss diverged at step {step}")
    if os.environ.get("FAULT") == "term":
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait()  # (the SIGTERM ends it)
    if os.environ.get("FAULT") == "node":
        os.kill(int(os.environ["LM_RESILIENCY_AGENT_PID"]), signal.SIGKILL)
        signal.pause()
    if os.environ.get("FAULT") == "twice":
        opt.step()
# Whole tensors (an FSDP2 shard's full_tensor() is a collective: every rank takes part).
state = held.named_parameters() if os.environ.get("READ") == "params" else held.state_dict().items()
final = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone() for k, v in state}
final["lr"] = torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64)
final["schedule"] = torch.tensor(sched.last_epoch)
if rank == 0:
    torch.save(final, out)
    with open(f"{out}.gen{gen}.json", "w") as f:
        context = os.environ.get("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT")
        instrumented = "lm_resiliency" in sys.modules
        json.dump({"generation": gen, "start": start, "instrumented": instrumented, "context": context}, f)
dist.destroy_process_group()
