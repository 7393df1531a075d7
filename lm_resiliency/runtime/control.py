"""A worker's line to the torchrun backend's control store (`LM_RESILIENCY_CONTROL_STORE`).

Workers publish what the leader needs to decide the next generation: each rank's GEMINI inventory
(which steps it can restore, for itself and for others, and which are recovery-verified) and the
SCOUT verdicts that call for a restart or a replacement. Failures here are logged and never stop
training: the backend then falls back to the workers' own agreement.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from typing import Any

__all__ = ["ControlChannel"]

log = logging.getLogger(__name__)


class ControlChannel:
    def __init__(self, address: str, run_id: str, timeout_s: float = 10.0) -> None:
        scheme, sep, rest = address.partition("://")
        if not sep or scheme not in ("tcp", "file") or not rest:
            raise ValueError(
                f"LM_RESILIENCY_CONTROL_STORE={address!r}: expected tcp://HOST:PORT or file://PATH"
            )
        self.scheme, self.where, self.prefix = scheme, rest, f"lmr/{run_id}/"
        self.timeout = timedelta(seconds=timeout_s)
        self._store: Any = None
        self._lock = threading.Lock()
        self._broken = False

    def _connect(self) -> Any:
        if self._store is None:
            import torch.distributed as dist

            if self.scheme == "file":
                self._store = dist.FileStore(self.where, -1)  # type: ignore[attr-defined]
            else:
                host, _, port = self.where.rpartition(":")
                self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, int(port), is_master=False, wait_for_workers=False, timeout=self.timeout
                )
        return self._store

    def _do(self, what: str, fn: Any) -> Any:
        with self._lock:
            try:
                return fn(self._connect())
            except Exception as exc:
                if not self._broken:
                    log.warning("control store: %s failed: %s", what, exc)
                self._broken = True
                self._store = None
                return None

    def publish_inventory(self, rank: int, doc: dict[str, Any]) -> None:
        raw = json.dumps(doc, sort_keys=True)
        self._do("publishing the inventory", lambda s: s.set(f"{self.prefix}inv/{rank}", raw))

    def post_verdict(self, generation: int, report: dict[str, Any]) -> None:
        raw = json.dumps(report, sort_keys=True, default=str)

        def post(s: Any) -> None:
            i = int(s.add(f"{self.prefix}verdicts/g{generation}/n", 1)) - 1
            s.set(f"{self.prefix}verdicts/g{generation}/{i}", raw)

        self._do("posting a verdict", post)

    def close(self) -> None:
        with self._lock:
            self._store = None
