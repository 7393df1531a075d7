"""One rank of a 4-rank gloo job with expert parallelism, audited by SCOUT.

Ranks {0,1} and {2,3} are expert-parallel groups: each rank holds one expert, and every step's tokens
travel to the experts of their group and back by all-to-all (inside the model's forward, so the
whole forward cannot be replayed on one rank). Ranks {0,2} and {1,3} hold the same expert (the
expert-data-parallel replicas, the SCOUT replica group). Dense weights are averaged over all four
ranks, expert weights over their replicas.

Env: RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, STEPS, SCENARIO (clean | output-once: a bit of
MODULE's output flipped once | grad-once: a bit of the gradient of MODULE's first weight flipped once,
in backward), MODULE (expert, embed, gate or head), CULPRIT, AT_STEP, WRAP (plain: every gradient
reduced by this script | ddp: dense weights under DDP, experts ignored by it).
Writes RESULT_DIR/rank<r>.json with every fault report and this rank's audit results.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
from torch import nn

from lm_resiliency import ReplayHarnessConfig, RuntimeConfig, enable_resiliency


class ExpertParallelMoE(nn.Module):
    def __init__(self, ep_group: dist.ProcessGroup, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # dense weights: the same on every rank
        self.embed = nn.Linear(32, 32)
        self.gate = nn.Linear(32, 1)
        self.head = nn.Linear(32, 32)
        torch.manual_seed(100 + ep_rank)  # this rank's expert: the same on its replicas
        self.expert = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.ep_group = ep_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        # Half of the tokens to each expert of the group, then back.
        routed = dnn.all_to_all_single(torch.empty_like(h), h, group=self.ep_group)
        out = self.expert(routed)
        back = dnn.all_to_all_single(torch.empty_like(out), out, group=self.ep_group)
        return self.head(h + torch.sigmoid(self.gate(h)) * back)


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps, scenario = int(os.environ["STEPS"]), os.environ["SCENARIO"]
    culprit, at = int(os.environ.get("CULPRIT", "-1")), int(os.environ.get("AT_STEP", "-1"))
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    edp_ranks = [[0, 2], [1, 3]]
    edp_groups = [dist.new_group(r) for r in edp_ranks]
    ep_rank = rank % 2
    model = ExpertParallelMoE(ep_groups[rank // 2], ep_rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    trained: nn.Module = model
    if os.environ.get("WRAP", "plain") == "ddp":
        ignored = [f"expert.{n}" for n, _ in model.expert.named_parameters()]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        trained = nn.parallel.DistributedDataParallel(model)
    faults: list[dict[str, object]] = []
    session = enable_resiliency(
        trained,
        opt,
        interval=1,
        enable_checkpoint=False,
        fault_callback=faults.append,
        parallelism_info={"replica_group": edp_ranks[ep_rank], "expert_modules": ["expert"]},
        replay=ReplayHarnessConfig(hang_stall_threshold_s=5.0, audit_interval=1),
        runtime=RuntimeConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0),
    )
    current = {"step": 0, "flipped": False}
    target = model.get_submodule(os.environ.get("MODULE", "expert"))

    def once() -> bool:  # an intermittent fault
        hit = rank == culprit and current["step"] == at and not current["flipped"]
        current["flipped"] |= hit
        return hit

    if scenario == "output-once":

        def flip_output(module: nn.Module, args: object, out: torch.Tensor) -> None:
            if once():
                with torch.no_grad():
                    out.view(-1).view(torch.int32)[17] ^= 1 << 21

        target.register_forward_hook(flip_output)
    elif scenario == "grad-once":

        def flip_grad(g: torch.Tensor) -> torch.Tensor:
            if not once():
                return g
            g = g.clone()
            g.view(-1).view(torch.int32)[5] ^= 1 << 21
            return g

        next(target.parameters()).register_hook(flip_grad)
    dense = [model.embed, model.gate, model.head]
    for step in range(1, steps + 1):
        current["step"] = step
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank * 7919 + step))
        opt.zero_grad()
        (trained(x) - x).pow(2).mean().backward()
        for m in dense if trained is model else ():
            for p in m.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        for p in model.expert.parameters():
            dist.all_reduce(p.grad, group=edp_groups[ep_rank])
            p.grad.div_(2)
        opt.step()
    view = session.cluster_view()  # before the barrier: no rank has closed (left) yet
    dist.barrier()
    time.sleep(0.3)  # let the last step's gossip land before reading verdicts
    result = {
        "rank": rank,
        "faults": faults,
        "audits": dict(session.scout.audit_stats),
        # Step telemetry is gossiped to the replica group only: whose this rank ever received.
        "telemetry_from": sorted(r for r, p in view.peers.items() if p.telemetry is not None),
        "live": sorted(view.live),
    }
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(
        os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json.tmp"),
        os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"),
    )
    session.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
