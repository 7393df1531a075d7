"""Four real processes, a real TCPStore, gloo DDP, each calling enable_resiliency."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lm_resiliency.core import codec
from lm_resiliency.core.auth import Signer
from lm_resiliency.core.messages import Goodbye

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

WORLD = 4
HB_TIMEOUT_S = 1.0


def _wait_keys(store: dist.TCPStore, keys: list[str], procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        dead = [p.args for p in procs if p.poll() not in (None, 0)]
        assert not dead, f"a worker exited early: {dead}"
        assert time.monotonic() < deadline, f"timed out waiting for {keys}"
        time.sleep(0.05)  # polling a store the workers write; no event to wait on from here


def _send_forged_goodbye(store: dist.TCPStore, to_rank: int, claiming: int) -> None:
    """A message signed with a key that is not the job's: must be rejected and counted."""
    import zmq

    tcp = store.get(f"test/router/{to_rank}").decode()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(tcp)
        forged = Signer(b"not-the-job-key!" * 2, claiming, 1).seal(
            codec.encode(Goodbye(claiming, 1, "forged"))
        )
        sock.send_multipart(forged)
        sock.close()
    finally:
        ctx.term()


def test_four_ranks_membership_telemetry_death_and_forgery(processes, tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(WORLD):
        node = 0 if rank < 3 else 1  # rank 3, the one killed, is a node of its own
        node_file = tmp_path / f"machine-id-{node}"
        node_file.write_text(f"synthetic-node-{node}\n")
        procs.append(
            processes.start(
                ["tests/integration/workers/ddp_worker.py"],
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(WORLD),
                    "STORE_PORT": str(store.port),
                    "RESULT_DIR": str(tmp_path),
                    "STEPS": "20",
                    "KILL_RANK": "3",
                    "HB_TIMEOUT_S": str(HB_TIMEOUT_S),
                    "LM_RESILIENCY_MACHINE_ID_PATH": str(node_file),
                },
                tmp_path / f"rank{rank}.log",
            )
        )
    _wait_keys(store, [f"test/trained/{r}" for r in range(WORLD)], procs, timeout=120)
    _send_forged_goodbye(store, to_rank=0, claiming=1)
    procs[3].send_signal(signal.SIGKILL)
    procs[3].wait(timeout=10)
    killed_at = time.time()
    store.set("test/killed/3", b"1")
    for p in procs[:3]:
        assert p.wait(timeout=60) == 0, (tmp_path / "rank0.log").read_text()[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    for r in results:
        assert r["all_live"], r
        assert r["time_to_all_live_s"] < 2.0, r
        assert r["telemetry_late"] == 0, r
        assert r["replica_groups"] == [[0, 1, 2, 3]]
        assert r["nodes"] == ["synthetic-node-0", "synthetic-node-1"]
    assert len({r["topology_digest"] for r in results}) == 1
    assert len({r["final_param_sum"] for r in results}) == 1  # DDP replicas stayed identical
    for r in results[:3]:
        assert r["noticed_death"], r
        assert r["dead_state"] == "dead"
        latency = r["noticed_at_wall"] - killed_at
        assert latency <= HB_TIMEOUT_S + 0.5, f"rank {r['rank']} noticed after {latency:.3f}s"
        # The rank, then its node as a whole (every rank of it went silent).
        assert [(f["failed_ranks"], f["scope"]) for f in r["faults"]] == [([3], "rank"), ([3], "node")]
        assert r["faults"][0]["kind"] == "process_failure"
        assert r["faults"][1]["reason"] == "node_silent" and r["faults"][1]["node"] == "synthetic-node-1"
        # Its process ended on this host (synthetic nodes share it): seen by pid at the next
        # heartbeat tick (0.1 s), not after the heartbeat timeout.
        assert r["faults"][0]["reason"] == "process_exited", r["faults"]
        assert r["faults"][0]["detection_latency_s"] < HB_TIMEOUT_S, r["faults"]
    assert results[0]["forged_rejected"] >= 1
    assert 1 in results[0]["live_after"]  # the forged goodbye was not acted on


@pytest.mark.parametrize("kind", ["complex", "sparse", "own-hook"])
def test_gradients_ddp_hands_over_differently_train_as_plain_ddp_does(
    processes, tmp_path: Path, kind: str
) -> None:  # type: ignore[no-untyped-def]
    """Complex parameters (DDP hands a comm hook real views of their gradients) and an
    Embedding(sparse=True) before dense layers (its gradient reaches the comm hook alone, sparse; SGD's
    momentum for it is sparse optimizer state): training is bitwise what plain DDP computes, both ranks
    agree (every step certified, no verdict) and every step is captured.
    So does a script that registers a comm hook of its own after enable_resiliency (DDP takes one):
    its hook is used. A second one is refused, as plain DDP refuses it; after ours, with a message
    that names lm-resiliency's."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (tmp_path / "machine-id").write_text("kinds-node\n")
    procs = [
        processes.start(
            ["tests/integration/workers/model_kinds_worker.py"],
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "STORE_PORT": str(store.port),
                "RESULT_DIR": str(tmp_path),
                "KIND": kind,
                "LM_RESILIENCY_SHM_DIR": str(tmp_path / "shm"),
                "LM_RESILIENCY_MACHINE_ID_PATH": str(tmp_path / "machine-id"),
            },
            tmp_path / f"rank{rank}.log",
        )
        for rank in range(2)
    ]
    for rank, p in enumerate(procs):
        assert p.wait(timeout=120) == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["equal_to_plain_ddp"] and not rep["faults"], rep
        assert rep["steps"] == 6 and rep["certified"] == [1, 2, 3, 4, 5, 6], rep
        assert rep["captures"] >= 1 and rep["capture_failures"] == 0, rep  # (one may find both slots busy)
        if kind == "own-hook":
            assert rep["hooks"][0] == "fp16_compress_hook", rep  # (DDP lists the refused one too)
            assert "can only be called once" in rep["refused"], rep
        if kind == "sparse":  # ours (canonical dense groups: a resumed run reduces as this one)
            assert rep["hooks"] == ["PyTorchAdapter._register_comm_hook.<locals>.comm_hook"], rep
        if kind == "complex":  # ours, registered at the first forward: the refusal says so
            assert "lm-resiliency registered its own at the model's first forward" in rep["refused"], rep
