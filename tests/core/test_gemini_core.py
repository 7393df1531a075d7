from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_resiliency.core.gemini.placement import replica_holders
from lm_resiliency.core.gemini.recovery import Source, plan_recovery, verified_steps
from lm_resiliency.core.topology import Topology

pytestmark = pytest.mark.timeout(60)


def topo(sizes: list[int]) -> Topology:
    nodes = [f"n{i}" for i, n in enumerate(sizes) for _ in range(n)]
    return Topology.build(nodes, [[r] for r in range(len(nodes))])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.sampled_from([-1, 1, 2, 3, 5]))
def test_placement_properties(sizes: list[int], jump: int) -> None:
    t = topo(sizes)
    holders = replica_holders(t, jump)
    assert set(holders) == set(range(t.world_size))
    for r, h in holders.items():
        if len(sizes) >= 2:
            assert h is not None, f"rank {r} has no holder with {len(sizes)} nodes"
            assert t.node_of(h) != t.node_of(r), "a replica on its own node protects nothing"
        else:
            assert h is None


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), st.integers(1, 8))
def test_default_placement_balances_equal_nodes(n_nodes: int, per_node: int) -> None:
    holders = replica_holders(topo([per_node] * n_nodes))
    counts = [list(holders.values()).count(r) for r in range(n_nodes * per_node)]
    assert counts == [1] * (n_nodes * per_node)


def test_plan_prefers_local_then_peer_then_disk() -> None:
    plan = plan_recovery(
        4,
        local={0: {5, 6}, 1: {5, 6}, 2: set(), 3: {6}},
        replicas={0: {2: {6}}, 1: {3: {5}}},
        disk={2: {4}, 3: {4}},
    )
    assert plan.step == 6
    assert plan.sources == {
        0: Source("local", 0),
        1: Source("local", 1),
        2: Source("peer", 0),
        3: Source("local", 3),
    }
    capped = plan_recovery(
        4,
        {0: {5, 6}, 1: {5, 6}, 2: set(), 3: {6}},
        {0: {2: {6}}, 1: {3: {5}}},
        {0: {4}, 1: {4}, 2: {4}, 3: {4}},
        at_most=5,
    )
    assert capped.step == 4 and {s.tier for s in capped.sources.values()} == {"disk"}


def test_plan_reports_why_nothing_is_loadable() -> None:
    plan = plan_recovery(2, {0: {3}}, {})
    assert plan.step == -1 and "ranks [1]" in plan.reason
    plan = plan_recovery(2, {0: {3}, 1: {4}}, {})
    assert plan.step == -1 and "no step" in plan.reason
    assert plan_recovery(2, {0: {3, 4}, 1: {3, 4}}, {}, allowed={3}).step == 3


def test_a_step_is_verified_when_every_replica_group_certified_it() -> None:
    # One group (plain DDP): any rank speaks for it, its publications a step apart.
    assert verified_steps({0: {7, 8}, 1: {7}, 2: {8, 9}}, {r: (0, 1, 2) for r in range(3)}) == {7, 8, 9}
    # Two groups (tensor parallel x data parallel): group (1, 3) disagreed at step 9 (an SDC on rank
    # 3) and certified up to 8; the healthy group (0, 2) certified 13 and 14. Step 13, which both
    # groups hold, is not verified: rank 3's copy of it carries the corruption.
    groups = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    certs = {0: {13, 14}, 2: {13}, 1: {8}, 3: {7, 8}}
    assert verified_steps(certs, groups) == set()
    assert (
        plan_recovery(
            4,
            {r: {8, 13} if r % 2 else {13, 14} for r in range(4)},
            {},
            allowed=verified_steps(certs, groups),
        ).step
        == -1
    )
    assert verified_steps({**certs, 1: {8, 13}}, groups) == {13}
    # A group none of whose ranks certified anything verifies nothing; inventories without a group
    # (an older version) count as one group.
    assert verified_steps({0: {5}, 1: set()}, {0: (0,), 1: (1,)}) == set()
    assert verified_steps({0: {5}, 1: {6}}, {}) == {5, 6}
    assert verified_steps({}, {}) == set()
