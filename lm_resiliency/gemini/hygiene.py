"""Shared-memory hygiene: what GEMINI holds in /dev/shm, and reclaiming runs that are over.

Layout: `<shm_dir>/<run_id>/<node_id>/{own-r<R>-s<K>, replica-r<O>-h<H>-s<K>, .owner-r<R>}`. Each rank
writes `.owner-r<R>` with its pid. A run directory is reclaimable when no owner process is alive on
this host and nothing in it changed for `stale_after_s` (a crashed job's copies must survive until
its restart, so recent ones are kept).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from lm_resiliency._proc import pid_alive

__all__ = [
    "RunUsage",
    "held_first_rank",
    "owner_pid",
    "reclaim_node",
    "reclaim_stale_runs",
    "usage",
    "write_owner",
]


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
    # Other processes create and delete files here while we look (a fresh run's ranks drop their
    # old slots, a peer reclaims a stale run): whatever vanishes mid-scan is simply not counted.
    for run in _dirs(root):
        for node in _dirs(run):
            try:
                node_mtime = node.stat().st_mtime
                entries = list(node.iterdir())
            except FileNotFoundError:
                continue
            stats = {}
            for f in entries:
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    stats[f] = st
            owners = []
            for f in stats:
                if f.name.startswith(".owner-r"):
                    pid = owner_pid(f)
                    if pid > 0 and pid_alive(pid):
                        owners.append(pid)
            newest = max((st.st_mtime for st in stats.values()), default=node_mtime)
            out.append(
                RunUsage(
                    run.name,
                    node.name,
                    sum(st.st_size for st in stats.values()),
                    len(stats),
                    tuple(sorted(owners)),
                    max(0.0, now - newest),
                )
            )
    return out


def _dirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def owner_pid(path: Path) -> int:
    """The pid an owner file names (0 when it is gone or unreadable)."""
    try:
        return int(path.read_text().strip() or "0")
    except (OSError, ValueError):
        return 0


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
        with contextlib.suppress(OSError):  # not empty, or another process removed it first
            (Path(shm_dir) / u.run).rmdir()
    return reclaimed


def reclaim_node(shm_dir: str | Path, run: str, node: str) -> int:
    """Delete one node's directory of a run that is over (its bytes; 0 when it is absent or a live
    process still owns it), and the run's directory once no node's is left in it."""
    node_dir = Path(shm_dir) / run / node
    got = [u for u in usage(shm_dir) if u.run == run and u.node == node]
    if not got or got[0].live_owners:
        return 0
    shutil.rmtree(node_dir, ignore_errors=True)
    with contextlib.suppress(OSError):  # other nodes' directories are still there
        node_dir.parent.rmdir()
    return got[0].bytes


def held_first_rank(shm_dir: str | Path, run: str, node: str) -> int:
    """The lowest rank whose own slots of `run` are in this node's directory (the node trained
    those ranks), or -1 when it holds none."""
    ranks = []
    with contextlib.suppress(OSError):
        for f in (Path(shm_dir) / run / node).iterdir():
            m = re.fullmatch(r"own-r(\d+)-s[01]", f.name)
            if m:
                ranks.append(int(m.group(1)))
    return min(ranks, default=-1)
