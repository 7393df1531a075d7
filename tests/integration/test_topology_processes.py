"""Replica groups read from real DDP, FSDP2, HSDP and FSDP+TP models on 4 gloo processes, and the
DDP comm hook checked bitwise against a plain average in the canonical layout on a 3-rank group."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_replica_groups_and_bitwise_comm_hook(processes, tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        processes.start(
            ["tests/integration/workers/topology_worker.py"],
            {"RANK": str(r), "WORLD_SIZE": "4", "STORE_PORT": str(store.port), "RESULT_DIR": str(tmp_path)},
            tmp_path / f"rank{r}.log",
        )
        for r in range(4)
    ]
    deadline = time.monotonic() + 150
    for r, p in enumerate(procs):
        rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert rc == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, out in enumerate(res):
        assert out["ddp"] == [0, 1, 2, 3]
        assert out["inner_ddps"] == [0, 1, 2, 3]  # DDPs inside a container: not a lone rank
        assert out["inner_loose"] == [r]  # ...unless trainable parameters outside them may differ
        assert out["fsdp2"] == [r]  # shards differ: no replica
        assert out["hsdp"] == ([0, 2] if r % 2 == 0 else [1, 3])
        assert out["hsdp_replicated"] == ["dp_replicate"]
        assert out["hsdp_dims"]["dp_shard"] == ([0, 1] if r < 2 else [2, 3])
        assert out["fsdp_tp"] == [r]
        # Every rank of the mesh does the same work: peers for step times, stalls and hangs.
        assert out["fsdp2_peers"] == out["hsdp_peers"] == out["fsdp_tp_peers"] == [0, 1, 2, 3]
        # Parameters on a 1-D slice and on the 2-D mesh: peers over both dims (before: the slice's).
        assert out["mixed_tp"] == [r]
        assert out["mixed_tp_peers"] == [0, 1, 2, 3]
        assert out["stage_peers"] == ([0, 1] if r < 2 else [2, 3])
        assert out["override"] == [r]
        if r < 3:
            assert out["bitwise_equal"], "the session's DDP comm hook changed the training numerics"
            assert out["comm_measured"]
            assert out["container_bitwise_equal"], "an inner DDP did not reduce in the canonical layout"
        assert out["session_steps"] == 5
        assert out["session_groups"] == out["container_groups"] == [[0, 1, 2], [3]]
        assert out["drift_error"] == (
            "settings: ranks started with different lm-resiliency settings (every rank must pass the same): "
            "interval: ranks [0, 1, 2] have 10, ranks [3] have 5"
        ), out["drift_error"]
        [drift] = out["drift_reports"]
        assert drift["kind"] == "config_drift" and drift["failed_ranks"] == [3], drift
        assert drift["reason"] == "settings_mismatch", drift
