from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lm_resiliency.core.scout.verdicts import (
    IDLE_AFTER_PEERS_CLOSED,
    IDLE_WHILE_PEERS_WAIT,
    LEFT,
    LEFT_WAIT_S,
    PEERS_WAIT,
    DriftDetector,
    HangDetector,
    PhaseTimes,
    Progress,
    QuietClock,
    SilenceDetector,
    StallDetector,
    StragglerDetector,
    closed_peers_verdict,
    desync_in_trails,
    desync_verdict,
    final_steps_verdict,
    fingerprint_verdict,
    hang_verdict,
    in_checkpoint_io,
    next_unmarked,
    rest_verdict,
    settings_verdict,
    unmarked_phase,
    waiting_peers_verdict,
)

pytestmark = pytest.mark.timeout(30)


def test_final_steps_agree_or_name_the_ranks_that_ended_apart() -> None:
    assert final_steps_verdict({0: 40, 1: 40, 2: 40}) is None
    assert final_steps_verdict({0: 7}) is None and final_steps_verdict({}) is None
    v = final_steps_verdict({0: 41, 1: 40, 2: 40, 3: 40})
    assert v is not None and (v.kind, v.ranks, v.step, v.reason) == (
        "stale_state",
        (0,),
        41,
        "final_steps_differ",
    )
    assert "at 40: [1, 2, 3]; at 41: [0]" in v.detail
    behind = final_steps_verdict({0: 40, 1: 39, 2: 40})  # one step skipped: as apart
    assert behind is not None and behind.ranks == (1,) and behind.step == 40
    # Two ranks, or a split with no strict majority: every rank is named.
    for finals in ({0: 25, 1: 24}, {0: 5, 1: 5, 2: 6, 3: 6}):
        v = final_steps_verdict(finals)
        assert v is not None and v.ranks == tuple(sorted(finals))
        assert v.reason == "final_steps_differ_no_majority" and v.step == max(finals.values())


def test_fingerprints_agree_minority_and_ambiguous() -> None:
    assert fingerprint_verdict(5, "params", {0: b"a", 1: b"a", 2: b"a"}) is None
    v = fingerprint_verdict(5, "grads", {0: b"a", 1: b"a", 2: b"x", 3: b"a"})
    assert v is not None and (v.kind, v.ranks, v.step, v.reason) == (
        "sdc",
        (2,),
        5,
        "grads_fingerprint_minority",
    )
    v = fingerprint_verdict(6, "params", {0: b"a", 1: b"b"})
    assert v is not None and v.kind == "sdc_ambiguous" and v.ranks == (0, 1)
    v = fingerprint_verdict(6, "params", {0: b"a", 1: b"a", 2: b"b", 3: b"b"})
    assert v is not None and v.kind == "sdc_ambiguous"
    v = fingerprint_verdict(6, "params", {0: b"a", 1: b"b", 2: b"c"})
    assert v is not None and v.kind == "sdc_ambiguous" and v.ranks == (0, 1, 2)


@pytest.mark.parametrize(
    ("fingerprints", "named"),
    [
        ({0: b"x", 1: b"a", 2: b"y", 3: b"a"}, (0, 2)),
        ({0: b"a", 1: b"a", 2: b"x", 3: b"y", 4: b"z", 5: b"w"}, (2, 3, 4, 5)),
        ({0: b"x", 1: b"a", 2: b"a", 3: b"y", 4: b"a", 5: b"z"}, (0, 3, 5)),
    ],
)
def test_replicas_each_alone_in_their_values_are_named_beside_the_ones_that_agree(
    fingerprints: dict[int, bytes], named: tuple[int, ...]
) -> None:
    """No strict majority, but one value two or more replicas share and every other replica alone
    in its own: separate faults, each named (before: ambiguous, nobody named)."""
    v = fingerprint_verdict(15, "params", fingerprints)
    assert v is not None and (v.kind, v.ranks, v.reason) == ("sdc", named, "params_fingerprint_lone"), v


@given(st.dictionaries(st.integers(0, 15), st.sampled_from([b"a", b"b", b"c", b"d", b"e"]), min_size=2))
def test_a_fingerprint_verdict_never_names_a_rank_that_shares_the_only_shared_value(
    fingerprints: dict[int, bytes],
) -> None:
    """Whatever the values: agreement is None; a named rank never holds the value a strict majority
    holds, nor the only value several replicas share; ambiguous names every replica."""
    v = fingerprint_verdict(1, "grads", fingerprints)
    counts = Counter(fingerprints.values())
    if len(counts) == 1:
        assert v is None
        return
    assert v is not None
    shared = [fp for fp, n in counts.items() if n >= 2]
    top, top_n = counts.most_common(1)[0]
    honest = top if top_n * 2 > len(fingerprints) else shared[0] if len(shared) == 1 else None
    if len(fingerprints) >= 3 and honest is not None:
        assert v.kind == "sdc"
        assert set(v.ranks) == {r for r, fp in fingerprints.items() if fp != honest}
    else:
        assert v.kind == "sdc_ambiguous" and v.ranks == tuple(sorted(fingerprints))


def test_state_changed_at_rest_on_a_minority_of_peers_is_named() -> None:
    assert rest_verdict(4, {0: False, 1: False, 2: False}) is None
    # Every peer's state changed between the steps: the script did it (a normalisation), no fault.
    assert rest_verdict(4, {0: True, 1: True, 2: True, 3: True}) is None
    v = rest_verdict(4, {0: False, 1: True, 2: False, 3: False})
    assert v is not None and (v.kind, v.ranks, v.step, v.reason) == ("sdc", (1,), 4, "state_changed_at_rest")
    assert "changed after step 4" in v.detail
    # Peers that are replicas of one state (two DDP replicas): a script changes both alike, so the
    # one that changed while its replica did not is named, with no majority.
    v = rest_verdict(7, {0: True, 1: False}, replicas=True)
    assert v is not None and (v.kind, v.ranks, v.reason) == ("sdc", (0,), "state_changed_at_rest")
    assert rest_verdict(7, {0: True, 1: True}, replicas=True) is None
    for changed in ({0: True, 1: False}, {0: True, 1: True, 2: False, 3: False}):
        v = rest_verdict(7, changed)
        want = tuple(r for r, c in changed.items() if c)
        assert v is not None and (v.kind, v.ranks, v.reason) == (
            "sdc_ambiguous",
            want,
            "state_changed_at_rest_no_majority",
        )


def pt(i: float = 0.01, c: float = 0.1, m: float = 0.02) -> PhaseTimes:
    return PhaseTimes(i, c, m)


def test_compute_straggler_confirmed_after_n_steps_once() -> None:
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=3)
    slow = {0: pt(m=0.2), 1: pt(m=0.2), 2: pt(c=0.3, m=0.001), 3: pt(m=0.2)}  # the others wait in comm
    assert d.observe(1, slow) == [] and d.observe(2, slow) == []
    (v,) = d.observe(3, slow)
    assert (v.kind, v.ranks, v.straggler_type, v.confirmations, v.reason) == (
        "straggler",
        (2,),
        "compute",
        3,
        "compute_straggler",
    )
    assert d.observe(4, slow) == []  # reported once
    d.observe(5, {r: pt() for r in range(4)})  # recovered: re-armed
    for s in (6, 7):
        assert d.observe(s, slow) == []
    assert [v.ranks for v in d.observe(8, slow)] == [(2,)]


def test_input_straggler_and_streak_broken_by_a_normal_step() -> None:
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=2)
    slow = {0: pt(), 1: pt(i=0.2), 2: pt()}
    assert d.observe(1, slow) == []
    assert d.observe(2, {0: pt(), 1: pt(), 2: pt()}) == []
    assert d.observe(3, slow) == []
    (v,) = d.observe(4, slow)
    assert v.straggler_type == "input" and v.ranks == (1,)


def test_waiting_for_two_stragglers_is_not_a_communication_straggler() -> None:
    """Rank 2 computes slowly and rank 3 reads slowly: ranks 0 and 1 wait for both (their waits
    differ by chance), but waiting is explained by the stragglers; only those two are named. A
    communication outlier with nobody else slow is still named."""
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=2)
    both = {0: pt(m=0.20), 1: pt(m=0.12), 2: pt(c=0.3, m=0.05), 3: pt(i=0.1, m=0.06)}
    assert d.observe(1, both) == []
    got = sorted((v.ranks, v.straggler_type) for v in d.observe(2, both))
    assert got == [((2,), "compute"), ((3,), "input")]
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=2)
    link = {0: pt(m=0.2), 1: pt(), 2: pt(), 3: pt()}
    assert d.observe(1, link) == []
    assert [(v.ranks, v.straggler_type) for v in d.observe(2, link)] == [((0,), "communication")]


def test_a_rank_that_reaches_the_collective_first_is_no_communication_straggler() -> None:
    """Rank 3 computes faster than its peers (a lighter batch, a faster device; or jitter as a job
    starts) and waits in the all-reduce for them as long: no compute straggler among the others
    (their times agree), and rank 3's long wait is its early arrival, not a slow link. Before, it
    was named a communication straggler (a clean 4-rank run restarted at its step 3 here). A wait
    its early arrival does not explain is still named."""
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=2)
    early = {0: pt(c=0.10, m=0.02), 1: pt(c=0.10, m=0.02), 2: pt(c=0.10, m=0.02), 3: pt(c=0.04, m=0.08)}
    for step in range(1, 6):
        assert d.observe(step, early) == []
    slow = {**early, 3: pt(c=0.04, m=0.15)}  # 60 ms of its wait explained, 70 ms more not
    assert d.observe(6, slow) == []
    assert [(v.ranks, v.straggler_type) for v in d.observe(7, slow)] == [((3,), "communication")]


@pytest.mark.parametrize("world", [8, 2])
def test_jitter_alone_is_never_a_straggler(world: int) -> None:
    rng = random.Random(3)
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=3)
    for step in range(2000):
        times = {
            r: pt(0.01 * rng.uniform(0.5, 1.6), 0.1 * rng.uniform(0.8, 1.25), 0.02 * rng.uniform(0.5, 2))
            for r in range(world)
        }
        assert d.observe(step, times) == []


def test_of_two_ranks_the_slow_one_is_named_never_the_one_that_waits_for_it() -> None:
    """A job of two replicas (two nodes of one GPU each) has its stragglers too (before: never named,
    'no others to compare against'). The slow rank's compute or input names it; the rank that waits
    for it in the collective is its victim, so communication is never a type among two: a delay
    outside the measured phases (rank 1 late for no phase shown) names nobody rather than rank 0."""
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=2)
    compute = {0: pt(m=0.2), 1: pt(c=0.3, m=0.001)}
    assert d.observe(1, compute) == []
    assert [(v.ranks, v.straggler_type) for v in d.observe(2, compute)] == [((1,), "compute")]
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=2)
    loader = {0: pt(m=0.2), 1: pt(i=0.2, m=0.001)}
    assert d.observe(1, loader) == []
    assert [(v.ranks, v.straggler_type) for v in d.observe(2, loader)] == [((1,), "input")]
    d = StragglerDetector(ratio=1.5, min_s=0.02, confirmations=2)
    unseen = {0: pt(m=0.2), 1: pt(m=0.001)}
    assert [d.observe(s, unseen) for s in range(5)] == [[]] * 5
    assert d.observe(1, {0: pt()}) == []  # alone: nobody to compare with


def test_hang_names_the_rank_that_never_entered_the_collective() -> None:
    prog = {
        0: Progress(9, 40, 3.0),
        1: Progress(9, 40, 3.2),
        2: Progress(9, 36, 0.0),
        3: Progress(9, 40, 2.0),
    }
    v = hang_verdict(9, prog, stall_threshold_s=2.5)
    assert v is not None and (v.kind, v.ranks, v.reason) == ("hang", (2,), "never_entered_collective")
    # Rank 3 entered a moment after its peers: it waits for the same culprit, and the detail says so.
    assert v.detail.startswith("ranks [0, 1, 3] wait in collective #40 for up to 3.2s; ranks [2] "), v.detail
    prog[3] = Progress(9, 39, 2.0)  # it issued collective 40 asynchronously and waits in 39
    v = hang_verdict(9, prog, stall_threshold_s=2.5)
    assert v is not None and v.ranks == (2,)
    assert v.detail.startswith("ranks [0, 1, 3] wait in collectives #39-#40 for up to 3.2s; "), v.detail
    assert v.stall_duration_s == 3.2
    # The step the hang happened in: the peers completed 9 and wait in step 10's collective, whatever
    # step the observer is at.
    assert v.step == 10 and hang_verdict(12, prog, stall_threshold_s=2.5).step == 10  # type: ignore[union-attr]
    assert hang_verdict(9, prog, stall_threshold_s=5.0) is None
    stuck = {r: Progress(9, 40, 6.0) for r in range(3)}
    v = hang_verdict(9, stuck, 5.0)
    assert v is not None and v.kind == "collective_stall" and v.ranks == (0, 1, 2)


def test_a_rank_that_moved_within_the_threshold_is_late_not_hung() -> None:
    """Rank 2 just got its batch after a long wait in its loader and is on its way to the all-reduce
    its peers have waited in for 3 s: not the hang's culprit until it stops moving that long."""
    waiting = {0: Progress(9, 40, 3.0), 1: Progress(9, 40, 3.0)}
    assert hang_verdict(9, {**waiting, 2: Progress(9, 39, 0.0, idle_s=0.1)}, 2.0) is None
    v = hang_verdict(9, {**waiting, 2: Progress(9, 39, 0.0, idle_s=2.0)}, 2.0)
    assert v is not None and (v.kind, v.ranks) == ("hang", (2,))


def test_hang_detector_reports_once_until_progress() -> None:
    d = HangDetector(2.0)
    prog = {0: Progress(1, 4, 2.5), 1: Progress(1, 3, 0.0)}
    assert d.observe(1, prog) is not None
    assert d.observe(1, prog) is None
    assert d.observe(2, {0: Progress(2, 5, 0.0), 1: Progress(2, 5, 0.0)}) is None
    assert d.observe(3, prog) is not None


def test_a_group_short_of_the_job_names_every_rank_stuck_only_well_past_the_threshold() -> None:
    """Replicas 0 and 2 of a tensor-parallel job both wait for rank 3, a tensor-parallel peer of
    another replica group: no culprit among them, and rank 3's own group names it at the threshold.
    Theirs says "every rank stuck" only at `all_stuck_after_s` (before, at the threshold too, and the
    leader restarted on it, naming 0 and 2). A culprit in view is named at the threshold still."""
    stuck = {0: Progress(21, 360, 20.5), 2: Progress(21, 360, 20.5)}
    assert hang_verdict(21, stuck, 20.0, all_stuck_after_s=30.0) is None
    late = {r: Progress(21, 360, 30.0) for r in (0, 2)}
    v = hang_verdict(21, late, 20.0, all_stuck_after_s=30.0)
    assert v is not None and (v.kind, v.ranks, v.reason) == (
        "collective_stall",
        (0, 2),
        "all_ranks_stuck_in_collective",
    )
    assert hang_verdict(21, stuck, 20.0).kind == "collective_stall"  # type: ignore[union-attr]  # the whole job
    culprit = {**stuck, 3: Progress(21, 358, 0.0, idle_s=20.5)}
    v = hang_verdict(21, culprit, 20.0, all_stuck_after_s=30.0)
    assert v is not None and (v.kind, v.ranks) == ("hang", (3,))
    d = HangDetector(20.0, all_stuck_after_s=30.0)
    assert d.observe(21, stuck) is None
    assert d.observe(21, late) is not None and d.observe(21, late) is None


def test_a_job_judged_as_a_whole_names_the_rank_in_no_collective_whatever_the_counts() -> None:
    """Ranks that know no peers (pipeline stages, each data parallel by the script's own all-reduce)
    judge the whole job's progress: stage 0 (rank 2) waits for stage 1's gradients (rank 3), rank 1
    waits in its all-reduce with rank 3, and rank 3 entered more collectives than either (another
    stage's transfers) but has made no progress for the threshold. Counts of other groups' collectives
    say nothing: the peer-group rule names nobody (rank 3 is ahead), the job-wide one names rank 3."""
    prog = {
        0: Progress(7, 30, 0.0, idle_s=0.5),  # between its transfers, moving
        1: Progress(7, 52, 21.0),
        2: Progress(7, 30, 20.5),
        3: Progress(7, 60, 0.0, idle_s=21.5),
    }
    assert hang_verdict(7, prog, 20.0, all_stuck_after_s=30.0) is None
    v = hang_verdict(7, prog, 20.0, all_stuck_after_s=30.0, jobwide=True)
    assert v is not None and (v.kind, v.ranks, v.reason, v.step) == (
        "hang",
        (3,),
        "never_entered_collective",
        8,
    )
    assert v.detail == (
        "ranks [1, 2] wait in collectives of their own groups (no peers known: judged across the job) "
        "for up to 21.0s; ranks [3] in none, with no progress for 21.5s"
    ), v.detail
    # A rank that moved within the threshold is late, not hung; nobody waiting past it, no hang.
    assert hang_verdict(7, {**prog, 3: Progress(7, 60, 0.0, idle_s=3.0)}, 20.0, jobwide=True) is None
    assert (
        hang_verdict(7, {**prog, 1: Progress(7, 52, 2.0), 2: Progress(7, 30, 1.0)}, 20.0, jobwide=True)
        is None
    )
    # In its data loader: a data stall its peers wait on, once past the loader's threshold.
    loader = {**prog, 3: Progress(7, 60, 0.0, idle_s=21.5, phase="input", in_phase_s=21.5)}
    assert hang_verdict(7, loader, 20.0, excused_s={"input": 60.0}, jobwide=True) is None
    v = hang_verdict(7, loader, 20.0, excused_s={"input": 10.0}, jobwide=True)
    assert v is not None and (v.kind, v.ranks) == ("data_stall", (3,)), v
    assert "in none, not progressing, in its data loader" in v.detail, v.detail
    # One that closed its session (whatever it had entered) while others wait; one gone silent.
    waiting = {r: Progress(7, 30 + r, 21.0) for r in range(3)}
    assert hang_verdict(7, waiting, 20.0, left={3: 99}, jobwide=True).ranks == (3,)  # type: ignore[union-attr]
    assert hang_verdict(7, waiting, 20.0, frozenset({3}), jobwide=True).ranks == (3,)  # type: ignore[union-attr]
    d = HangDetector(20.0, all_stuck_after_s=30.0, jobwide=True)
    assert d.observe(7, prog) is not None and d.observe(7, prog) is None


def test_a_silent_rank_is_the_hang_when_every_live_peer_waits() -> None:
    """Rank 3's heartbeats stopped (stopped, frozen, partitioned): it is not in the progress the
    live ranks exchange, and without it the rest would be an anonymous 'every rank is stuck'."""
    stuck = {r: Progress(9, 40, 31.0) for r in range(3)}
    v = hang_verdict(9, stuck, 30.0, silent=frozenset({3}))
    assert v is not None and (v.kind, v.ranks, v.reason) == ("hang", (3,), "silent_while_peers_wait")
    assert v.step == 10
    assert v.stall_duration_s == 31.0
    # A live culprit is named before a silent one; silence alone, with nobody waiting, is no hang.
    prog = {**stuck, 2: Progress(9, 39, 0.0)}
    assert hang_verdict(9, prog, 30.0, silent=frozenset({3})).ranks == (2,)  # type: ignore[union-attr]
    assert hang_verdict(9, {r: Progress(9, 40, 0.0) for r in range(3)}, 30.0, frozenset({3})) is None


def test_a_rank_that_left_before_the_collective_is_the_hang_when_every_live_peer_waits() -> None:
    """Rank 3's loop ended early (uneven inputs): it closed its session after entering 36
    collectives, so it is not in the live ranks' progress, and they wait in collective #40. It is
    named, not the waiting ranks' anonymous 'every rank is stuck'."""
    stuck = {r: Progress(9, 40, 31.0) for r in range(3)}
    v = hang_verdict(9, stuck, 30.0, left={3: 36})
    assert v is not None and (v.kind, v.ranks, v.reason, v.step) == (
        "hang",
        (3,),
        "left_while_peers_wait",
        10,
    )
    assert v.reason.endswith(PEERS_WAIT)  # acted on by the torchrun leader
    assert hang_verdict(9, stuck, 30.0, left={3: -1}).ranks == (3,)  # type: ignore[union-attr]  # never heard
    # One that had entered the collective they wait in (it left afterwards) is not why they wait.
    assert hang_verdict(9, stuck, 30.0, left={3: 40}).kind == "collective_stall"  # type: ignore[union-attr]
    # A live culprit is named first; one that left, before a silent one.
    prog = {**stuck, 2: Progress(9, 39, 0.0)}
    assert hang_verdict(9, prog, 30.0, left={3: 36}).ranks == (2,)  # type: ignore[union-attr]
    v = hang_verdict(9, {r: Progress(9, 40, 31.0) for r in range(2)}, 30.0, frozenset({2}), left={3: 36})
    assert v is not None and v.ranks == (3,)
    # Leaving with nobody waiting (the job's end) is no hang.
    assert hang_verdict(9, {r: Progress(9, 40, 0.0) for r in range(3)}, 30.0, left={3: 36}) is None


def test_a_rank_that_left_is_named_once_every_live_peer_waited_a_moment_not_the_threshold() -> None:
    """A closed session enters no counted collective again: once every live rank of the group has
    waited `LEFT_WAIT_S` in the same collective, none silent, the rank that left before it is named
    (before, only at the hang threshold: a script that exited mid-run, `sys.exit(3)`, waited in its
    close for peers that waited for it, and the restart came 30 s late)."""
    early = {r: Progress(9, 40, LEFT_WAIT_S) for r in range(3)}
    v = hang_verdict(9, early, 30.0, left={3: 36})
    assert v is not None and (v.kind, v.ranks, v.reason, v.step) == (
        "hang",
        (3,),
        "left_while_peers_wait",
        10,
    )
    assert hang_verdict(9, early, 30.0, left={3: -1}).ranks == (3,)  # type: ignore[union-attr]  # never heard
    # Not yet waited long enough; a threshold below it is the threshold.
    assert (
        hang_verdict(9, {r: Progress(9, 40, LEFT_WAIT_S - 0.5) for r in range(3)}, 30.0, left={3: 36}) is None
    )
    assert hang_verdict(9, {r: Progress(9, 40, 2.0) for r in range(3)}, 2.0, left={3: 36}) is not None
    # Another could be why they wait: a live rank outside the collective (not named yet: it is
    # named at the threshold), one in another collective, a silent one; or the closed one entered it.
    assert hang_verdict(9, {**early, 2: Progress(9, 39, 0.0)}, 30.0, left={3: 36}) is None
    assert hang_verdict(9, {**early, 2: Progress(9, 39, LEFT_WAIT_S)}, 30.0, left={3: 36}) is None
    assert hang_verdict(9, early, 30.0, frozenset({4}), left={3: 36}) is None
    assert hang_verdict(9, early, 30.0, left={3: 40}) is None
    # Ranks judged across the whole job count other groups' collectives: the threshold, as before.
    assert hang_verdict(9, early, 30.0, left={3: 36}, jobwide=True) is None


def test_a_rank_being_stopped_is_never_named_for_a_hang() -> None:
    """SIGTERM: the rank writes its capture to disk before it ends, while its peers wait for it in
    a collective. That is a termination (its goodbye names it), however long the write takes."""
    waiting = {0: Progress(9, 40, 300.0), 1: Progress(9, 40, 300.0)}
    stopping = {**waiting, 2: Progress(9, 39, 0.0, phase="stopping", in_phase_s=301.0)}
    assert hang_verdict(9, stopping, 30.0) is None
    # Another rank that never entered is named as before.
    both = {**stopping, 3: Progress(9, 39, 0.0)}
    assert hang_verdict(9, both, 30.0) is None  # one verdict per collective: the stopping rank explains it
    assert hang_verdict(9, {**waiting, 3: Progress(9, 39, 0.0)}, 30.0).ranks == (3,)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("phase", "limit", "where", "kind"),
    [
        ("checkpoint_io", 120.0, "in its checkpoint I/O", "checkpoint_stall"),
        # Rank 2 runs its model with gradients off (an evaluation of its own) between steps.
        ("evaluation", 600.0, "(in an evaluation", "hang"),
    ],
)
def test_a_rank_in_marked_checkpoint_io_or_its_loader_is_excused_until_it_overstays(
    phase: str, limit: float, where: str, kind: str
) -> None:
    """Past its phase's threshold, a rank its peers wait on is named. In its data loader or
    checkpoint I/O, that is the stall (`..._peers_wait`, which the torchrun leader acts on), not a
    hang; in an evaluation, a hang."""
    excused = {"checkpoint_io": 120.0, "input": 10.0, "evaluation": 600.0}
    waiting = {0: Progress(9, 40, 35.0), 1: Progress(9, 40, 35.0)}
    saving = {**waiting, 2: Progress(9, 39, 0.0, phase=phase, in_phase_s=36.0)}
    assert hang_verdict(9, saving, 30.0, excused_s=excused) is None
    over = {**waiting, 2: Progress(9, 39, 0.0, phase=phase, in_phase_s=limit + 1.0)}
    v = hang_verdict(9, over, 30.0, excused_s=excused)
    assert v is not None and v.ranks == (2,) and where in v.detail and v.kind == kind
    assert v.reason == {"hang": "never_entered_collective"}.get(kind, "checkpoint_io_stalled_peers_wait")
    loading = {**waiting, 2: Progress(9, 39, 0.0, phase="input", in_phase_s=36.0)}
    v = hang_verdict(9, loading, 30.0, excused_s=excused)
    assert v is not None and v.ranks == (2,) and "in its data loader for 36.0s" in v.detail
    assert (v.kind, v.reason, v.stall_duration_s) == ("data_stall", "dataloader_stalled_peers_wait", 35.0)
    # Two culprits, one in its loader and one not: a hang.
    mixed = {0: waiting[0], 1: Progress(9, 39, 0.0), 2: loading[2]}
    v = hang_verdict(9, mixed, 30.0, excused_s=excused)
    assert v is not None and (v.kind, v.ranks) == ("hang", (1, 2))


def test_stalls_in_the_data_loader_and_checkpoint_io_are_named_once_per_stall() -> None:
    d = StallDetector({"input": 10.0, "checkpoint_io": 120.0})
    calm = {0: Progress(5, 10, 0.0), 1: Progress(5, 10, 0.0, phase="input", in_phase_s=9.9)}
    assert d.observe(5, calm) == []
    stalled = {**calm, 1: Progress(5, 10, 0.0, phase="input", in_phase_s=10.5)}
    [v] = d.observe(5, stalled)
    assert (v.kind, v.ranks, v.reason, v.stall_duration_s) == ("data_stall", (1,), "dataloader_stalled", 10.5)
    assert d.observe(5, stalled) == []  # still the same stall
    assert d.observe(6, calm) == []  # it got its batch
    assert [v.kind for v in d.observe(7, stalled)] == ["data_stall"]  # a new stall
    saving = {0: Progress(8, 12, 0.0, phase="checkpoint_io", in_phase_s=130.0)}
    [v] = d.observe(8, saving)
    assert (v.kind, v.ranks, v.reason) == ("checkpoint_stall", (0,), "checkpoint_io_stalled")


def test_a_rank_stuck_in_its_data_loaders_first_batch_is_a_data_stall_only_when_peers_wait() -> None:
    """An iterator's first batch waits for its workers to start: no stall is named for its length
    alone, but a rank still in it when its peers have waited the hang threshold is stuck in its data
    loader (before, it was called a hang: the first batch was marked as no phase at all)."""
    slow_start = {0: Progress(5, 10, 0.0), 1: Progress(5, 10, 0.0, phase="input_start", in_phase_s=40.0)}
    assert StallDetector({"input": 10.0, "checkpoint_io": 120.0}).observe(5, slow_start) == []
    excused = {"checkpoint_io": 120.0, "input": 10.0, "evaluation": 600.0}
    waiting = {0: Progress(24, 26, 31.0), 2: Progress(24, 26, 31.0)}
    stuck = {**waiting, 1: Progress(24, 25, 0.0, phase="input_start", in_phase_s=33.0)}
    v = hang_verdict(24, stuck, 30.0, excused_s=excused)
    assert v is not None and v.ranks == (1,)
    assert (v.kind, v.reason) == ("data_stall", "dataloader_stalled_peers_wait")
    assert "in its data loader's first batch for 33.0s" in v.detail


def test_collective_desync_names_the_rank_whose_chain_differs() -> None:
    chains = {0: [(40, b"a")], 1: [(40, b"a")], 2: [(40, b"b")], 3: [(39, b"z")]}
    v = desync_verdict(7, chains)
    assert v is not None and (v.kind, v.ranks, v.reason) == (
        "collective_desync",
        (2,),
        "collective_sequence_minority",
    )
    assert desync_verdict(7, {0: [(40, b"a")], 1: [(41, b"b")]}) is None  # different counts: not comparable
    v = desync_verdict(7, {0: [(5, b"a")], 1: [(5, b"b")]})
    assert v is not None and v.kind == "collective_desync_ambiguous"


def test_a_desync_is_found_among_ranks_sampled_collectives_apart() -> None:
    """Rank 1 all-reduced 5 elements where its peers all-reduced 4 (collective 14): ranks 0 and 3
    came out of it and entered 15, ranks 1 and 2 are stuck in it. Only their states before the
    current ones put three ranks at 14, where rank 1 is the minority."""
    chains = {
        0: [(15, b"A15"), (14, b"A"), (13, b"c")],
        1: [(14, b"B"), (13, b"c")],
        2: [(14, b"A"), (13, b"c")],
        3: [(15, b"A15"), (14, b"A"), (13, b"c")],
    }
    v = desync_verdict(7, chains)
    assert v is not None and (v.kind, v.ranks) == ("collective_desync", (1,))
    assert "after 14 collectives" in v.detail
    # The current states alone: only ranks 1 and 2 share a count, where neither is a majority.
    # Before, both were named (ambiguous); ranks 0 and 3 may yet make rank 1 the minority there.
    assert desync_verdict(7, {r: states[:1] for r, states in chains.items()}) is None
    # Every rank at that count, two on each side: all four are named, none is the culprit.
    v = desync_verdict(7, {0: [(14, b"A")], 1: [(14, b"B")], 2: [(14, b"B")], 3: [(14, b"A")]})
    assert v is not None and (v.kind, v.ranks, v.reason) == (
        "collective_desync_ambiguous",
        (0, 1, 2, 3),
        "collective_sequence_no_majority",
    )
    assert v.detail == "after 14 collectives: replicas [0, 1, 2, 3] entered different ones, with no majority"


@pytest.mark.parametrize(
    ("files", "inside"),
    [
        (["/v/lib/python3.11/site-packages/torch/serialization.py", "/job/train.py"], True),
        (["/v/site-packages/torch/distributed/checkpoint/state_dict_saver.py", "/job/train.py"], True),
        (["/v/site-packages/safetensors/torch.py", "/v/site-packages/transformers/modeling_utils.py"], True),
        (["C:\\py\\Lib\\site-packages\\torch\\serialization.py"], True),
        (["/v/site-packages/torch/nn/modules/module.py", "/job/train.py"], False),
        (["/job/serialization.py", "/job/my_checkpoint.py"], False),  # the job's own modules
        ([], False),
    ],
)
def test_a_stack_inside_torch_save_dcp_or_safetensors_is_checkpoint_io(
    files: list[str], inside: bool
) -> None:
    assert in_checkpoint_io(files) is inside


def test_a_module_running_between_steps_is_an_evaluation_and_inside_a_step_is_the_step() -> None:
    """An EMA copy evaluated between steps runs module code no hook of ours sees: an evaluation.
    Inside a step the same frames are the training forward, whose hang must be named at the hang
    threshold (a kernel hung in it), not excused for the evaluation's 600 s."""
    ema = [
        "/v/site-packages/torch/nn/modules/linear.py",
        "/v/site-packages/torch/nn/modules/module.py",
        "/job/t.py",
    ]
    assert unmarked_phase(ema, between_steps=True) == "evaluation"
    assert unmarked_phase(ema, between_steps=False) is None
    save = ["/v/site-packages/torch/serialization.py", "/job/t.py"]
    assert unmarked_phase(save, between_steps=False) == unmarked_phase(save, True) == "checkpoint_io"
    assert unmarked_phase(["/job/t.py"], between_steps=True) is None


def test_a_data_loader_nobody_instrumented_is_told_by_the_stack_between_steps() -> None:
    """A rank inside a DataLoader's iterator between steps (zero-import, no instrument_dataloader):
    its data loader, though a dataset that runs a module (a tokenizer model) is still the loader's.
    No threshold of its own; a rank stuck in it while its peers wait is a data stall, not a hang."""
    fetch = [
        "/v/site-packages/torch/nn/modules/module.py",  # the dataset runs a module
        "/job/data.py",
        "/v/site-packages/torch/utils/data/_utils/fetch.py",
        "/v/site-packages/torch/utils/data/dataloader.py",
        "/job/t.py",
    ]
    assert unmarked_phase(fetch, between_steps=True) == "input_unmarked"
    assert unmarked_phase(fetch, between_steps=False) is None  # inside a step: the step's
    waiting = {0: Progress(7, 40, 31.0), 1: Progress(7, 39, 0.0, 31.0, "input_unmarked", 31.0)}
    v = hang_verdict(7, waiting, 30.0, excused_s={"input": 10.0})
    assert v is not None and (v.kind, v.ranks, v.reason) == (
        "data_stall",
        (1,),
        "dataloader_stalled_peers_wait",
    )
    assert "in its data loader (not instrumented) for 31.0s" in v.detail, v.detail
    assert StallDetector({"input": 10.0}).observe(7, {1: waiting[1]}) == []  # not alone


def test_going_from_one_unmarked_phase_to_another_is_progress() -> None:
    """An EMA copy evaluated over a validation loader: its stack says "evaluation" and
    "input_unmarked" by turns. Each change counts as progress, so the rank is not idle for the
    evaluation's whole length and then named in a data stall; a loader that stays stuck is."""
    cur, left = next_unmarked(None, float("-inf"), "evaluation", 1.0)
    assert cur == ("evaluation", 1.0) and left == float("-inf")
    cur, left = next_unmarked(cur, left, "evaluation", 2.0)
    assert cur == ("evaluation", 1.0) and left == float("-inf")
    cur, left = next_unmarked(cur, left, "input_unmarked", 3.0)
    assert cur == ("input_unmarked", 3.0) and left == 3.0
    cur, left = next_unmarked(cur, left, "input_unmarked", 40.0)  # stuck in it: since 3.0
    assert cur == ("input_unmarked", 3.0) and left == 3.0
    assert next_unmarked(cur, left, None, 41.0) == (None, 41.0)
    assert next_unmarked(None, 41.0, None, 42.0) == (None, 41.0)


# Three nodes of two ranks each: a = {0, 1}, b = {2, 3}, c = {4, 5}.
NODES = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}


def test_a_peer_silent_while_steps_complete_with_it_is_named_cut_off_once() -> None:
    """Rank 2 declared dead at t=0 (step 10). Not yet named: 4.9 s later, or after only 2 more
    steps (a dead peer would have stopped them). Named at 5 s and 3 steps, once; heard again, its
    next silence is news again."""
    d = SilenceDetector(hold_s=5.0)
    peers = range(6)
    assert d.observe(0.0, 10, {2}, peers, NODES, 0) == []
    assert d.observe(4.9, 20, {2}, peers, NODES, 0) == []
    assert d.observe(9.0, 12, {2}, peers, NODES, 0) == []  # steps stalled: it may be dead
    (v,) = d.observe(9.0, 13, {2}, peers, NODES, 0)
    assert (v.kind, v.ranks, v.reason, v.endpoint) == (
        "network_partition",
        (2,),
        "rank_unreachable",
        "rank:2",
    )
    assert v.stall_duration_s == 14.0 and "rest of node b is heard" in v.detail
    assert d.observe(20.0, 30, {2}, peers, NODES, 0) == []
    assert d.observe(21.0, 31, set(), peers, NODES, 0) == []
    assert d.observe(22.0, 32, {2}, peers, NODES, 0) == []
    assert [x.ranks for x in d.observe(27.0, 35, {2}, peers, NODES, 0)] == [(2,)]


def test_every_rank_of_a_node_silent_is_that_node_cut_off() -> None:
    d = SilenceDetector(hold_s=1.0, min_steps=1)
    d.observe(0.0, 0, {2, 3}, range(6), NODES, 0)
    (v,) = d.observe(1.0, 1, {2, 3}, range(6), NODES, 0)
    assert (v.ranks, v.reason, v.endpoint) == ((2, 3), "node_unreachable", "node:b")
    # A node mate of the silent rank names it by its endpoint only: its own node is not cut off.
    d = SilenceDetector(hold_s=1.0, min_steps=1)
    d.observe(0.0, 0, {0}, range(6), NODES, 1)
    assert [(v.ranks, v.reason) for v in d.observe(1.0, 1, {0}, range(6), NODES, 1)] == [
        ((0,), "rank_unreachable")
    ]


def test_a_silent_node_heard_through_the_control_store_only_lost_its_messages() -> None:
    """Every rank of node b silent on our transport, but heard through the torchrun backend's
    control store: the node reaches the network, our transport dropped its messages (FAILURES.md's
    message_drop: a restart), not its partition (a replacement). Before, a node of one rank whose
    messages were dropped was replaced."""
    d = SilenceDetector(hold_s=1.0, min_steps=1)
    d.observe(0.0, 0, {2, 3}, range(6), NODES, 0, heard={3})
    (v,) = d.observe(1.0, 1, {2, 3}, range(6), NODES, 0, heard={3})
    assert (v.ranks, v.reason, v.endpoint) == ((2, 3), "rank_unreachable", "rank:2")
    assert "heard through the control store" in v.detail and "ranks [3] of node b" in v.detail


def test_a_rank_that_hears_too_few_peers_cannot_tell_who_is_cut_off() -> None:
    """Rank 0 hears nobody on nodes b and c (4 of its 5 others): it may be the one cut off. It says
    so (a restart, no node named). In a job of two, each side of a split is in that place."""
    d = SilenceDetector(hold_s=1.0, min_steps=1)
    d.observe(0.0, 0, {2, 3, 4, 5}, range(6), NODES, 0)
    # It waits twice as long as a rank that can tell: in a real split those name the node first.
    assert d.observe(1.9, 1, {2, 3, 4, 5}, range(6), NODES, 0) == []
    (v,) = d.observe(2.0, 1, {2, 3, 4, 5}, range(6), NODES, 0)
    assert (v.ranks, v.reason) == ((2, 3, 4, 5), "unreachable_ambiguous") and "may be the one" in v.detail
    d = SilenceDetector(hold_s=1.0, min_steps=1)
    d.observe(0.0, 0, {1}, range(2), {0: "a", 1: "b"}, 0)
    assert [v.reason for v in d.observe(2.0, 1, {1}, range(2), {0: "a", 1: "b"}, 0)] == [
        "unreachable_ambiguous"
    ]


def test_only_peers_whose_collectives_this_rank_shares_are_judged_alive() -> None:
    """Rank 4 is not in rank 0's peer group (another pipeline stage): steps completing here say
    nothing of it; it is not named."""
    d = SilenceDetector(hold_s=1.0, min_steps=1)
    d.observe(0.0, 0, {4}, (0, 1, 2, 3), NODES, 0)
    assert d.observe(5.0, 9, {4}, (0, 1, 2, 3), NODES, 0) == []


def test_ranks_whose_torch_settings_differ_from_the_majority_drifted() -> None:
    keys = ("tf32_matmul", "matmul_precision", "deterministic")
    base, odd = "0,highest,0", "1,high,0"
    assert settings_verdict(4, {0: base, 1: base, 2: base}, keys) is None
    assert settings_verdict(4, {0: base, 1: ""}, keys) is None  # a rank that sent none (an older version)
    v = settings_verdict(4, {0: base, 1: base, 2: odd, 3: base}, keys)
    assert v is not None and (v.kind, v.ranks, v.reason) == ("config_drift", (2,), "settings_differ")
    assert v.detail == "ranks [2] have tf32_matmul=1 (others 0), matmul_precision=high (others highest)"
    # Two ranks: no majority; the lowest rank's settings count as the job's.
    v = settings_verdict(9, {0: base, 1: odd}, keys)
    assert v is not None and v.ranks == (1,)
    # A newer peer's extra value (no key for it here) is named by its position.
    v = settings_verdict(9, {0: base, 1: base + ",x"}, keys)
    assert v is not None and v.detail == "ranks [1] have #3=x (others <unset>)"


def test_a_drift_is_named_once_when_it_lasts_past_the_hold() -> None:
    """Every rank turning TF32 on at one step is seen half-flipped for up to a heartbeat (each
    gossips its own every 0.5 s): not named. Rank 2 alone from t=10 on: named at 12, once."""
    off, on = "0", "1"
    d = DriftDetector(hold_s=2.0, keys=("tf32_matmul",))
    assert d.observe(0.0, 5, {0: on, 1: off, 2: off}) is None
    assert d.observe(0.5, 5, {0: on, 1: on, 2: off}) is None
    assert d.observe(1.0, 5, {0: on, 1: on, 2: on}) is None
    assert d.observe(10.0, 9, {0: on, 1: on, 2: off}) is None
    assert d.observe(11.9, 9, {0: on, 1: on, 2: off}) is None
    v = d.observe(12.0, 9, {0: on, 1: on, 2: off})  # the job may have stopped stepping meanwhile
    assert v is not None and v.ranks == (2,) and v.detail == "ranks [2] have tf32_matmul=0 (others 1)"
    assert d.observe(30.0, 9, {0: on, 1: on, 2: off}) is None


def test_desync_in_the_trails_of_stopped_ranks_names_the_minority_of_its_replica_group() -> None:
    """Final states of ranks that all stopped (runtime/trail.py): compared at a count every rank
    of a replica group passed, within the group only (another group issues other collectives)."""
    same = [(15, b"h15"), (16, b"h16")]
    g1, g2 = b"group-01", b"group-02"
    trails = {0: (g1, same), 1: (g1, same), 2: (g1, [(15, b"h15"), (16, b"xx")])}
    v = desync_in_trails(trails)
    assert v is not None and v.kind == "collective_desync" and v.ranks == (2,)
    assert v.reason == "collective_sequence_minority"
    # Another group whose collectives differ from group 1's is no desync; nor is a rank that stopped
    # a collective earlier (its states end before, equal where they overlap).
    other = [(15, b"o15"), (16, b"o16")]
    assert desync_in_trails({0: (g1, same), 1: (g1, same[:1]), 3: (g2, other), 4: (g2, other)}) is None
    assert desync_in_trails({}) is None
    # Two replicas that differ: no majority, both named. A minority in one group wins over that.
    two = {0: (g1, same), 1: (g1, [(16, b"xx")])}
    v = desync_in_trails(two)
    assert v is not None and v.kind == "collective_desync_ambiguous" and v.ranks == (0, 1)
    both = {**two, 4: (g2, other), 5: (g2, other), 6: (g2, [(16, b"yy")])}
    v = desync_in_trails(both)
    assert v is not None and v.kind == "collective_desync" and v.ranks == (6,)


def test_ranks_hung_after_their_loops_together_name_each_other_once_the_rest_closed() -> None:
    """Two ranks hang after the last step: neither ever sees every other rank closed. Each, quiet
    itself, names both when the other is idle after the same step too (one verdict, one key: the
    two votes make its quorum). Not while the other is in a collective, in a phase, at another
    step, or not idle for the threshold yet."""
    idle = Progress(step=24, collectives=50, in_collective_s=0.0, idle_s=31.0)
    v = closed_peers_verdict(0, idle, 30.5, 30.0, {3: Progress(24, 50, 0.0, idle_s=33.0)})
    assert v is not None and (v.kind, v.ranks, v.step, v.reason) == (
        "hang",
        (0, 3),
        25,
        IDLE_AFTER_PEERS_CLOSED,
    )
    assert "every rank but [0, 3] closed" in v.detail
    assert closed_peers_verdict(3, idle, 30.5, 30.0, {0: idle}) == dataclasses.replace(
        v, detail=v.detail.replace("rank 0 made", "rank 3 made")
    )
    for other in (
        Progress(24, 51, 12.0, idle_s=40.0),  # waiting in a collective: hang_verdict's
        Progress(24, 50, 0.0, idle_s=40.0, phase="checkpoint_io", in_phase_s=40.0),
        Progress(23, 48, 0.0, idle_s=40.0),  # another step
        Progress(24, 50, 0.0, idle_s=5.0),  # progress lately
    ):
        assert closed_peers_verdict(0, idle, 30.5, 30.0, {3: other}) is None, other


def test_ranks_waiting_in_a_barrier_a_replica_left_without_entering_name_that_replica() -> None:
    """Rank 1's script exits after its last step (`sys.exit(0)`) while ranks 0 and 2 wait for it in
    their final barrier (a collective between steps: never counted as a wait). They are idle and
    quiet, as hung ranks are, but each entered one collective more than rank 1 at its close: rank
    1 is named, `left_while_peers_wait` (before, ranks 0 and 2 were named hung after their loops)."""
    waiting = Progress(step=30, collectives=61, in_collective_s=0.0, idle_s=31.0)
    v = closed_peers_verdict(0, waiting, 30.5, 30.0, {2: waiting}, left={1: 60})
    assert v is not None and (v.kind, v.ranks, v.step, v.reason) == ("hang", (1,), 31, LEFT), v
    assert "ranks [0, 2] entered collective #61" in v.detail and v.stall_duration_s == 30.5
    assert closed_peers_verdict(2, waiting, 30.5, 30.0, {0: waiting}, left={1: 60}).ranks == (1,)  # type: ignore[union-attr]
    # A replica that closed having entered as many (or its count unknown): this rank is hung itself.
    for entered in (61, -1):
        v = closed_peers_verdict(0, waiting, 30.5, 30.0, {2: waiting}, left={1: entered})
        assert v is not None and (v.ranks, v.reason) == ((0, 2), IDLE_AFTER_PEERS_CLOSED), v
    # Not before the threshold, nor while it is at work: as before.
    assert closed_peers_verdict(0, waiting, 12.0, 30.0, left={1: 60}) is None


def test_a_rank_idle_and_quiet_once_its_peers_closed_is_named_hung_after_its_loop() -> None:
    idle = Progress(step=24, collectives=50, in_collective_s=0.0, idle_s=31.0)
    v = closed_peers_verdict(1, idle, quiet_s=30.5, threshold_s=30.0)
    assert v is not None and v.kind == "hang" and v.ranks == (1,) and v.step == 25
    assert v.reason == IDLE_AFTER_PEERS_CLOSED and v.stall_duration_s == 30.5
    # Not yet: no progress for less than the threshold, or its process at work meanwhile.
    assert closed_peers_verdict(1, Progress(24, 50, 0.0, idle_s=29.0), 40.0, 30.0) is None
    assert closed_peers_verdict(1, idle, quiet_s=12.0, threshold_s=30.0) is None
    # Inside a collective (its peers' hang_verdict), or in a phase (its own threshold): not this.
    assert closed_peers_verdict(1, Progress(24, 51, 35.0, idle_s=35.0), 40.0, 30.0) is None
    saving = Progress(24, 50, 0.0, idle_s=40.0, phase="checkpoint_io", in_phase_s=40.0)
    assert closed_peers_verdict(1, saving, 40.0, 30.0) is None


def test_the_quiet_clock_runs_while_cpu_time_stands_and_restarts_on_work() -> None:
    q = QuietClock(rate=0.01, slack_s=0.05)
    assert q.observe(100.0, 5.0) == 0.0
    assert q.observe(110.0, 5.02) == 10.0  # a tick or two: still quiet
    assert q.observe(130.0, 5.2) == 30.0  # 0.2 s in 30 s: within 1 % and the slack
    assert q.observe(131.0, 6.0) == 0.0  # work: it starts again
    assert q.observe(140.0, 5.0) == 0.0  # a thread that ended took its time out: a change too
    q.reset()
    assert q.observe(150.0, 5.0) == 0.0


def test_a_rank_hung_between_steps_while_its_peers_wait_in_a_barrier_is_named() -> None:
    """Ranks 0 and 2 entered collective 51 between steps (a barrier after the loop: never counted
    as a wait) and made no progress since; rank 1, idle in no collective and its process quiet,
    never entered it."""
    waiting = Progress(step=30, collectives=51, in_collective_s=0.0, idle_s=40.0)
    hung = Progress(step=30, collectives=50, in_collective_s=0.0, idle_s=45.0)
    quiet = {0: 39.0, 1: 31.0, 2: 39.0}  # (those waiting blocked: quiet as well)
    v = waiting_peers_verdict({0: waiting, 1: hung, 2: waiting}, quiet, 30.0)
    assert v is not None and (v.kind, v.ranks, v.step, v.reason) == ("hang", (1,), 31, IDLE_WHILE_PEERS_WAIT)
    assert "ranks [0, 2] entered collective #51" in v.detail and v.stall_duration_s == 31.0
    # Two hung together are named together.
    assert waiting_peers_verdict({0: waiting, 1: hung, 2: hung}, {1: 31.0, 2: 33.0}, 30.0).ranks == (1, 2)  # type: ignore[union-attr]
    for why, progress, q in (
        ("its process uses CPU (saving, uploading)", {0: waiting, 1: hung}, {1: 3.0}),
        ("not idle that long yet", {0: waiting, 1: dataclasses.replace(hung, idle_s=20.0)}, {1: 31.0}),
        (
            "in a phase (torch.save)",
            {0: waiting, 1: dataclasses.replace(hung, phase="checkpoint_io")},
            {1: 31.0},
        ),
        (
            "in a collective itself",
            {0: waiting, 1: dataclasses.replace(hung, in_collective_s=40.0)},
            {1: 31.0},
        ),
        ("not behind its peers", {0: waiting, 1: dataclasses.replace(hung, collectives=51)}, {1: 31.0}),
        ("a peer progressed lately", {0: dataclasses.replace(waiting, idle_s=5.0), 1: hung}, {1: 31.0}),
        ("a peer in a phase", {0: dataclasses.replace(waiting, phase="evaluation"), 1: hung}, {1: 31.0}),
        ("every rank idle: no one waits", {0: hung, 1: hung}, {0: 31.0, 1: 31.0}),
        (
            "a wait counted, in a step",
            {0: dataclasses.replace(waiting, in_collective_s=40.0), 1: hung},
            {1: 31.0},
        ),
        ("one behind not hung", {0: waiting, 1: hung, 2: dataclasses.replace(hung, idle_s=3.0)}, {1: 31.0}),
    ):
        assert waiting_peers_verdict(progress, q, 30.0) is None, why
