"""The control store of a torchrun run, served by a small detached process.

`python -m lm_resiliency.runtime.store_host HOST PORT RUN_ID` serves a TCPStore on HOST:PORT. The
first agent that finds no store starts it in a session of its own, so it outlives any one agent (the
leader's agent may die; the store must not). It exits by itself: a few seconds after the run closed,
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
                time.sleep(args.grace_s)  # let every agent read the verdict
                return 0
            total = sum(int(store.add(f"{prefix}hb/{n}", 0)) for n in doc.get("nodes", {}))
            if total != last_total:
                last_total, last_change = total, now
        if now - last_change > args.idle_s:
            return 0


if __name__ == "__main__":
    sys.exit(main())
