from __future__ import annotations

import pytest

from lm_resiliency.core.clock import ManualClock
from lm_resiliency.core.gemini.placement import replica_holders
from lm_resiliency.core.topology import ParallelDim, Topology, node_ids_by_machine, replica_groups_from

pytestmark = pytest.mark.timeout(30)


def test_build_nodes_groups_and_digest() -> None:
    t = Topology.build(["a", "a", "b", "b"], [[0, 2], [1, 3]], [ParallelDim("dp", ((0, 2), (1, 3)), True)])
    assert t.world_size == 4 and t.nodes() == ("a", "b") and t.ranks_on("b") == (2, 3)
    assert t.replica_group_of(3) == (1, 3) and [r.local_rank for r in t.ranks] == [0, 1, 0, 1]
    same = Topology.build(["a", "a", "b", "b"], [[1, 3], [2, 0]], [ParallelDim("dp", ((0, 2), (1, 3)), True)])
    assert t.digest() == same.digest()
    replaced = Topology.build(
        ["a", "a", "c", "c"], [[0, 2], [1, 3]], [ParallelDim("dp", ((0, 2), (1, 3)), True)]
    )
    assert replaced.digest() != t.digest() and replaced.shape_digest() == t.shape_digest()


@pytest.mark.parametrize(
    ("groups", "needle"),
    [([[0, 1], [1, 2]], "two replica groups"), ([[0, 1]], "no replica group"), ([[0, 5], [1, 2]], "outside")],
)
def test_invalid_groups(groups: list[list[int]], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Topology.build(["a", "a", "a"], groups)


def test_replica_groups_from_reports() -> None:
    assert replica_groups_from({0: [0, 1], 1: [1, 0], 2: []}, 3) == ((0, 1), (2,))
    with pytest.raises(ValueError, match="disagree"):
        replica_groups_from({0: [0, 1], 1: [1]}, 2)
    with pytest.raises(ValueError, match="does not contain"):
        replica_groups_from({0: [1]}, 2)


def test_peer_groups_contain_replica_groups_and_default_to_them() -> None:
    """HSDP over 2 replicas x 2 shards: replicas (0, 2) and (1, 3), all four ranks peers; without
    peer groups each replica group is its own, and digests do not depend on them."""
    t = Topology.build(["a", "a", "b", "b"], [[0, 2], [1, 3]], peer_groups=[[3, 2, 1, 0]])
    assert t.peer_group_of(1) == (0, 1, 2, 3) and t.replica_group_of(1) == (1, 3)
    plain = Topology.build(["a", "a", "b", "b"], [[0, 2], [1, 3]])
    assert plain.peer_group_of(1) == (1, 3) and plain.digest() == t.digest()
    with pytest.raises(ValueError, match=r"lacks replicas of rank 0: \(0, 2\)"):
        Topology.build(["a", "a", "b", "b"], [[0, 2], [1, 3]], peer_groups=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="two peer groups"):
        Topology.build(["a", "a"], [[0], [1]], peer_groups=[[0, 1], [1]])
    with pytest.raises(ValueError, match="disagree on the peer group"):
        replica_groups_from({0: [0, 1], 1: [1]}, 2, "peer group")


def test_manual_clock() -> None:
    c = ManualClock(1.0)
    assert c.advance(0.5) == 1.5
    with pytest.raises(ValueError):
        c.advance(-1)
    with pytest.raises(ValueError):
        c.set(1.0)


def test_a_node_id_that_several_machines_share_is_told_apart_so_replicas_leave_the_machine() -> None:
    """Hosts cloned from one image share /etc/machine-id: as one node, no rank's copy would leave
    its machine (no holder at all), and that machine's loss would lose its ranks' state."""
    a, b = "5d1c0f3e-9a7b-4c52-8e61-0b2f4a9d7c11", "e7a94b20-31cf-4d8e-a5f6-6c3b1d2e9f80"
    ids, hosts = ["img"] * 4, [f"{a}:4026531836"] * 2 + [f"{b}:4026531836"] * 2
    assert replica_holders(Topology.build(ids, [[0, 2], [1, 3]])) == {0: None, 1: None, 2: None, 3: None}
    named, shared = node_ids_by_machine(ids, hosts)
    assert named == ["img@5d1c0f3e", "img@5d1c0f3e", "img@e7a94b20", "img@e7a94b20"] and shared == ["img"]
    t = Topology.build(named, [[0, 2], [1, 3]])
    assert replica_holders(t) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert [r.local_rank for r in t.ranks] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "hosts",
    [
        ["m1:1", "m1:2", "m2:1", "m2:1"],  # containers on one machine: one boot id, two pid namespaces
        ["", "", "", ""],  # not Linux: machines unknown
        ["m1:1", "", "m2:1", ""],  # partly unknown: each id on one known machine
    ],
)
def test_node_ids_are_kept_unless_known_machines_share_them(hosts: list[str]) -> None:
    ids = ["x", "x", "y", "y"]
    named, shared = node_ids_by_machine(ids, hosts)
    assert named == ids and shared == []
