"""Failure kinds and which checkpoint each may recover from (pure).

A fault that may have corrupted state silently (SDC, stale state, a corrupted payload) must resume
from a recovery-verified capture; a fault that stopped the job without touching its numbers (a crash,
a hang, a lost node) may resume from the latest capture.
"""

from __future__ import annotations

__all__ = ["FAILURE_KINDS", "VERIFIED_KINDS", "default_recovery_mode"]

FAILURE_KINDS = frozenset(
    {
        "sdc",
        "straggler",
        "hang",
        "data_stall",
        "checkpoint_stall",
        "process_failure",
        "hardware",
        "collective_desync",
        "network_partition",
        "config_drift",
        "stale_state",
        "payload_corruption",
        "unknown",
    }
)

VERIFIED_KINDS = frozenset({"sdc", "stale_state", "payload_corruption", "collective_desync", "unknown"})


def default_recovery_mode(failure_kind: str) -> str:
    """ "recovery_verified" when the fault may have corrupted state silently, else "latest"."""
    return "recovery_verified" if failure_kind in VERIFIED_KINDS else "latest"
