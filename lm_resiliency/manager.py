"""For users who run their own controller: read the backend's decisions and incidents, publish a plan.

    from lm_resiliency.manager import RunManager
    m = RunManager("head-node:29500", "my-run")
    m.state()["generation"], m.decisions()[-1], m.incidents()
    m.inventories()[0]["local"], m.heartbeats()          # what `lm-resiliency monitor` shows
    m.publish_plan("replace", culprits=["node-7"], failure_kind="hardware", reason="ecc_storm")

A published plan goes through the same state machine as the leader's own decisions: it starts a
restart of the current generation (every agent stops its workers and re-enters the rendezvous);
`replace` also quarantines the culprits so standbys take their slots. The leader still forms the
next generation and picks the step.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from lm_resiliency.core.rendezvous import state as rs

__all__ = ["RunManager"]


class RunManager:
    def __init__(self, endpoint: str, run_id: str, store_type: str = "tcp", timeout_s: float = 30.0) -> None:
        from typing import Any as _Store

        import torch.distributed as dist

        from lm_resiliency.adapters.torchrun import _Control

        store: _Store
        if store_type == "file":
            import os

            if not os.path.isfile(endpoint):  # (a FileStore would create it: an empty store)
                raise LookupError(f"no control store file at {endpoint}")
            store = dist.FileStore(endpoint, -1)  # type: ignore[attr-defined]
        elif store_type == "tcp":
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"endpoint {endpoint!r}: expected HOST:PORT")
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
            )
        else:
            raise ValueError(f"store_type {store_type!r}: expected tcp or file")
        self._control = _Control(store, run_id)
        self.run_id = run_id

    def _state(self) -> rs.RdzvState:
        got = self._control.read()
        if got is None:
            raise LookupError(f"no rendezvous state for run {self.run_id!r} in this store")
        return got[1]

    def read(self) -> rs.RdzvState:
        """The rendezvous document, read once: pass it to the methods below for one consistent
        view (each reads it again otherwise)."""
        return self._state()

    def state(self, at: rs.RdzvState | None = None) -> dict[str, Any]:
        """The whole rendezvous document (JSON-ready)."""
        s = at or self._state()
        doc = dataclasses.asdict(s)
        doc["nodes"] = {n: dataclasses.asdict(i) for n, i in s.nodes.items()}
        return doc

    def decisions(self, at: rs.RdzvState | None = None) -> list[dict[str, Any]]:
        """One entry per published generation: slots, admitted standbys, failure kind, culprits."""
        s = at or self._state()
        out = [dict(h) for h in s.history]
        if out:
            out[-1]["plan"] = dict(s.plan)
        return out

    def incidents(self, at: rs.RdzvState | None = None) -> list[dict[str, Any]]:
        """SCOUT verdicts the workers posted in the current generation, and the restart under way."""
        s = at or self._state()
        out: list[dict[str, Any]] = []
        n = int(self._control.store.add(self._control.key(f"verdicts/g{s.generation}/n"), 0))
        for i in range(n):
            v = self._control.json_get(f"verdicts/g{s.generation}/{i}")
            if isinstance(v, dict):
                out.append({"generation": s.generation, "source": "scout", **v})
        if s.phase == rs.RESTARTING:
            out.append({"generation": s.generation, "source": "backend", **dict(s.pending)})
        return out

    def heartbeats(self, at: rs.RdzvState | None = None) -> dict[str, int]:
        """Each registered node's agent heartbeat counter: it moves while the agent lives."""
        s = at or self._state()
        return {n: int(self._control.store.add(self._control.key(f"hb/{n}"), 0)) for n in sorted(s.nodes)}

    def inventories(self, at: rs.RdzvState | None = None) -> dict[int, dict[str, Any]]:
        """Each rank's newest GEMINI inventory (rank -> {"local", "replicas", "disk", "certified",
        "generation", ...}): the steps it holds in memory, of other ranks, on disk. Ranks that
        posted none yet are missing."""
        s = at or self._state()
        out: dict[int, dict[str, Any]] = {}
        for r in range(s.world_size()):
            inv = self._control.json_get(f"inv/{r}")
            if isinstance(inv, dict):
                out[r] = inv
        return out

    def publish_plan(
        self,
        action: str,
        culprits: list[str] | tuple[str, ...] = (),
        failure_kind: str = "operator",
        reason: str = "operator_plan",
    ) -> dict[str, Any]:
        """Restart the current generation in place, or `replace`: quarantine `culprits`, admit standbys."""
        if action not in ("restart", "replace"):
            raise ValueError(f"action {action!r}: expected 'restart' or 'replace'")
        s = self._state()
        unknown = [c for c in culprits if c not in s.nodes]
        if unknown:
            raise ValueError(f"unknown nodes {unknown} (known: {sorted(s.nodes)})")
        if action == "replace" and not culprits:
            raise ValueError("a replace plan names the nodes to replace (culprits=...)")
        gen = s.generation
        new = self._control.update(
            lambda cur: rs.request_restart(cur, gen, failure_kind, reason, culprits, action == "replace")
        )
        return {
            "generation": gen,
            "phase": new.phase,
            "pending": dict(new.pending),
            "excluded": dict(new.excluded),
        }
