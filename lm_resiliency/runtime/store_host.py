"""The control store of a torchrun run, served by a small detached process.

`python -m lm_resiliency.runtime.store_host HOST PORT RUN_ID` serves a TCPStore on HOST:PORT. The
first agent that finds no store starts it in a session of its own, so it outlives any one agent (the
leader's agent may die; the store must not). It exits by itself: once the run closed and every node
still in it has let go of its node id (its agent's exit), or `--grace-s` after the close at most;
or when no agent's heartbeat counter has moved for `--idle-s` (every agent is gone). If the port is
taken (another agent already started one), it exits at once with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lm_resiliency.runtime.store_host")
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("run_id")
    ap.add_argument("--idle-s", type=float, default=120.0)
    ap.add_argument("--grace-s", type=float, default=5.0)
    args = ap.parse_args(argv)
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    try:
        store = TCPStore(
            args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
        )
    except (RuntimeError, OSError):
        return 3  # someone else serves this port
    prefix = f"lmr/{args.run_id}/"
    store.set(prefix + "store_host_pid", str(os.getpid()))
    last_total, last_change = -1, time.monotonic()
    while True:
        time.sleep(0.5)
        now = time.monotonic()
        state_key = prefix + "state"
        if store.check([state_key]):
            try:
                doc = json.loads(store.get(state_key))
            except ValueError:
                doc = {}
            if doc.get("phase") == "closed":
                _until_every_node_left(store, prefix, doc, args.grace_s)
                return 0
            total = sum(int(store.add(f"{prefix}hb/{n}", 0)) for n in doc.get("nodes", {}))
            if total != last_total:
                last_total, last_change = total, now
        if now - last_change > args.idle_s:
            return 0


def _until_every_node_left(store: Any, prefix: str, doc: dict[str, Any], grace_s: float) -> None:
    """The run closed: serve on until every node still in it (a slot's, a standby's, a quarantined
    one's) has let go of its node id, which its agent does last as it exits, at most `grace_s` (an
    agent killed meanwhile never lets go). Before, the host always served `grace_s` more: 5 s of
    every job's end (and of each torchrun test in the suite)."""
    nodes: list[str] = []
    for part in ("slots", "standbys", "excluded"):
        got = doc.get(part) or []
        nodes += [n for n in got if isinstance(n, str) and n]  # (excluded: a mapping's keys)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if all(_let_go(store, f"{prefix}owner/{n}") for n in nodes):
            return
        time.sleep(0.1)


def _let_go(store: Any, key: str) -> bool:
    return not store.check([key]) or bool(store.get(key) == b"")


if __name__ == "__main__":
    sys.exit(main())
