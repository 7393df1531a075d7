"""Public test kit: clocks, in-memory transport, transport contract suite.

Users can test their own integrations with these; our own tests use them too.
"""

from lm_resiliency.core.clock import ManualClock
from lm_resiliency.testing.transport import InMemoryNetwork, InMemoryTransport

__all__ = ["InMemoryNetwork", "InMemoryTransport", "ManualClock"]
