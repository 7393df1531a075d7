"""Failure kinds and which checkpoint each may recover from (pure).

A fault that may have corrupted state silently (SDC, stale state, a corrupted payload) must resume
from a recovery-verified capture; a fault that stopped the job without touching its numbers (a crash,
a hang, a lost node) may resume from the latest capture.
"""

from __future__ import annotations

__all__ = [
    "CANONICAL_TYPES",
    "CLOSED",
    "CYCLE_ACTIONS",
    "EXIT_FAILURES",
    "FAILURE_KINDS",
    "VERIFIED_KINDS",
    "classify_exit",
    "default_recovery_mode",
    "kind_of",
]

FAILURE_KINDS = frozenset(
    {
        "sdc",
        "straggler",
        "hang",
        "data_stall",
        "checkpoint_stall",
        "process_failure",
        "node_lost",
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

# The 21 canonical failure types (FAILURES.md: campaign ids) as the kind that catches each. A drop,
# duplicate or reorder of a tensor changes the numbers as a corruption does; a damaged or missing
# checkpoint copy, or a failing disk, leaves the job's numbers alone (the copy is skipped), as a
# checkpoint stall does; a message drop is the silence of one endpoint, as a partition's.
CANONICAL_TYPES: dict[str, str] = {
    "hang": "hang",
    "tensor_corruption": "sdc",
    "stale_state": "stale_state",
    "drop": "sdc",
    "duplicate": "sdc",
    "reorder": "sdc",
    "delay": "straggler",
    "timeout": "hang",
    "exception": "process_failure",
    "resource_exhaustion": "process_failure",
    "process_termination": "process_failure",
    "resource_unavailable": "hardware",
    "checkpoint_corruption": "checkpoint_stall",
    "checkpoint_truncation": "checkpoint_stall",
    "checkpoint_missing": "checkpoint_stall",
    "io_error": "checkpoint_stall",
    "payload_corruption": "payload_corruption",
    "collective_desync": "collective_desync",
    "message_drop": "network_partition",
    "network_partition": "network_partition",
    "config_drift": "config_drift",
}


# The recovery action each canonical type ends in (FAILURES.md): "replace" quarantines the node and
# a standby takes its slot; every other type restarts on the same nodes.
CYCLE_ACTIONS: dict[str, str] = {
    t: "replace"
    if t in ("tensor_corruption", "resource_unavailable", "collective_desync", "network_partition")
    else "restart"
    for t in CANONICAL_TYPES
}


def kind_of(failure: str) -> str | None:
    """The failure kind of `failure`: a kind itself, or one of the 21 canonical types; else None."""
    return failure if failure in FAILURE_KINDS else CANONICAL_TYPES.get(failure)


def default_recovery_mode(failure_kind: str) -> str:
    """ "recovery_verified" when the fault may have corrupted state silently, else "latest"."""
    return "recovery_verified" if failure_kind in VERIFIED_KINDS else "latest"


# The reason in the goodbye of a session its script closed (`close()`, or at interpreter exit).
CLOSED = "close"

# How a worker's uncaught exception ended it (the reason code of its own process_failure report).
# Not failures of the rank: `collective_error` (a collective failed under it, most often because a
# peer died first: a casualty, the others name the culprit) and `interrupted` (KeyboardInterrupt:
# someone stopped the job on purpose).
EXIT_FAILURES = frozenset({"uncaught_exception", "resource_exhaustion"})

_RESOURCE_TYPES = frozenset({"MemoryError", "OutOfMemoryError"})
_RESOURCE_ERRNOS = frozenset({12, 23, 24, 28})  # ENOMEM, ENFILE, EMFILE, ENOSPC
_RESOURCE_TEXT = (
    "out of memory",
    "not enough memory",
    "can't allocate memory",
    "cannot allocate memory",
    "too many open files",
    "no space left on device",
)
_COLLECTIVE_TYPES = frozenset({"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"})
_COLLECTIVE_TEXT = (
    "gloo",
    "nccl",
    "processgroup",
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
)


def classify_exit(exc: BaseException) -> str:
    """The reason code of an uncaught exception: resource_exhaustion (memory, file descriptors,
    disk), collective_error (a collective failed under the rank), interrupted (KeyboardInterrupt),
    else uncaught_exception. Judged from type names and text only, so any framework's errors work."""
    names = {t.__name__ for t in type(exc).__mro__}
    text = str(exc).lower()
    if names & _RESOURCE_TYPES or getattr(exc, "errno", None) in _RESOURCE_ERRNOS:
        return "resource_exhaustion"
    if any(t in text for t in _RESOURCE_TEXT):
        return "resource_exhaustion"
    if names & _COLLECTIVE_TYPES or any(t in text for t in _COLLECTIVE_TEXT):
        return "collective_error"
    if "KeyboardInterrupt" in names:
        return "interrupted"
    return "uncaught_exception"
