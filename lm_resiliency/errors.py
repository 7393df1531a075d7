"""One error tree for the library.

Local faults (our own misuse or misconfiguration) are kept apart from peer faults (something another
process sent or did), so a caller can tell "fix your config" from "a peer misbehaved".
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "CheckpointMismatchError",
    "CodecError",
    "ConfigError",
    "DiscoveryError",
    "PeerFault",
    "ResiliencyError",
    "RuntimeClosedError",
    "SharedMemoryError",
    "UnsupportedFrameworkError",
]


class ResiliencyError(Exception):
    """Base class of every error raised by lm-resiliency."""


class ConfigError(ResiliencyError, ValueError):
    """A setting is missing, unknown or of the wrong type; the message names the key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class UnsupportedFrameworkError(ResiliencyError, NotImplementedError):
    """The framework was recognised but this version ships no adapter for it."""


class RuntimeClosedError(ResiliencyError, RuntimeError):
    """The runtime thread was used after `close()`."""


class DiscoveryError(ResiliencyError, RuntimeError):
    """Peers could not be found through the job's store."""


class CheckpointMismatchError(ResiliencyError, ValueError):
    """A checkpoint does not fit the live model (other names, shapes or dtypes): nothing was loaded."""


class SharedMemoryError(ResiliencyError, OSError):
    """Shared memory could not be created or mapped (for example, /dev/shm is too small)."""


class PeerFault(ResiliencyError):
    """Something a peer sent or did is wrong. Never fatal to a healthy rank."""


class CodecError(PeerFault, ValueError):
    """A wire payload is malformed: unknown type, bad schema version, wrong fields or frames."""


class AuthError(PeerFault):
    """A message failed authentication (wrong key, tampered, or replayed)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
