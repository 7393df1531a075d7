"""Topology values: ranks, the nodes they run on, and the groups that must agree.

A *replica group* is a set of ranks that hold bitwise-identical state after every optimizer step
(DDP ranks; HSDP ranks along the replicate dimension with equal shard coordinates). SCOUT compares
fingerprints inside a replica group; GEMINI places copies on ranks of other nodes.

A *peer group* is a set of ranks that do the same work each step, whether or not they hold the same
state: every rank of an FSDP2/TP mesh (one pipeline stage), the ranks of a DDP group. SCOUT compares
step times, stalls and hangs inside a peer group. Each one contains its members' replica groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgpack

__all__ = ["ParallelDim", "RankInfo", "Topology", "machine_of", "node_ids_by_machine", "replica_groups_from"]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node_id: str
    local_rank: int = 0


@dataclass(frozen=True)
class ParallelDim:
    """One named parallel dimension (dp, tp, pp, ep, cp, ...) as the groups of ranks along it."""

    name: str
    groups: tuple[tuple[int, ...], ...]
    replicated: bool = False  # ranks along this dimension hold identical state


@dataclass(frozen=True)
class Topology:
    """The job's layout. Validated on construction; `digest()` is stable across processes."""

    ranks: tuple[RankInfo, ...]
    replica_groups: tuple[tuple[int, ...], ...]
    dims: tuple[ParallelDim, ...] = ()
    peer_groups: tuple[tuple[int, ...], ...] = ()  # none listed: each replica group is its own
    _group_of: Mapping[int, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)
    _peers_of: Mapping[int, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        world = len(self.ranks)
        if [r.rank for r in self.ranks] != list(range(world)):
            raise ValueError("ranks must be listed in order 0..world_size-1")
        group_of: dict[int, tuple[int, ...]] = {}
        for group in self.replica_groups:
            if list(group) != sorted(set(group)):
                raise ValueError(f"replica group {group} must be sorted and without repeats")
            for r in group:
                if not 0 <= r < world:
                    raise ValueError(f"replica group {group} names rank {r} outside world size {world}")
                if r in group_of:
                    raise ValueError(f"rank {r} is in two replica groups: {group_of[r]} and {group}")
                group_of[r] = group
        missing = [r for r in range(world) if r not in group_of]
        if missing:
            raise ValueError(f"ranks {missing} are in no replica group")
        object.__setattr__(self, "_group_of", group_of)
        peers_of: dict[int, tuple[int, ...]] = {}
        for group in self.peer_groups:
            for r in group:
                if not 0 <= r < world:
                    raise ValueError(f"peer group {group} names rank {r} outside world size {world}")
                if r in peers_of:
                    raise ValueError(f"rank {r} is in two peer groups: {peers_of[r]} and {group}")
                if not set(group_of[r]) <= set(group):
                    raise ValueError(f"peer group {group} lacks replicas of rank {r}: {group_of[r]}")
                peers_of[r] = group
        object.__setattr__(self, "_peers_of", peers_of)

    @classmethod
    def build(
        cls,
        node_ids: Iterable[str],
        replica_groups: Iterable[Iterable[int]],
        dims: Iterable[ParallelDim] = (),
        local_ranks: Iterable[int] | None = None,
        peer_groups: Iterable[Iterable[int]] = (),
    ) -> Topology:
        nodes = list(node_ids)
        locals_ = list(local_ranks) if local_ranks is not None else _local_ranks(nodes)
        ranks = tuple(RankInfo(r, n, lr) for r, (n, lr) in enumerate(zip(nodes, locals_, strict=True)))
        groups = tuple(sorted({tuple(sorted(g)) for g in replica_groups}))
        peers = tuple(sorted({tuple(sorted(g)) for g in peer_groups}))
        return cls(ranks, groups, tuple(dims), peers)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def node_of(self, rank: int) -> str:
        return self.ranks[rank].node_id

    def nodes(self) -> tuple[str, ...]:
        """Node ids in order of their lowest rank."""
        return tuple(dict.fromkeys(r.node_id for r in self.ranks))

    def ranks_on(self, node_id: str) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks if r.node_id == node_id)

    def replica_group_of(self, rank: int) -> tuple[int, ...]:
        return self._group_of[rank]

    def peer_group_of(self, rank: int) -> tuple[int, ...]:
        """The ranks doing the same work as `rank` each step (its replica group when none is known)."""
        return self._peers_of.get(rank) or self._group_of[rank]

    def digest(self) -> str:
        """A short hash of ranks, node ids and groups; a replaced node changes it."""
        canon = [
            [(r.rank, r.node_id, r.local_rank) for r in self.ranks],
            [list(g) for g in self.replica_groups],
            [(d.name, [list(g) for g in d.groups], d.replicated) for d in self.dims],
        ]
        return hashlib.sha256(msgpack.packb(canon, use_bin_type=True)).hexdigest()[:16]

    def shape_digest(self) -> str:
        """Like `digest` but blind to which machine a node is: survives a standby replacement."""
        node_index = {n: i for i, n in enumerate(self.nodes())}
        canon = [
            [(r.rank, node_index[r.node_id], r.local_rank) for r in self.ranks],
            [list(g) for g in self.replica_groups],
            [(d.name, [list(g) for g in d.groups], d.replicated) for d in self.dims],
        ]
        return hashlib.sha256(msgpack.packb(canon, use_bin_type=True)).hexdigest()[:16]


def _local_ranks(nodes: list[str]) -> list[int]:
    seen: dict[str, int] = {}
    out = []
    for n in nodes:
        out.append(seen.get(n, 0))
        seen[n] = seen.get(n, 0) + 1
    return out


def machine_of(host: str) -> str:
    """The machine in a rank's host key (`<kernel boot id>:<pid namespace>`, "" unknown): its boot
    id. Containers on one machine share it; machines, and one machine across a reboot, do not."""
    return host.split(":", 1)[0]


def node_ids_by_machine(node_ids: Iterable[str], hosts: Iterable[str]) -> tuple[list[str], list[str]]:
    """Each rank's node id, and the ids that ranks on several machines share. Hosts cloned from one
    image carry one /etc/machine-id: taken as is, their ranks look like one node, so no copy would
    leave them and a node's loss would lose it. Such an id gets its machine's boot id appended
    (`<id>@<boot id prefix>`) on each machine; others are kept. Unknown machines ("") are not told
    apart."""
    ids, machines = list(node_ids), [machine_of(h) for h in hosts]
    seen: dict[str, set[str]] = {}
    for node, machine in zip(ids, machines, strict=True):
        if machine:
            seen.setdefault(node, set()).add(machine)
    shared = sorted(n for n, m in seen.items() if len(m) > 1)
    named = [f"{n}@{m[:8]}" if n in shared and m else n for n, m in zip(ids, machines, strict=True)]
    return named, shared


def replica_groups_from(
    per_rank: Mapping[int, Iterable[int]], world_size: int, what: str = "replica group"
) -> tuple[tuple[int, ...], ...]:
    """Assemble the replica (or peer) groups from what each rank reported as its own group.

    Ranks that reported nothing form singleton groups. Raises ValueError when reports contradict.
    """
    groups: dict[int, tuple[int, ...]] = {}
    for rank in range(world_size):
        reported = tuple(sorted(per_rank.get(rank, ()))) or (rank,)
        if rank not in reported:
            raise ValueError(f"rank {rank} reported {what} {reported} that does not contain it")
        for member in reported:
            if member in groups and groups[member] != reported:
                raise ValueError(
                    f"ranks disagree on the {what} of rank {member}: {groups[member]} vs {reported}"
                )
            groups[member] = reported
    return tuple(sorted(set(groups.values())))
