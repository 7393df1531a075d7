"""Settling ambiguous SDC by replay, and recurring SDC (pure; no clock, no torch).

Two replicas that disagree cannot outvote each other. Replay re-derives the disputed value from
inputs both of them hold and trust, on every replica of the group (each rank replays, so a device
that corrupts again shows up as a replay that disagrees with its peers'):

- `grads` (after reduction): the reduction is recomputed from every replica's own contribution (its
  gradient before the all-reduce), exchanged between the replicas; a replica whose gradients differ
  from the recomputed reduction was corrupted after it.
- `params` (after the step, gradients agreed): the optimizer step is re-run from the pre-step copy of
  the parameters and optimizer state with the agreed gradients; a replica whose parameters differ from
  the replayed ones was corrupted in or after its step. When the previous step was checked too, each
  replica also says whether its parameters changed between that step's end and this step's start
  (they must not): parameters corrupted between steps start every replay of their own, so that is
  the evidence that names them.
- `optim` (after the step, gradients and parameters agreed): the same replay, its optimizer state
  compared (a moment corrupted between the step and the capture).

`replay_verdict` turns the replayed fingerprints (one per replica: what that replica computes the
value should be) and the recorded ones (what each replica actually held) into a verdict that every
rank computes identically from the same results. `SdcHistory` names a rank found corrupting at a
second, different step: recurring SDC, a device to quarantine. `DivergenceTracker` says which
disagreements only continue one already judged, and `RestLedger` which flips a check at rest named
(so one flip is named once). `stale_verdict` tells a rank holding a neighbouring
step's gradients, parameters or optimizer state (stale state: restart it) from one holding corrupted
ones (SDC: a device to replace); `dropped_verdict` one that holds zeros where its replicas do not
(a dropped gradient: restart it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lm_resiliency.core.scout.verdicts import STATE_NAMES, Verdict

__all__ = [
    "DROPPED",
    "DivergenceTracker",
    "ReplayOutcome",
    "RestLedger",
    "SdcHistory",
    "dropped_verdict",
    "replay_verdict",
    "stale_verdict",
]


@dataclass(frozen=True)
class ReplayOutcome:
    """One replica's replay of one disputed step."""

    replayed: bytes  # fingerprint of the value this replica recomputed ("" = it could not replay)
    recorded: bytes  # fingerprint of the value this replica held at the step
    note: str = ""  # why a replay was not possible, when `replayed` is empty
    # Its parameters before the step differ from its own after the previous (checked) step: they were
    # written outside the optimizer. None: unknown (the previous step was not checked).
    drifted: bool | None = None


def replay_verdict(step: int, what: str, outcomes: Mapping[int, ReplayOutcome]) -> Verdict:
    """The verdict of a replay over every replica of a group (always a verdict: the step disagreed)."""
    members = sorted(outcomes)
    drifted = tuple(r for r in members if outcomes[r].drifted)
    if what in ("params", "optim") and drifted and any(outcomes[r].drifted is False for r in members):
        # A state the group agreed on one step ago changed on these ranks without an optimizer step:
        # their replays start from it and cannot clear them, but their own two fingerprints do.
        return Verdict(
            "sdc",
            drifted,
            step,
            "params_changed_outside_step",
            f"ranks {list(drifted)} hold parameters or optimizer state before step {step} that "
            f"differ from their own after step {step - 1}, which the group agreed on",
        )
    missing = [r for r in members if not outcomes[r].replayed]
    if missing:
        notes = "; ".join(f"rank {r}: {outcomes[r].note or 'no replay'}" for r in missing)
        return _inconclusive(step, what, members, f"replay unavailable ({notes})")
    votes = Counter(outcomes[r].replayed for r in members)
    truth, n = votes.most_common(1)[0]
    if n != len(members):
        # The replicas recompute the same value from the same inputs with deterministic kernels: a
        # disagreement here means one device computes wrongly again, but two cannot tell which.
        return _inconclusive(
            step,
            what,
            members,
            f"replays disagree ({len(votes)} distinct results from {len(members)} replicas)",
        )
    culprits = tuple(r for r in members if outcomes[r].recorded != truth)
    if not culprits or len(culprits) == len(members):
        what_happened = "every replica's" if culprits else "no replica's"
        return _inconclusive(
            step,
            what,
            members,
            f"{what_happened} {STATE_NAMES.get(what, what)} differ from the replayed value (not replayable)",
        )
    return Verdict(
        "sdc",
        culprits,
        step,
        f"{what}_replay_mismatch",
        f"replay of step {step} on {len(members)} replicas agrees with ranks "
        f"{[r for r in members if r not in culprits]}; ranks {list(culprits)} held other "
        f"{STATE_NAMES.get(what, what)}",
    )


def _majority(values: Mapping[int, bytes], members: list[int]) -> bytes | None:
    """The fingerprint more than half of `members` hold in `values` (None: no majority, or unknown)."""
    votes = Counter(values.get(r, b"") for r in members)
    value, n = votes.most_common(1)[0]
    return value if value and n * 2 > len(members) else None


def stale_verdict(
    v: Verdict,
    held: Mapping[int, bytes],
    before: Mapping[int, bytes],
    reused: Mapping[int, tuple[int, bytes]] | None = None,
    entered: Mapping[int, int] | None = None,
) -> Verdict:
    """`v`, a disagreement at `v.step` on gradients, parameters or optimizer state (its reason's
    prefix), as stale state when the ranks it suspects hold a neighbouring step's tensors rather
    than corrupted ones; else `v` itself.

    `held`: every replica's fingerprint of that state at `v.step`; `before`: at `v.step - 1` (empty
    when that step was not checked). Two signatures, both exact equalities of whole-model
    fingerprints:

    - reused: ranks hold at this step what a majority held at the step before (gradients of the
      previous step used again, or a rank one optimizer step ahead, that stepped twice; parameters
      or optimizer state the step did not update: its update dropped);
    - behind (gradients only): ranks held at the step before the gradients a majority holds now
      (they skipped an optimizer step: each of their steps holds their replicas' next step, forever).

    `entered` (each replica's collectives entered by the step's end, `Evidence.collectives`) tells
    the skipped step at once, at the step it happened: the suspects entered more collectives by this
    step than every other replica, which agree (a step's collectives ran with no optimizer step
    after them); of two replicas, the one that entered more. Corruption changes no count.

    A third, per tensor (`reused`: each replica's count of its own tensors that held at `v.step`
    what they held at the step before, and a digest of which; see `Evidence.reused`): ranks with
    more of them than the others (a majority's, or for an ambiguous verdict the fewest any replica
    has), and other ones, reused some tensors only (one gradient). Corruption changes tensors; it
    never makes one hold its previous step's bytes again.

    Suspects are the ranks `v` names (a majority's minority, or the replay's culprits); for an
    ambiguous verdict, any proper subset of its replicas. Two replicas have no majority when they
    disagree, so only `reused` (both agreed one step before) can tell them apart.
    """
    what = v.reason.split("_", 1)[0]
    if v.kind not in ("sdc", "sdc_ambiguous") or what not in STATE_NAMES:
        return v
    members = sorted(held)
    prev, now = _majority(before, members), _majority(held, members)
    name = STATE_NAMES[what]
    used = "a previous step's tensor used again" if what == "grads" else "the step's update not applied"
    signatures = [
        (
            f"{what}_reused",
            [r for r in v.ranks if before and prev is not None and held.get(r) == prev and prev != now],
            f"hold the {name} the group held at step {{prev}}: {used}",
        )
    ]
    if what == "grads":
        signatures.append(
            (
                "grads_step_behind",
                [
                    r
                    for r in v.ranks
                    if now is not None and before.get(r) == now != prev and held.get(r) != now
                ],
                "held at step {prev} the gradients the group holds at step {step}: one optimizer step "
                "behind their replicas (a step skipped)",
            )
        )
        counts = entered or {}
        if v.kind == "sdc":  # the count every replica it does not suspect agrees on
            others = {counts.get(r, -1) for r in members if r not in v.ranks}
            least = others.pop() if len(others) == 1 else -1
        else:  # no majority (two replicas): the fewest any replica entered, every count known
            least = min(counts.get(r, -1) for r in members)
        signatures.append(
            (
                "grads_step_behind",
                [r for r in v.ranks if least >= 0 and counts.get(r, -1) > least],
                "entered by step {step} the collectives of a later step, with no optimizer step after "
                "them: one optimizer step behind their replicas (a step skipped)",
            )
        )
    known, base, some = _more_than_replicas(v, members, reused or {})
    signatures.append(
        (
            f"{what}_reused",
            some,
            f"hold in some tensors ({', '.join(str(known[r][0] - base[0]) for r in some)} more than "
            f"their replicas) the {name} they held at step {{prev}}: {used}"
            if base is not None
            else "",
        )
    )
    for reason, culprits, detail in signatures:
        whole = set(culprits) == set(v.ranks) if v.kind == "sdc" else 0 < len(culprits) < len(members)
        if culprits and whole:
            return Verdict(
                "stale_state",
                tuple(culprits),
                v.step,
                reason,
                f"ranks {culprits} at step {v.step} " + detail.format(prev=v.step - 1, step=v.step),
            )
    return v


def _more_than_replicas(
    v: Verdict, members: list[int], counts: Mapping[int, tuple[int, bytes]]
) -> tuple[dict[int, tuple[int, bytes]], tuple[int, bytes] | None, list[int]]:
    """Of the replicas' (how many tensors, digest of which) in `counts`: those known, the base to
    count against (the count most of the ranks `v` does not suspect have; for an ambiguous `v`,
    the fewest any replica has), and the ranks `v` suspects that have more than the base."""
    known = {r: c for r, c in counts.items() if r in members and c[0] >= 0}
    if v.kind == "sdc":
        usual = Counter(c for r, c in known.items() if r not in v.ranks).most_common(1)
        base = usual[0][0] if usual else None
    else:
        base = min(known.values()) if len(known) == len(members) else None
    some = [r for r in v.ranks if base is not None and r in known and known[r][0] > base[0]]
    return known, base, some


DROPPED = "_dropped"  # the reason's suffix of a disagreement that is a dropped tensor (`dropped_verdict`)


def dropped_verdict(v: Verdict, members: list[int], zeroed: Mapping[int, tuple[int, bytes]]) -> Verdict:
    """`v`, an SDC (or ambiguous SDC) on gradients, parameters or optimizer state (its reason's
    prefix), as a dropped tensor when the ranks it suspects hold only zeros in more tensors than
    their replicas (`zeroed`: each replica's count of its tensors that hold only zeros, and a digest
    of which; see `Evidence.zeroed`); else `v` itself.

    A gradient bucket skipped or zeroed (a collective left out, a hook that returned zeros) is the
    software's doing, not the device's: still `sdc` (the numbers are wrong; resume from a recovery-
    verified step), but with the reason `<what>_dropped`, on which the leader restarts in place and
    quarantines no node. Corruption of a device flips, scales or overwrites values; it does not
    zero whole tensors. For an ambiguous `v` (two replicas) it names the replica that dropped, as
    `stale_verdict` does, without a replay."""
    what = v.reason.split("_", 1)[0]
    if v.kind not in ("sdc", "sdc_ambiguous") or what not in STATE_NAMES:
        return v
    known, base, some = _more_than_replicas(v, members, zeroed)
    whole = set(some) == set(v.ranks) if v.kind == "sdc" else 0 < len(some) < len(members)
    if not some or not whole or base is None:
        return v
    more = ", ".join(str(known[r][0] - base[0]) for r in some)
    return Verdict(
        "sdc",
        tuple(some),
        v.step,
        f"{what}{DROPPED}",
        f"ranks {some} at step {v.step} hold only zeros in {more} more tensors of the "
        f"{STATE_NAMES[what]} than their replicas: dropped (a bucket skipped or zeroed)",
    )


def _inconclusive(step: int, what: str, members: list[int], why: str) -> Verdict:
    return Verdict(
        "sdc_ambiguous",
        tuple(members),
        step,
        f"{what}_replay_inconclusive",
        f"replicas {members} disagree on {STATE_NAMES.get(what, what)} at step {step}; {why}",
    )


@dataclass
class SdcHistory:
    """The steps at which each rank was named as the corrupting replica."""

    steps: dict[int, set[int]] = field(default_factory=dict)

    def record(self, v: Verdict) -> Verdict | None:
        """Note an acted-on SDC verdict; returns a `recurring_sdc` verdict for ranks named at a
        second distinct step (once per rank and step). A dropped tensor (`dropped_verdict`) is the
        software's doing and says nothing of the device: not noted."""
        if v.kind != "sdc" or v.reason.endswith(DROPPED):
            return None
        recurring = []
        for r in v.ranks:
            seen = self.steps.setdefault(r, set())
            if v.step in seen:
                continue
            if seen:
                recurring.append(r)
            seen.add(v.step)
        if not recurring:
            return None
        earlier = {r: sorted(self.steps[r] - {v.step}) for r in recurring}
        return Verdict(
            "sdc",
            tuple(recurring),
            v.step,
            "recurring_sdc",
            f"ranks {recurring} corrupted state again at step {v.step} (before: {earlier}): "
            "quarantine the device",
        )


# Checks in a row at which the same ranks' gradients may disagree and still be judged: the first
# names them, the second names them recurring; later ones are the same incident.
GRADS_JUDGED = 2


@dataclass
class DivergenceTracker:
    """Which fingerprint disagreements continue one already judged (`interval`: steps between checks).

    - Parameters or optimizer state that disagreed at the previous check (or gradients) stay apart
      until recovery: the same divergence, not a new fault, and not judged again while it lasts.
    - Gradients re-agree every step through the all-reduce, so their disagreement is a new fault.
      The same ranks disagreeing at every check are one incident, though: a device that corrupts
      every step, or a rank one optimizer step behind its replicas (it skipped one: its step k holds
      the gradients of their step k+1, forever). It is judged at `GRADS_JUDGED` checks in a row
      (the second names it recurring), then not again until those ranks agree at a check.
    """

    interval: int
    params: tuple[int, frozenset[int]] = (-1, frozenset())  # last check that disagreed, its ranks
    grads: tuple[int, tuple[int, ...], int] = (-1, (), 0)  # ... and how many checks in a row

    def continuing(self, v: Verdict) -> bool:
        """Whether the disagreement `v` (its reason names "params", "optim" or "grads") is not to be
        judged. Optimizer state is state after the step like the parameters: a moment corrupted at
        one check parts the parameters at the next, the same divergence."""
        step, what = v.step, v.reason.split("_", 1)[0]
        before, self.params = self.params, (step, frozenset(v.ranks))
        if what in ("params", "optim"):
            follows = before[0] == step - self.interval
            return follows and (v.kind == "sdc_ambiguous" or set(v.ranks) <= before[1])
        last, ranks, n = self.grads
        n = n + 1 if ranks == v.ranks and last == step - self.interval else 1
        self.grads = (step, v.ranks, n)
        return n > GRADS_JUDGED

    def judged_at_rest(self, step: int, ranks: tuple[int, ...]) -> None:
        """Ranks were named for state that changed between step `step` and the next (at rest): the
        disagreement it leaves at the next check is that divergence, not judged again."""
        self.params = ((step // self.interval) * self.interval, frozenset(ranks))

    @property
    def grads_streak(self) -> int:
        """Checks in a row at which the ranks of the newest gradient disagreement disagreed."""
        return self.grads[2]


def _of_state(v: Verdict) -> bool:
    """An SDC verdict on replicas' parameters or optimizer state (at a check, or its replay)."""
    return v.kind in ("sdc", "sdc_ambiguous") and v.reason.split("_", 1)[0] in ("params", "optim")


@dataclass
class RestLedger:
    """Flips named at rest and by the replicas' checks, so that each is named once, and the
    ambiguous verdicts that wait for a window at rest (`interval`: steps between checks; `keep`:
    steps remembered). The caller gives the time and the windows still open.

    A weight flipped after step k is seen by the window at rest after k (the state changed between
    two steps on one rank) and by the check of k or of the next one (the replicas apart): the check
    of step c covers the windows c - interval .. c. Whichever names it first names that flip; the
    other is the same flip, not a second SDC of the device (it would read as recurring). Between two
    replicas a check's replay cannot tell which one changed (each replays from its own copy, the
    flipped one too): its ambiguous verdict waits while a window it covers is open, which may name
    the rank (before, the ambiguous verdict came first and the torchrun leader restarted both
    replicas in place, keeping the faulty device)."""

    interval: int
    keep: int = 64
    named_rest: dict[int, tuple[int, ...]] = field(default_factory=dict)  # window -> ranks named
    named_check: dict[int, tuple[tuple[int, ...], bool]] = field(default_factory=dict)  # ... ambiguous
    held: list[tuple[Verdict, float]] = field(default_factory=list)  # verdict, since

    def covers(self, check: int, window: int) -> bool:
        """Whether the check of step `check` sees a flip in the window at rest after `window`."""
        return check - self.interval <= window <= check

    def may_wait(self, v: Verdict, open_windows: Iterable[int]) -> bool:
        """Whether `v`, replicas' state apart with no culprit, waits for a window still open."""
        return (
            v.kind == "sdc_ambiguous" and _of_state(v) and any(self.covers(v.step, t) for t in open_windows)
        )

    def hold(self, v: Verdict, now: float) -> None:
        self.held.append((v, now))

    def release(self, step: int, now: float, wait: float, open_windows: Iterable[int]) -> list[Verdict]:
        """The held verdicts to report now (the newest step seen is `step`): those whose windows
        closed or that waited `wait` seconds (the job's last step, whose window never closes, or a
        peer gone silent), less those a window named (`named_at_rest`)."""
        windows = set(open_windows)
        held, self.held = self.held, []
        out = []
        for v, since in held:
            if self.may_wait(v, windows) and v.step > step - self.keep and now - since < wait:
                self.held.append((v, since))
            elif self.named_at_rest(v) is None:
                out.append(v)
        return out

    def named_at_rest(self, v: Verdict) -> int | None:
        """The window at rest that named the flip `v` shows (replicas' parameters or optimizer state
        apart at a check or its replay): one it covers that named the ranks `v` names, or some of
        those an ambiguous verdict names. None otherwise, and `v` is noted as the check's."""
        if not _of_state(v):
            return None
        ambiguous = v.kind == "sdc_ambiguous" or v.reason.endswith("inconclusive")
        for at, ranks in self.named_rest.items():
            if self.covers(v.step, at) and (
                set(v.ranks) == set(ranks) or (ambiguous and set(ranks) <= set(v.ranks))
            ):
                return at
        self.named_check[v.step] = (v.ranks, ambiguous)
        for old in [s for s in self.named_check if s < v.step - self.keep]:
            del self.named_check[old]
        return None

    def rest_named(self, window: int, ranks: tuple[int, ...]) -> int | None:
        """The window at rest after step `window` named `ranks`: the check that named exactly those
        ranks already (the same flip, not reported again), or None."""
        seen = [
            c
            for c, (named, ambiguous) in sorted(self.named_check.items())
            if self.covers(c, window) and not ambiguous and set(named) == set(ranks)
        ]
        self.named_rest[window] = ranks
        for old in [s for s in self.named_rest if s < window - self.keep]:
            del self.named_rest[old]
        return seen[0] if seen else None
