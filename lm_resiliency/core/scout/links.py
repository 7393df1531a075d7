"""Slow communication endpoints from link probes (pure; no clock).

A synchronous collective runs at the pace of its slowest link, so every rank waits the same and phase
times cannot say where the slowness is. Link probes can: each rank times a fixed-size transfer to
peers on other nodes and gossips the times. A slow endpoint (a node's NIC or link, or one rank's) is
slow from every side, so:

- each observer compares a target with its own median over all targets it probed (a slow observer,
  which sees everyone slow, accuses nobody);
- a target is slow when a strict majority of its observers on other nodes see it more than `ratio`
  times their median and more than `min_s` above it;
- over `confirmations` consecutive probe rounds (`LinkDetector`).

When every observed rank of a node is slow the node is the endpoint, otherwise the rank. Two nodes
alone cannot tell which end of the one link between them is slow (each sees only the other): that
takes three or more nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lm_resiliency.core.scout.verdicts import Verdict, _median

__all__ = ["LinkDetector", "SlowEndpoint", "slow_endpoints"]


@dataclass(frozen=True)
class SlowEndpoint:
    kind: str  # "node" | "rank"
    id: str  # the node id, or the rank as a string
    ranks: tuple[int, ...]
    accusers: tuple[int, ...]
    ratio: float  # how many times the observers' median a probe to it took (the smallest accuser's)


def slow_endpoints(
    probes: Mapping[int, Mapping[int, float]], node_of: Mapping[int, str], ratio: float, min_s: float
) -> list[SlowEndpoint]:
    """`probes[observer][target]`: seconds a probe took. Returns the slow endpoints, sorted."""
    accused: dict[int, list[tuple[int, float]]] = {}
    observers_of: dict[int, set[int]] = {}
    for o, row in probes.items():
        times = {t: s for t, s in row.items() if t != o and node_of.get(t) != node_of.get(o)}
        if len(times) < 2:
            continue  # one target: nothing to compare it with
        for t in times:
            observers_of.setdefault(t, set()).add(o)
        for t, s in times.items():
            base = _median([v for q, v in times.items() if q != t])
            if s > ratio * base and s - base > min_s:
                accused.setdefault(t, []).append((o, s / base if base > 0 else float("inf")))
    slow = {
        t: acc
        for t, acc in accused.items()
        if len(acc) * 2 > len(observers_of.get(t, ())) and len(observers_of.get(t, ())) >= 2
    }
    out: list[SlowEndpoint] = []
    by_node: dict[str, list[int]] = {}
    for t in slow:
        by_node.setdefault(node_of.get(t, f"rank{t}"), []).append(t)
    for node, ranks in sorted(by_node.items()):
        observed = sorted(t for t in observers_of if node_of.get(t, f"rank{t}") == node)
        accusers = tuple(sorted({o for t in ranks for o, _ in slow[t]}))
        least = min(x for t in ranks for _, x in slow[t])
        if sorted(ranks) == observed and len(observed) > 0:
            out.append(SlowEndpoint("node", node, tuple(sorted(ranks)), accusers, least))
        else:
            out.extend(
                SlowEndpoint(
                    "rank", str(t), (t,), tuple(sorted(o for o, _ in slow[t])), min(x for _, x in slow[t])
                )
                for t in sorted(ranks)
            )
    return out


class LinkDetector:
    """Confirms slow endpoints over consecutive probe rounds; reports each once until it recovers."""

    def __init__(self, ratio: float, min_s: float, confirmations: int) -> None:
        self.ratio, self.min_s, self.confirmations = ratio, min_s, confirmations
        self._streak: dict[tuple[str, str], int] = {}
        self._reported: set[tuple[str, str]] = set()

    def observe(
        self, step: int, probes: Mapping[int, Mapping[int, float]], node_of: Mapping[int, str]
    ) -> list[Verdict]:
        found = {(e.kind, e.id): e for e in slow_endpoints(probes, node_of, self.ratio, self.min_s)}
        for key in list(self._streak):
            if key not in found:
                del self._streak[key]
                self._reported.discard(key)
        out = []
        for key, e in sorted(found.items()):
            self._streak[key] = self._streak.get(key, 0) + 1
            if self._streak[key] >= self.confirmations and key not in self._reported:
                self._reported.add(key)
                out.append(
                    Verdict(
                        "straggler",
                        e.ranks,
                        step,
                        f"slow_{e.kind}_link",
                        f"{e.kind} {e.id}: probes to it took {e.ratio:.1f}x the median of the others "
                        f"as seen by ranks {list(e.accusers)}, {self._streak[key]} rounds in a row",
                        straggler_type="communication",
                        confirmations=self._streak[key],
                        endpoint=f"{e.kind}:{e.id}",
                    )
                )
        return out
