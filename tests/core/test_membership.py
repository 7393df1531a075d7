from __future__ import annotations

import pytest

from lm_resiliency.core.membership import EventKind, FailureDetector, PeerState

pytestmark = pytest.mark.timeout(30)


def kinds(events: list) -> list[tuple[EventKind, int]]:
    return [(e.kind, e.peer) for e in events]


def test_join_death_and_rejoin_with_literal_times() -> None:
    d = FailureDetector([1, 2], timeout=1.0, now=0.0)
    assert d.next_deadline() == 1.0
    assert kinds(d.heard(1, 1, now=0.1)) == [(EventKind.JOINED, 1)]
    assert d.heard(1, 1, now=0.2) == []
    assert d.tick(now=0.99) == []
    assert kinds(d.tick(now=1.0)) == [(EventKind.DIED, 2)]  # never heard
    assert d.state(1) is PeerState.ALIVE and d.next_deadline() == pytest.approx(1.2)
    died = d.tick(now=1.2)
    assert kinds(died) == [(EventKind.DIED, 1)] and "silent for 1.000s" in died[0].reason
    assert died[0].silent_s == pytest.approx(1.0)
    assert d.alive() == frozenset()
    assert kinds(d.heard(1, 2, now=5.0)) == [(EventKind.REJOINED, 1)]
    assert d.incarnation(1) == 2 and d.alive() == {1}


def test_older_incarnation_is_ignored() -> None:
    d = FailureDetector([1], timeout=1.0, now=0.0)
    d.heard(1, 5, now=0.1)
    assert d.heard(1, 4, now=0.9) == []
    assert kinds(d.tick(now=1.1)) == [(EventKind.DIED, 1)]  # the stale message did not refresh it


def test_restart_seen_before_death_is_a_rejoin() -> None:
    d = FailureDetector([1], timeout=1.0, now=0.0)
    d.heard(1, 1, now=0.1)
    assert kinds(d.heard(1, 2, now=0.2)) == [(EventKind.REJOINED, 1)]


def test_goodbye_leaves_without_waiting_and_late_beats_do_not_revive() -> None:
    d = FailureDetector([1], timeout=1.0, now=0.0)
    d.heard(1, 1, now=0.1)
    assert kinds(d.goodbye(1, 1, now=0.2)) == [(EventKind.LEFT, 1)]
    assert d.heard(1, 1, now=0.3) == []
    assert d.tick(now=10.0) == [] and d.next_deadline() is None
    assert d.state(1) is PeerState.LEFT
    assert kinds(d.heard(1, 2, now=11.0)) == [(EventKind.REJOINED, 1)]


def test_invalid_timeout() -> None:
    with pytest.raises(ValueError, match="timeout"):
        FailureDetector([1], timeout=0, now=0.0)
