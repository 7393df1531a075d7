"""Real processes: a killed member is marked dead within the timeout, and its restart rejoins."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
WORLD = 3


def _await(store: dist.TCPStore, keys: list[str], procs: list, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        bad = [(p.args, p.returncode) for p in procs if p.poll() is not None]
        assert not bad, f"a member exited early: {bad}"
        assert time.monotonic() < deadline, f"timed out waiting for {keys}"
        time.sleep(0.02)  # polling the store these processes write; nothing to block on here


def test_killed_member_dies_and_restarted_member_rejoins(processes, tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def start(rank: int, tag: str):  # type: ignore[no-untyped-def]
        env = {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "STORE_PORT": str(store.port), "WATCH_RANK": "2"}
        return processes.start(["tests/integration/workers/runtime_member.py"], env, tmp_path / f"{tag}.log")

    procs = [start(r, f"r{r}") for r in range(WORLD)]
    _await(store, [f"member/{r}/incarnation1/all_live" for r in range(WORLD)], procs)
    procs[2].send_signal(signal.SIGKILL)
    procs[2].wait(10)
    killed = time.time()
    survivors = procs[:2]
    _await(store, [f"member/{r}/saw_dead" for r in range(2)], survivors)
    for r in range(2):
        latency = float(store.get(f"member/{r}/saw_dead")) - killed
        assert latency <= 0.5 + 0.3, f"rank {r} noticed the death after {latency:.3f}s"
    restarted = start(2, "r2-restarted")
    _await(
        store,
        [f"member/{r}/saw_rejoin" for r in range(2)] + ["member/2/incarnation2/all_live"],
        [*survivors, restarted],
    )
    assert [int(store.get(f"member/{r}/saw_rejoin")) for r in range(2)] == [2, 2]
    store.set("member/done", b"1")
    for p in (*survivors, restarted):
        assert p.wait(30) == 0
