"""Heartbeat failure detector (pure).

Each observer judges each peer on its own monotonic clock: a peer is ALIVE while it was heard from in
the last `timeout` seconds, DEAD after that silence, LEFT after it said goodbye. A newer incarnation of
a peer (a restarted process) replaces the old one and brings it back to ALIVE; an older incarnation is
ignored. A peer never heard from is UNKNOWN until `timeout` after the detector started, then DEAD.

An observer that stood still (its `tick` came `pause_s` or more after the one before: the observer
was SIGSTOPped, its VM paused, its loop blocked) heard nothing meanwhile because it listened to
nothing: that time does not count against its peers. Their silence is measured from the end of the
pause, plus what they had been silent before it; the messages that queued up meanwhile then revive
nothing, and a resumed observer accuses no healthy peer. A peer that died meanwhile is declared at
most the pause's length later.

Transitions (peer state x event -> state, events emitted):
    UNKNOWN/DEAD/LEFT  + heartbeat        -> ALIVE  (JOINED, or REJOINED if it had been seen before)
    ALIVE              + heartbeat        -> ALIVE  (nothing)
    ALIVE/UNKNOWN      + silence>=timeout -> DEAD   (DIED)
    ALIVE              + process exited   -> DEAD   (DIED; seen by a same-host observer; later
                                                   messages of that incarnation are ignored)
    any                + goodbye          -> LEFT   (LEFT)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["EventKind", "FailureDetector", "MembershipEvent", "PeerState"]


class PeerState(enum.Enum):
    UNKNOWN = "unknown"
    ALIVE = "alive"
    DEAD = "dead"
    LEFT = "left"


class EventKind(enum.Enum):
    JOINED = "joined"
    REJOINED = "rejoined"
    DIED = "died"
    LEFT = "left"


@dataclass(frozen=True)
class MembershipEvent:
    kind: EventKind
    peer: int
    incarnation: int
    at: float
    reason: str
    silent_s: float | None = None  # DIED: how long the peer had been silent (the detection latency)


@dataclass
class _Peer:
    state: PeerState
    incarnation: int
    last_heard: float
    ever_seen: bool = False
    exited: bool = False  # this incarnation's process was seen ending: nothing it sent revives it
    left_reason: str = ""  # LEFT: why it said it goes (its goodbye's reason)


class FailureDetector:
    """Tracks liveness of a fixed set of peers. Every method takes `now`; nothing reads a clock."""

    def __init__(
        self, peers: Iterable[int], timeout: float, now: float, pause_s: float | None = None
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"heartbeat timeout must be > 0, got {timeout}")
        if pause_s is not None and pause_s <= 0:
            raise ValueError(f"pause threshold must be > 0, got {pause_s}")
        self.timeout = float(timeout)
        self.pause_s = pause_s
        self._last_tick = now
        self._peers = {p: _Peer(PeerState.UNKNOWN, -1, now) for p in peers}

    def add_peer(self, peer: int, now: float) -> None:
        self._peers.setdefault(peer, _Peer(PeerState.UNKNOWN, -1, now))

    def heard(self, peer: int, incarnation: int, now: float) -> list[MembershipEvent]:
        """Record any authenticated message from `peer` as a sign of life."""
        p = self._peers.get(peer)
        if p is None or incarnation < p.incarnation:
            return []
        newer = incarnation > p.incarnation
        p.last_heard = max(p.last_heard, now)
        if p.state is PeerState.ALIVE and not newer:
            return []
        if (p.state is PeerState.LEFT or p.exited) and not newer:
            return []  # late message of a peer that said goodbye, or whose process ended
        kind = EventKind.REJOINED if p.ever_seen else EventKind.JOINED
        was = p.state
        p.state, p.incarnation, p.ever_seen, p.exited = PeerState.ALIVE, incarnation, True, False
        if was is PeerState.ALIVE:  # a restart we never saw die: report it as a rejoin
            return [MembershipEvent(EventKind.REJOINED, peer, incarnation, now, "new incarnation")]
        return [MembershipEvent(kind, peer, incarnation, now, f"heard while {was.value}")]

    def goodbye(self, peer: int, incarnation: int, now: float, reason: str = "") -> list[MembershipEvent]:
        p = self._peers.get(peer)
        if p is None or incarnation < p.incarnation or p.state is PeerState.LEFT:
            return []
        p.state, p.incarnation, p.ever_seen = PeerState.LEFT, incarnation, True
        p.left_reason = reason or "goodbye"
        return [MembershipEvent(EventKind.LEFT, peer, incarnation, now, p.left_reason)]

    def exited(self, peer: int, incarnation: int, now: float, reason: str) -> list[MembershipEvent]:
        """An observer on the peer's host found its process gone (no heartbeat timeout to wait
        for). Only the incarnation it was heard as, and only while it is believed alive."""
        p = self._peers.get(peer)
        if p is None or p.state is not PeerState.ALIVE or incarnation != p.incarnation:
            return []
        p.state, p.exited = PeerState.DEAD, True
        return [MembershipEvent(EventKind.DIED, peer, incarnation, now, reason, now - p.last_heard)]

    def tick(self, now: float) -> list[MembershipEvent]:
        """Declare dead every peer silent for `timeout` or longer (not counting a pause of ours)."""
        gap, self._last_tick = now - self._last_tick, max(self._last_tick, now)
        if self.pause_s is not None and gap >= self.pause_s:
            for p in self._peers.values():
                if p.state in (PeerState.ALIVE, PeerState.UNKNOWN):
                    p.last_heard = min(now, p.last_heard + gap)
        events = []
        for peer, p in sorted(self._peers.items()):
            if p.state in (PeerState.ALIVE, PeerState.UNKNOWN) and now - p.last_heard >= self.timeout:
                silent = now - p.last_heard
                why = f"silent for {silent:.3f}s" if p.ever_seen else f"never heard in {silent:.3f}s"
                p.state = PeerState.DEAD
                events.append(MembershipEvent(EventKind.DIED, peer, p.incarnation, now, why, silent))
        return events

    def next_deadline(self) -> float | None:
        """The earliest `now` at which `tick` may declare a death, or None."""
        pending = [
            p.last_heard + self.timeout
            for p in self._peers.values()
            if p.state in (PeerState.ALIVE, PeerState.UNKNOWN)
        ]
        return min(pending) if pending else None

    def state(self, peer: int) -> PeerState:
        return self._peers[peer].state

    def incarnation(self, peer: int) -> int:
        return self._peers[peer].incarnation

    def alive(self) -> frozenset[int]:
        return frozenset(p for p, s in self._peers.items() if s.state is PeerState.ALIVE)

    def snapshot(self) -> dict[int, PeerState]:
        return {p: s.state for p, s in self._peers.items()}

    def departed(self) -> dict[int, str]:
        """The peers that said goodbye (LEFT), each with the reason it gave."""
        return {p: s.left_reason for p, s in self._peers.items() if s.state is PeerState.LEFT}
