"""Scoring a campaign: ground truth per injection against the job's fault reports (pure).

An injector records one ground-truth line per fault it injected (`GroundTruth`), never telling the
detection what it did; the job's fault reports (the `report_dir` JSON lines, or the dicts a
`fault_callback` got) are its localization results. `evaluate` matches them in time:

- per occurrence: detected (a verdict came within the window after the injection), localized (a
  verdict's culprit ranks equal the injected ranks exactly, and its endpoint or node names an
  injected resource when the fault named one), kind match (a localized verdict's kind is the kind
  that must catch the type, FAILURES.md), detection latency (to the first localized verdict, else
  the first verdict);
- over the campaign: precision (distinct verdicts that localized an occurrence / all distinct
  verdicts), recall (localized occurrences / occurrences), and false positives (verdicts that match
  no occurrence). `evaluate_clean` gives the false-positive rate over clean runs of the same job.

Every rank writes each verdict it hears; reports with the same kind, culprits and scope within
`merge_s` of each other are one verdict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lm_resiliency.core.taxonomy import CANONICAL_TYPES

__all__ = ["GroundTruth", "Verdict", "evaluate", "evaluate_clean", "verdicts"]

# Kinds that also localize a type (a worker killed by a signal is a process failure, and a node the
# agents stop hearing from is lost; both end in the same restart or replacement).
_ALSO: dict[str, frozenset[str]] = {
    "process_termination": frozenset({"process_failure", "node_lost"}),
    "network_partition": frozenset({"network_partition", "node_lost"}),
    "timeout": frozenset({"hang"}),
    # GEMINI names a damaged copy by the type itself.
    "checkpoint_corruption": frozenset({"checkpoint_corruption"}),
    "checkpoint_truncation": frozenset({"checkpoint_corruption"}),
    "checkpoint_missing": frozenset({"checkpoint_corruption"}),
}


@dataclass(frozen=True)
class GroundTruth:
    """One injected fault: what, where, when (wall-clock seconds)."""

    occurrence_id: str
    incident_id: str
    fault_id: str
    type: str
    iteration: int
    attempt: int
    rank: int
    injected_at: float
    surface: str = ""
    node: str | None = None
    generation: int | None = None
    expected_ranks: tuple[int, ...] = ()
    expected_resources: tuple[str, ...] = ()
    detail: str = ""

    @property
    def expected_kind(self) -> str:
        return CANONICAL_TYPES.get(self.type, "unknown")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["expected_ranks"] = list(self.expected_ranks)
        d["expected_resources"] = list(self.expected_resources)
        d["expected_kind"] = self.expected_kind
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> GroundTruth:
        names = GroundTruth.__dataclass_fields__
        kw = {k: v for k, v in d.items() if k in names}
        kw["expected_ranks"] = tuple(int(r) for r in kw.get("expected_ranks", ()))
        kw["expected_resources"] = tuple(str(r) for r in kw.get("expected_resources", ()))
        return GroundTruth(**kw)


@dataclass(frozen=True)
class Verdict:
    """Reports of one finding (every rank writes what it hears), merged."""

    kind: str
    failed_ranks: tuple[int, ...]
    scope: str
    time: float
    resources: frozenset[str] = field(default_factory=frozenset)
    reason: str = ""
    reports: int = 1


def _resources(report: Mapping[str, Any]) -> set[str]:
    out = set()
    for k in ("endpoint_id", "node", "device"):
        v = report.get(k)
        if v not in (None, ""):
            out.add(str(v))
    return out


def verdicts(reports: Iterable[Mapping[str, Any]], merge_s: float = 30.0) -> list[Verdict]:
    """Distinct verdicts in time order: reports with the same kind, culprits and scope within
    `merge_s` of the first of them are one verdict. Reports without a time or kind are skipped."""
    rows = []
    for r in reports:
        t = r.get("time")
        kind = r.get("kind")
        if not isinstance(t, (int, float)) or not isinstance(kind, str):
            continue
        ranks = tuple(sorted({int(x) for x in r.get("failed_ranks", ()) or ()}))
        rows.append((float(t), kind, ranks, str(r.get("scope", "rank")), r))
    rows.sort(key=lambda x: x[0])
    out: list[Verdict] = []
    open_: dict[tuple[str, tuple[int, ...], str], int] = {}
    for t, kind, ranks, scope, r in rows:
        key = (kind, ranks, scope)
        i = open_.get(key)
        if i is not None and t - out[i].time <= merge_s:
            v = out[i]
            out[i] = Verdict(
                v.kind, v.failed_ranks, v.scope, v.time, v.resources | _resources(r), v.reason, v.reports + 1
            )
            continue
        open_[key] = len(out)
        out.append(Verdict(kind, ranks, scope, t, frozenset(_resources(r)), str(r.get("reason", ""))))
    return out


def _localizes(v: Verdict, ranks: frozenset[int], resources: frozenset[str]) -> bool:
    if frozenset(v.failed_ranks) != ranks:
        return False
    return not resources or bool(resources & v.resources)


def evaluate(
    ground_truth: Sequence[GroundTruth],
    reports: Iterable[Mapping[str, Any]],
    window_s: float = 120.0,
    merge_s: float = 30.0,
) -> dict[str, Any]:
    """The campaign's evaluation: one entry per occurrence, then the campaign's figures."""
    found = verdicts(reports, merge_s)
    by_occ: dict[str, list[GroundTruth]] = {}
    for g in ground_truth:
        by_occ.setdefault(g.occurrence_id, []).append(g)
    order = sorted(by_occ, key=lambda o: min(g.injected_at for g in by_occ[o]))
    starts = [min(g.injected_at for g in by_occ[o]) for o in order]
    used: set[int] = set()
    occurrences: list[dict[str, Any]] = []
    for n, occ in enumerate(order):
        gts = by_occ[occ]
        at = starts[n]
        # A verdict belongs to the newest injection before it (within the window).
        until = min(
            at + window_s, starts[n + 1] if n + 1 < len(order) and starts[n + 1] > at else at + window_s
        )
        ranks = frozenset(r for g in gts for r in (g.expected_ranks or (g.rank,)))
        resources = frozenset(x for g in gts for x in g.expected_resources)
        kinds: set[str] = set()
        for g in gts:
            kinds |= _ALSO.get(g.type, frozenset()) | {g.expected_kind}
        window = [(i, v) for i, v in enumerate(found) if at <= v.time <= until]
        localized = [(i, v) for i, v in window if _localizes(v, ranks, resources)]
        matched = [(i, v) for i, v in localized if v.kind in kinds]
        pick = matched or localized or window
        best = pick[0] if pick else None
        used.update(i for i, _ in (matched or localized))
        occurrences.append(
            {
                "occurrence_id": occ,
                "incident_id": gts[0].incident_id,
                "types": sorted({g.type for g in gts}),
                "expected_ranks": sorted(ranks),
                "expected_resources": sorted(resources),
                "expected_kinds": sorted(kinds),
                "injected_at": at,
                "detected": bool(window),
                "localized": bool(localized),
                "kind_match": bool(matched),
                "reported_kind": best[1].kind if best else None,
                "reported_ranks": list(best[1].failed_ranks) if best else None,
                "detection_latency_s": round(best[1].time - at, 3) if best else None,
            }
        )
    n_occ = len(occurrences)
    hits = sum(1 for o in occurrences if o["localized"])
    n_verdicts = len(found)
    unmatched = [v for i, v in enumerate(found) if i not in used]
    latencies = sorted(o["detection_latency_s"] for o in occurrences if o["localized"])
    return {
        "occurrences": occurrences,
        "injected": n_occ,
        "detected": sum(1 for o in occurrences if o["detected"]),
        "localized": hits,
        "kind_matched": sum(1 for o in occurrences if o["kind_match"]),
        "verdicts": n_verdicts,
        "false_positives": len(unmatched),
        "unmatched_verdicts": [
            {"kind": v.kind, "failed_ranks": list(v.failed_ranks), "time": v.time, "reason": v.reason}
            for v in unmatched
        ],
        "precision": round((n_verdicts - len(unmatched)) / n_verdicts, 4) if n_verdicts else None,
        "recall": round(hits / n_occ, 4) if n_occ else None,
        "median_detection_latency_s": latencies[len(latencies) // 2] if latencies else None,
    }


def evaluate_clean(runs: Sequence[Iterable[Mapping[str, Any]]], merge_s: float = 30.0) -> dict[str, Any]:
    """False positives over clean runs (no injection): any verdict is one."""
    per_run = [len(verdicts(r, merge_s)) for r in runs]
    return {
        "clean_runs": len(per_run),
        "false_positives": sum(per_run),
        "runs_with_false_positives": sum(1 for n in per_run if n),
        "false_positive_rate": round(sum(1 for n in per_run if n) / len(per_run), 4) if per_run else None,
    }
