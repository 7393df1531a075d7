"""Gradients reduced in the canonical layout are bitwise the same whatever DDP's bucket layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.timeout(180)

WORLD = 3  # with three addends the order of a sum changes its rounding


def test_gradients_do_not_depend_on_ddp_buckets(processes, tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        processes.start(
            ["tests/integration/workers/canonical_worker.py"],
            {
                "RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "STORE_PORT": str(store.port),
                "RESULT_DIR": str(tmp_path),
                "STEPS": "4",
            },
            tmp_path / f"rank{r}.log",
        )
        for r in range(WORLD)
    ]
    for r, p in enumerate(procs):
        assert p.wait(timeout=150) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for res in results:
        # A fresh DDP (initial layout: one bucket, staged into the canonical groups) against one
        # that rebuilt its buckets (the canonical groups themselves, reduced in place).
        assert res["equal"] == [True] * 4, res
        assert res["warm_paths"][0] > 0, res
        assert all(staged > 0 for _, staged in res["fresh_paths"]), res
        # The fresh DDP hands the whole model over as one bucket: staged a bounded part at a time.
        assert 0 < res["fresh_peak_staging"] < res["grad_bytes"], res
        # Without it the two layouts round differently: what a resumed run would have diverged by.
        assert not all(res["plain_equal"][1:]), res
        # DDP's other modes: unused parameters, static graph, gradients as bucket views, gradient
        # accumulation (no_sync), buckets of two dtypes: still bitwise, and the same average as DDP.
        for name, v in res["variants"].items():
            assert v["equal"] == [True] * 4, (name, v)
            assert v["close"] == [True] * 4, (name, v)
