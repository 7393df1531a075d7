"""Worker start-up under the lm_resiliency torchrun backend (loaded through `_boot/sitecustomize.py`).

- Workers die with their agent: a SIGKILLed agent must not leave workers hung in a collective
  (Linux parent-death signal; a worker whose agent is already gone exits at once).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import sys
from pathlib import Path

from lm_resiliency._proc import pid_alive

__all__ = ["boot", "chain_next_sitecustomize", "die_with_agent"]

_PR_SET_PDEATHSIG = 1


def die_with_agent(agent_pid: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1 or not pid_alive(agent_pid):  # the agent died before we asked
        os._exit(1)
    return True


def boot() -> None:
    raw = os.environ.get("LM_RESILIENCY_AGENT_PID", "")
    if raw.isdigit():
        die_with_agent(int(raw))


def chain_next_sitecustomize(ours: str) -> None:
    """Run the `sitecustomize` that ours shadows (the first other one on sys.path)."""
    here = Path(ours).resolve().parent
    for entry in sys.path:
        try:
            folder = Path(entry or ".").resolve()
        except OSError:
            continue
        if folder == here:
            continue
        candidate = folder / "sitecustomize.py"
        if candidate.is_file():
            spec = importlib.util.spec_from_file_location("_lm_resiliency_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return
