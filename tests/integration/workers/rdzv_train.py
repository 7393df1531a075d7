"""A DDP job under `torchrun --rdzv-backend=lm_resiliency`: one call to enable_resiliency.

FAULT (generation 0 only) picks the fault the test injects, at step FAULT_STEP:
  worker  -- rank FAULT_RANK's worker dies (SIGKILL)
  stop    -- rank FAULT_RANK's worker is stopped (SIGSTOP) for good
  stopmate -- as stop, and then its node-mate (rank FAULT_RANK ^ 1; run with 2 ranks per node) dies
             (SIGKILL): torchrun stops the node's workers at once, the stopped one among them
  node    -- rank FAULT_RANK's whole node dies: its agent, then (parent-death signal) its worker
  leader  -- the node of the current leader dies the same way
  job     -- every node dies that way, once every rank's capture of FAULT_STEP is in place
  sdc     -- rank FAULT_RANK flips a bit of a gradient after reduction (SCOUT must name it)
  stale   -- rank FAULT_RANK steps with the previous step's gradients (SCOUT must name stale state)
  optstate -- rank FAULT_RANK flips a bit of an Adam moment after its optimizer step, before the
             scheduler's (SCOUT must name it, and no capture holding it may be recovered)
  loader  -- rank FAULT_RANK's data loader blocks for good at step FAULT_STEP (LOADER_S: its threshold)
  hang    -- rank FAULT_RANK never enters step FAULT_STEP's all-reduce (SCOUT must name it; HANG_S is
             the stall threshold)
  repeat  -- in each generation g < FAULT_REPEAT, rank g % world dies two steps after its start
  midstep -- rank FAULT_RANK's worker dies (SIGKILL) after its backward of step FAULT_STEP, once the
             capture of the step before is in place
  late    -- after the loop, once every other rank's worker has ended (or waits for the others at
             its session's close), rank FAULT_RANK fails (an exception in the script's own end)
  killlast -- as late, and rank FAULT_RANK's worker dies (SIGKILL): no peer's session sees it go
  afterend -- as late, once every other rank's worker has ended (FINISH_S: how long their closed
             sessions wait for the others)
  hanglast -- after the loop, rank FAULT_RANK (and ALSO_RANKS) hangs for good (a wait on something
             that never comes)
  busylast -- after the loop, rank FAULT_RANK's main thread waits BUSY_S for a thread of its own
             that computes meanwhile (work after the loop, not a hang)
  sleeplast -- after the loop, rank FAULT_RANK sleeps BUSY_S (time.sleep: a wait it chose, not a hang)
  exit    -- rank FAULT_RANK's script exits (status 3) after step FAULT_STEP, its capture in place:
             its session closes at exit, its peers wait in the next step's all-reduce
  mismatch -- rank FAULT_RANK all-reduces a tensor of its own before step FAULT_STEP's forward, where
             its peers all-reduce their gradients (gloo aborts some process on the sizes)
TP=1: tensor parallel within each node (run with 2 ranks per node), DDP(device_mesh=) across them;
every rank writes its parameters to OUT.rank<r>.
LOADER=plain: the loop reads its batches without instrument_dataloader (captures are then taken
at the scheduler's step). SCHED_EVERY=n: the scheduler steps after every n-th step only. AUG=1: the
loop adds noise from the global torch RNG to each batch before the forward.
BARRIER=1: after the loop (and after hanglast's, sleeplast's or busylast's fault), every rank
enters dist.barrier(): the others wait there for the faulted rank, in a collective between steps.
FINISH_S, DESTINATION_WAIT_S: RuntimeConfig's finish_wait_s, restart_destination_wait_s.
Rank 0 writes the final parameters to OUT and each generation's start to OUT.gen<g>.json.
"""

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import (
    InMemoryCkptConfig,
    OrchestrationHooks,
    ReplayHarnessConfig,
    RuntimeConfig,
    enable_resiliency,
)

STEPS = int(os.environ.get("STEPS", "24"))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
gen = int(os.environ.get("LM_RESILIENCY_GENERATION", "0"))
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
TP = os.environ.get("TP") == "1"
if TP:  # tensor parallel within each node (2 ranks), DDP across the nodes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model = nn.parallel.DistributedDataParallel(net, device_mesh=mesh["dp"])
else:
    model = nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)


def _same_node(report: dict) -> str | None:
    """An orchestrator's answer (DESTINATION=culprit): the culprit's own node, restarted in place."""
    print(f"rank {rank} restart_destination asked about {report['kind']}: {report.get('node')}", flush=True)
    return report.get("node")


def _no_answer(report: dict) -> str | None:
    """An orchestrator that does not answer in time (DESTINATION=slow): an API call that hangs."""
    print(f"rank {rank} restart_destination asked about {report['kind']}, answers late", flush=True)
    threading.Event().wait(60)
    return None


hooks = {"culprit": _same_node, "slow": _no_answer}.get(os.environ.get("DESTINATION", ""))
settings = (("finish_wait_s", "FINISH_S"), ("restart_destination_wait_s", "DESTINATION_WAIT_S"))
runtime = {key: float(os.environ[name]) for key, name in settings if os.environ.get(name)}
session = enable_resiliency(
    model,
    opt,
    orchestration=OrchestrationHooks(restart_destination=hooks) if hooks else None,
    opt_param_scheduler=sched,
    interval=1,
    checkpoint=InMemoryCkptConfig(disk_flush_interval=10**6),
    replay=ReplayHarnessConfig(
        hang_stall_threshold_s=float(os.environ.get("HANG_S", "30")),
        dataloader_latency_threshold_s=float(os.environ.get("LOADER_S", "10")),
    ),
    runtime=RuntimeConfig(**runtime) if runtime else None,
)
start = session.step_count
print(f"rank {rank} generation {gen} starts at step {start} (recovered {session.recovered_step})", flush=True)
if rank == 0:
    with open(f"{os.environ['OUT']}.gen{gen}.json", "w") as f:
        json.dump(
            {
                "generation": gen,
                "start": start,
                "env_step": int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0")),
                "decision": session.last_recovery_decision,
                "context": os.environ.get("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT"),
            },
            f,
        )
fault = os.environ.get("FAULT", "") if gen == 0 else ""
fault_rank = int(os.environ.get("FAULT_RANK", "1"))
fault_step = int(os.environ.get("FAULT_STEP", "10"))
if os.environ.get("FAULT") == "repeat" and gen < int(os.environ.get("FAULT_REPEAT", "10")):
    fault, fault_rank, fault_step = "worker", gen % world, start + 2


def kill_my_node() -> None:
    os.kill(int(os.environ["LM_RESILIENCY_AGENT_PID"]), signal.SIGKILL)
    signal.pause()  # the parent-death signal ends this worker


def leader_is_me() -> bool:
    from torch.distributed import TCPStore

    host, port = os.environ["LM_RESILIENCY_CONTROL_STORE"].split("://", 1)[1].rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    run = os.environ["TORCHELASTIC_RUN_ID"]
    state = json.loads(store.get(f"lmr/{run}/state"))
    return state["leader"] == os.environ["LM_RESILIENCY_NODE_ID"]


def die_once_stopped(mate_pid_file: str) -> None:
    """SIGKILL this worker once its node-mate has written its pid and stopped itself."""
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the node-mate never stopped"
        try:
            with open(mate_pid_file) as f:
                pid = int(f.read())
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            if stat[stat.rfind(b")") + 2 :].split()[0] == b"T":
                os.kill(os.getpid(), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # not written yet
        time.sleep(0.01)  # polling the kernel's view of the mate


kept: list[torch.Tensor] = []  # the stale fault's gradients of the step before


def batches():  # type: ignore[no-untyped-def]
    for step in range(start + 1, STEPS + 1):
        if fault == "loader" and rank == fault_rank and step == fault_step:
            session.gemini.drain(10)
            threading.Event().wait()  # its storage never answers: the agents must stop it
        yield step, torch.randn(8, 16, generator=torch.Generator().manual_seed(rank * 1000 + step))


for step, x in batches() if os.environ.get("LOADER") == "plain" else session.instrument_dataloader(batches()):
    if fault == "hang" and rank == fault_rank and step == fault_step:
        session.gemini.drain(10)
        threading.Event().wait()  # stuck for good: the agents must stop it
    if fault == "mismatch" and rank == fault_rank and step == fault_step:
        dist.all_reduce(torch.ones(100_000))  # the script's own bug: a collective its peers skip
    if os.environ.get("AUG") == "1":
        x = x + 0.01 * torch.randn(x.shape)  # augmentation: the loop's own random draws
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if fault == "midstep" and rank == fault_rank and step == fault_step:
        session.gemini.drain(10)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "sdc" and rank == fault_rank and step == fault_step:
        with torch.no_grad():
            p = next(model.parameters())
            p.grad.view(-1)[3] += 1.0  # after reduction: only this replica's copy changes
    if fault == "drop" and rank == fault_rank and step == fault_step:
        for p in model.parameters():  # a bucket dropped after the all-reduce: its gradients zeroed
            p.grad.zero_()
    if fault == "stale" and rank == fault_rank:
        if step == fault_step:
            for p, g in zip(model.parameters(), kept, strict=True):
                p.grad.copy_(g)
        kept = [p.grad.clone() for p in model.parameters()]
    opt.step()
    if fault == "optstate" and rank == fault_rank and step == fault_step:
        with torch.no_grad():
            moment = opt.state[next(model.parameters())]["exp_avg_sq"]
            moment.view(-1).view(torch.int32)[5] ^= 1 << 29
    if step % int(os.environ.get("SCHED_EVERY", "1")) == 0:
        sched.step()
    if step == fault_step and fault == "stopmate" and rank == fault_rank ^ 1:
        session.gemini.drain(10)
        die_once_stopped(f"{os.environ['OUT']}.stopped")
    if step == fault_step and fault in ("worker", "stop", "stopmate", "node") and rank == fault_rank:
        session.gemini.drain(10)
        if fault == "worker":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault in ("stop", "stopmate"):
            with open(f"{os.environ['OUT']}.stopping", "w") as f:
                f.write(str(os.getpid()))
            os.replace(f"{os.environ['OUT']}.stopping", f"{os.environ['OUT']}.stopped")
            os.kill(os.getpid(), signal.SIGSTOP)  # continued only by the agent, to be stopped
        else:
            kill_my_node()
    if step == fault_step and fault == "exit" and rank == fault_rank:
        session.gemini.drain(10)
        sys.exit(3)
    if step == fault_step and fault == "job":
        session.gemini.drain(10)
        dist.barrier()
        kill_my_node()
    if step == fault_step and fault == "leader":
        session.gemini.drain(10)
        if leader_is_me():
            kill_my_node()


def ended(r: int) -> bool:
    """Rank r's worker has ended."""
    try:
        with open(f"{os.environ['OUT']}.pid{r}") as f:
            os.kill(int(f.read()), 0)
    except ProcessLookupError:
        return True
    except (FileNotFoundError, ValueError):  # (not written yet, or being written)
        return False
    return False


def ended_or_waiting(r: int) -> bool:
    """Rank r's worker has ended, or closed its session and waits for the others' (its count in
    the control store: see ControlChannel.finish)."""
    from torch.distributed import TCPStore

    from lm_resiliency.runtime.control import finished_key

    if ended(r):
        return True
    host, port = os.environ["LM_RESILIENCY_CONTROL_STORE"].split("://", 1)[1].rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    return store.add(f"lmr/{os.environ['TORCHELASTIC_RUN_ID']}/{finished_key(gen)}", 0) >= world - 1


if fault in ("late", "killlast", "afterend"):
    with open(f"{os.environ['OUT']}.pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == fault_rank:
        deadline = time.monotonic() + 60
        done = ended if fault == "afterend" else ended_or_waiting
        while not all(done(r) for r in range(world) if r != rank):
            assert time.monotonic() < deadline, "the other ranks never ended"
            time.sleep(0.05)  # polling the other workers' ends
        if fault == "killlast":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("the script's own failure after its loop")
also = {int(r) for r in os.environ.get("ALSO_RANKS", "").split(",") if r}  # (hanglast: more ranks)
if fault == "hanglast" and (rank == fault_rank or rank in also):
    threading.Event().wait()  # SCOUT must name it once the others closed their sessions
if fault == "sleeplast" and rank == fault_rank:
    time.sleep(float(os.environ["BUSY_S"]))
if fault == "busylast" and rank == fault_rank:

    def work(until: float) -> None:
        a = torch.randn(128, 128)
        while time.monotonic() < until:
            a = torch.tanh(a @ a)

    worker = threading.Thread(target=work, args=(time.monotonic() + float(os.environ["BUSY_S"]),))
    worker.start()
    worker.join()
if os.environ.get("BARRIER") == "1":  # (every rank, every generation; the faulted one after its fault)
    dist.barrier()
if TP:  # each rank its shards (the model's state_dict lacks them under DDP + TP: DDP's list has all)
    held = {str(i): p.detach().clone() for i, p in enumerate(model._module_parameters)}
    torch.save(held, f"{os.environ['OUT']}.rank{rank}")
elif rank == 0:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.environ["OUT"])
session.close()
dist.destroy_process_group()
