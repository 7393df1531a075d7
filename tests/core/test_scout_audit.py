"""Audit pairing and verdicts (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lm_resiliency.core.scout.audit import audit_source, audit_target, audit_verdicts

pytestmark = pytest.mark.timeout(60)


@given(
    st.lists(st.integers(0, 10_000), min_size=2, max_size=64, unique=True),
    st.integers(0, 10_000),
    st.integers(1, 50),
)
def test_every_rank_audits_one_peer_and_is_audited_by_one(group: list[int], step: int, interval: int) -> None:
    targets = {r: audit_target(group, r, step, interval) for r in group}
    assert all(t is not None and t != r and t in group for r, t in targets.items())
    assert sorted(targets.values()) == sorted(group)  # a permutation: each audited exactly once
    assert all(audit_source(group, t, step, interval) == r for r, t in targets.items())


def test_pairing_rotates_so_every_peer_audits_every_other() -> None:
    group = [3, 5, 8, 13]
    seen = {audit_source(group, 8, step, 10) for step in range(0, 30, 10)}
    assert seen == {3, 5, 13}
    assert audit_target([4], 4, 10, 10) is None and audit_target([1, 2], 7, 10, 10) is None


def test_an_accusation_by_the_assigned_auditor_names_the_audited_rank() -> None:
    group, step = [0, 1, 2, 3], 6
    results = {r: (audit_target(group, r, step, 1), "ok", "") for r in group}
    culprit = 2
    auditor = audit_source(group, culprit, step, 1)
    results[auditor] = (culprit, "grads", "")
    (v,) = audit_verdicts(step, results, group, 1)
    assert (v.kind, v.ranks, v.step, v.reason) == ("sdc", (2,), 6, "backward_replay_mismatch")
    assert audit_verdicts(step, {r: (t, "ok", "") for r, (t, _, _) in results.items()}, group, 1) == []


def test_an_accused_auditor_loses_its_standing() -> None:
    """The culprit corrupts its replay of its own target too: that accusation does not stand."""
    group, step = [0, 1, 2, 3], 6
    culprit = 1
    results = {r: (audit_target(group, r, step, 1), "ok", "") for r in group}
    results[audit_source(group, culprit, step, 1)] = (culprit, "output", "")
    results[culprit] = (audit_target(group, culprit, step, 1), "output", "")
    (v,) = audit_verdicts(step, results, group, 1)
    assert v.ranks == (culprit,) and v.reason == "forward_replay_mismatch"


def test_two_replicas_accusing_each_other_are_ambiguous() -> None:
    (v,) = audit_verdicts(4, {0: (1, "output", ""), 1: (0, "output", "")}, [0, 1], 2)
    assert (v.kind, v.ranks, v.reason) == ("sdc_ambiguous", (0, 1), "audit_inconclusive")


def test_accusations_from_unassigned_auditors_or_unknown_findings_are_ignored() -> None:
    group, step = [0, 1, 2, 3], 6
    stranger = next(r for r in group if r not in (2, audit_source(group, 2, step, 1)))
    assert audit_verdicts(step, {stranger: (2, "output", "")}, group, 1) == []
    assert audit_verdicts(step, {audit_source(group, 2, step, 1): (2, "bogus", "")}, group, 1) == []
