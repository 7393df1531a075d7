"""Worker processes for bench/gemini.py (not a benchmark by itself).

MODE=replica (2 ranks, 2 synthetic nodes): rank 0 captures a large state; GEMINI replicates it to
rank 1; the same bytes also go through raw pyzmq DEALER->ROUTER between the same processes.
MODE=ddp (4 ranks): DDP steps/s in alternating blocks with GEMINI capturing every step or not at all.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import zmq
from torch import nn

from lm_resiliency import InMemoryCkptConfig, RuntimeConfig, enable_resiliency


def replica(store: dist.TCPStore, rank: int, reps: int, mib: int) -> None:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Linear(1024, (mib << 20) // 4096, bias=False)  # `mib` MiB of float32 parameters
    session = enable_resiliency(
        model,
        None,
        interval=1,
        checkpoint=InMemoryCkptConfig(disk_flush_interval=10**9),
        runtime=RuntimeConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0, use_ipc=False),
    )
    gem = session.gemini
    ctx = zmq.Context()
    if rank == 1:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        store.set("bench/raw", router.getsockopt(zmq.LAST_ENDPOINT))
        while not store.check(["bench/done"]):
            if router.poll(50):
                parts = router.recv_multipart(copy=False)
                if bytes(parts[1]) == b"last":
                    router.send_multipart([parts[0], b"ack"])
        router.close(0)
    else:
        store.wait(["bench/raw"])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(store.get("bench/raw").decode())
        ours, with_commit, raw, size = [], [], [], 0
        phases: list[tuple[float, float]] = []
        for i in range(reps + 1):
            assert gem.capture(i + 1)
            t0 = time.perf_counter()
            gem.drain(120)  # checksums + replication to rank 1 (acknowledged)
            dt_ours = time.perf_counter() - t0
            slot = next(s for k, s in enumerate(gem._own) if gem._own_step.get(k) == i + 1)
            header = slot.read_header()
            size = header.file_size
            view = slot.view()[: header.file_size]
            chunk = gem.chunk
            parts = [view[j : j + chunk] for j in range(0, size, chunk)]
            t0 = time.perf_counter()
            for j, p in enumerate(parts):
                dealer.send_multipart([b"last" if j == len(parts) - 1 else b"more", p], copy=False)
            dealer.recv()
            dt_raw = time.perf_counter() - t0
            del view, parts
            if i:  # the first rep warms both paths
                # Replication: from the committed capture to the holder's acknowledgement. The commit
                # (checksums of the capture) is the capture's own integrity, paid with or without a
                # replica; `..._including_commit` counts it as well.
                ours.append(size / gem.stats.replication_s_last)
                with_commit.append(size / dt_ours)
                raw.append(size / dt_raw)
                phases.append((gem.stats.commit_s_last, gem.stats.replication_s_last))
        store.set(
            "bench/result",
            json.dumps(
                {
                    "replica_bytes": size,
                    "replica_gbps": statistics.median(ours) / 1e9,
                    "raw_gbps": statistics.median(raw) / 1e9,
                    "replica_ratio_vs_raw_zmq": statistics.median(ours) / statistics.median(raw),
                    "replica_ratio_including_commit": statistics.median(with_commit) / statistics.median(raw),
                    "replica_commit_s": statistics.median(p[0] for p in phases),
                    "replica_send_s": statistics.median(p[1] for p in phases),
                    "note": "replication from commit to ack; _including_commit adds the capture checksums",
                }
            ).encode(),
        )
        store.set("bench/done", b"1")
        dealer.close(0)
    ctx.term()
    session.close()


def ddp(
    store: dist.TCPStore, rank: int, world: int, blocks: int, block_steps: int, width: int, rows: int
) -> None:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    session = enable_resiliency(
        model,
        opt,
        interval=1,
        checkpoint=InMemoryCkptConfig(disk_flush_interval=10**9),
        runtime=RuntimeConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0),
    )
    gem = session.gemini
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, width, generator=gen)
    rates: dict[str, list[float]] = {"on": [], "off": [], "local": []}
    cpu: dict[str, list[float]] = {"on": [], "off": [], "local": []}  # this process's, all threads
    waits: dict[str, list[float]] = {"on": [], "local": []}  # waiting for SCOUT's verdict, per step
    own: dict[str, list[float]] = {"on": [], "off": [], "local": []}  # the training thread's CPU
    step_times: list[float] = []
    holder = gem.holder
    modes = ["off", "on", "local"]
    for b in range(blocks * 3 + 1):
        mode = modes[b % 3]
        gem.interval = 10**9 if mode == "off" else 1
        gem.drain(60)
        gem.holder = holder if mode == "on" else None  # "local": capture without replication
        dist.barrier()
        c0, o0 = time.process_time(), time.thread_time()
        w0 = gem.stats.verdict_wait_s
        t0 = time.perf_counter()
        for _ in range(block_steps):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        dist.barrier()
        dt = time.perf_counter() - t0
        if b:  # block 0 warms up
            rates[mode].append(block_steps / dt)
            cpu[mode].append((time.process_time() - c0) / block_steps)
            own[mode].append((time.thread_time() - o0) / block_steps)
            if mode in waits:
                waits[mode].append((gem.stats.verdict_wait_s - w0) / block_steps)
            step_times.append(dt / block_steps)
    state_bytes = gem.stats.bytes_per_capture
    if rank == 0:
        store.set(
            "bench/result",
            json.dumps(
                {
                    "healthy_throughput_ratio": statistics.median(rates["on"])
                    / statistics.median(rates["off"]),
                    "steps_per_s_capture_every_step": statistics.median(rates["on"]),
                    "steps_per_s_without_capture": statistics.median(rates["off"]),
                    "throughput_ratio_capture_without_replication": statistics.median(rates["local"])
                    / statistics.median(rates["off"]),
                    "ddp_ranks": world,
                    "ddp_state_bytes_per_rank": state_bytes,
                    "ddp_step_s": statistics.median(step_times),
                    "ddp_rows_per_step": rows,
                    "captures_skipped_busy": gem.stats.skipped_busy,
                    # The training thread's wait for SCOUT's verdict on the previous capture
                    # before choosing which slot to overwrite (GeminiStats.verdict_wait_s).
                    "verdict_wait_ms_per_step": 1000 * statistics.median(waits["on"]),
                    "verdict_wait_ms_per_step_without_replication": 1000 * statistics.median(waits["local"]),
                    # CPU time of rank 0's process per step (every thread): where cores are few,
                    # the ratios follow it; where they are many, the training thread's own share does.
                    "cpu_ms_per_step_capture_every_step": 1000 * statistics.median(cpu["on"]),
                    "cpu_ms_per_step_capture_without_replication": 1000 * statistics.median(cpu["local"]),
                    "cpu_ms_per_step_without_capture": 1000 * statistics.median(cpu["off"]),
                    # The training thread's own share: what a capture costs it (the copy, the walk
                    # of the state) where other cores take the background threads' work.
                    "training_thread_cpu_ms_per_step_capture_every_step": 1000 * statistics.median(own["on"]),
                    "training_thread_cpu_ms_per_step_without_capture": 1000 * statistics.median(own["off"]),
                }
            ).encode(),
        )
    session.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=300)
    )
    if os.environ["MODE"] == "replica":
        replica(store, rank, int(os.environ["REPS"]), int(os.environ["MIB"]))
    else:
        ddp(
            store,
            rank,
            world,
            int(os.environ["BLOCKS"]),
            int(os.environ["BLOCK_STEPS"]),
            int(os.environ["WIDTH"]),
            int(os.environ.get("ROWS", "64")),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
