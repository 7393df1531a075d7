"""Peer processes for bench/transport.py (not a benchmark by itself).

MODE=bulk: rank 1 of a 2-rank runtime plus a raw pyzmq ROUTER, both on TCP; consumes transfers.
MODE=gossip: one of 4 ranks; publishes timestamped telemetry and records arrival latency.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch.distributed as dist
import zmq

from lm_resiliency.config import RuntimeConfig
from lm_resiliency.core.messages import StepTelemetry
from lm_resiliency.runtime.discovery import StoreDiscovery
from lm_resiliency.runtime.node import RankRuntime
from lm_resiliency.runtime.transport import ZmqTransport

CFG = RuntimeConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0)


def runtime(store: dist.TCPStore, run: str, rank: int, world: int) -> tuple[RankRuntime, StoreDiscovery]:
    disc = StoreDiscovery(store, run, 0, rank, world)
    rt = RankRuntime(
        rank=rank,
        world_size=world,
        node_id=f"bench-node-{rank}",
        key=disc.shared_secret(),
        incarnation=disc.next_incarnation(),
        config=CFG,
        transport_factory=lambda: ZmqTransport("127.0.0.1", use_ipc=False),
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
    rt.add_handler("step", lambda sealed, msg: latencies.append((time.time() - msg.extra["t"]) * 1e3))
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


def main() -> int:
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    if os.environ["MODE"] == "bulk":
        bulk(store)
    else:
        gossip(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["COUNT"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
