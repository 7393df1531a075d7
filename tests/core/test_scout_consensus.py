from __future__ import annotations

import math

import pytest

from lm_resiliency.core.scout.consensus import VoteBook, partner, rounds_for
from lm_resiliency.testing.sim import simulate_agreement

pytestmark = pytest.mark.timeout(120)


def test_votebook_quorum_and_merge() -> None:
    a, b = VoteBook(), VoteBook()
    a.vote(0, "sdc:2@6")
    b.vote(1, "sdc:2@6")
    b.vote(3, "straggler:1")
    assert a.decide(4) is None
    assert a.merge(b) and not a.merge(b)
    assert a.count("sdc:2@6") == 2 and a.decide(4) is None  # 2 of 4 is not a majority
    a.vote(2, "sdc:2@6")
    assert a.decide(4) == "sdc:2@6" and a.count("sdc:2@6", members=[0, 1]) == 2


def test_schedule_is_a_permutation_each_round() -> None:
    for n in (2, 3, 7, 64, 100):
        for rnd in range(rounds_for(n)):
            targets = [partner(r, rnd, n) for r in range(n)]
            assert sorted(targets) == list(range(n))  # every rank receives exactly one message too


@pytest.mark.parametrize("n", [64, 1024, 4096])
def test_honest_ranks_agree_within_log2n_plus_3_rounds(n: int) -> None:
    bound = math.ceil(math.log2(n)) + 3
    clean = simulate_agreement(n, "hang:17", seed=1)
    assert clean.rounds_to_agree is not None and clean.rounds_to_agree <= math.ceil(math.log2(n))
    faulty = simulate_agreement(n, "hang:17", liars=0.1, silent=0.02, seed=2)
    assert faulty.rounds_to_agree is not None and faulty.rounds_to_agree <= bound, faulty.rounds_to_agree
    assert set(faulty.decisions.values()) == {"hang:17"}
    assert faulty.max_messages_per_rank_round == 1


def test_no_quorum_no_action() -> None:
    # Most ranks see nothing (silent here means "no vote"): nobody may act on a minority's verdict.
    res = simulate_agreement(64, "sdc:3@9", silent=0.6, seed=3)
    assert res.rounds_to_agree is None and set(res.decisions.values()) == {None}
