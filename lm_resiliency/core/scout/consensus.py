"""Agreeing on a verdict (pure): votes, quorum, and a gossip schedule that scales.

Every rank that reaches a verdict from the evidence votes for it. A `VoteBook` holds, for each verdict
key, the set of voters as a bitmask (so merging two books is an OR, cheap even for 4096 ranks). A
verdict is acted on once more than half of the group voted for it (`decide`), so a minority of
faulty or lying ranks cannot make the group act, and every honest rank that holds the same votes
decides the same way.

Dissemination (`partner`): in round r, rank i sends its book to rank (i + 2^r) mod n, for
ceil(log2 n) rounds; after them every rank holds every vote of a fault-free group, with one message
sent per rank per round. Three further rounds with other offsets route around silent ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["VoteBook", "partner", "rounds_for"]


def rounds_for(n: int) -> int:
    """ceil(log2 n) structured rounds + 3 repair rounds."""
    return max(1, (n - 1).bit_length()) + 3


def partner(rank: int, round_: int, n: int) -> int:
    """Whom `rank` sends to in round `round_` (the same schedule on every rank)."""
    structured = max(1, (n - 1).bit_length())
    # Repair rounds use offsets that do not repeat the structured ones.
    offset = 1 << round_ if round_ < structured else (3 << (round_ - structured)) + 1
    return (rank + offset % n) % n if n > 1 else rank


@dataclass
class VoteBook:
    votes: dict[str, int] = field(default_factory=dict)  # verdict key -> bitmask of voters

    def vote(self, voter: int, key: str) -> None:
        self.votes[key] = self.votes.get(key, 0) | (1 << voter)

    def merge(self, other: VoteBook) -> bool:
        """OR the other book in; True when something was new."""
        changed = False
        for key, mask in other.votes.items():
            merged = self.votes.get(key, 0) | mask
            if merged != self.votes.get(key, 0):
                self.votes[key] = merged
                changed = True
        return changed

    def count(self, key: str, members: Iterable[int] | None = None) -> int:
        mask = self.votes.get(key, 0)
        if members is None:
            return mask.bit_count()
        return sum(1 for m in members if mask >> m & 1)

    def decide(self, group_size: int) -> str | None:
        """The verdict key with a strict majority of the group, if any (ties impossible by majority)."""
        for key in sorted(self.votes):
            if self.votes[key].bit_count() * 2 > group_size:
                return key
        return None

    def copy(self) -> VoteBook:
        return VoteBook(dict(self.votes))
