"""A rank runtime with no training: discovery through a TCPStore, heartbeats, membership.

Env: RANK, WORLD_SIZE, STORE_PORT, WATCH_RANK. Writes `member/<rank>/...` keys to the store when it
sees WATCH_RANK die and come back, so the test (the store's host) can follow without sleeping.
Also used by bench/transport.py for the gossip latency measurement (MODE=gossip).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time

import torch.distributed as dist

from lm_resiliency.config import RuntimeConfig
from lm_resiliency.core.membership import PeerState
from lm_resiliency.runtime.discovery import StoreDiscovery
from lm_resiliency.runtime.node import RankRuntime
from lm_resiliency.runtime.transport import ZmqTransport


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    watch = int(os.environ.get("WATCH_RANK", "-1"))
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    disc = StoreDiscovery(store, "member-test", 0, rank, world)
    cfg = RuntimeConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
    rt = RankRuntime(
        rank=rank,
        world_size=world,
        node_id=f"node{rank}",
        key=disc.shared_secret(),
        incarnation=disc.next_incarnation(),
        config=cfg,
        transport_factory=lambda: ZmqTransport("127.0.0.1"),
    )
    ann = rt.start()
    disc.publish(ann)
    rt.connect_peers(disc.wait_all(30).values(), announce=True)
    store.set(f"member/{rank}/incarnation{rt.incarnation}/up", b"1")
    if not rt.wait_for(lambda v: len(v.live) == world, 5.0):
        return 2
    store.set(f"member/{rank}/incarnation{rt.incarnation}/all_live", b"1")
    if watch >= 0 and rank != watch:
        if not rt.wait_for(lambda v: v.peers[watch].state is PeerState.DEAD, 10.0):
            return 3
        store.set(f"member/{rank}/saw_dead", str(time.time()).encode())
        if not rt.wait_for(
            lambda v: v.peers[watch].state is PeerState.ALIVE and v.peers[watch].incarnation > 1, 10.0
        ):
            return 4
        store.set(f"member/{rank}/saw_rejoin", str(rt.view().peers[watch].incarnation).encode())
    store.wait(["member/done"], datetime.timedelta(seconds=60))
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
