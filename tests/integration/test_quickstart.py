from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_quickstart_trains_is_killed_resumes_bitwise() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lm_resiliency.cli.quickstart", "--steps", "8", "--kill-at", "5"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["killed_exit_code"] == -9 and summary["resumed_at_step"] == 5
    assert summary["bitwise_equal_to_uninterrupted"] and summary["batches_seen_by_resumed_run"] == 8
    assert summary["recovery_decision"]["checkpoint_source"] == "gemini"
