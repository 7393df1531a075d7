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
`merge_s` of each other are one verdict, unless both name the steps they judged and no step is
in both, or both name their generation and it differs (the same rank found at another step, or
failing again after a restart, is another finding: faults of one campaign on one rank can come
seconds apart).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lm_resiliency.core.taxonomy import CANONICAL_TYPES

__all__ = ["GroundTruth", "Verdict", "evaluate", "evaluate_clean", "read_reports", "verdicts"]

# Kinds that also localize a type (a worker killed by a signal is a process failure, and a node the
# agents stop hearing from is lost; both end in the same restart or replacement).
_ALSO: dict[str, frozenset[str]] = {
    "process_termination": frozenset({"process_failure", "node_lost"}),
    # From inside the job, a rank or node that falls silent while it lives looks lost.
    "network_partition": frozenset({"network_partition", "node_lost", "process_failure"}),
    "message_drop": frozenset({"network_partition", "node_lost", "process_failure"}),
    "timeout": frozenset({"hang"}),
    # GEMINI names a damaged copy by the type itself.
    "checkpoint_corruption": frozenset({"checkpoint_corruption"}),
    "checkpoint_truncation": frozenset({"checkpoint_corruption"}),
    "checkpoint_missing": frozenset({"checkpoint_corruption"}),
    "io_error": frozenset({"io_error"}),
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
    steps: frozenset[int] = field(default_factory=frozenset)
    generation: int | None = None  # of the workers that reported it (torchrun backend)


def jsonl_lines(path: Path) -> Iterable[tuple[int, str, bool]]:
    """(line number, text, whether it may be torn) of each non-blank line of a JSON-lines file that
    processes append to: only the last line, with no newline after it, may be torn (a kill while it
    was written)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            yield n, line, n == len(lines) and not text.endswith("\n")


def read_reports(folder: str | os.PathLike[str], skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Every rank's fault reports in a report_dir (`reports-rank<R>.jsonl`). A torn last line (from
    a kill) is skipped; any other line that is no JSON object is skipped too, and named in `skipped`
    ("<file> line N: why"). A folder that does not exist: FileNotFoundError."""
    p = Path(folder)
    if not p.is_dir():
        raise FileNotFoundError(f"no report folder {folder}")
    out = []
    for f in sorted(p.glob("reports-rank*.jsonl")):
        for n, line, torn in jsonl_lines(f):
            try:
                r = json.loads(line)
            except ValueError as exc:
                r, why = None, f"not JSON ({exc})"
            else:
                why = f"a JSON {type(r).__name__}, not an object"
            if isinstance(r, dict):
                out.append(r)
            elif skipped is not None and not torn:
                skipped.append(f"{f} line {n}: {why}")
    return out


def _resources(report: Mapping[str, Any]) -> set[str]:
    out = set()
    for k in ("endpoint_id", "node", "device"):
        v = report.get(k)
        if v not in (None, ""):
            out.add(str(v))
    return out


def _steps(report: Mapping[str, Any]) -> frozenset[int]:
    v = report.get("steps")
    if not isinstance(v, (list, tuple)):
        return frozenset()
    return frozenset(x for x in v if isinstance(x, int) and not isinstance(x, bool))


def verdicts(reports: Iterable[Mapping[str, Any]], merge_s: float = 30.0) -> list[Verdict]:
    """Distinct verdicts in time order: reports with the same kind, culprits and scope within
    `merge_s` of the first of them are one verdict, unless both name steps and none in common, or
    both name generations and they differ. Reports without a time or kind are skipped."""
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
    open_: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
    for t, kind, ranks, scope, r in rows:
        steps = _steps(r)
        gen = r.get("generation")
        gen = gen if isinstance(gen, int) and not isinstance(gen, bool) else None
        opened = open_.setdefault((kind, ranks, scope), [])
        i = next(  # the newest open verdict this report belongs to
            (
                i
                for i in reversed(opened)
                if t - out[i].time <= merge_s
                and (not steps or not out[i].steps or steps & out[i].steps)
                and (gen is None or out[i].generation in (None, gen))
            ),
            None,
        )
        if i is not None:
            v = out[i]
            out[i] = replace(
                v,
                resources=v.resources | _resources(r),
                reports=v.reports + 1,
                steps=v.steps | steps,
                generation=v.generation if v.generation is not None else gen,
            )
            continue
        opened.append(len(out))
        out.append(
            Verdict(
                kind,
                ranks,
                scope,
                t,
                frozenset(_resources(r)),
                str(r.get("reason", "")),
                steps=steps,
                generation=gen,
            )
        )
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
    occs = []
    for occ in sorted(by_occ, key=lambda o: min(g.injected_at for g in by_occ[o])):
        gts = by_occ[occ]
        kinds: set[str] = set()
        for g in gts:
            kinds |= _ALSO.get(g.type, frozenset()) | {g.expected_kind}
        ranks = frozenset(r for g in gts for r in (g.expected_ranks or (g.rank,)))
        resources = frozenset(x for g in gts for x in g.expected_resources)
        occs.append((occ, gts, min(g.injected_at for g in gts), ranks, resources, frozenset(kinds)))
    # Each verdict goes to the one injection before it (within the window) that it explains best:
    # one it localizes with the expected kind, else one it localizes, else the newest. (Faults
    # overlap: a delay may begin while the SDC of the step before is being found.)
    mine: dict[int, list[tuple[int, Verdict, int]]] = {n: [] for n in range(len(occs))}
    for i, v in enumerate(found):
        best: tuple[int, float, int] | None = None
        for n, (_, _, at, who, where, want) in enumerate(occs):
            if not at <= v.time <= at + window_s:
                continue
            fit = int(_localizes(v, who, where)) * (2 if v.kind in want else 1)
            if best is None or (fit, at) > (best[0], best[1]):
                best = (fit, at, n)
        if best is not None:
            mine[best[2]].append((i, v, best[0]))
    used: set[int] = set()
    occurrences: list[dict[str, Any]] = []
    for n, (occ, gts, at, who, where, want) in enumerate(occs):
        got = sorted(mine[n], key=lambda x: (-x[2], x[1].time))
        pick = got[0] if got else None
        used.update(i for i, _, fit in got if fit)
        occurrences.append(
            {
                "occurrence_id": occ,
                "incident_id": gts[0].incident_id,
                "types": sorted({g.type for g in gts}),
                "expected_ranks": sorted(who),
                "expected_resources": sorted(where),
                "expected_kinds": sorted(want),
                "injected_at": at,
                "detected": bool(got),
                "localized": any(fit for _, _, fit in got),
                "kind_match": any(fit == 2 for _, _, fit in got),
                "reported_kind": pick[1].kind if pick else None,
                "reported_ranks": list(pick[1].failed_ranks) if pick else None,
                "detection_latency_s": round(pick[1].time - at, 3) if pick else None,
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
