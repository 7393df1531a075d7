"""In-process simulation of SCOUT's verdict agreement at scale (64 to 4096+ ranks, one thread).

Each simulated rank votes on what its evidence shows: honest ranks see the true culprit; `liars` vote
for a wrong one; `silent` ranks (crashed, partitioned) neither vote nor forward. Books travel along
`core.scout.consensus.partner`, one message per rank per round. The result says after how many rounds
every honest rank decided, what they decided, and how many messages any rank sent in any round.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lm_resiliency.core.scout.consensus import VoteBook, partner, rounds_for

__all__ = ["SimResult", "simulate_agreement"]


@dataclass(frozen=True)
class SimResult:
    n: int
    rounds_run: int
    rounds_to_agree: int | None  # first round after which every honest rank decided
    decisions: dict[int, str | None]  # honest rank -> decision
    max_messages_per_rank_round: int


def simulate_agreement(
    n: int, truth: str, liars: float = 0.0, silent: float = 0.0, seed: int = 0, max_rounds: int | None = None
) -> SimResult:
    rng = random.Random(seed)
    ranks = list(range(n))
    rng.shuffle(ranks)
    n_liars, n_silent = int(n * liars), int(n * silent)
    liar_set = set(ranks[:n_liars])
    silent_set = set(ranks[n_liars : n_liars + n_silent])
    books = [VoteBook() for _ in range(n)]
    for r in range(n):
        if r in silent_set:
            continue
        books[r].vote(r, "wrong-culprit" if r in liar_set else truth)
    honest = [r for r in range(n) if r not in liar_set and r not in silent_set]
    total = max_rounds if max_rounds is not None else rounds_for(n)
    agreed_at = None
    max_msgs = 0
    for rnd in range(total):
        outbox = [(r, partner(r, rnd, n), books[r].copy()) for r in range(n) if r not in silent_set]
        sent: dict[int, int] = {}
        for src, dst, book in outbox:
            sent[src] = sent.get(src, 0) + 1
            if dst not in silent_set:
                books[dst].merge(book)
        max_msgs = max(max_msgs, max(sent.values(), default=0))
        if agreed_at is None and all(books[r].decide(n) is not None for r in honest):
            agreed_at = rnd + 1
    return SimResult(n, total, agreed_at, {r: books[r].decide(n) for r in honest}, max_msgs)
