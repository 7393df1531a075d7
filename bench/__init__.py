"""Benchmarks: ours vs a baseline, side by side in one run (see each script's docstring)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_pythonpath() -> str:
    """PYTHONPATH of a benchmark's worker processes: the checkout first, then the caller's own
    (packages installed beside the interpreter's, as `pip install --target` leaves them). Before,
    the workers got the checkout alone and could not import pyzmq where it came that way."""
    return os.pathsep.join([str(ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)])
