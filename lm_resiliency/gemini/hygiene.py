"""Shared-memory hygiene: what GEMINI holds in /dev/shm, and reclaiming runs that are over.

Layout: `<shm_dir>/<run_id>/<node_id>/{own-r<R>-s<K>, replica-r<O>-h<H>-s<K>, .owner-r<R>}`. Each rank
writes `.owner-r<R>` with its pid. A run directory is reclaimable when no owner process is alive on
this host and nothing in it changed for `stale_after_s` (a crashed job's copies must survive until
its restart, so recent ones are kept).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from lm_resiliency._proc import pid_alive

__all__ = ["RunUsage", "reclaim_stale_runs", "usage", "write_owner"]


@dataclass(frozen=True)
class RunUsage:
    run: str
    node: str
    bytes: int
    files: int
    live_owners: tuple[int, ...]
    idle_s: float


def write_owner(node_dir: Path, rank: int) -> None:
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / f".owner-r{rank}").write_text(str(os.getpid()))


def usage(shm_dir: str | Path, now: float | None = None) -> list[RunUsage]:
    root = Path(shm_dir)
    now = time.time() if now is None else now
    out = []
    for run in sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []:
        for node in sorted(p for p in run.iterdir() if p.is_dir()):
            files = [p for p in node.iterdir() if p.is_file()]
            owners = []
            for f in files:
                if f.name.startswith(".owner-r"):
                    try:
                        pid = int(f.read_text().strip() or "0")
                    except (OSError, ValueError):
                        continue
                    if pid > 0 and pid_alive(pid):
                        owners.append(pid)
            newest = max((f.stat().st_mtime for f in files), default=node.stat().st_mtime)
            out.append(
                RunUsage(
                    run.name,
                    node.name,
                    sum(f.stat().st_size for f in files),
                    len(files),
                    tuple(sorted(owners)),
                    max(0.0, now - newest),
                )
            )
    return out


def reclaim_stale_runs(
    shm_dir: str | Path, stale_after_s: float, keep_run: str | None = None
) -> list[RunUsage]:
    """Delete node directories with no live owner and no change for `stale_after_s`; return them."""
    reclaimed = []
    for u in usage(shm_dir):
        if u.run == keep_run or u.live_owners or u.idle_s < stale_after_s:
            continue
        shutil.rmtree(Path(shm_dir) / u.run / u.node, ignore_errors=True)
        reclaimed.append(u)
        run_dir = Path(shm_dir) / u.run
        if run_dir.exists() and not any(run_dir.iterdir()):
            run_dir.rmdir()
    return reclaimed
