"""Real torchrun (c10d, `--max-restarts`): a worker dies, torchrun restarts the group, and the
session resumes from shared memory, bitwise equal to an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _torchrun(processes, tmp: Path, name: str, extra: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    env = {
        # torch 2.13's shared rendezvous store hands dead peers' addresses to the restarted gloo group
        # (pytorch#135712); with sharing off, restarts are clean.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "LM_RESILIENCY_SHM_DIR": str(tmp / "shm"),
        "OUT": str(tmp / f"{name}.pt"),
        **extra,
    }
    proc = processes.start(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.2",
            "tests/integration/workers/torchrun_train.py",
        ],
        env,
        tmp / f"{name}.log",
    )
    assert proc.wait(timeout=200) == 0, (tmp / f"{name}.log").read_text()[-4000:]


def test_worker_crash_under_torchrun_resumes_from_memory_bitwise(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _torchrun(processes, tmp_path, "baseline", {})
    _torchrun(processes, tmp_path, "crashed", {"CRASH": "1"})
    log = (tmp_path / "crashed.log").read_text()
    assert "attempt 1 starts at step 12 (recovered 12)" in log, log[-3000:]
    a, b = torch.load(tmp_path / "baseline.pt"), torch.load(tmp_path / "crashed.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
