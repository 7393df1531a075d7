"""One rank of a 4-rank DDP job with GEMINI capturing every step.

Env: RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, STEPS, PAUSE_RANK, PAUSE_AT, DISK_FOLDER, DISK_INTERVAL,
FSDP (1: the model is FSDP2-sharded over all ranks, DTensor state, instead of DDP), TP (1: tensor
parallel within a node, DDP(device_mesh=) across the nodes), FLIP_RANK and
FLIP_AT (generation 0: that rank flips a weight bit after that step, or an AdamW moment's with
FLIP_WHAT=moment, or its units' forward outputs during that step with FLIP_WHAT=output; every rank
waits for SCOUT's SDC verdict after the next step, then for the kill), AUDIT_INTERVAL (SCOUT's),
LOADER (1: batches come through `session.instrument_dataloader`), RECOVERY_MODE (enable_resiliency's),
PUBLISH_COALESCE_S and HEARTBEAT_S (RuntimeConfig's: evidence, and so certificates, up to the
smaller of the two late), VERIFY_INTEGRITY (1: InMemoryCkptConfig's), DAMAGE_RANK and DAMAGE_AT
(that rank flips a byte of each of its own committed captures after that step),
plus LM_RESILIENCY_{RUN_ID,SHM_DIR,GENERATION,MACHINE_ID_PATH}. Data depends only on (rank, step);
the model uses dropout, so a bitwise resume needs the RNG state too. In generation 0, PAUSE_RANK
blocks after step PAUSE_AT (all captures drained) until the test kills the job. At the end it saves
its final model and optimizer state to RESULT_DIR/final-rank<r>.pt and a JSON report.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import (
    DurableCheckpointConfig,
    InMemoryCkptConfig,
    ReplayHarnessConfig,
    RuntimeConfig,
    enable_resiliency,
)


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps = int(os.environ["STEPS"])
    pause_rank, pause_at = int(os.environ.get("PAUSE_RANK", "-1")), int(os.environ.get("PAUSE_AT", "-1"))
    flip_rank, flip_at = int(os.environ.get("FLIP_RANK", "-1")), int(os.environ.get("FLIP_AT", "-1"))
    damage_rank, damage_at = int(os.environ.get("DAMAGE_RANK", "-1")), int(os.environ.get("DAMAGE_AT", "-1"))
    generation = int(os.environ.get("LM_RESILIENCY_GENERATION", "0"))
    result_dir = os.environ["RESULT_DIR"]
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 32))
    fsdp = os.environ.get("FSDP") == "1"
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (net[0], net[3]):
            fully_shard(layer, mesh=mesh)
        model: nn.Module = fully_shard(net, mesh=mesh)
    elif os.environ.get("TP") == "1":
        # Tensor parallel within a node, DDP across the two (torch's DDP + TP composition, which
        # takes the tensor-parallel parameters out of the model's registry at each forward).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "3": RowwiseParallel()})
        model = nn.parallel.DistributedDataParallel(net, device_mesh=mesh["dp"])
    else:
        model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    optimizers, schedulers = [opt], [sched]
    if os.environ.get("TWO_OPTIMIZERS") == "1":
        # Muon for the matrices and AdamW for the rest, each with its schedule, passed as a list
        # (the schedulers are found).
        matrices = [p for p in model.parameters() if p.ndim == 2]
        # (Muon orthogonalizes whole matrices: not FSDP2's shards; SGD with momentum there.)
        muon = (
            torch.optim.SGD(matrices, lr=0.02, momentum=0.9) if fsdp else torch.optim.Muon(matrices, lr=0.02)
        )
        opt = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        optimizers = [muon, opt]
        schedulers = [torch.optim.lr_scheduler.LambdaLR(muon, lambda s: 1.0 / (1 + s)), sched]
    seen = {"batches": 0}
    faults: list[dict[str, object]] = []
    session = enable_resiliency(
        model,
        optimizers if len(optimizers) > 1 else opt,
        opt_param_scheduler=None if len(optimizers) > 1 else sched,
        interval=1,
        checkpoint=InMemoryCkptConfig(
            replication_chunk_size=1 << 16, verify_integrity=os.environ.get("VERIFY_INTEGRITY") == "1"
        ),
        durable_checkpoint=DurableCheckpointConfig(
            folder=os.environ["DISK_FOLDER"], interval=int(os.environ.get("DISK_INTERVAL", "4"))
        ),
        extra_state_fn=lambda: dict(seen),
        load_extra_state_fn=seen.update,
        fault_callback=faults.append,
        runtime=RuntimeConfig(
            heartbeat_interval_s=float(os.environ.get("HEARTBEAT_S", "0.1")),
            heartbeat_timeout_s=5.0,
            publish_coalesce_s=float(os.environ.get("PUBLISH_COALESCE_S", "0")),
        ),
        recovery_mode=os.environ.get("RECOVERY_MODE") or None,
        replay=ReplayHarnessConfig(audit_interval=int(os.environ.get("AUDIT_INTERVAL", "100"))),
        # FALLBACK="s0,s1,...": the step each rank's own checkpoint restores (-1: none).
        load_fallback=(lambda step: int(os.environ["FALLBACK"].split(",")[rank]))
        if os.environ.get("FALLBACK")
        else None,
    )
    start = session.step_count
    # Certificates survive the restart: SCOUT's marks on the captures this rank restored from.
    restored_certified = session.recovered_step >= 0 and session.scout.certified(session.recovered_step)
    # Sharded: no replica to agree with, nothing to certify; the rank says when its capture of the
    # paused step is replicated instead (below), or a loaded machine's kill found it in flight.
    sharded = len(session.scout.group) == 1
    if generation == 0 and pause_rank >= 0 and not sharded:
        mark = session.scout.on_certified
        # Its own client: the paused rank's training thread blocks in `store.wait` on the other one.
        signal_store = dist.TCPStore(
            "127.0.0.1",
            int(os.environ["STORE_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )

        def certified(step: int) -> None:
            mark(step)  # GEMINI's mark on the capture first, then tell the test
            if step == pause_at:
                signal_store.set(f"test/certified/{rank}", b"1")

        session.scout.on_certified = certified
    assert seen["batches"] == start, f"extra state says {seen['batches']} batches, resuming at {start}"

    def batches():  # type: ignore[no-untyped-def]
        for step in range(start + 1, steps + 1):
            g = torch.Generator().manual_seed(rank * 100_003 + step)
            yield step, torch.randn(16, 32, generator=g)

    # LOADER=1: through the session's loader proxy, so that a step is captured as the next begins
    # (what the loop does after `opt.step()` is in its capture).
    loader = session.instrument_dataloader(batches()) if os.environ.get("LOADER") == "1" else batches()
    now = {"step": 0}
    if generation == 0 and rank == flip_rank and os.environ.get("FLIP_WHAT") == "output":
        # A unit's forward computes wrong once (its output scaled during step FLIP_AT): the peer
        # that audits this rank's step replays the unit and finds it.
        for unit in (net[0], net[3]):
            unit.register_forward_hook(lambda m, i, o: o * 1.5 if now["step"] == flip_at else None)
    for step, x in loader:
        now["step"] = step
        seen["batches"] += 1
        loss = (model(x) - x).pow(2).mean()
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        for o in optimizers:
            o.step()
        for sc in schedulers:
            sc.step()
        if (
            generation == 0
            and rank == flip_rank
            and step == flip_at
            and os.environ.get("FLIP_WHAT") != "output"
        ):
            with torch.no_grad():  # silent data corruption of one weight (or moment), after the step
                first = next(model.parameters())
                flipped = opt.state[first]["exp_avg"] if os.environ.get("FLIP_WHAT") == "moment" else first
                flipped = flipped.to_local() if hasattr(flipped, "to_local") else flipped  # a shard
                flipped.view(-1).view(torch.int32)[5] ^= 1 << 22
        if generation == 0 and flip_rank >= 0 and step > flip_at:
            # Every rank waits for SCOUT's verdict, then for the kill (captures of the corrupted
            # steps taken and kept, uncertified).
            deadline = time.monotonic() + 60
            while not any(f["kind"] == "sdc" for f in faults) and time.monotonic() < deadline:
                time.sleep(0.01)  # the verdict arrives on the runtime thread; bounded
            session.gemini.drain(30)
            store.set(f"test/paused/{rank}", b"1")
            store.set(f"test/certified/{rank}", b"1")
            store.wait(["test/never"], datetime.timedelta(seconds=300))  # killed here
        if rank == damage_rank and step == damage_at:
            # A byte of each of this rank's committed captures flips at rest (bit rot, a stray
            # write). The next capture overwrites one of them; the one it keeps stays damaged.
            session.gemini.drain(30)
            for path in Path(os.environ["LM_RESILIENCY_SHM_DIR"]).rglob(f"own-r{rank}-s*"):
                with open(path, "r+b") as f:
                    f.seek(4096 + 200)
                    byte = f.read(1)[0]
                    f.seek(4096 + 200)
                    f.write(bytes([byte ^ 0x10]))
        if generation == 0 and pause_rank >= 0 and sharded and step == pause_at:
            session.gemini.drain(30)  # committed, replicated and published
            store.set(f"test/certified/{rank}", b"1")
        if generation == 0 and rank == pause_rank and step == pause_at:
            session.gemini.drain(30)
            # Its peers' copies of the step too: each rank's is held on the other node (a peer that
            # certified the step may still be sending it when the test kills the job, and a
            # restart without node 1's memory would then resume a step back).
            deadline = time.monotonic() + 30
            while not _held_off_node(session, pause_at) and time.monotonic() < deadline:
                time.sleep(0.01)  # inventories arrive by gossip on the runtime thread; bounded
            store.set(f"test/paused/{rank}", b"1")
            store.wait(["test/never"], datetime.timedelta(seconds=300))  # killed here
    gem = session.gemini
    gem.drain(30)
    dist.barrier()  # every rank's last capture is committed and replicated; inventories follow by gossip
    deadline = time.monotonic() + 10
    while gem.cluster_plan().step < steps and time.monotonic() < deadline:
        time.sleep(0.01)  # waiting for gossip to arrive; bounded
    final = {
        # (DDP + TP: the model's state_dict lacks the tensor-parallel parameters; DDP's list has all)
        "model": {str(i): p.detach() for i, p in enumerate(model._module_parameters)}
        if os.environ.get("TP") == "1"
        else model.state_dict(),
        "optimizer": [o.state_dict() for o in optimizers],
        "scheduler": [sc.state_dict() for sc in schedulers],
    }
    if fsdp:  # this rank's shards, as plain tensors
        final = torch.utils._pytree.tree_map(lambda v: v.to_local() if hasattr(v, "to_local") else v, final)
    torch.save(final, os.path.join(result_dir, f"final-rank{rank}.pt"))
    report = {
        "rank": rank,
        "generation": generation,
        "recovered_step": session.recovered_step,
        "restored_certified": restored_certified,
        "decision": session.last_recovery_decision,
        "rejected_copies": gem.stats.rejected_copies,
        "captures": gem.stats.captures,
        "replicated": gem.stats.replicated,
        "replicas_received": gem.stats.replicas_received,
        "disk_writes": gem.stats.disk_writes,
        "disk_errors": gem.stats.disk_errors,
        "scrubbed": gem.stats.scrubbed,
        "faults": session.fault_reports,  # (the callback's list may lag: it runs on a thread of its own)
        "held_bytes": gem.held_bytes(),
        "cluster_plan_step": gem.cluster_plan().step,
        "cluster_plan_tiers": sorted({src.tier for src in gem.cluster_plan().sources.values()}),
    }
    with open(os.path.join(result_dir, f"report-g{generation}-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    store.set(f"test/done/{rank}", b"1")
    dist.barrier()
    session.close()
    dist.destroy_process_group()
    return 0


def _held_off_node(session, step: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether every rank's capture of `step` is held by a rank on another node (2 ranks a node),
    as the inventories heard so far say."""
    inv = session.gemini.cluster_inventory()
    return all(
        any(step in i.replicas.get(str(r), ()) for h, i in inv.items() if h // 2 != r // 2)
        for r in range(session.gemini.world_size)
    )


if __name__ == "__main__":
    sys.exit(main())
