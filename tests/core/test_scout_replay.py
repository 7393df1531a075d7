"""Replay verdicts (pure) and the replays themselves on real torch optimizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lm_resiliency.core.scout.replay import (
    DivergenceTracker,
    ReplayOutcome,
    RestLedger,
    SdcHistory,
    dropped_verdict,
    replay_verdict,
    stale_verdict,
)
from lm_resiliency.core.scout.verdicts import Verdict
from lm_resiliency.scout.fingerprint import device_fold, fingerprint, fingerprint_async, zero_parts, zeroed
from lm_resiliency.scout.replay import (
    ReplayRecorder,
    optimizer_tensors,
    pack_contributions,
    replay_grads,
    replay_params,
)
from tests.conftest import Fp32StateSGD

pytestmark = pytest.mark.timeout(60)
A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def test_replays_that_agree_name_the_replica_that_held_something_else() -> None:
    v = replay_verdict(7, "grads", {0: ReplayOutcome(A, B), 1: ReplayOutcome(A, A)})
    assert (v.kind, v.ranks, v.step, v.reason) == ("sdc", (0,), 7, "grads_replay_mismatch")


def test_replays_that_disagree_stay_ambiguous() -> None:
    v = replay_verdict(7, "params", {0: ReplayOutcome(A, A), 1: ReplayOutcome(B, B)})
    assert (v.kind, v.ranks, v.reason) == ("sdc_ambiguous", (0, 1), "params_replay_inconclusive")
    assert "replays disagree" in v.detail


def test_a_missing_replay_is_inconclusive_and_says_why() -> None:
    v = replay_verdict(3, "grads", {0: ReplayOutcome(b"", A, "not DDP"), 1: ReplayOutcome(A, B)})
    assert v.kind == "sdc_ambiguous" and "rank 0: not DDP" in v.detail


def test_every_replica_off_the_replayed_value_is_not_replayable() -> None:
    v = replay_verdict(3, "grads", {0: ReplayOutcome(C, A), 1: ReplayOutcome(C, B)})
    assert v.kind == "sdc_ambiguous" and "every replica" in v.detail


def test_parameters_changed_outside_the_step_name_their_rank_even_when_replays_disagree() -> None:
    outcomes = {0: ReplayOutcome(A, A, drifted=False), 1: ReplayOutcome(B, B, drifted=True)}
    v = replay_verdict(6, "params", outcomes)
    assert (v.kind, v.ranks, v.reason) == ("sdc", (1,), "params_changed_outside_step")
    # Unknown drift (the previous step was not checked) is no evidence.
    unknown = {0: ReplayOutcome(A, A), 1: ReplayOutcome(B, B, drifted=True)}
    assert replay_verdict(6, "params", unknown).kind == "sdc_ambiguous"


def test_recurring_sdc_is_a_second_distinct_step() -> None:
    h = SdcHistory()
    first = Verdict("sdc", (2,), 4, "grads_replay_mismatch")
    assert h.record(first) is None
    assert h.record(first) is None  # the same verdict again (another voter) is not a recurrence
    assert h.record(Verdict("sdc_ambiguous", (1, 2), 5, "x")) is None
    again = h.record(Verdict("sdc", (2, 3), 9, "grads_fingerprint_minority"))
    assert again is not None and (again.ranks, again.step, again.reason) == ((2,), 9, "recurring_sdc")


def test_a_divergence_that_continues_is_judged_once_and_gradients_twice_in_a_row() -> None:
    """Parameters apart at the previous check stay apart: not judged again. Gradients re-agree every
    step, so the same ranks disagreeing at every check (a rank one optimizer step behind) are
    judged at the first check (named) and the second (named recurring), then not until they agree."""
    t = DivergenceTracker(interval=2)
    p = Verdict("sdc", (1,), 4, "params_fingerprint_minority")
    assert not t.continuing(p)
    assert t.continuing(Verdict("sdc", (1,), 6, "params_fingerprint_minority"))
    assert not t.continuing(Verdict("sdc", (3,), 8, "params_fingerprint_minority"))  # other ranks
    assert not t.continuing(Verdict("sdc", (3,), 12, "params_fingerprint_minority"))  # not the previous check

    t = DivergenceTracker(interval=1)
    behind = [t.continuing(Verdict("sdc", (1,), s, "grads_fingerprint_minority")) for s in range(9, 14)]
    assert behind == [False, False, True, True, True] and t.grads_streak == 5
    # The group agreed at step 14: a disagreement at 15 is a new fault, judged again.
    assert not t.continuing(Verdict("sdc", (1,), 15, "grads_fingerprint_minority"))
    assert not t.continuing(Verdict("sdc", (2,), 16, "grads_fingerprint_minority"))  # other ranks
    # Parameters that took different gradients at the previous check stay apart too.
    assert t.continuing(Verdict("sdc", (2,), 17, "params_fingerprint_minority"))


def test_replicas_parted_by_a_change_named_at_rest_are_that_incident_at_the_next_check() -> None:
    """A weight flipped on rank 1 after step 6 is named at rest (at step 6); with checks every 5
    steps the replicas' parameters part at the check of step 10 (and stay apart): the same
    divergence, not judged again (two replicas: no replay, which could not tell them apart)."""
    t = DivergenceTracker(interval=5)
    t.judged_at_rest(6, (1,))
    assert t.continuing(Verdict("sdc_ambiguous", (0, 1), 10, "params_fingerprint_no_majority"))
    assert t.continuing(Verdict("sdc", (1,), 15, "params_fingerprint_minority"))
    t = DivergenceTracker(interval=5)
    t.judged_at_rest(10, (1,))  # (after a check: the next one parts)
    assert t.continuing(Verdict("sdc", (1,), 15, "params_fingerprint_minority"))
    assert not t.continuing(Verdict("sdc", (2,), 25, "params_fingerprint_minority"))  # another, later


def test_parameters_parted_by_a_moment_named_at_the_check_before_are_that_incident() -> None:
    """A moment corrupted between the step and the capture: named by the optimizer state at step 5,
    it parts the parameters at step 6 (the same divergence, not a second SDC). A later optimizer
    state disagreement after an agreed check is a new one."""
    t = DivergenceTracker(interval=1)
    assert not t.continuing(Verdict("sdc", (1,), 5, "optim_fingerprint_minority"))
    assert t.continuing(Verdict("sdc", (1,), 6, "params_fingerprint_minority"))
    assert t.continuing(Verdict("sdc", (1,), 7, "optim_fingerprint_minority"))
    assert not t.continuing(Verdict("sdc", (1,), 9, "optim_fingerprint_minority"))


def test_an_optimizer_state_replay_names_the_replica_off_it_and_its_detail_says_what() -> None:
    v = replay_verdict(5, "optim", {0: ReplayOutcome(A, A), 1: ReplayOutcome(A, B)})
    assert (v.kind, v.ranks, v.reason) == ("sdc", (1,), "optim_replay_mismatch")
    assert "held other optimizer state" in v.detail
    # Changed between two checks, as parameters can be: its own fingerprints name it.
    drifted = {0: ReplayOutcome(A, A, drifted=False), 1: ReplayOutcome(B, B, drifted=True)}
    assert replay_verdict(5, "optim", drifted).ranks == (1,)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[2].bias.requires_grad_(False)  # a frozen parameter: not the optimizer's
    opt = torch.optim.AdamW(
        [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight], "lr": 3e-2}],
        lr=1e-3,
        weight_decay=0.1,
    )
    return model, opt


def _grads(model: nn.Module, seed: int) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    model.zero_grad()
    model(x).pow(2).mean().backward()


@pytest.mark.parametrize("foreach", [False, True])
def _on_grads(kind: str, ranks: tuple[int, ...], step: int = 9) -> Verdict:
    return Verdict(kind, ranks, step, "grads_fingerprint_minority" if kind == "sdc" else "grads_x")


def test_a_rank_holding_the_previous_steps_gradients_is_stale_state_not_sdc() -> None:
    """Reused: two replicas cannot outvote each other, but one holds exactly what both agreed on
    one step before; among four, the minority does."""
    v = stale_verdict(_on_grads("sdc_ambiguous", (0, 1)), {0: A, 1: B}, {0: B, 1: B})
    assert (v.kind, v.ranks, v.step, v.reason) == ("stale_state", (1,), 9, "grads_reused")
    assert "step 8" in v.detail
    v = stale_verdict(_on_grads("sdc", (2,)), {0: A, 1: A, 2: C, 3: A}, {0: C, 1: C, 2: C, 3: C})
    assert (v.kind, v.ranks, v.reason) == ("stale_state", (2,), "grads_reused")


def test_parameters_or_optimizer_state_the_step_left_as_they_were_are_stale_state() -> None:
    """A rank whose step counted but whose update was not applied holds the parameters (or the
    optimizer state) the group held one step before: reused, with four replicas or two."""
    v = stale_verdict(
        Verdict("sdc", (2,), 10, "params_fingerprint_minority"),
        {0: C, 1: C, 2: B, 3: C},
        {0: B, 1: B, 2: B, 3: B},
    )
    assert (v.kind, v.ranks, v.reason) == ("stale_state", (2,), "params_reused")
    assert "hold the parameters the group held at step 9" in v.detail
    two = stale_verdict(
        Verdict("sdc_ambiguous", (0, 1), 4, "optim_fingerprint_no_majority"), {0: C, 1: A}, {0: A, 1: A}
    )
    assert (two.kind, two.ranks, two.reason) == ("stale_state", (1,), "optim_reused")
    # Corrupted, not stale: neither what the group held before nor now.
    corrupt = Verdict("sdc", (2,), 10, "params_fingerprint_minority")
    assert stale_verdict(corrupt, {0: C, 1: C, 2: A, 3: C}, {0: B, 1: B, 2: B, 3: B}) is corrupt
    # No update anywhere (a learning rate of 0): every rank holds the step before, nobody is stale.
    assert stale_verdict(corrupt, {0: B, 1: B, 2: A, 3: B}, {0: B, 1: B, 2: B, 3: B}) is corrupt


def test_a_rank_one_optimizer_step_behind_is_stale_state_at_its_second_check() -> None:
    """Rank 3 skipped a step: its step 8 held the others' step 9, so at step 9 it is behind."""
    v = stale_verdict(_on_grads("sdc", (3,)), {0: B, 1: B, 2: B, 3: C}, {0: A, 1: A, 2: A, 3: B})
    assert (v.kind, v.ranks, v.reason) == ("stale_state", (3,), "grads_step_behind")
    assert "one optimizer step behind" in v.detail


def test_a_rank_that_skipped_its_optimizer_step_is_stale_state_at_once_by_its_collectives() -> None:
    """Rank 3 ran step 9's collectives (the all-reduce) with no optimizer step after them: at its step
    8 it holds the others' step 9 and has entered their step 9's collectives too. Told at step 8,
    with no step before it checked; a flipped gradient enters as many collectives as its replicas."""
    skipped = _on_grads("sdc", (3,), step=8)
    v = stale_verdict(skipped, {0: A, 1: A, 2: A, 3: B}, {}, entered={0: 16, 1: 16, 2: 16, 3: 18})
    assert (v.kind, v.ranks, v.step, v.reason) == ("stale_state", (3,), 8, "grads_step_behind")
    assert "collectives of a later step" in v.detail
    flipped = stale_verdict(skipped, {0: A, 1: A, 2: A, 3: B}, {}, entered={0: 16, 1: 16, 2: 16, 3: 16})
    assert flipped is skipped
    # Counts the others do not agree on, or unknown ones (-1: an older peer), say nothing.
    for entered in ({0: 16, 1: 17, 2: 16, 3: 18}, {0: 16, 1: 16, 2: 16}, {}):
        assert stale_verdict(skipped, {0: A, 1: A, 2: A, 3: B}, {}, entered=entered) is skipped
    # Two replicas have no majority: the one that entered more collectives skipped, no replay needed.
    two = _on_grads("sdc_ambiguous", (0, 1), step=8)
    v = stale_verdict(two, {0: A, 1: B}, {}, entered={0: 16, 1: 18})
    assert (v.kind, v.ranks, v.reason) == ("stale_state", (1,), "grads_step_behind")
    for entered in ({0: 16, 1: 16}, {0: 16}):
        assert stale_verdict(two, {0: A, 1: B}, {}, entered=entered) is two


def test_a_rank_holding_zeros_where_its_replicas_hold_values_dropped_them() -> None:
    """A gradient dropped on one rank (its bucket skipped or zeroed): still sdc (the numbers are
    wrong), but named by its reason, on which the leader restarts in place, quarantining no node.
    Among two replicas it names the one that dropped, with no replay; corruption that zeroes no
    whole tensor stays what it was."""
    usual, one_more = (1, b"bias"), (2, b"bias+weight")
    v = dropped_verdict(_on_grads("sdc", (2,)), [0, 1, 2, 3], {0: usual, 1: usual, 2: one_more, 3: usual})
    assert (v.kind, v.ranks, v.step, v.reason) == ("sdc", (2,), 9, "grads_dropped")
    assert "hold only zeros in 1 more tensors of the gradients" in v.detail
    two = dropped_verdict(_on_grads("sdc_ambiguous", (0, 1)), [0, 1], {0: one_more, 1: usual})
    assert (two.kind, two.ranks, two.reason) == ("sdc", (0,), "grads_dropped")
    params = Verdict("sdc", (1,), 4, "params_fingerprint_minority")
    v = dropped_verdict(params, [0, 1, 2], {0: (0, b""), 1: (1, b"w"), 2: (0, b"")})
    assert (v.kind, v.ranks, v.reason) == ("sdc", (1,), "params_dropped")
    sdc, amb = _on_grads("sdc", (2,)), _on_grads("sdc_ambiguous", (0, 1))
    # As many zeroed tensors as the others, fewer, unknown (-1) or missing: the verdict as it was.
    for counts in (
        {0: usual, 1: usual, 2: usual, 3: usual},
        {0: usual, 1: usual, 2: (0, b""), 3: usual},
        {0: usual, 1: usual, 2: (-1, b""), 3: usual},
        {2: one_more},
    ):
        assert dropped_verdict(sdc, [0, 1, 2, 3], counts) is sdc
    assert dropped_verdict(amb, [0, 1], {0: usual, 1: usual}) is amb
    assert dropped_verdict(amb, [0, 1], {0: one_more}) is amb
    # One of two minority ranks dropped, the other corrupted: not a drop of both.
    pair = _on_grads("sdc", (2, 3))
    five = {0: usual, 1: usual, 2: one_more, 3: usual, 4: usual}
    assert dropped_verdict(pair, [0, 1, 2, 3, 4], five) is pair
    # Not a state disagreement: untouched.
    hang = Verdict("hang", (1,), 9, "never_entered_collective")
    assert dropped_verdict(hang, [0, 1], {0: usual, 1: one_more}) is hang


def test_a_dropped_tensor_is_no_device_that_corrupts_again() -> None:
    """Named at two steps, a rank that corrupted is a device to quarantine; one that dropped
    tensors at either of them is not counted against its device."""
    h = SdcHistory()
    assert h.record(Verdict("sdc", (1,), 5, "grads_dropped")) is None
    assert h.record(Verdict("sdc", (1,), 9, "grads_fingerprint_minority")) is None
    again = h.record(Verdict("sdc", (1,), 12, "grads_fingerprint_minority"))
    assert again is not None and (again.ranks, again.reason) == ((1,), "recurring_sdc")


def test_zero_parts_tell_which_tensors_hold_only_zeros() -> None:
    """A tensor's part is its bytes' digest: those of zeros of the state's sizes (computed once,
    through a 1 MiB buffer even for a larger tensor) say which tensors hold only zeros, whatever
    their dtype or shape. -0.0 is not zero bytes; a tensor of another size never matches."""
    big = torch.zeros(300_000, dtype=torch.float64)  # 2.4 MB: more than one pass of the buffer
    ts = [torch.zeros(3, 4), torch.ones(12), torch.zeros(6, dtype=torch.float64), big, torch.tensor([-0.0])]
    zeros = zero_parts([*ts, None])
    assert zeroed(fingerprint_async(ts).parts(), zeros) == [0, 2, 3]
    big[-1] = 1e-300
    assert zeroed(fingerprint_async([big, torch.zeros(5)]).parts(), zeros) == []
    # CUDA tensors' parts: their size, then their folds (here folded on the CPU, as on the
    # device), zero for zeros only; the size prefix alone (folds not on the host) says nothing.
    bit = torch.zeros(70000)
    bit.view(torch.int32)[12345] = 1

    def on_device(t: torch.Tensor) -> bytes:
        return b"\0cuda" + t.numel().to_bytes(8, "little") + device_fold(t).numpy().tobytes()

    parts = [on_device(t) for t in (torch.zeros(1000, 77), bit, torch.tensor([-0.0]), torch.ones(3))]
    assert zeroed([*parts, b"\0cuda" + (12).to_bytes(8, "little")], frozenset()) == [0]


def test_a_rank_that_reused_some_tensors_only_is_stale_state() -> None:
    """One gradient of the previous step used again (or one parameter's update not applied): the
    whole-model fingerprints match no step's, but the rank holds more tensors unchanged since the
    step before than its replicas do."""
    usual, one_more = (2, b"usual"), (3, b"+one")
    v = stale_verdict(
        _on_grads("sdc", (2,)), {0: A, 1: A, 2: C, 3: A}, {}, {0: usual, 1: usual, 2: one_more, 3: usual}
    )
    assert (v.kind, v.ranks, v.step, v.reason) == ("stale_state", (2,), 9, "grads_reused")
    assert "hold in some tensors (1 more than their replicas)" in v.detail and "at step 8" in v.detail
    two = stale_verdict(
        _on_grads("sdc_ambiguous", (0, 1)), {0: A, 1: B}, {0: C, 1: C}, {0: usual, 1: one_more}
    )
    assert (two.kind, two.ranks, two.reason) == ("stale_state", (1,), "grads_reused")
    params = Verdict("sdc", (0,), 4, "params_fingerprint_minority")
    v = stale_verdict(params, {0: A, 1: B, 2: B}, {}, {0: (1, b"x"), 1: (0, b"y"), 2: (0, b"y")})
    assert (v.kind, v.ranks, v.reason) == ("stale_state", (0,), "params_reused")
    # Corrupted: no more tensors unchanged than the others (fewer, when one they leave alone changed).
    sdc = _on_grads("sdc", (2,))
    for counts in ({0: usual, 1: usual, 2: usual, 3: usual}, {0: usual, 1: usual, 2: (1, b"-one"), 3: usual}):
        assert stale_verdict(sdc, {0: A, 1: A, 2: C, 3: A}, {}, counts) is sdc
    # Unknown (the step before not checked, -1), or missing for a replica: no signature.
    assert stale_verdict(sdc, {0: A, 1: A, 2: C, 3: A}, {}, {2: one_more}) is sdc
    amb = _on_grads("sdc_ambiguous", (0, 1))
    assert stale_verdict(amb, {0: A, 1: B}, {}, {0: (-1, b""), 1: one_more}) is amb
    assert stale_verdict(amb, {0: A, 1: B}, {}, {0: usual, 1: usual}) is amb


def test_corrupted_gradients_and_lone_evidence_stay_what_they_were() -> None:
    sdc = _on_grads("sdc", (2,))
    # Other gradients than any step's; the step before not checked; a verdict on something else.
    assert stale_verdict(sdc, {0: A, 1: A, 2: C, 3: A}, {0: B, 1: B, 2: B, 3: B}) is sdc
    assert stale_verdict(sdc, {0: A, 1: A, 2: C, 3: A}, {}) is sdc
    chain = Verdict("collective_desync", (2,), 9, "collective_sequence_minority")
    assert stale_verdict(chain, {0: A, 1: A, 2: C, 3: A}, {0: C, 1: C, 2: C, 3: C}) is chain
    # The group's gradients repeat legitimately (the same batch, parameters unchanged): the rank
    # off them is corrupted, not stale.
    assert stale_verdict(sdc, {0: A, 1: A, 2: C, 3: A}, {0: A, 1: A, 2: A, 3: A}) is sdc
    # A majority named by a verdict naming one rank: only that rank can be stale.
    assert stale_verdict(_on_grads("sdc", (1,)), {0: A, 1: B, 2: C}, {0: C, 1: C, 2: C}).kind == "sdc"
    # Two replicas that disagreed one step before too: neither step tells them apart.
    amb = _on_grads("sdc_ambiguous", (0, 1))
    assert stale_verdict(amb, {0: A, 1: B}, {0: C, 1: A}) is amb
    slow = Verdict("straggler", (1,), 9, "grads_x")
    assert stale_verdict(slow, {0: A, 1: B}, {0: B, 1: B}) is slow


def test_a_rank_that_stepped_twice_is_the_one_named() -> None:
    """Rank 2 stepped twice at step 8: its step 9 holds what all held at 8, then it stays one step
    ahead: at 10 the others are not 'behind' it (they are the majority), it is what reused."""
    v = stale_verdict(_on_grads("sdc", (2,)), {0: B, 1: B, 2: A, 3: B}, {0: A, 1: A, 2: A, 3: A})
    assert (v.ranks, v.reason) == ((2,), "grads_reused")
    v = stale_verdict(_on_grads("sdc", (2,), 10), {0: C, 1: C, 2: B, 3: C}, {0: B, 1: B, 2: A, 3: B})
    assert (v.ranks, v.reason) == ((2,), "grads_reused")


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_replay_is_bitwise_the_step_it_recorded(foreach: bool) -> None:
    model, opt = _model()
    for g in opt.param_groups:
        g["foreach"] = foreach
    rec = ReplayRecorder(model, opt)
    for step in (1, 2, 3):  # state (exp_avg, step counts) exists from step 2 on
        _grads(model, step)
        rec.arm(step)
        record = rec.capture(step)
        opt.step()
        assert record is not None and record.problem == ""
        replayed, note = replay_params(record)
        assert note == "" and replayed == fingerprint(model.parameters())
        optim, note = replay_params(record, "optim")  # the same record again: it is left as it was
        assert note == "" and optim == fingerprint(optimizer_tensors(opt))
    # A moment flipped after the step is off the replayed state; the parameters are not.
    opt.state[model[0].weight]["exp_avg"].view(-1).view(torch.int32)[2] ^= 1 << 20
    assert replay_params(record, "optim")[0] != fingerprint(optimizer_tensors(opt))
    assert replay_params(record)[0] == fingerprint(model.parameters())


def test_a_replay_keeps_the_float32_state_of_bfloat16_parameters() -> None:
    """A master copy (or NAdam's `mu_product`) is float32 for a bfloat16 parameter; torch's
    load_state_dict cast it to bfloat16, so a replay did not match the honest step (inconclusive,
    the culprit unnamed)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    opt = Fp32StateSGD(model.parameters())
    rec = ReplayRecorder(model, opt)
    replays = []
    for step in range(1, 9):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        model.zero_grad()
        model(x).float().pow(2).mean().backward()
        rec.arm(step)
        record = rec.capture(step)
        opt.step()
        assert record is not None and record.problem == ""
        replays.append(replay_params(record) == (fingerprint(model.parameters()), ""))
    assert all(replays), replays


def test_reduction_replay_is_the_sum_of_both_contributions() -> None:
    model, opt = _model()
    rec = ReplayRecorder(model, opt)
    _grads(model, 1)
    params = [p for g in opt.param_groups for p in g["params"]]
    mine = [p.grad * 0.5 for p in params]
    theirs = [torch.randn_like(p) for p in params]
    rec.arm(1)
    rec.on_contributions(params, mine)
    for p, a, b in zip(params, mine, theirs, strict=True):
        p.grad = a + b  # what the all-reduce left
    record = rec.capture(1)
    assert record is not None
    peer = {1: [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in theirs]}
    replayed, note, consistent = replay_grads(record, peer)
    assert note == "" and consistent and replayed == fingerprint(p.grad for p in params)
    # A peer whose buffers do not fit this model is reported, not summed.
    assert replay_grads(record, {1: peer[1][:-1]})[0] == b""
    # Without a comm hook there is nothing to recompute the reduction from.
    rec.arm(2)
    bare = rec.capture(2)
    assert bare is not None and pack_contributions(bare) == []
    assert "no DDP comm hook" in replay_grads(bare, peer)[1]
    # A script's own all-reduce of each gradient: the first share of the step is kept (a gradient
    # reduced twice in one step, its second share is already the sum).
    rec.arm(3)
    rec.on_contributions(params, mine, first=True)
    rec.on_contributions(params, [p.grad for p in params], first=True)
    own = rec.capture(3)
    assert own is not None and pack_contributions(own) == pack_contributions(record)


def test_a_custom_optimizer_that_cannot_be_rebuilt_is_inconclusive_not_an_error() -> None:
    class Odd(torch.optim.SGD):
        def __init__(self, params: object, momentum_schedule: list[float]) -> None:
            super().__init__(params, lr=0.1)  # type: ignore[arg-type]

    model = nn.Linear(3, 3)
    opt = Odd(model.parameters(), [0.9])
    rec = ReplayRecorder(model, opt)
    model(torch.ones(2, 3)).sum().backward()
    rec.arm(1)
    record = rec.capture(1)
    assert record is not None
    replayed, note = replay_params(record)
    assert replayed == b"" and "cannot re-run Odd" in note


def test_gradients_clipped_after_the_reduction_still_match_it_and_a_flip_does_not() -> None:
    from lm_resiliency.scout.replay import _scaled_by_one_factor

    torch.manual_seed(3)
    params = [nn.Parameter(torch.randn(64, 32)), nn.Parameter(torch.randn(32))]
    reduced = [torch.randn_like(p) * 10 for p in params]
    for p, r in zip(params, reduced, strict=True):
        p.grad = r.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)  # one factor for every gradient
    clipped = [p.grad.clone() for p in params]
    assert not torch.equal(clipped[0], reduced[0])
    assert _scaled_by_one_factor(reduced, clipped)
    assert _scaled_by_one_factor(reduced, [r.clone() for r in reduced])  # no clipping: factor 1
    flipped = [c.clone() for c in clipped]
    flipped[1].view(torch.int32)[5] ^= 1 << 12
    assert not _scaled_by_one_factor(reduced, flipped)
    # Each gradient clipped on its own (two factors) is not one uniform factor either.
    separately = [r * 0.5 for r in reduced[:1]] + [r * 0.25 for r in reduced[1:]]
    assert not _scaled_by_one_factor(reduced, separately)
    # Every gradient dropped (zeroed) or negated on one rank: no clipping or unscaling does that.
    assert not _scaled_by_one_factor(reduced, [torch.zeros_like(r) for r in reduced])
    assert not _scaled_by_one_factor(reduced, [-r for r in reduced])


def _apart(step: int, ranks: tuple[int, ...] = (0, 1)) -> Verdict:
    """Two replicas' parameters apart at the check of `step`, their replay inconclusive."""
    return Verdict("sdc_ambiguous", ranks, step, "params_replay_inconclusive")


def test_an_ambiguous_replay_waits_for_the_window_at_rest_that_names_the_flip() -> None:
    """Checks every 5 steps; rank 1's weight flipped after step 8. The check of step 10 and its
    replay came back (both replicas named, ambiguous) while the window after 8 was still open: the
    verdict waits. The window then names rank 1: the held verdict is that flip, never reported, and
    the window's own verdict is reported (no check named it before)."""
    ledger = RestLedger(interval=5)
    v = _apart(10)
    assert ledger.may_wait(v, {8}) and ledger.may_wait(v, {5}) and ledger.may_wait(v, {10})
    assert not ledger.may_wait(v, {4}) and not ledger.may_wait(v, {11}) and not ledger.may_wait(v, ())
    ledger.hold(v, now=100.0)
    assert ledger.release(10, now=100.5, wait=2.0, open_windows={8}) == []  # (still open: held)
    assert ledger.rest_named(8, (1,)) is None  # the window names rank 1, first
    assert ledger.release(10, now=100.6, wait=2.0, open_windows=set()) == [] and not ledger.held


def test_a_held_verdict_is_reported_when_its_window_names_nobody_or_never_closes() -> None:
    ledger = RestLedger(interval=5)
    v = _apart(10)
    # Closed without naming anyone (both replicas changed alike, or neither did): reported.
    ledger.hold(v, now=0.0)
    assert ledger.release(10, now=0.1, wait=2.0, open_windows=set()) == [v]
    # Never closes (the job's last step, a peer gone silent): reported after `wait`.
    ledger = RestLedger(interval=5)
    ledger.hold(v, now=0.0)
    assert ledger.release(12, now=1.9, wait=2.0, open_windows={9}) == [] and ledger.held
    assert ledger.release(12, now=2.0, wait=2.0, open_windows={9}) == [v] and not ledger.held
    # A window the check does not cover does not hold it.
    ledger = RestLedger(interval=5)
    ledger.hold(v, now=0.0)
    assert ledger.release(12, now=0.1, wait=2.0, open_windows={11}) == [v]


def test_a_flip_is_named_once_by_the_window_at_rest_or_the_check_whichever_comes_first() -> None:
    # The check first (it named rank 1 exactly): the window after it is that flip.
    ledger = RestLedger(interval=5)
    assert ledger.named_at_rest(Verdict("sdc", (1,), 10, "params_replay_mismatch")) is None
    assert ledger.rest_named(7, (1,)) == 10
    assert ledger.rest_named(4, (1,)) is None  # (a window the check of 10 does not cover)
    # An ambiguous check does not settle the window: it is reported, and the check is its flip.
    ledger = RestLedger(interval=5)
    assert ledger.named_at_rest(_apart(10)) is None
    assert ledger.rest_named(7, (1,)) is None
    # The window first: a check it covers naming those ranks, or both replicas ambiguously, is it.
    ledger = RestLedger(interval=1)
    assert ledger.rest_named(6, (1,)) is None
    assert ledger.named_at_rest(_apart(7)) == 6
    assert ledger.named_at_rest(Verdict("sdc", (1,), 6, "params_minority")) == 6
    assert ledger.named_at_rest(Verdict("sdc", (0,), 7, "params_replay_mismatch")) is None  # another rank
    assert ledger.named_at_rest(_apart(8)) is None  # (past the window's checks: a new disagreement)
    assert ledger.named_at_rest(Verdict("sdc", (1,), 7, "grads_minority")) is None  # (not state)
