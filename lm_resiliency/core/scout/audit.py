"""Audits: a peer re-executes one rank's micro-batches (pure; no clock, no torch).

A fault before the gradient all-reduce (a corrupted forward output or a corrupted local gradient)
is averaged into every replica's gradients: the replicas still agree bitwise, so fingerprints
cannot see it. Only re-executing the rank's work can. Every `audit_interval` steps each rank of a
replica group sends what it computed from (its micro-batches' inputs, RNG state, buffers and the
gradients that reached its outputs) and fingerprints of what it got (outputs, local gradients) to
one auditor; the auditor re-runs the forward and backward with its own copy of the pre-step
parameters, which the group agreed on, and compares bitwise.

Pairing (`audit_target`) is a rotation of the replica group: every rank audits exactly one peer and
is audited by exactly one, and the pairing moves each audited step so over time every peer checks
every other. An auditor accuses only after it replayed the audited work twice with the same result
and replayed its own work of that step bitwise (its setup reproduces computations). Every auditor
announces its result, and every rank decides from the same set (`audit_verdicts`), where an auditor
accused at the same step loses its standing.

With expert parallelism the audited units are the expert modules, and the replica group is the
ranks that hold the same experts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lm_resiliency.core.scout.verdicts import Verdict

__all__ = ["AUDIT_FINDINGS", "audit_source", "audit_target", "audit_verdicts"]

# What an auditor can find, and the stable reason code of each.
AUDIT_FINDINGS = {
    "output": "forward_replay_mismatch",  # the audited rank's forward outputs differ from the replay
    "grads": "backward_replay_mismatch",  # same outputs, different gradients before the all-reduce
}


def _offset(n: int, step: int, interval: int) -> int:
    """Rotation of the pairing at an audited step: 1 .. n-1, moving by one per audit."""
    return 1 + (step // max(1, interval)) % (n - 1)


def audit_target(group: Sequence[int], rank: int, step: int, interval: int) -> int | None:
    """The rank whose work of `step` `rank` audits (None: a group of one has no peer)."""
    members = sorted(group)
    if len(members) < 2 or rank not in members:
        return None
    i = members.index(rank)
    return members[(i - _offset(len(members), step, interval)) % len(members)]


def audit_source(group: Sequence[int], rank: int, step: int, interval: int) -> int | None:
    """The rank that audits `rank`'s work of `step` (the inverse of `audit_target`)."""
    members = sorted(group)
    if len(members) < 2 or rank not in members:
        return None
    i = members.index(rank)
    return members[(i + _offset(len(members), step, interval)) % len(members)]


def audit_verdicts(
    step: int, results: Mapping[int, tuple[int, str, str]], group: Sequence[int], interval: int
) -> list[Verdict]:
    """Verdicts of one audited step from every auditor's result (auditor -> (audited, finding,
    detail)); findings other than those of `AUDIT_FINDINGS` ("ok", "skipped") accuse nobody.

    A result counts only from the rank's assigned auditor. A rank found corrupting at this step
    loses its standing as an auditor at this step: a device that corrupts deterministically
    corrupts its replay of a peer's work as it corrupted its own, and would accuse that peer. When
    every accusation comes from an accused rank (two replicas accusing each other), nobody can be
    named: one `sdc_ambiguous` verdict over the accused ranks."""
    accusations = {
        auditor: (audited, finding, detail)
        for auditor, (audited, finding, detail) in results.items()
        if finding in AUDIT_FINDINGS and audit_target(group, auditor, step, interval) == audited
    }
    accused = {audited for audited, _, _ in accusations.values()}
    standing = {a: v for a, v in accusations.items() if a not in accused}
    if accusations and not standing:
        ranks = tuple(sorted(accused))
        return [
            Verdict(
                "sdc_ambiguous",
                ranks,
                step,
                "audit_inconclusive",
                f"ranks {list(ranks)} each found the other's work of step {step} different from "
                "its replay: one of them corrupts, the audits cannot tell which",
            )
        ]
    out = []
    for auditor, (audited, finding, detail) in sorted(standing.items()):
        what = "forward outputs" if finding == "output" else "gradients before the all-reduce"
        out.append(
            Verdict(
                "sdc",
                (audited,),
                step,
                AUDIT_FINDINGS[finding],
                f"rank {auditor} re-executed rank {audited}'s micro-batches of step {step} twice and "
                f"its own once, bitwise; rank {audited}'s {what} differ from the replay"
                + (f" ({detail})" if detail else ""),
            )
        )
    return out
