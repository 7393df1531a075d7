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
    assert d.state(1) is PeerState.LEFT and d.departed() == {1: "goodbye"}
    assert kinds(d.heard(1, 2, now=11.0)) == [(EventKind.REJOINED, 1)]
    assert d.departed() == {}
    d.goodbye(1, 2, now=12.0, reason="close")
    assert d.departed() == {1: "close"}


def test_invalid_timeout() -> None:
    with pytest.raises(ValueError, match="timeout"):
        FailureDetector([1], timeout=0, now=0.0)


def test_a_process_seen_ending_is_dead_at_once_and_stays_dead_until_restarted() -> None:
    d = FailureDetector([1, 2], timeout=10.0, now=0.0)
    d.heard(1, 3, now=0.5)
    assert d.exited(2, 3, now=1.0, reason="process_exited: gone") == []  # never heard: nothing to end
    assert d.exited(1, 2, now=1.0, reason="process_exited: gone") == []  # an older incarnation's pid
    died = d.exited(1, 3, now=1.5, reason="process_exited: pid 7 on this host ended")
    assert kinds(died) == [(EventKind.DIED, 1)] and died[0].reason.startswith("process_exited")
    assert died[0].silent_s == pytest.approx(1.0)
    assert d.state(1) is PeerState.DEAD and d.exited(1, 3, now=1.6, reason="again") == []
    assert d.heard(1, 3, now=1.7) == []  # a message it sent before it ended, read late
    assert d.state(1) is PeerState.DEAD and kinds(d.tick(now=20.0)) == [(EventKind.DIED, 2)]
    assert kinds(d.heard(1, 4, now=21.0)) == [(EventKind.REJOINED, 1)]  # its restart
    assert d.heard(1, 4, now=21.5) == [] and d.state(1) is PeerState.ALIVE


def test_a_pause_of_the_observer_does_not_count_against_its_peers() -> None:
    """The observer stands still for 10 s (SIGSTOPped, its VM paused): before, its first tick after
    declared every peer dead, healthy ones included, though their beats were queued for it. Now the
    pause does not count: silence before it does, and a peer that died meanwhile is declared once
    its silence outside the pause reaches the timeout."""
    d = FailureDetector([1, 2], timeout=1.0, now=0.0, pause_s=0.5)
    d.heard(1, 1, now=0.1)
    d.heard(2, 1, now=0.1)
    assert d.tick(now=0.3) == []
    assert d.tick(now=10.3) == []  # back from the pause; nothing was read meanwhile
    assert d.heard(1, 1, now=10.31) == []  # a beat queued during the pause: still alive
    assert d.tick(now=10.7) == []
    died = d.tick(now=11.1)  # 0.2 s silent before the pause, 0.8 s after it
    assert kinds(died) == [(EventKind.DIED, 2)] and died[0].silent_s == pytest.approx(1.0)
    assert d.state(1) is PeerState.ALIVE
    plain = FailureDetector([1], timeout=1.0, now=0.0)  # no pause threshold: any gap counts
    plain.heard(1, 1, now=0.1)
    assert kinds(plain.tick(now=10.3)) == [(EventKind.DIED, 1)]
    with pytest.raises(ValueError, match="pause"):
        FailureDetector([1], timeout=1.0, now=0.0, pause_s=0.0)
