"""Verdicts from symmetric evidence (pure; time is the `now` argument).

Rules of this file: every function takes the evidence of one replica group (or of the job) and
returns a `Verdict` or None; nothing here reads a clock or keeps hidden state besides the explicit
confirmation counters of `StragglerDetector` and `HangDetector`. Reason codes are stable strings
that reports and tests rely on.

- Fingerprints (`fingerprint_verdict`): replicas must hold bitwise-identical gradients after
  reduction and parameters after the step. With >= 3 replicas a strict majority names the minority
  (`sdc`); with 2, or without a majority, the disagreement is `sdc_ambiguous` and needs replay.
- Stragglers (`StragglerDetector`): per phase (input, compute, communication), a rank whose time is
  above `ratio` x the median of its peers and more than `min_s` above it, on `confirmations`
  consecutive steps. Synchronous training equalises step times (everyone waits in the collective for
  the slowest), so phases, not whole steps, are compared; compute stops at the rank's last gradient
  handed to communication, before any waiting.
- Desync (`desync_verdict`): ranks that entered the same number of collectives carry the same hash
  chain of (op, size, dtype, group) unless one issued a different collective.
- Hangs (`hang_verdict`): peers wait inside collective k for `stall_threshold` seconds while a rank
  never entered it (its collective count is lower): that rank is the culprit. A rank that went
  silent (its heartbeats stopped: frozen, stopped, partitioned) while its peers wait is the culprit
  too, since it cannot describe itself any more. A culprit stuck in its data loader or checkpoint
  I/O past that phase's threshold makes the verdict that stall (`..._peers_wait`), not a hang.
- Stalls (`StallDetector`): a rank whose training thread has been inside its data loader, or inside
  the framework's checkpoint I/O, for longer than that phase's threshold (`data_stall`,
  `checkpoint_stall`).
- Settings (`settings_verdict`, `DriftDetector`): every rank gossips the torch settings its
  numerics depend on (TF32, matmul precision, determinism, cuDNN, default dtype); ranks whose values
  differ from the majority's for a few heartbeats drifted (`config_drift`, `settings_differ`):
  replicas set up differently disagree. (A script that flips a setting on every rank at one step
  is seen half-flipped for up to a heartbeat: not a drift.)
- Silence (`SilenceDetector`): a peer whose heartbeats stopped while this rank kept completing steps
  with it (their collectives complete: it lives) is cut off from our transport (`network_partition`).
  Every rank of a node silent is the node's partition (`node_unreachable`: replaced), unless the
  node is heard through another channel (the torchrun backend's control store); some of them, or a
  node heard that way, the ranks' endpoints (`rank_unreachable`, a message drop: restarted). A
  rank that stopped hearing half its peers or more may be the one cut off itself
  (`unreachable_ambiguous`: restarted).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "CHECKPOINT_IO_CODE",
    "IDLE_AFTER_PEERS_CLOSED",
    "IDLE_WHILE_PEERS_WAIT",
    "LEFT",
    "LEFT_WAIT_S",
    "MODULE_CODE",
    "PEERS_WAIT",
    "PHASES",
    "STALL_KINDS",
    "STATE_NAMES",
    "DriftDetector",
    "HangDetector",
    "PhaseTimes",
    "Progress",
    "QuietClock",
    "SilenceDetector",
    "StallDetector",
    "StragglerDetector",
    "Verdict",
    "closed_peers_verdict",
    "desync_in_trails",
    "desync_verdict",
    "final_steps_verdict",
    "fingerprint_verdict",
    "hang_verdict",
    "in_checkpoint_io",
    "next_unmarked",
    "rest_verdict",
    "settings_verdict",
    "unmarked_phase",
    "waiting_peers_verdict",
]

PHASES = ("input", "compute", "communication")
# Phases with a stall threshold of their own: the verdict kind and reason of a rank stuck in one.
STALL_KINDS = {
    "input": ("data_stall", "dataloader_stalled"),
    # An iterator's first batch: its workers start (fork, open the dataset), which may take longer
    # than a batch should, so no stall is named for it alone; but a rank still in it when its peers
    # have waited the hang threshold is stuck in its data loader, not hung elsewhere.
    "input_start": ("data_stall", "dataloader_stalled"),
    # In a DataLoader the script did not instrument (zero-import, or no instrument_dataloader),
    # told by the training thread's stack: like a first batch, no threshold of its own (a batch
    # may be slow for all we know), but the data loader's when its peers have waited for it.
    "input_unmarked": ("data_stall", "dataloader_stalled"),
    "checkpoint_io": ("checkpoint_stall", "checkpoint_io_stalled"),
}
# The reason suffix of a stall its peers wait on (stuck in a collective the stalled rank never
# entered): the job is stopped, and the stall is acted on like a hang.
PEERS_WAIT = "_peers_wait"
# The reason of a hang whose culprits closed their sessions and left while their peers wait.
LEFT = f"left_while{PEERS_WAIT}"
# How long every live peer waits in a collective a rank that closed its session never entered
# before it is named (at most the hang threshold): a closed session enters no counted collective
# again, so the wait says nothing more after a moment. (Before, the threshold: a worker whose
# script exited mid-run, `sys.exit(3)`, waited in its close for peers that waited for it, and the
# restart that torchrun alone would have started at once came 30 s later.)
LEFT_WAIT_S = 5.0
# Where a training thread's stack is inside checkpoint I/O it did not mark (session.checkpoint_io):
# torch.save / torch.load, torch.distributed.checkpoint, safetensors. Rank 0 writing a checkpoint of
# its own while its peers wait in the next collective is not a hang.
CHECKPOINT_IO_CODE = ("/torch/serialization.py", "/torch/distributed/checkpoint/", "/safetensors/")
MODULE_CODE = "/torch/nn/modules/module.py"  # a module's __call__: some model is running
DATA_CODE = "/torch/utils/data/"  # a DataLoader's iterator (its fetch, its wait for workers)


def in_checkpoint_io(filenames: Iterable[str]) -> bool:
    """Whether a stack whose frames run code from `filenames` is inside checkpoint I/O."""
    return unmarked_phase(filenames, between_steps=False) == "checkpoint_io"


def unmarked_phase(filenames: Iterable[str], between_steps: bool) -> str | None:
    """The phase a training thread is in by its stack (`filenames`, innermost first) when nothing
    marked one: `checkpoint_io` inside torch.save and the like; `evaluation` when, between steps
    (after the optimizer step, before the model's next training forward), some module runs: an
    evaluation of a model other than the one passed (an EMA copy, a reward model), whose forward no
    hook of ours sees. A module running inside a step is the step's own (a kernel hung in the
    training forward is a hang, named at the hang threshold). `input_unmarked` when, between
    steps, a DataLoader's iterator runs (a loader nobody instrumented: before, a rank stuck in
    it while its peers waited was named hung, not its data loader)."""
    files = [f.replace("\\", "/") for f in filenames]
    if any(part in f for f in files for part in CHECKPOINT_IO_CODE):
        return "checkpoint_io"
    if between_steps and any(DATA_CODE in f for f in files):
        return "input_unmarked"
    if between_steps and any(MODULE_CODE in f for f in files):
        return "evaluation"
    return None


def next_unmarked(
    current: tuple[str, float] | None, left: float, name: str | None, now: float
) -> tuple[tuple[str, float] | None, float]:
    """The unmarked phase a training thread is in, (name, since), and when it last left one, after
    its stack said `name` at `now` (see `unmarked_phase`; sampled each heartbeat). Leaving a phase
    counts as progress (the rank is on its way to the collective), and so does going from one to
    another: an evaluation of an EMA copy reads its validation loader between forwards, and its
    stack says "evaluation" and "input_unmarked" by turns; counted as one stay, the time since the
    evaluation began would have been the loader's, and a rank whose peers waited for it named in a
    data stall."""
    if name is None:
        return None, (now if current is not None else left)
    if current is None:
        return (name, now), left
    if current[0] != name:
        return (name, now), now
    return current, left


# What a rank's training thread may be inside of while its peers wait (`Progress.phase`).
PHASE_NAMES = {
    "input": "its data loader",
    "input_start": "its data loader's first batch",
    "input_unmarked": "its data loader (not instrumented)",
    "checkpoint_io": "its checkpoint I/O",
    "evaluation": "an evaluation (a model run between steps)",
}


# What a fingerprint covers, as a verdict's detail names it (its reason code keeps the short key).
STATE_NAMES = {
    "grads": "gradients",
    "params": "parameters",
    "optim": "optimizer state",
    "final_state": "parameters and optimizer state at the loop's end",
}


@dataclass(frozen=True)
class Verdict:
    kind: str  # sdc | sdc_ambiguous | straggler | hang | collective_stall
    ranks: tuple[int, ...]
    step: int
    reason: str
    detail: str = ""
    straggler_type: str | None = None
    confirmations: int | None = None
    stall_duration_s: float | None = None
    endpoint: str = ""  # "<kind>:<id>" of a communication endpoint ("node:n3", "rank:5")


def fingerprint_verdict(step: int, what: str, fingerprints: Mapping[int, bytes]) -> Verdict | None:
    """Compare the fingerprints of one replica group at one step. None when they all agree."""
    counts = Counter(fingerprints.values())
    if len(counts) <= 1:
        return None
    members = sorted(fingerprints)
    top, top_n = counts.most_common(1)[0]
    if len(members) >= 3 and top_n * 2 > len(members):
        minority = tuple(r for r in members if fingerprints[r] != top)
        return Verdict(
            "sdc",
            minority,
            step,
            f"{what}_fingerprint_minority",
            f"{len(minority)} of {len(members)} replicas disagree on {STATE_NAMES.get(what, what)} "
            f"at step {step}",
        )
    shared = [fp for fp, n in counts.items() if n >= 2]
    if len(shared) == 1:
        # No strict majority, but one fingerprint two or more replicas hold bit for bit, and every
        # other held by one replica alone: those differ from each other too, so they are separate
        # faults (two devices corrupting at once within a check interval). The replicas that agree
        # are named honest, as with a majority: the others would need corruptions that came out
        # identical. Before, all were ambiguous and replay (of the checked step, not of the step
        # each went wrong in) could name no one: the faulty devices kept their slots (outsider 57,
        # 4 replicas, gradient flips on ranks 0 and 2 at steps 12 and 13, checked at 15).
        lone = tuple(r for r in members if fingerprints[r] != shared[0])
        return Verdict(
            "sdc",
            lone,
            step,
            f"{what}_fingerprint_lone",
            f"{len(lone)} of {len(members)} replicas disagree on {STATE_NAMES.get(what, what)} at "
            f"step {step}, each with a value of its own, while the {len(members) - len(lone)} others "
            "agree",
        )
    return Verdict(
        "sdc_ambiguous",
        tuple(members),
        step,
        f"{what}_fingerprint_no_majority",
        f"replicas {members} disagree on {STATE_NAMES.get(what, what)} at step {step} with no majority: "
        "replay decides",
    )


def rest_verdict(step: int, changed: Mapping[int, bool], replicas: bool = False) -> Verdict | None:
    """Judge one window between two optimizer steps of peers whose state no replica holds (FSDP2
    shards): `changed[r]` says whether rank r's parameters or optimizer state changed between the end
    of its step `step` and the start of its next. None when none changed, and when every one did
    (the script's doing: a normalisation or an averaging applied between steps). A strict minority
    of three or more is named; otherwise the ranks that changed, ambiguous (a script's clamp may
    change some shards and not others). `replicas`: the peers are replicas of one state (two DDP
    replicas): what a script does between steps it does to both alike, so the ones that changed
    while a replica did not are named, with no majority needed."""
    moved = tuple(sorted(r for r, c in changed.items() if c))
    if not moved or len(moved) == len(changed):
        return None
    what = (
        f"rank(s) {list(moved)}: parameters or optimizer state changed after step {step} and before "
        f"the next optimizer step, while {len(changed) - len(moved)} of their {len(changed)} peers' "
        "did not (no replica holds their shards to compare with)"
    )
    if replicas or (len(changed) >= 3 and 2 * len(moved) < len(changed)):
        return Verdict("sdc", moved, step, "state_changed_at_rest", what)
    return Verdict("sdc_ambiguous", moved, step, "state_changed_at_rest_no_majority", what)


def final_steps_verdict(finals: Mapping[int, int]) -> Verdict | None:
    """Compare the step counts the ranks of one job ended their loops at (`finals`: rank -> its
    session's step count when the script closed it). Every rank of a synchronous job takes one
    optimizer step per iteration (data-parallel replicas, tensor and pipeline stages, shards alike),
    so they end at one count. A rank that took a step of its own (an optimizer stepped twice on it,
    with no collective to pair it with its peers), or skipped one, ends elsewhere, and in its last
    step nobody compared it any more: no peer took that step. With three or more ranks, a strict
    majority names the others; without one, every rank is named. None when all agree."""
    counts = Counter(finals.values())
    if len(counts) <= 1:
        return None
    members = sorted(finals)
    top, top_n = counts.most_common(1)[0]
    majority = len(members) >= 3 and top_n * 2 > len(members)
    odd = tuple(r for r in members if finals[r] != top) if majority else tuple(members)
    ends = "; ".join(f"at {s}: {[r for r in members if finals[r] == s]}" for s in sorted(counts))
    return Verdict(
        "stale_state",
        odd,
        max(finals.values()),
        "final_steps_differ" if majority else "final_steps_differ_no_majority",
        f"the ranks ended their loops at different optimizer steps ({ends})"
        + ("" if majority else ", with no majority: each is named"),
    )


@dataclass(frozen=True)
class PhaseTimes:
    input: float
    compute: float
    communication: float

    def get(self, phase: str) -> float:
        return float(getattr(self, phase))


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class StragglerDetector:
    """Confirms a slow rank over consecutive steps. One per replica group (or per job)."""

    def __init__(self, ratio: float, min_s: float, confirmations: int) -> None:
        self.ratio, self.min_s, self.confirmations = ratio, min_s, confirmations
        self._streak: dict[tuple[int, str], int] = {}
        self._reported: set[tuple[int, str]] = set()

    def observe(self, step: int, times: Mapping[int, PhaseTimes]) -> list[Verdict]:
        if len(times) < 2:
            return []
        slow_now: set[tuple[int, str]] = set()
        for phase in PHASES:
            if phase == "communication" and len(times) == 2:
                # Of two ranks, the one that waits longer in the collective waits for the other: a
                # victim, whatever made the other late. Its compute or input time names it instead.
                continue
            for r, t in times.items():
                others = [o.get(phase) for q, o in times.items() if q != r]
                base = _median(others)
                value = t.get(phase)
                excess = value - base
                if phase == "communication":
                    # A rank that reached the collective earlier than its peers (less input and
                    # compute: a faster device, a lighter batch) waits that much longer in it: that
                    # is no slow communication. Only what its early arrival does not explain counts.
                    work = _median([o.input + o.compute for q, o in times.items() if q != r])
                    excess -= max(0.0, work - (t.input + t.compute))
                if value > self.ratio * base and excess > self.min_s:
                    slow_now.add((r, phase))
        if any(phase != "communication" for _, phase in slow_now):
            # Waiting in a collective is a symptom of whoever arrives late: with a compute or input
            # straggler in the step, a rank that waited longer than its peers (for two stragglers
            # instead of one) is explained by them, not slow itself.
            slow_now = {(r, phase) for r, phase in slow_now if phase != "communication"}
        for key in list(self._streak):
            if key not in slow_now:
                del self._streak[key]
                self._reported.discard(key)
        out = []
        for key in sorted(slow_now):
            self._streak[key] = self._streak.get(key, 0) + 1
            if self._streak[key] >= self.confirmations and key not in self._reported:
                self._reported.add(key)
                r, phase = key
                base = _median([o.get(phase) for q, o in times.items() if q != r])
                out.append(
                    Verdict(
                        "straggler",
                        (r,),
                        step,
                        f"{phase}_straggler",
                        f"rank {r} {phase} {times[r].get(phase) * 1e3:.1f} ms vs peers' median "
                        f"{base * 1e3:.1f} ms for {self._streak[key]} steps",
                        straggler_type=phase,
                        confirmations=self._streak[key],
                    )
                )
        return out


@dataclass(frozen=True)
class Progress:
    """What a rank's runtime says about its training thread (durations, never wall clocks)."""

    step: int
    collectives: int  # collectives this rank has entered
    in_collective_s: float  # how long it has been waiting in the current one (0: not in one)
    idle_s: float = math.inf  # how long since its training thread last made progress
    phase: str = ""  # "input" / "input_start" (in its data loader), "checkpoint_io", ... ("": other)
    in_phase_s: float = 0.0  # how long it has been in that phase


def hang_verdict(
    now_step: int,
    progress: Mapping[int, Progress],
    stall_threshold_s: float,
    silent: frozenset[int] = frozenset(),
    excused_s: Mapping[str, float] | None = None,
    left: Mapping[int, int] | None = None,
    all_stuck_after_s: float | None = None,
    jobwide: bool = False,
) -> Verdict | None:
    """Name the ranks that never entered the collective their peers are stuck in; failing that, the
    ranks that `left` (closed their sessions and went, while their peers still wait: a loop that ended
    early, uneven inputs; each with the collectives it had entered when last heard, -1 unknown); failing
    that, the `silent` ranks (peers of the group whose heartbeats stopped, so they are not in `progress`).

    `excused_s`: phases a rank may spend that long in while its peers wait (checkpoint I/O the
    framework marked, a data loader's batch, an evaluation between steps): no hang is named until it
    overstays. A rank in phase "stopping" (it received SIGTERM and is writing its capture to disk)
    is never named.

    The verdict's step is the one the stuck collective belongs to: the waiting ranks' step in
    progress (they completed `step`), the step in which the fault happened, not `now_step`.

    With no culprit among them, every rank of `progress` waiting is a `collective_stall` once the
    stall reaches `all_stuck_after_s` (default: the threshold). A group that is not the whole job
    waits longer: the rank they all wait for may be outside it (a tensor-parallel peer of another
    replica group, the next pipeline stage), and its own group names it at the threshold.

    `jobwide`: `progress` is every rank of the job, not a peer group (a rank that knows no peers: a
    pipeline stage, a plain module whose script all-reduces its gradients itself). Ranks of other
    groups enter other collectives, so the counts say nothing: a culprit is a rank in no collective
    that has not progressed for the threshold while others wait (a hang, or a stall of its phase)."""
    waiting = {r: p for r, p in progress.items() if p.in_collective_s >= stall_threshold_s}
    if not waiting:
        return _left_early(progress, stall_threshold_s, silent, left, jobwide)
    at = max(p.step for p in waiting.values()) + 1
    k = max(p.collectives for p in waiting.values())
    # A rank that made progress within the threshold (it just got its batch, or ended its checkpoint
    # I/O, and is on its way to the collective) is late, not stuck: not yet a culprit.
    culprits = tuple(
        sorted(
            r
            for r, p in progress.items()
            if (jobwide or p.collectives < k) and p.in_collective_s == 0 and p.idle_s >= stall_threshold_s
        )
    )
    stall = max(p.in_collective_s for p in waiting.values())
    # Those the detail names as waiting: every rank inside a collective, not only those past the
    # threshold (a peer that entered one a moment later waits for the same culprit), nor only those
    # in collective k (a peer that issued it asynchronously may still be counted in the one before).
    waiters = [p.collectives for p in progress.values() if p.in_collective_s > 0]
    in_k = f"{sorted(r for r, p in progress.items() if p.in_collective_s > 0)} wait in collective"
    if jobwide:
        in_k += "s of their own groups (no peers known: judged across the job)"
    else:
        in_k += f" #{k}" if min(waiters) == k else f"s #{min(waiters)}-#{k}"
    never = "in none, not progressing," if jobwide else "never entered it:"
    if any(p.phase == "stopping" for r, p in progress.items() if r in culprits):
        return None  # being terminated (SIGTERM): its peers name that when it goes, not a hang
    excused = excused_s or {}
    if any(
        p.phase in excused and p.in_phase_s < excused[p.phase] for r, p in progress.items() if r in culprits
    ):
        return None  # within what its phase may take
    phases = {p.phase for r, p in progress.items() if r in culprits}
    if culprits and len(phases) == 1 and (phase := phases.pop()) in STALL_KINDS:
        # Every culprit is stuck in its data loader (or checkpoint I/O) while its peers wait: the
        # stall, now stopping the job, not a hang of the training thread.
        kind, reason = STALL_KINDS[phase]
        return Verdict(
            kind,
            culprits,
            at,
            f"{reason}{PEERS_WAIT}",
            f"ranks {in_k} for up to {stall:.1f}s; ranks {list(culprits)} "
            f"{never} in {PHASE_NAMES[phase]} for "
            f"{max(p.in_phase_s for r, p in progress.items() if r in culprits):.1f}s",
            stall_duration_s=stall,
        )
    if culprits:
        where = {
            r: f" (in {PHASE_NAMES.get(p.phase, p.phase)})"
            for r, p in progress.items()
            if r in culprits and p.phase
        }
        return Verdict(
            "hang",
            culprits,
            at,
            "never_entered_collective",
            f"ranks {in_k} for up to {stall:.1f}s; "
            f"ranks {list(culprits)} "
            + (
                f"in none, with no progress for {max(progress[r].idle_s for r in culprits):.1f}s"
                if jobwide
                else "never entered it"
            )
            + "".join(where.values()),
            stall_duration_s=stall,
        )
    went = tuple(
        sorted(r for r, entered in (left or {}).items() if r not in progress and (jobwide or entered < k))
    )
    if went:
        return _left(went, at, in_k, stall)
    gone = tuple(sorted(silent - set(progress)))
    if gone:
        return Verdict(
            "hang",
            gone,
            at,
            "silent_while_peers_wait",
            f"ranks {in_k} for up to {stall:.1f}s; ranks {list(gone)} went silent (no heartbeat)",
            stall_duration_s=stall,
        )
    if len(waiting) == len(progress) and stall >= (all_stuck_after_s or stall_threshold_s):
        return Verdict(
            "collective_stall",
            tuple(sorted(waiting)),
            at,
            "all_ranks_stuck_in_collective",
            f"every rank waits in collective #{k} for {stall:.1f}s",
            stall_duration_s=stall,
        )
    return None


def _left_early(
    progress: Mapping[int, Progress],
    stall_threshold_s: float,
    silent: frozenset[int],
    left: Mapping[int, int] | None,
    jobwide: bool,
) -> Verdict | None:
    """`hang_verdict`'s LEFT before the threshold: every live rank of the group has waited
    `LEFT_WAIT_S` in the same collective, none is silent, and a rank that closed its session never
    entered it. Nobody else can be the culprit (a live rank outside the collective, one that went
    silent), and the closed one will not enter it. Not for a job judged whole (`jobwide`: the
    counts of other groups' collectives say nothing)."""
    soon = min(stall_threshold_s, LEFT_WAIT_S)
    if jobwide or not left or silent or not progress:
        return None
    if any(p.in_collective_s < soon for p in progress.values()):
        return None
    k = max(p.collectives for p in progress.values())
    if any(p.collectives != k for p in progress.values()):
        return None
    went = tuple(sorted(r for r, entered in left.items() if r not in progress and entered < k))
    if not went:
        return None
    at = max(p.step for p in progress.values()) + 1
    return _left(
        went,
        at,
        f"{sorted(progress)} wait in collective #{k}",
        max(p.in_collective_s for p in progress.values()),
    )


def _left(went: tuple[int, ...], at: int, in_k: str, stall: float) -> Verdict:
    """The hang of ranks that closed their sessions before the collective the ranks `in_k` wait in."""
    return Verdict(
        "hang",
        went,
        at,
        LEFT,
        f"ranks {in_k} for up to {stall:.1f}s; ranks {list(went)} "
        "closed their sessions and left before entering it (a loop that ended early?)",
        stall_duration_s=stall,
    )


def desync_verdict(now_step: int, chains: Mapping[int, Sequence[tuple[int, bytes]]]) -> Verdict | None:
    """Collective desync: ranks that entered the same number of collectives must have entered the same
    ones (op, size, dtype, group, in order), so their hash chains must be equal. `chains` maps a rank
    to its states (collectives entered, hash chain): its current one and those just before it, so
    that ranks sampled a collective or two apart are compared at a count they all passed. The first
    count at which they disagree names the rank that issued another collective: the minority of
    three or more. With no majority there (two replicas, or as many on each side) every rank is
    named (`collective_desync_ambiguous`), but only once every rank's states reach that count: a
    rank sampled elsewhere may yet make a majority."""
    by_count: dict[int, dict[int, bytes]] = {}
    for r, states in chains.items():
        for count, chain in states:
            if count > 0 and chain:
                by_count.setdefault(count, {})[r] = chain
    for count, group in sorted(by_count.items()):
        v = fingerprint_verdict(now_step, "collective", group)
        if v is None:
            continue
        if v.kind == "sdc":
            return Verdict(
                "collective_desync",
                v.ranks,
                now_step,
                "collective_sequence_minority",
                f"after {count} collectives: {len(v.ranks)} of {len(group)} replicas entered another one",
            )
        if len(group) == len(chains):
            return Verdict(
                "collective_desync_ambiguous",
                v.ranks,
                now_step,
                "collective_sequence_no_majority",
                f"after {count} collectives: replicas {list(v.ranks)} entered different ones, "
                "with no majority",
            )
        return None  # the others' states may yet make a majority at this count
    return None


def desync_in_trails(trails: Mapping[int, tuple[bytes, Sequence[tuple[int, bytes]]]]) -> Verdict | None:
    """The collective desync in the last states of ranks that all stopped: `trails` maps a rank to
    (its replica group's digest, its states), as each wrote them (runtime/trail.py). Ranks compare
    within their replica group only (other groups issue other collectives), by `desync_verdict`'s
    rule. A minority named in some group wins over ambiguity in another."""
    groups: dict[bytes, dict[int, Sequence[tuple[int, bytes]]]] = {}
    for r, (group, states) in trails.items():
        groups.setdefault(group, {})[r] = states
    found = [v for g in groups.values() if (v := desync_verdict(-1, g)) is not None]
    found.sort(key=lambda v: (v.kind != "collective_desync", v.ranks))
    return found[0] if found else None


class HangDetector:
    """Reports each distinct hang once (until progress resumes)."""

    def __init__(
        self,
        stall_threshold_s: float,
        excused_s: Mapping[str, float] | None = None,
        all_stuck_after_s: float | None = None,
        jobwide: bool = False,
    ) -> None:
        self.stall_threshold_s = stall_threshold_s
        self.excused_s = dict(excused_s or {})
        self.all_stuck_after_s = all_stuck_after_s
        self.jobwide = jobwide
        self._open: tuple[str, tuple[int, ...]] | None = None

    def observe(
        self,
        now_step: int,
        progress: Mapping[int, Progress],
        silent: frozenset[int] = frozenset(),
        left: Mapping[int, int] | None = None,
    ) -> Verdict | None:
        v = hang_verdict(
            now_step,
            progress,
            self.stall_threshold_s,
            silent,
            self.excused_s,
            left,
            self.all_stuck_after_s,
            self.jobwide,
        )
        if v is None:
            self._open = None
            return None
        key = (v.kind, v.ranks)
        if key == self._open:
            return None
        self._open = key
        return v


# The reason of a rank hung after its loop: every other rank closed its session, it did not.
IDLE_AFTER_PEERS_CLOSED = "idle_after_peers_closed"


def closed_peers_verdict(
    rank: int,
    own: Progress,
    quiet_s: float,
    threshold_s: float,
    still: Mapping[int, Progress] | None = None,
    left: Mapping[int, int] | None = None,
) -> Verdict | None:
    """Called while the other ranks of the job have closed their sessions (their loops ended) and
    this one has not. Its training thread in no collective and no phase, with no progress for
    `threshold_s`, and its process (the library's threads aside) using no CPU for as long
    (`quiet_s`, see QuietClock): hung after its last step (a lock, an event never set, a wait on
    something that never comes), a hang of `rank`.

    `still`: the other ranks that have not closed either, as their runtimes last said. Each must
    be as this one is (after the same step, in no collective and no phase, no progress for
    `threshold_s`): they are named with it, and each votes for that alone if its own process is
    quiet, so the verdict needs every one of them hung. Before, two ranks hung after their loops
    never saw every other rank closed: nobody was named and the job never ended (outsider fuzz,
    FSDP2, hangs on ranks 0 and 3 after the last step).

    Nobody waits for it in a collective, so `hang_verdict` never names it; its peers' workers wait
    for it at their close for a while, and the job never ended (outsider 57: a hang right after the
    last step). A rank busy with work of its own after its loop (saving, uploading, evaluating)
    uses CPU, and is not named.

    `left`: the replicas of this rank that closed their sessions (they issue the same collectives),
    each with the collectives it had entered at its close. Where this rank entered more than one of
    them, it waits in a collective between steps (a barrier after the loop, never counted as a
    wait) that the replica left without entering: those replicas are named (`LEFT`), not this one
    and its like. Before, a script that exited after its last step (`sys.exit(0)`) while the others
    waited in their final barrier had the waiting ranks named hung (outsider fuzz)."""
    if own.in_collective_s > 0 or own.phase:
        return None  # a collective's peers (hang_verdict) or its phase's threshold (StallDetector)
    if own.idle_s < threshold_s or quiet_s < threshold_s:
        return None
    still = still or {}
    for p in still.values():
        if p.step != own.step or p.in_collective_s > 0 or p.phase or p.idle_s < threshold_s:
            return None
    went = tuple(sorted(r for r, entered in (left or {}).items() if 0 <= entered < own.collectives))
    if went:
        return Verdict(
            "hang",
            went,
            own.step + 1,
            LEFT,
            f"ranks {sorted({rank, *still})} entered collective #{own.collectives} after step {own.step} "
            f"and wait in it, idle for {own.idle_s:.1f}s; ranks {list(went)} closed their sessions and "
            "left before entering it (a script that ended early?)",
            stall_duration_s=min(own.idle_s, quiet_s),
        )
    ranks = tuple(sorted({rank, *still}))
    who = (
        "every other rank closed its session"
        if not still
        else f"every rank but {list(ranks)} closed its session, those all idle after step {own.step}"
    )
    return Verdict(
        "hang",
        ranks,
        own.step + 1,
        IDLE_AFTER_PEERS_CLOSED,
        f"{who}; rank {rank} made no progress after step {own.step} "
        f"for {own.idle_s:.1f}s, its process using no CPU for {quiet_s:.1f}s (hung after its loop)",
        stall_duration_s=min(own.idle_s, quiet_s),
    )


# The reason of a rank hung between steps (after its loop) while its peers wait for it in a
# collective issued between steps (a barrier after the loop), which is never counted as a wait.
IDLE_WHILE_PEERS_WAIT = "idle_while_peers_wait"


def waiting_peers_verdict(
    progress: Mapping[int, Progress], quiet_s: Mapping[int, float], threshold_s: float
) -> Verdict | None:
    """`progress`: a peer group's ranks (replicas: they issue the same collectives), `quiet_s`: how
    long each one's process has used no CPU while its training thread sat idle in no collective
    and no phase (as its runtime said). The ranks so idle and quiet for `threshold_s`, whose every
    other peer has entered more collectives than they have and made no progress since for as long
    (in no phase): those wait for them in a collective they never entered, issued between steps.

    A collective between steps is never counted as a wait (`hang_verdict` does not see it): rank 0
    saving its checkpoint after the loop while the others wait in a barrier is no hang. But a rank
    hung after its loop (an event never set, a lock) while its peers wait in their barrier was
    never named, and the job waited for the process group's timeout (outsider fuzz: rank 1 hung
    after its last step, the others in `dist.barrier()`). A rank at work (saving, uploading,
    evaluating) uses CPU or is in a phase, and is not named."""
    if not progress:
        return None
    k = max(p.collectives for p in progress.values())
    others = {r: p for r, p in progress.items() if p.collectives == k}  # (in it: quiet too, blocked)
    behind = {r: p for r, p in progress.items() if p.collectives < k}
    if not behind:
        return None
    for r, p in behind.items():
        if p.in_collective_s > 0 or p.phase or min(p.idle_s, quiet_s.get(r, 0.0)) < threshold_s:
            return None  # on its way, at work, or waiting in a collective of its own (hang_verdict's)
    if any(p.phase or p.idle_s < threshold_s or p.in_collective_s > 0 for p in others.values()):
        return None  # a peer at work or progressing (not yet waiting), or a wait counted: hang_verdict's
    ranks = tuple(sorted(behind))
    idle = min(progress[r].idle_s for r in ranks)
    quiet = min(quiet_s[r] for r in ranks)
    return Verdict(
        "hang",
        ranks,
        max(p.step for p in progress.values()) + 1,
        IDLE_WHILE_PEERS_WAIT,
        f"ranks {sorted(others)} entered collective #{k} and wait in it; ranks {list(ranks)} never "
        f"entered it, made no progress for {idle:.1f}s, their processes using no CPU for {quiet:.1f}s "
        "(hung between steps)",
        stall_duration_s=min(idle, quiet),
    )


class QuietClock:
    """How long a CPU-time counter (seconds) has grown by at most `rate` of the time passed, plus
    `slack_s` (a clock tick or two): a process waiting on something idles at ~0, one at work does
    not. Any other change (a thread that ended takes its CPU time out of the sum) starts it again."""

    def __init__(self, rate: float = 0.01, slack_s: float = 0.05) -> None:
        self.rate, self.slack_s = rate, slack_s
        self._anchor: tuple[float, float] | None = None  # (cpu, now) when the quiet began

    def observe(self, now: float, cpu: float) -> float:
        a = self._anchor
        if a is None or abs(cpu - a[0]) > self.rate * (now - a[1]) + self.slack_s:
            self._anchor = a = (cpu, now)
        return now - a[1]

    def reset(self) -> None:
        self._anchor = None


class StallDetector:
    """Names each rank stuck in a phase (data loader, checkpoint I/O) past its threshold, once per
    stall: a rank that leaves the phase and stalls again is named again."""

    def __init__(self, thresholds_s: Mapping[str, float]) -> None:
        self.thresholds_s = dict(thresholds_s)
        self._open: set[tuple[int, str]] = set()

    def observe(self, now_step: int, progress: Mapping[int, Progress]) -> list[Verdict]:
        out = []
        stalled = set()
        for r, p in sorted(progress.items()):
            limit = self.thresholds_s.get(p.phase)
            if p.phase not in STALL_KINDS or limit is None or p.in_phase_s < limit:
                continue
            stalled.add((r, p.phase))
            if (r, p.phase) in self._open:
                continue
            kind, reason = STALL_KINDS[p.phase]
            what = "its data loader" if p.phase.startswith("input") else "checkpoint I/O"
            out.append(
                Verdict(
                    kind,
                    (r,),
                    now_step,
                    reason,
                    f"rank {r} has been in {what} for {p.in_phase_s:.1f}s (threshold {limit:.1f}s)",
                    stall_duration_s=p.in_phase_s,
                )
            )
        # Ranks we no longer hear from keep their open stall: silence is not recovery.
        self._open = stalled | {(r, ph) for r, ph in self._open if r not in progress}
        return out


class SilenceDetector:
    """Names peers cut off from our transport while they live: declared dead (their heartbeats
    stopped for the heartbeat timeout), silent `hold_s` longer, and meanwhile this rank completed
    `min_steps` steps, whose collectives they took part in. A dead or frozen peer stops those
    collectives (a hang, or an exit its agent sees); one that only lost its messages does not.

    Each rank is named once per silence: heard again, its next silence is news again."""

    def __init__(self, hold_s: float, min_steps: int = 3) -> None:
        self.hold_s = hold_s
        self.min_steps = min_steps
        self._since: dict[int, tuple[float, int]] = {}  # rank -> (first seen silent, own step then)
        self._named: set[int] = set()

    def observe(
        self,
        now: float,
        step: int,
        silent: Iterable[int],
        peers: Iterable[int],
        node_of: Mapping[int, str],
        me: int,
        heard: Iterable[int] = (),
    ) -> list[Verdict]:
        """`silent`: the ranks declared dead (any in the world); `peers`: those whose collectives
        this rank shares (its steps complete only with them); `node_of`: every rank's node;
        `heard`: silent ranks heard meanwhile through another channel (the torchrun backend's
        control store): their node reaches the network, only our transport lost their messages."""
        silent = frozenset(silent) - {me}
        heard = frozenset(heard)
        peer_set = frozenset(peers) - {me}
        for r in [r for r in self._since if r not in silent]:
            del self._since[r]
            self._named.discard(r)
        for r in silent:
            self._since.setdefault(r, (now, step))
        # Hearing fewer than half of the others, this rank may be the one cut off: it waits twice
        # as long, so that in a real split the ranks that can tell (who name the node) speak first.
        ambiguous = 2 * len(silent) > len(node_of) - 1
        hold = self.hold_s * (2 if ambiguous else 1)
        cut = {
            r
            for r in silent & peer_set
            if r not in self._named
            and now - self._since[r][0] >= hold
            and step - self._since[r][1] >= self.min_steps
        }
        if not cut:
            return []
        self._named |= cut
        # Silent since about a heartbeat timeout before they were declared dead.
        quiet = max(now - self._since[r][0] for r in cut) + self.hold_s
        steps = min(step - self._since[r][1] for r in cut)
        said = f"sent nothing on our transport for about {quiet:.1f}s, while this rank completed {steps} "
        said += "steps with"

        def verdict(ranks: Iterable[int], reason: str, endpoint: str, detail: str) -> Verdict:
            rs = tuple(sorted(ranks))
            return Verdict(
                "network_partition", rs, step, reason, detail, stall_duration_s=quiet, endpoint=endpoint
            )

        if ambiguous:  # a restart, no node named
            return [
                verdict(
                    cut,
                    "unreachable_ambiguous",
                    f"rank:{min(cut)}",
                    f"ranks {sorted(cut)} {said} them; this rank hears only {len(node_of) - 1 - len(silent)} "
                    f"of {len(node_of) - 1} others, so it may be the one cut off",
                )
            ]
        out = []
        for node in sorted({node_of[r] for r in cut}):
            on_node = {r for r, n in node_of.items() if n == node}
            here = sorted(cut & on_node)
            if on_node <= silent and not on_node & heard:
                detail = f"every rank of node {node} ({sorted(on_node)}) {said} them: the node is cut off"
                out.append(verdict(on_node, "node_unreachable", f"node:{node}", detail))
            elif on_node <= silent:
                detail = (
                    f"ranks {here} {said} them, while ranks {sorted(on_node & heard)} of node {node} are "
                    "heard through the control store: the node is reachable, messages dropped"
                )
                out.append(verdict(here, "rank_unreachable", f"rank:{here[0]}", detail))
            else:
                detail = f"ranks {here} {said} them while the rest of node {node} is heard: messages dropped"
                out.append(verdict(here, "rank_unreachable", f"rank:{here[0]}", detail))
        return out


def settings_verdict(step: int, settings: Mapping[int, str], keys: Sequence[str] = ()) -> Verdict | None:
    """`settings`: each rank's values joined by "," (ranks that sent none are left out), named by
    `keys` in order. The ranks whose settings differ from the most common (ties: the one the lowest
    rank holds) drifted; None when all agree."""
    by_value: dict[str, list[int]] = {}
    for r, v in sorted(settings.items()):
        if v:
            by_value.setdefault(v, []).append(r)
    if len(by_value) < 2:
        return None
    common = max(by_value.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))[0]
    odd = tuple(sorted(r for v, ranks in by_value.items() if v != common for r in ranks))

    def parse(v: str) -> dict[str, str]:
        return {keys[i] if i < len(keys) else f"#{i}": x for i, x in enumerate(v.split(","))}

    want = parse(common)
    parts = []
    for v, ranks in sorted(by_value.items(), key=lambda kv: kv[1][0]):
        if v == common:
            continue
        have = parse(v)
        names = [k for k in dict.fromkeys([*want, *have]) if want.get(k) != have.get(k)]
        diff = ", ".join(f"{k}={have.get(k, '<unset>')} (others {want.get(k, '<unset>')})" for k in names)
        parts.append(f"ranks {ranks} have {diff}")
    return Verdict("config_drift", odd, step, "settings_differ", "; ".join(parts))


class DriftDetector:
    """Names each settings drift (`settings_verdict`) once, when it has lasted `hold_s`. Each
    rank gossips its settings every heartbeat, so every rank flipping one at the same step is seen
    half-flipped for up to a heartbeat; a hold of a few heartbeats passes over that."""

    def __init__(self, hold_s: float, keys: Sequence[str] = ()) -> None:
        self.hold_s = hold_s
        self.keys = tuple(keys)
        self._open: tuple[tuple[int, ...], str, float] | None = None  # (ranks, detail, first seen)
        self._named: set[tuple[tuple[int, ...], str]] = set()

    def observe(self, now: float, step: int, settings: Mapping[int, str]) -> Verdict | None:
        v = settings_verdict(step, settings, self.keys)
        if v is None:
            self._open = None
            return None
        key = (v.ranks, v.detail)
        if self._open is None or self._open[:2] != key:
            self._open = (*key, now)
        if key in self._named or now - self._open[2] < self.hold_s:
            return None
        self._named.add(key)
        return v
