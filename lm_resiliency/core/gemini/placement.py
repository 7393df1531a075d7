"""Replica placement (pure).

Each rank's checkpoint is held by its own node (local shared memory) and by one rank on another node.
Default placement pairs nodes in a ring: rank r, the k-th rank of node i, is held by the k-th rank
(mod size) of node i+1. With equal node sizes every rank holds exactly one replica.
`replication_jump = j > 0`: rank r is held by the first rank r+j, r+2j, ... (mod world) that lives on
another node, as the 0.2 product did (the ring when no such rank exists).
With a single node there is nowhere else to put a copy: every holder is None.
"""

from __future__ import annotations

from lm_resiliency.core.topology import Topology

__all__ = ["replica_holders"]


def replica_holders(topology: Topology, jump: int = -1) -> dict[int, int | None]:
    """Map each rank to the rank that holds its replica (None when there is no other node)."""
    nodes = topology.nodes()
    if len(nodes) < 2:
        return {r: None for r in range(topology.world_size)}
    world = topology.world_size
    by_node = {n: topology.ranks_on(n) for n in nodes}
    ring: dict[int, int | None] = {}
    for i, node in enumerate(nodes):
        nxt = by_node[nodes[(i + 1) % len(nodes)]]
        for k, r in enumerate(by_node[node]):
            ring[r] = nxt[k % len(nxt)]
    if jump <= 0:
        return ring
    out: dict[int, int | None] = {}
    for r in range(world):
        # The jump may cycle inside one node (e.g. jump == world): fall back to the ring then.
        out[r] = next(
            (
                c
                for k in range(1, world + 1)
                if topology.node_of(c := (r + k * jump) % world) != topology.node_of(r)
            ),
            ring[r],
        )
    return out
