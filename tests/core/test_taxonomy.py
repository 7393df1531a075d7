"""How an uncaught exception is classified (pure: type names and text only)."""

from __future__ import annotations

import errno

import pytest

from lm_resiliency.core.taxonomy import EXIT_FAILURES, classify_exit

pytestmark = pytest.mark.timeout(30)


class DistBackendError(RuntimeError):
    """Named like torch.distributed's: classification goes by the type's name, not by importing it."""


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda's."""


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (ValueError("loss is nan"), "uncaught_exception"),
        (RuntimeError("shape mismatch"), "uncaught_exception"),
        (MemoryError(), "resource_exhaustion"),
        (OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "resource_exhaustion"),
        (
            RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 bytes"),
            "resource_exhaustion",
        ),
        (OSError(errno.EMFILE, "Too many open files"), "resource_exhaustion"),
        (OSError(errno.ENOSPC, "No space left on device"), "resource_exhaustion"),
        (OSError(errno.ENOENT, "No such file or directory"), "uncaught_exception"),
        (DistBackendError("NCCL communicator was aborted"), "collective_error"),
        (
            RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"),
            "collective_error",
        ),
        (KeyboardInterrupt(), "interrupted"),
    ],
)
def test_uncaught_exceptions_are_classified(exc: BaseException, reason: str) -> None:
    assert classify_exit(exc) == reason


def test_only_the_rank_own_failures_accuse_it() -> None:
    assert {"uncaught_exception", "resource_exhaustion"} == EXIT_FAILURES  # not casualties, not Ctrl-C


def test_every_failure_kind_the_backend_plans_has_a_recovery_mode() -> None:
    """A restart context's failure_kind goes to `session.prepare_recovery` as it is."""
    from lm_resiliency.config import FAILURE_ACTIONS
    from lm_resiliency.core.taxonomy import FAILURE_KINDS, default_recovery_mode

    assert set(FAILURE_ACTIONS) <= FAILURE_KINDS
    assert default_recovery_mode("node_lost") == "latest"
    assert default_recovery_mode("sdc") == "recovery_verified"


def test_the_21_canonical_failure_types_are_recovered_as_the_kind_that_catches_them() -> None:
    from lm_resiliency.core.taxonomy import CANONICAL_TYPES, FAILURE_KINDS, default_recovery_mode, kind_of

    assert len(CANONICAL_TYPES) == 21 and set(CANONICAL_TYPES.values()) <= FAILURE_KINDS
    assert all(kind_of(k) == k for k in FAILURE_KINDS)  # a kind stays itself
    verified = {t for t in CANONICAL_TYPES if default_recovery_mode(kind_of(t) or "") == "recovery_verified"}
    # What may have changed the numbers silently resumes from a verified step; the rest from the latest.
    assert verified == {
        "tensor_corruption", "stale_state", "drop", "duplicate", "reorder",
        "payload_corruption", "collective_desync",
    }  # fmt: skip
    assert kind_of("checkpoint_missing") == "checkpoint_stall" and kind_of("nonsense") is None
