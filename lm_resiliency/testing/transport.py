"""An in-memory twin of `ZmqTransport` for single-process tests and simulations.

Same contract (see `lm_resiliency.testing.contract`): gossip fans out to subscribers, direct messages
reach one connected peer in order, a closed or disconnected peer raises PeerUnavailable. Frames are
copied to `bytes` on the way, as a real wire would. Faults can be injected on the network: drop
everything from an address (`partition`) or let a function rewrite frames in flight (`tamper`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence

from lm_resiliency.runtime.transport import (
    ALL,
    DIRECT,
    GOSSIP,
    Endpoints,
    Incoming,
    PeerUnavailable,
    _check_topic,
)

__all__ = ["InMemoryNetwork", "InMemoryTransport"]

Frame = bytes | memoryview


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class InMemoryNetwork:
    """The medium shared by every InMemoryTransport of one test."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.listeners: dict[str, InMemoryTransport] = {}
        self.partitioned: set[str] = set()  # transports whose outgoing messages are dropped
        self.tamper: Callable[[str, list[bytes]], list[bytes] | None] | None = None

    def new_name(self) -> str:
        return f"mem{next(self._ids)}"

    def partition(self, transport: InMemoryTransport) -> None:
        self.partitioned.add(transport.name)

    def heal(self, transport: InMemoryTransport) -> None:
        self.partitioned.discard(transport.name)

    def deliver(self, sender: InMemoryTransport, address: str, incoming: Incoming) -> None:
        if sender.name in self.partitioned:
            return
        frames = [bytes(f) for f in incoming.frames]
        if self.tamper is not None:
            tampered = self.tamper(sender.name, frames)
            if tampered is None:
                return
            frames = tampered
        target = self.listeners.get(address)
        if target is not None and not target.closed:
            target.put(Incoming(incoming.channel, list(frames)))


class InMemoryTransport:
    """Implements the `Transport` protocol on an `InMemoryNetwork`."""

    def __init__(self, network: InMemoryNetwork) -> None:
        self.network = network
        self.name = network.new_name()
        self.inbox: asyncio.Queue[Incoming] = asyncio.Queue()
        self.closed = False
        self._subscribers: set[str] = set()  # router addresses of those subscribed to our pub
        self.topics: set[bytes] = {ALL}  # gossip topics this transport takes
        self._subscriptions: dict[int, str] = {}  # peer -> its pub address
        self._routes: dict[int, str] = {}  # peer -> its router address
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that receives

    def put(self, incoming: Incoming) -> None:
        """Deliver to this transport's inbox. From another thread's loop (a rank runtime of its own),
        through this one's: an asyncio queue is not thread-safe, and a put from outside would not
        wake the receiver (it would sit until some timer of the receiver's loop fired)."""
        loop = self._loop
        if loop is None or _running_loop() is loop:
            self.inbox.put_nowait(incoming)
            return
        with contextlib.suppress(RuntimeError):  # the receiver's loop already stopped: dropped
            loop.call_soon_threadsafe(self._put_open, incoming)

    def _put_open(self, incoming: Incoming) -> None:
        if not self.closed:
            self.inbox.put_nowait(incoming)

    @property
    def pub_address(self) -> str:
        return f"mem://{self.name}/pub"

    @property
    def router_address(self) -> str:
        return f"mem://{self.name}/router"

    async def start(self) -> Endpoints:
        self._started = True
        self._loop = asyncio.get_running_loop()
        self.network.listeners[self.pub_address] = self
        self.network.listeners[self.router_address] = self
        return Endpoints((self.pub_address,), (self.router_address,))

    def connect(self, peer: int, pub: str, router: str) -> None:
        if self.closed:
            raise PeerUnavailable("transport is closed")
        self.disconnect(peer)
        publisher = self.network.listeners.get(pub)
        if publisher is not None:
            publisher._subscribers.add(self.router_address)
        self._subscriptions[peer] = pub
        self._routes[peer] = router

    def disconnect(self, peer: int) -> None:
        pub = self._subscriptions.pop(peer, None)
        self._routes.pop(peer, None)
        publisher = self.network.listeners.get(pub) if pub else None
        if publisher is not None:
            publisher._subscribers.discard(self.router_address)

    def subscribe(self, topic: bytes) -> None:
        if self.closed:
            raise PeerUnavailable("transport is closed")
        _check_topic(topic)
        self.topics.add(topic)

    async def publish(self, frames: Sequence[Frame], topic: bytes = ALL) -> None:
        if self.closed:
            raise PeerUnavailable("transport is closed")
        for address in sorted(self._subscribers):
            target = self.network.listeners.get(address)
            # As ZeroMQ matches subscriptions: a prefix of the topic.
            if target is not None and any(topic.startswith(t) for t in target.topics):
                self.network.deliver(self, address, Incoming(GOSSIP, list(frames)))
        await asyncio.sleep(0)

    async def send(self, peer: int, frames: Sequence[Frame]) -> None:
        address = self._routes.get(peer)
        if address is None or self.closed:
            raise PeerUnavailable(f"peer {peer} is not connected")
        self.network.deliver(self, address, Incoming(DIRECT, list(frames)))
        await asyncio.sleep(0)

    async def recv(self) -> Incoming:
        if self.closed:
            raise PeerUnavailable("transport is closed")
        return await self.inbox.get()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for peer in list(self._subscriptions):
            self.disconnect(peer)
        self.network.listeners.pop(self.pub_address, None)
        self.network.listeners.pop(self.router_address, None)
