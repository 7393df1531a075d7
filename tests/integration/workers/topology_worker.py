"""4 ranks: read replica groups for DDP, FSDP2, HSDP and FSDP+TP models, and check that our DDP comm
hook leaves training bitwise identical to DDP's built-in all-reduce. Writes rank<r>.json."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lm_resiliency import ConfigError, RuntimeConfig, enable_resiliency
from lm_resiliency.adapters.canonical import canonical_groups, ddp_caps
from lm_resiliency.adapters.pytorch import PyTorchAdapter


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(16, 32)
        self.w2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def train(model: nn.Module, steps: int, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    out: dict[str, object] = {"rank": rank}

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Block())
    out["ddp"] = list(PyTorchAdapter(ddp, None).topology().replica_group)
    pair = nn.ModuleDict({"g": ddp, "d": nn.parallel.DistributedDataParallel(Block())})
    out["inner_ddps"] = list(PyTorchAdapter(pair, None).topology().replica_group)
    loose = nn.ModuleDict({"g": ddp, "head": Block()})  # a trainable part no DDP averages
    out["inner_loose"] = list(PyTorchAdapter(loose, None).topology().replica_group)

    torch.manual_seed(0)
    fsdp = Block()
    mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    fully_shard(fsdp, mesh=mesh1)
    fsdp_topo = PyTorchAdapter(fsdp, None).topology()
    out["fsdp2"] = list(fsdp_topo.replica_group)
    out["fsdp2_peers"] = list(fsdp_topo.peer_group)

    torch.manual_seed(0)
    hsdp = Block()
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    fully_shard(hsdp, mesh=mesh2)
    topo = PyTorchAdapter(hsdp, None).topology()
    out["hsdp"] = list(topo.replica_group)
    out["hsdp_dims"] = {k: list(v) for k, v in topo.dims.items()}
    out["hsdp_replicated"] = list(topo.replicated_dims)
    out["hsdp_peers"] = list(topo.peer_group)

    torch.manual_seed(0)
    tp = Block()
    mesh3 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    parallelize_module(tp, mesh3["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(tp, mesh=mesh3["dp_shard"])
    tp_topo = PyTorchAdapter(tp, None).topology()
    out["fsdp_tp"] = list(tp_topo.replica_group)
    out["fsdp_tp_peers"] = list(tp_topo.peer_group)

    # TorchTitan's layout: a layer left out of tensor parallel (sharded over the data-parallel dim
    # only) before the tensor-parallel ones (sharded over both): its parameters' mesh is a 1-D slice.
    torch.manual_seed(0)
    mixed = nn.Sequential(nn.Linear(16, 16), Block())
    parallelize_module(mixed[1], mesh3["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(mixed[1], mesh=mesh3["dp_shard"])
    fully_shard(mixed, mesh=mesh3["dp_shard"])
    mixed_topo = PyTorchAdapter(mixed, None).topology()
    out["mixed_tp"] = list(mixed_topo.replica_group)
    out["mixed_tp_peers"] = list(mixed_topo.peer_group)
    # A pipeline stage's layers (TP within a 2-rank slice of a pp x tp mesh): peers are its stage.
    mesh4 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
    stage = Block()
    parallelize_module(stage, mesh4["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    out["stage_peers"] = list(PyTorchAdapter(stage, None).topology().peer_group)

    out["override"] = list(
        PyTorchAdapter(Block(), None, parallelism_info={"replica_group": [rank]}).topology().replica_group
    )

    # Bitwise: the session's DDP comm hook must equal a plain average in the canonical layout (no
    # DDP at all: each canonical group flattened and all-reduced), whatever DDP's bucket layout (its
    # initial one in the first step, a rebuilt one after), on a 3-rank subgroup (not a power of two,
    # so rounding shows).
    # Rank 3 joins the session with a plain module: a job with mixed replica groups.
    sub = dist.new_group([0, 1, 2])
    if rank < 3:
        torch.manual_seed(1)
        plain = Block()
        probe = nn.parallel.DistributedDataParallel(Block(), process_group=sub, bucket_cap_mb=0.001)
        params = list(plain.parameters())
        groups = canonical_groups(params, *ddp_caps(probe))
        assert len(groups) > 1  # the layout matters: several groups
        popt = torch.optim.SGD(plain.parameters(), lr=0.1)
        pgen = torch.Generator().manual_seed(rank)
        for _ in range(5):
            loss = plain(torch.randn(8, 16, generator=pgen)).pow(2).mean()
            popt.zero_grad()
            loss.backward()
            for members in groups:
                flat = torch.cat([params[i].grad.reshape(-1) for i in members]).mul_(1.0 / 3)
                dist.all_reduce(flat, group=sub)
                off = 0
                for i in members:
                    n = params[i].numel()
                    params[i].grad.copy_(flat[off : off + n].view_as(params[i]))
                    off += n
            popt.step()
        ref = [p.detach().clone() for p in plain.parameters()]
        torch.manual_seed(1)
        ours: nn.Module = nn.parallel.DistributedDataParallel(Block(), process_group=sub, bucket_cap_mb=0.001)
    else:
        ours = Block()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    session = enable_resiliency(
        ours, opt, runtime=RuntimeConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0)
    )
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        loss = ours(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank < 3:
        got = [p.detach() for p in ours.parameters()]
        out["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
        out["comm_measured"] = session.cluster_view().peers[rank].telemetry.comm_s > 0  # type: ignore[union-attr]
    out["session_steps"] = session.step_count
    out["session_groups"] = [list(g) for g in session.topology.replica_groups]
    session.close()
    # The same model in a container that has no forward of its own (a GAN's nn.ModuleDict of
    # wrapped models, as the one-session-per-process error suggests): the inner DDP reduces through
    # the session's comm hook (bitwise, whatever its bucket layout), and its ranks are the replicas.
    torch.manual_seed(1)
    inner = (
        nn.parallel.DistributedDataParallel(Block(), process_group=sub, bucket_cap_mb=0.001)
        if rank < 3
        else Block()
    )
    box = nn.ModuleDict({"g": inner})
    opt = torch.optim.SGD(box.parameters(), lr=0.1)
    session = enable_resiliency(
        box, opt, runtime=RuntimeConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0)
    )
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        loss = box["g"](torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank < 3:
        out["container_bitwise_equal"] = all(
            torch.equal(a, b.detach()) for a, b in zip(ref, box.parameters(), strict=True)
        )
    out["container_groups"] = [list(g) for g in session.topology.replica_groups]
    session.close()
    # Config drift: rank 3 starts its next session with another interval; every rank refuses it.
    drift: list[dict] = []
    try:
        enable_resiliency(
            nn.Linear(2, 2),
            interval=5 if rank == 3 else 10,
            enable_checkpoint=False,
            fault_callback=drift.append,
            runtime=RuntimeConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0),
        ).close()
        out["drift_error"] = None
    except ConfigError as exc:
        out["drift_error"] = str(exc)
    out["drift_reports"] = drift
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
