"""Slow communication endpoints from link probes (pure, literal probe times)."""

from __future__ import annotations

import pytest

from lm_resiliency.core.scout.links import LinkDetector, slow_endpoints

pytestmark = pytest.mark.timeout(30)
FAST, SLOW = 0.002, 0.120


def _probes(nodes: dict[int, str], slow: set[int]) -> dict[int, dict[int, float]]:
    """Every rank probes every rank on another node; a probe touching a slow rank is slow."""
    return {
        o: {t: SLOW if (o in slow or t in slow) else FAST for t in nodes if nodes[t] != nodes[o]}
        for o in nodes
    }


def test_a_slow_node_is_named_by_the_others_and_accuses_nobody() -> None:
    nodes = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    found = slow_endpoints(_probes(nodes, {4, 5}), nodes, ratio=1.5, min_s=0.02)
    assert [(e.kind, e.id, e.ranks, e.accusers) for e in found] == [("node", "c", (4, 5), (0, 1, 2, 3))]


def test_one_slow_rank_on_a_healthy_node_is_named_as_the_rank() -> None:
    nodes = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    found = slow_endpoints(_probes(nodes, {3}), nodes, ratio=1.5, min_s=0.02)
    assert [(e.kind, e.id, e.ranks) for e in found] == [("rank", "3", (3,))]


def test_two_nodes_cannot_tell_which_end_is_slow_and_accuse_nobody() -> None:
    nodes = {0: "a", 1: "b"}
    assert slow_endpoints(_probes(nodes, {1}), nodes, ratio=1.5, min_s=0.02) == []


def test_jitter_below_the_floor_and_a_minority_of_accusers_are_not_enough() -> None:
    nodes = {0: "a", 1: "b", 2: "c", 3: "d"}
    probes = _probes(nodes, set())
    probes[0][3] = 0.015  # 7x the others but only 13 ms above them: under min_s
    probes[1][2] = 0.5  # one observer of four sees rank 2 slow: a minority
    assert slow_endpoints(probes, nodes, ratio=1.5, min_s=0.02) == []


def test_detector_confirms_over_rounds_reports_once_and_again_after_recovery() -> None:
    nodes = {0: "a", 1: "b", 2: "c"}
    d = LinkDetector(ratio=1.5, min_s=0.02, confirmations=3)
    slow, healthy = _probes(nodes, {2}), _probes(nodes, set())
    assert d.observe(1, slow, nodes) == [] and d.observe(2, slow, nodes) == []
    (v,) = d.observe(3, slow, nodes)
    assert (v.kind, v.ranks, v.straggler_type, v.endpoint, v.reason) == (
        "straggler",
        (2,),
        "communication",
        "node:c",
        "slow_node_link",
    )
    assert d.observe(4, slow, nodes) == []  # once
    assert d.observe(5, healthy, nodes) == []
    assert [d.observe(s, slow, nodes) for s in (6, 7)] == [[], []]
    assert len(d.observe(8, slow, nodes)) == 1
