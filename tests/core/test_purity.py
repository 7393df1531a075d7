"""The core stays pure: importing it pulls in no zmq, torch, asyncio, threads or anyio."""

from __future__ import annotations

import subprocess
import sys

import pytest

FORBIDDEN = ("zmq", "torch", "asyncio", "anyio", "threading", "socket", "pynvml")


@pytest.mark.timeout(60)
def test_core_imports_nothing_impure() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import lm_resiliency.core.codec, lm_resiliency.core.auth, lm_resiliency.core.membership\n"
        "import lm_resiliency.core.topology, lm_resiliency.core.clock, lm_resiliency.core.taxonomy\n"
        "import lm_resiliency.core\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    loaded_roots = {m.split(".")[0] for m in out}
    bad = sorted(loaded_roots & set(FORBIDDEN))
    assert not bad, f"lm_resiliency.core pulled in {bad}"


@pytest.mark.timeout(60)
def test_core_sources_read_no_clock_or_environment() -> None:
    from pathlib import Path

    import lm_resiliency.core as core

    for path in Path(core.__file__).parent.rglob("*.py"):
        text = path.read_text()
        for needle in ("time.time(", "time.monotonic(", "os.environ", "getenv(", "import threading"):
            assert needle not in text, f"{path.name} uses {needle}"
