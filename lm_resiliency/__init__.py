"""lm-resiliency: keep distributed LLM pre-training alive.

from lm_resiliency import enable_resiliency
session = enable_resiliency(model, optimizer, interval=10)
"""

from lm_resiliency._version import __version__
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
]
