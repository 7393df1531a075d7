"""One rank of a 4-rank gloo DDP job with SCOUT checking every step, and one injected fault.

Env: RANK, WORLD_SIZE, STORE_PORT, RESULT_DIR, STEPS,
SCENARIO (clean|sdc|weight|step-flip: a weight written wrongly inside the optimizer's step|
optstate|recurring|compute|input|hang|output|output-once|localgrad|
nondeterministic: every rank's forward depends on the clock, so no replay can reproduce it;
oom: the culprit's allocation of 16 TiB fails at AT_STEP and the exception goes uncaught;
datastall: the culprit's data loader blocks for 3 s at AT_STEP; prep: the culprit's loader is fast
but the loop spends 80 ms on each batch before the forward (host-side preparation); sigstop: the
culprit SIGSTOPs itself at AT_STEP, runtime thread and all; sigterm: the culprit SIGTERMs itself at
AT_STEP; group-stop: every rank tells the test it reached AT_STEP, which SIGTERMs them all;
desync: every rank all-reduces a metric of 4 elements after each step, the culprit 5 at AT_STEP;
evaluation: every AT_STEP steps the culprit alone runs the model with gradients off for 4 s;
stale-grads: at AT_STEP the culprit steps with the previous step's reduced gradients (stale-one-grad:
with one of them; stale-one-param: its last parameter's update at AT_STEP is not applied);
drop: at AT_STEP the culprit zeroes every gradient after the all-reduce;
skip-step: the culprit skips its optimizer step at AT_STEP and counts one step behind from then on;
lr-drift: after its step AT_STEP the culprit halves its learning rate, its replicas do not;
leave: the culprit's loop ends at AT_STEP (uneven inputs): it closes its session and ends, or with
LINGER=1 keeps its process group open (as a peer NCCL would wait for), until the test kills it),
CULPRIT, AT_STEP, LOCALGRAD_ALSO (rank:step: a gradient flipped before reduction besides),
REPORT_DIR, INTERVAL (steps between checks; default 1),
OPT=zero (a ZeroRedundancyOptimizer of AdamW), AUDIT (audit interval, 0 = off), REST (rest_interval), ACCUM
(micro-batches per step),
SLOW_LOADER (a rank whose loader is slow besides the scenario's fault), HB_TIMEOUT (heartbeat timeout, s;
default 10), LOADER_S (dataloader_latency_threshold_s; default 10),
WRAP (ddp | plain: no DDP, this script all-reduces the gradients after backward | fsdp2: every layer
sharded with `fully_shard` | hsdp: the same over a 2-D mesh, replicated over ranks 0 and 2 (1 and 3)
| fsdp1: FullyShardedDataParallel | tp: tensor parallel over the 4 ranks,
column- then row-wise, every rank fed the same batch), CHECKPOINT=1 (GEMINI captures every step as in
the sdc scenario, and the result has the certificates and recovery decisions), CLOSE_FIRST=1 (the
session is closed right after the loop, and the result written after).
Faults are injected by this script, never told to SCOUT. Writes RESULT_DIR/rank<r>.json with every
fault report and the step at which this rank first saw it.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import random
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import ReplayHarnessConfig, RuntimeConfig, enable_resiliency


class Source:
    """Batches that depend on (rank, step); a slow loader on the culprit in the input scenario."""

    def __init__(self, rank: int, slow: bool, stall_at: int = -1) -> None:
        self.rank, self.slow, self.stall_at = rank, slow, stall_at

    def __iter__(self):  # type: ignore[no-untyped-def]
        step = 0
        while True:
            step += 1
            if self.slow:
                time.sleep(0.08)
            if step == self.stall_at:
                time.sleep(3.0)  # a loader that blocks (a stuck storage read)
            yield torch.randn(32, 128, generator=torch.Generator().manual_seed(self.rank * 7919 + step))


class ShardedAdamW(torch.optim.AdamW):
    """A ZeRO-like optimizer of a script's own: each rank keeps the state of, and updates, every
    world-th parameter, then each parameter is broadcast from the rank that updated it."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        rank, world = dist.get_rank(), dist.get_world_size()
        params = [p for g in self.param_groups for p in g["params"]]
        kept = [p.grad for p in params]
        for i, p in enumerate(params):
            if i % world != rank:
                p.grad = None  # not this rank's: no state, no update
        super().step(closure)
        for i, (p, g) in enumerate(zip(params, kept, strict=True)):
            p.grad = g
            dist.broadcast(p.data, src=i % world)


class _SlowStorage:
    """A file-like object whose writes take `seconds` in all (slow network storage)."""

    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def write(self, data: bytes) -> int:
        time.sleep(max(0.0, min(0.2, self.until - time.monotonic())))
        return len(data)

    def flush(self) -> None:
        time.sleep(max(0.0, self.until - time.monotonic()))


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps, scenario = int(os.environ["STEPS"]), os.environ["SCENARIO"]
    checkpoint = scenario == "sdc" or os.environ.get("CHECKPOINT") == "1"
    culprit, at = int(os.environ.get("CULPRIT", "-1")), int(os.environ.get("AT_STEP", "-1"))
    out_dir = os.environ["RESULT_DIR"]
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128))
    if os.environ.get("BN") == "1":  # buffers: DDP broadcasts them from rank 0 in every training forward
        inner.append(nn.BatchNorm1d(128))
    wrapped = os.environ.get("WRAP", "ddp") == "ddp"
    model: nn.Module = nn.parallel.DistributedDataParallel(inner) if wrapped else inner
    sharded = os.environ.get("WRAP") in ("fsdp2", "hsdp")
    if sharded:  # every parameter sharded over the 4 ranks: no two ranks hold the same state
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # hsdp: replicated over pairs of ranks (0 and 2, 1 and 3), sharded within (0 and 1, 2 and 3)
        hsdp = os.environ.get("WRAP") == "hsdp"
        mesh = (
            init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
        )
        for layer in (inner[0], inner[2], inner):
            fully_shard(layer, mesh=mesh)
    if os.environ.get("WRAP") == "fsdp1":  # FullyShardedDataParallel: flat parameters, no DTensor
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(inner, device_id=torch.device("cpu"))
        sharded = True
    tensor_parallel = os.environ.get("WRAP") == "tp"
    if tensor_parallel:  # DTensor's functional collectives: the row-wise layer's output all-reduce
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(inner, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    plain = None
    if scenario == "throughput":  # the same job without lm-resiliency, as the user runs it today
        plain = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128))
        )
        plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    if os.environ.get("OPT") == "zero":  # torch's ZeRO-1: each rank steps and broadcasts its own
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
        )
    elif scenario == "optstate":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif scenario == "sharded-optim":
        opt = ShardedAdamW(model.parameters(), lr=1e-3)
    elif scenario == "stale-one-param":  # its last parameter in a group of its own
        every = list(model.parameters())
        opt = torch.optim.SGD([{"params": every[:-1]}, {"params": every[-1:]}], lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    faults: list[dict[str, object]] = []
    current = {"step": 0}
    if scenario == "step-flip" and rank == culprit:
        # A device that computes the step wrongly: one bit of a weight the optimizer just wrote (a
        # hook of the script's, registered before the session's: inside the step, before its end).
        def flip_in_step(o: object, args: object, kwargs: object) -> None:
            if current["step"] == at:
                with torch.no_grad():
                    w = inner[2].weight
                    w = w.to_local() if hasattr(w, "to_local") else w
                    w.view(-1).view(torch.int32)[11] ^= 1 << 20

        opt.register_step_post_hook(flip_in_step)
    result: dict[str, object] = {"rank": rank, "first_seen_step": {}}
    written = threading.Event()

    def write_result() -> None:
        result["faults"] = list(faults)
        tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
        written.set()

    def on_fault(report: dict[str, object]) -> None:
        faults.append(report)
        key = f"{report['kind']}:{report.get('failed_ranks')}"
        result["first_seen_step"].setdefault(key, current["step"])  # type: ignore[union-attr]
        if report["kind"] == "hang":
            result["hang_seen_at"] = time.time()
            write_result()  # this rank's training thread is stuck in the collective: report from here

    session = enable_resiliency(
        inner if os.environ.get("PASS_INNER") == "1" else model,  # the module DDP wraps: found
        opt,
        interval=int(os.environ.get("INTERVAL", "1")),
        enable_checkpoint=checkpoint,
        fault_callback=on_fault,
        # A plain module's data-parallel peers are named; the others' come from DDP or the mesh.
        group=None
        if wrapped or sharded or tensor_parallel or os.environ.get("NO_GROUP") == "1"
        else dist.group.WORLD,
        replay=ReplayHarnessConfig(
            straggler_ratio=1.5,
            straggler_min_ms=20.0,
            straggler_confirmations=3,
            hang_stall_threshold_s=2.0,
            dataloader_latency_threshold_s=float(os.environ.get("LOADER_S", "10")),
            checkpoint_io_latency_threshold_s=float(os.environ.get("IO_S", "120")),
            report_dir=os.environ["REPORT_DIR"],
            audit_interval=int(os.environ.get("AUDIT", "0")),
            rest_interval=int(os.environ.get("REST", "1")),
        ),
        runtime=RuntimeConfig(
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=float(os.environ.get("HB_TIMEOUT", "10")),
            publish_coalesce_s=float(os.environ.get("COALESCE", "0")),
        ),
    )
    if scenario == "compute" and rank == culprit:
        inner[0].register_forward_hook(lambda m, i, o: time.sleep(0.06))  # ~3x this job's compute
    if scenario in ("output", "output-once") and rank == culprit:
        # A device that corrupts one forward output: every forward at the step (replays included, as
        # faulty hardware would), or only the first one (an intermittent fault).
        calls = {"n": 0}

        def flip_output(module: nn.Module, args: object, out: torch.Tensor) -> None:
            if current["step"] == at and (scenario == "output" or calls["n"] == 0):
                calls["n"] += 1
                with torch.no_grad():
                    out.view(-1).view(torch.int32)[5] ^= 1 << 22

        inner[2].register_forward_hook(flip_output)
    if scenario == "nondeterministic":  # on every rank: not a fault, a model audits cannot check
        inner[0].register_forward_hook(lambda m, i, o: o + (time.perf_counter_ns() % 1009) * 1e-9)
    # LOCALGRAD_ALSO="<rank>:<step>": that rank's gradient is flipped at that step too (one job, two faults).
    also = [int(v) for v in os.environ.get("LOCALGRAD_ALSO", "-1:-1").split(":")]
    grad_flip_at = at if scenario == "localgrad" and rank == culprit else also[1] if rank == also[0] else -1
    if grad_flip_at >= 0:

        def flip_local_grad(g: torch.Tensor) -> torch.Tensor:
            if current["step"] != grad_flip_at:
                return g
            g = g.clone()
            g.view(-1).view(torch.int32)[9] ^= 1 << 21  # before the all-reduce averages it away
            return g

        if sharded:  # the whole weight exists only inside the unit's forward, after FSDP2's gather
            installed: list[object] = []

            def install(module: nn.Module, args: object) -> None:
                if not installed:  # FSDP2 keeps the same whole-weight tensor from step to step
                    installed.append(module.weight.register_hook(flip_local_grad))

            inner[0].register_forward_pre_hook(install)
        else:
            inner[0].weight.register_hook(flip_local_grad)
    if scenario == "throughput":
        # bench/scout.py: alternate blocks with detection on, paused, and a plain DDP copy of the model
        # that lm-resiliency never touched (what our comm hook and hooks cost even when paused).
        assert plain is not None
        rows = int(os.environ.get("ROWS", "32"))  # bench/scout.py --rows
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rank))
        rates: dict[str, list[float]] = {"on": [], "off": [], "plain": []}
        modes = ("off", "on", "plain")
        for b in range(3 * int(os.environ.get("BLOCKS", "5")) + 1):
            mode = modes[b % 3] if b else "off"
            session.pause_detection(mode == "off")
            m, o = (plain, plain_opt) if mode == "plain" else (model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = (m(x) - x).pow(2).mean()
                o.zero_grad()
                loss.backward()
                o.step()
            dist.barrier()
            if b:
                rates[mode].append(steps / (time.perf_counter() - t0))
        result["rates"] = rates
        write_result()
        session.close()
        dist.destroy_process_group()
        return 0
    jitter = random.Random(rank)
    accumulate = int(os.environ.get("ACCUM", "1"))
    kept: list[torch.Tensor] = []  # the stale-grads culprit's gradients of the step before
    stall_at = at if scenario == "datastall" and rank == culprit else -1
    slow_loader = (scenario == "input" and rank == culprit) or rank == int(
        os.environ.get("SLOW_LOADER", "-1")
    )
    loader = session.instrument_dataloader(Source(0 if tensor_parallel else rank, slow_loader, stall_at))
    for step, x in zip(range(1, steps + 1), loader, strict=False):
        current["step"] = step
        if scenario == "hang" and rank == culprit and step == at:
            store.set("test/stalled_at", str(time.time()).encode())
            threading.Event().wait(600)  # never enters this step's collective; killed by the test
        time.sleep(jitter.uniform(0, 0.004))  # timing jitter on every rank
        if scenario == "prep" and rank == culprit:
            time.sleep(0.08)  # after the instrumented fetch, before the forward
        if scenario == "sigstop" and rank == culprit and step == at:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen whole: no heartbeat, no progress; the test kills it
        if scenario == "sigterm" and rank == culprit and step == at:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler or a campaign stops one worker
        if scenario == "group-stop" and step == at:
            store.set(f"test/at/{rank}", b"1")  # the test SIGTERMs every rank, as torchrun's agent does
        if scenario == "leave" and rank == culprit and step == at:
            session.close()
            if os.environ.get("LINGER") == "1":
                threading.Event().wait(600)
            dist.destroy_process_group()
            return 0
        if scenario == "oom" and rank == culprit and step == at:
            torch.empty(1 << 44, dtype=torch.uint8)  # the allocator refuses: a real, uncaught error
        if accumulate > 1:  # gradient accumulation: all-reduce only after the last micro-batch
            opt.zero_grad()
            parts = x.chunk(accumulate)
            for j, part in enumerate(parts):
                last = j == len(parts) - 1
                with model.no_sync() if wrapped and not last else contextlib.nullcontext():
                    ((model(part) - part).pow(2).mean() / len(parts)).backward()
        else:
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
        if not wrapped and not sharded and not tensor_parallel:  # the caller's own reduction
            for p in inner.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        flip_grad = (scenario == "sdc" and step == at) or (scenario == "recurring" and step in (at, 2 * at))
        if flip_grad and rank == culprit:
            g = next(model.parameters()).grad
            g = g.to_local() if hasattr(g, "to_local") else g  # (a DTensor's shard: FSDP2)
            g.view(-1).view(torch.int32)[7] ^= 1 << 3  # one bit, after the all-reduce
        if scenario == "drop" and rank == culprit and step == at:
            for p in model.parameters():  # every gradient dropped after the all-reduce (one bucket)
                p.grad.zero_()
        if scenario in ("stale-grads", "stale-one-grad") and rank == culprit:
            reused = list(model.parameters())[: 1 if scenario == "stale-one-grad" else None]
            if step == at:  # the previous step's tensors used again, after this step's all-reduce
                for p, g in zip(reused, kept, strict=True):
                    p.grad.copy_(g)
            kept = [p.grad.clone() for p in reused]
        if os.environ.get("CLIP") == "1":  # clipping between the all-reduce and the step, as LLMs do
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        dropped = scenario in ("stale-params", "stale-one-param") and rank == culprit and step == at
        # The step counts, its update is not applied (stale-one-param: to its last parameter only).
        undone = opt.param_groups[-1:] if scenario == "stale-one-param" else opt.param_groups
        for group in undone if dropped else ():
            group["lr"] = 0.0
        if not (scenario == "skip-step" and rank == culprit and step == at):
            opt.step()
        for group in undone if dropped else ():
            group["lr"] = 1e-3
        if scenario == "lr-drift" and rank == culprit and step == at:
            # As a ReduceLROnPlateau stepped with this rank's own loss would: its replicas keep theirs.
            for group in opt.param_groups:
                group["lr"] *= 0.5
        if scenario == "optstate" and rank == culprit and step == at:
            with torch.no_grad():
                m = opt.state[inner[0].weight]["exp_avg"]
                m.view(-1).view(torch.int32)[3] ^= 1 << 29  # one bit of a moment, between steps
        if scenario == "desync":  # a metric all-reduced after each step, between steps
            size = 5 if rank == culprit and step == at else 4  # the culprit's differs once
            dist.all_reduce(torch.full((size,), float(step)))
        if scenario == "evaluation" and rank == culprit and step % at == 0:
            # An evaluation of its own (gradients off, the module DDP wraps called directly) for
            # twice the hang threshold, while its peers wait in the next step's all-reduce.
            store.set(f"test/eval/{step}", b"1")
            with torch.no_grad():
                done = time.monotonic() + 4.0
                while time.monotonic() < done:
                    inner(torch.randn(64, 128))
        if scenario == "ema" and rank == culprit and step % at == 0:
            # An evaluation of its own of another model (an EMA copy: no hook of ours sees its
            # forward) for twice the hang threshold, while its peers wait in the next all-reduce.
            ema = copy.deepcopy(inner)
            done = time.monotonic() + 4.0
            while time.monotonic() < done:
                ema(torch.randn(64, 128))
        if scenario == "save" and rank == culprit and step % at == 0:
            # A checkpoint of its own written with plain torch.save (not marked) to storage that
            # takes 4 s (twice the hang threshold), while its peers wait in the next all-reduce.
            torch.save(inner.state_dict(), _SlowStorage(4.0))
        if scenario == "own-work" and rank == culprit:
            # Work of its own between steps, told to SCOUT: a checkpoint it saves (marked), or an
            # evaluation (gradients off). Its peers wait for it, but neither is a slow input.
            if step % 2:
                with session.checkpoint_io("write", name="own"):
                    time.sleep(0.08)
            else:
                with torch.no_grad():
                    done = time.monotonic() + 0.08
                    while time.monotonic() < done:
                        inner(torch.randn(64, 128))
        if scenario == "weight" and rank == culprit and step == at:
            with torch.no_grad():
                w = inner[2].weight
                w = w.to_local() if hasattr(w, "to_local") else w  # (a DTensor's view would gather)
                w.view(-1).view(torch.int32)[11] ^= 1 << 20  # one bit of a weight, after the step
    if os.environ.get("CLOSE_FIRST") == "1":  # the loop's end as most scripts have it: close, nothing more
        session.close()
        write_result()
        dist.destroy_process_group()
        return 0
    if scenario in ("output", "output-once", "localgrad"):
        result["certified"] = {str(s): session.scout.certified(s) for s in range(1, steps + 1)}
    if checkpoint:
        result["certified"] = {str(s): session.scout.certified(s) for s in range(max(1, at - 2), steps + 1)}
        session.gemini.drain(30)
        dist.barrier()
        time.sleep(0.3)  # let the last inventories land (gossip), bounded
        session.prepare_recovery("sdc")
        result["sdc_decision"] = session.last_recovery_decision
        session.prepare_recovery("process_failure")
        result["crash_decision"] = session.last_recovery_decision
    result["audits"] = dict(session.scout.audit_stats)
    dist.barrier()
    time.sleep(0.3)  # a benchmark-free grace: let the last step's gossip land before reading verdicts
    write_result()
    session.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
