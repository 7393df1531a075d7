"""Peer processes for bench/transport.py (not a benchmark by itself).

MODE=bulk: rank 1 of a 2-rank runtime plus a raw pyzmq ROUTER, both on TCP; consumes transfers.
MODE=gossip: one of 4 ranks; publishes timestamped telemetry and records arrival latency.
MODE=scope: one of WORLD_SIZE ranks in replica groups of GROUP; publishes COUNT steps of telemetry to
  the whole job, then COUNT more scoped to its group, and records messages and CPU time per step.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Sequence

import torch.distributed as dist
import zmq

from lm_resiliency.config import RuntimeConfig
from lm_resiliency.core.auth import Sealed
from lm_resiliency.core.messages import StepTelemetry
from lm_resiliency.runtime.discovery import StoreDiscovery
from lm_resiliency.runtime.node import ClusterView, RankRuntime
from lm_resiliency.runtime.transport import ZmqTransport

CFG = RuntimeConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0)


def runtime(
    store: dist.TCPStore, run: str, rank: int, world: int, group: tuple[int, ...] = ()
) -> tuple[RankRuntime, StoreDiscovery]:
    disc = StoreDiscovery(store, run, 0, rank, world)
    rt = RankRuntime(
        rank=rank,
        world_size=world,
        node_id=f"bench-node-{rank}",
        key=disc.shared_secret(),
        incarnation=disc.next_incarnation(),
        config=CFG,
        transport_factory=lambda: ZmqTransport("127.0.0.1", use_ipc=False),
        replica_group=group,
    )
    disc.publish(rt.start())
    return rt, disc


def bulk(store: dist.TCPStore) -> None:
    rt, disc = runtime(store, "bench-bulk", 1, 2)
    rt.add_transfer_listener(lambda sender, tid, meta, chunks: True)  # consume: keep nothing
    rt.connect_peers(disc.wait_all(60).values(), announce=True)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    store.set("bench/raw_endpoint", router.getsockopt(zmq.LAST_ENDPOINT))
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    got = 0
    while not store.check(["bench/done"]):
        if not poller.poll(100):
            continue
        parts = router.recv_multipart(copy=False)
        got += len(parts[-1])
        expected = int(bytes(parts[1]))
        if got >= expected:
            router.send_multipart([parts[0], b"ack"])
            got = 0
    store.set("bench/peer_alive", b"1" if rt.alive else b"0")
    router.close(0)
    ctx.term()
    rt.close()


def gossip(store: dist.TCPStore, rank: int, world: int, count: int) -> None:
    rt, disc = runtime(store, "bench-gossip", rank, world)
    latencies: list[float] = []

    def arrived(sealed: Sealed, msg: StepTelemetry) -> None:
        if msg.rank != rank:  # a rank's own gossip reaches its own handlers too: not a delivery
            latencies.append((time.time() - msg.extra["t"]) * 1e3)

    rt.add_handler("step", arrived)  # type: ignore[arg-type]
    rt.connect_peers(disc.wait_all(60).values(), announce=True)
    assert rt.wait_for(lambda v: len(v.live) == world, 30)
    store.add("bench/gossip_ready", 1)
    while store.add("bench/gossip_ready", 0) < world:
        time.sleep(0.01)
    for step in range(count):
        rt.submit(StepTelemetry(rank=rank, step=step, step_s=0.0, extra={"t": time.time()}))
        time.sleep(0.005)  # a benchmark's pacing, not synchronization
    rt.wait_for(lambda v: all(v.telemetry_step(r) == count - 1 for r in range(world)), 30)
    store.set(f"bench/gossip/{rank}", json.dumps(latencies).encode())
    store.add("bench/gossip_done", 1)
    while store.add("bench/gossip_done", 0) < world:
        time.sleep(0.01)
    rt.close()


def scope(store: dist.TCPStore, rank: int, world: int, count: int, size: int) -> None:
    first = rank - rank % size
    group = tuple(range(first, first + size))
    rt, disc = runtime(store, "bench-scope", rank, world, group)
    rt.connect_peers(disc.wait_all(60).values(), announce=True)
    assert rt.wait_for(lambda v: len(v.live) == world, 30)

    def barrier(name: str) -> None:
        store.set(f"bench/{name}/{rank}", b"1")
        store.wait([f"bench/{name}/{r}" for r in range(world)])

    result = {}
    for i, phase in enumerate(("job", "group")):
        if phase == "group":
            rt.scope_to_group("step")
        barrier(f"{phase}-ready")
        accepted, cpu = rt.view().stats["accepted"], time.process_time()
        last = (i + 1) * count - 1
        for step in range(i * count, last + 1):
            rt.submit(StepTelemetry(rank=rank, step=step, step_s=0.0))
            time.sleep(0.005)  # a benchmark's pacing (steps), not synchronization
        peers = range(world) if phase == "job" else group

        def arrived(v: ClusterView, last: int = last, peers: Sequence[int] = peers) -> bool:
            return all(v.telemetry_step(r) == last for r in peers)

        assert rt.wait_for(arrived, 60)
        barrier(f"{phase}-done")  # every rank's steps are in: nothing more of this phase arrives
        result[phase] = {
            "received_per_step": (rt.view().stats["accepted"] - accepted) / count,
            "cpu_ms_per_step": (time.process_time() - cpu) * 1e3 / count,
        }
    store.set(f"bench/scope/{rank}", json.dumps(result).encode())
    barrier("scope-closed")
    rt.close()


def main() -> int:
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    if os.environ["MODE"] == "bulk":
        bulk(store)
    elif os.environ["MODE"] == "scope":
        rank, world, count = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["COUNT"])
        scope(store, rank, world, count, int(os.environ["GROUP"]))
    else:
        gossip(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["COUNT"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
