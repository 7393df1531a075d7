"""lm-resiliency: keep distributed LLM pre-training alive.

from lm_resiliency import enable_resiliency
session = enable_resiliency(model, optimizer, interval=10)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lm_resiliency._version import __version__

# Exports resolve lazily (PEP 562) so that `import lm_resiliency.core` stays free of torch, zmq and
# asyncio, and `lm_resiliency --version` does not pay for importing torch.
_EXPORTS = {
    "enable_resiliency": "lm_resiliency.api",
    "ResiliencySession": "lm_resiliency.api",
    "Session": "lm_resiliency.api",
    "DurableCheckpointConfig": "lm_resiliency.config",
    "InMemoryCkptConfig": "lm_resiliency.config",
    "OrchestrationHooks": "lm_resiliency.config",
    "RecoveryDecision": "lm_resiliency.config",
    "RecoveryMode": "lm_resiliency.config",
    "ReplayHarnessConfig": "lm_resiliency.config",
    "RuntimeConfig": "lm_resiliency.config",
    "SCOUTFaultReport": "lm_resiliency.config",
    "WorkerPolicy": "lm_resiliency.config",
    "load_policy": "lm_resiliency.config",
    "parse_policy": "lm_resiliency.config",
    "policy_kwargs": "lm_resiliency.config",
    "AuthError": "lm_resiliency.errors",
    "CodecError": "lm_resiliency.errors",
    "ConfigError": "lm_resiliency.errors",
    "DiscoveryError": "lm_resiliency.errors",
    "PeerFault": "lm_resiliency.errors",
    "ResiliencyError": "lm_resiliency.errors",
    "RuntimeClosedError": "lm_resiliency.errors",
    "UnsupportedFrameworkError": "lm_resiliency.errors",
}

if TYPE_CHECKING:
    from lm_resiliency.api import ResiliencySession, Session, enable_resiliency
    from lm_resiliency.config import (
        DurableCheckpointConfig,
        InMemoryCkptConfig,
        OrchestrationHooks,
        RecoveryDecision,
        RecoveryMode,
        ReplayHarnessConfig,
        RuntimeConfig,
        SCOUTFaultReport,
        WorkerPolicy,
        load_policy,
        parse_policy,
        policy_kwargs,
    )
    from lm_resiliency.errors import (
        AuthError,
        CodecError,
        ConfigError,
        DiscoveryError,
        PeerFault,
        ResiliencyError,
        RuntimeClosedError,
        UnsupportedFrameworkError,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lm_resiliency' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AuthError",
    "CodecError",
    "ConfigError",
    "DiscoveryError",
    "DurableCheckpointConfig",
    "InMemoryCkptConfig",
    "OrchestrationHooks",
    "PeerFault",
    "RecoveryDecision",
    "RecoveryMode",
    "ReplayHarnessConfig",
    "ResiliencyError",
    "ResiliencySession",
    "RuntimeClosedError",
    "RuntimeConfig",
    "SCOUTFaultReport",
    "Session",
    "UnsupportedFrameworkError",
    "WorkerPolicy",
    "__version__",
    "enable_resiliency",
    "load_policy",
    "parse_policy",
    "policy_kwargs",
]
