"""Recovery planning (pure): the newest step every rank can load, and where each rank loads it from.

Inputs are what ranks reported through the store: the steps each rank holds of its own state in
local memory, the replicas each rank holds for others, and the steps on the durable tier. Sources are
tried nearest first: local memory, a peer replica, disk. Every rank runs this on the same inputs, so
all agree without a coordinator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

__all__ = ["RecoveryPlan", "Source", "memory_checkpoint_id", "plan_recovery", "verified_steps"]


@dataclass(frozen=True)
class Source:
    tier: str  # "local" | "peer" | "disk"
    holder: int  # the rank that has the bytes (itself for local and disk)


@dataclass(frozen=True)
class RecoveryPlan:
    step: int  # -1: nothing every rank can load
    sources: dict[int, Source]
    reason: str


def memory_checkpoint_id(step: int) -> str:
    """The `checkpoint_id` of a step restored from GEMINI's memory tiers (local or a peer replica):
    the restart context and the session's recovery decision name it the same way. A restore from
    disk names the file instead."""
    return f"gemini-step-{step}"


def plan_recovery(
    world_size: int,
    local: Mapping[int, Set[int]],
    replicas: Mapping[int, Mapping[int, Set[int]]],
    disk: Mapping[int, Set[int]] | None = None,
    at_most: int | None = None,
    allowed: Set[int] | None = None,
) -> RecoveryPlan:
    """Choose the newest step that every rank can load.

    Args:
        local: rank -> steps of its own state it holds in memory.
        replicas: holder rank -> {owner rank -> steps it holds of the owner's state}.
        disk: rank -> steps of its state on the durable tier.
        at_most: only steps <= this (a restart context naming a step).
        allowed: only these steps (e.g. the recovery-verified ones).
    """
    disk = disk or {}
    loadable: dict[int, dict[int, Source]] = {r: {} for r in range(world_size)}
    for r in range(world_size):
        for s in disk.get(r, ()):
            loadable[r][s] = Source("disk", r)
    for holder in sorted(replicas, reverse=True):  # lowest holder rank wins ties, deterministically
        for owner, steps in replicas[holder].items():
            if 0 <= owner < world_size:
                for s in steps:
                    loadable[owner][s] = Source("peer", holder)
    for r in range(world_size):
        for s in local.get(r, ()):
            loadable[r][s] = Source("local", r)
    common = set(loadable[0]) if world_size else set()
    for r in range(1, world_size):
        common &= set(loadable[r])
    if at_most is not None:
        common = {s for s in common if s <= at_most}
    if allowed is not None:
        common &= set(allowed)
    if not common:
        missing = [r for r in range(world_size) if not loadable[r]]
        why = f"ranks {missing} have no copy at all" if missing else "no step is held for every rank"
        return RecoveryPlan(-1, {}, why)
    step = max(common)
    sources = {r: loadable[r][step] for r in range(world_size)}
    tiers = sorted({s.tier for s in sources.values()})
    return RecoveryPlan(step, sources, f"newest step held for every rank ({'+'.join(tiers)})")


def verified_steps(certified: Mapping[int, Set[int]], groups: Mapping[int, Sequence[int]]) -> set[int]:
    """The steps recovery-verified for the whole job: certified in every replica group.

    Args:
        certified: rank -> the steps its certificates cover (of the copies it holds).
        groups: rank -> its replica group (the ranks SCOUT compares it with); a rank without one
            (an inventory of an older version) counts as one group with every other such rank.

    The ranks of one group reach the same certificates from the same evidence, and publish them a
    step or two apart: any of them speaks for the group (the union). A group certifies its own
    ranks' state only: with several groups (tensor, pipeline or expert parallelism, HSDP), a step
    another group's SDC left corrupt may be certified by every healthy group, and is verified only
    when the corrupted group certified it too (the intersection)."""
    by_group: dict[tuple[int, ...], set[int]] = {}
    for rank, steps in certified.items():
        by_group.setdefault(tuple(sorted(groups.get(rank, ()))), set()).update(steps)
    return set.intersection(*by_group.values()) if by_group else set()
