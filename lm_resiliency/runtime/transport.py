"""Transport: how frames move between rank runtimes.

Two channels, both carrying lists of frames:
- gossip: `publish` fans out to every runtime subscribed to us (ZeroMQ PUB/SUB). Best effort: a slow
  subscriber drops gossip rather than stalling the publisher. Each message has a topic: `ALL` (every
  runtime takes it) or one a runtime `subscribe`s to besides (its replica group's): the publisher
  sends a topic's messages only to subscribers of that topic (ZeroMQ filters at the publisher).
- direct: `send` reaches one peer (a DEALER per peer, connected to the peer's ROUTER). Ordered per
  peer, flow-controlled by the high-water mark; used for requests and bulk transfers.

Every method runs in the loop thread only (ZeroMQ sockets are not thread-safe). `ZmqTransport` is the
real thing; `lm_resiliency.testing.InMemoryTransport` is its twin, and one contract suite
(`lm_resiliency.testing.contract`) runs against both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import stat
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import zmq
import zmq.asyncio

from lm_resiliency._proc import pid_alive

__all__ = ["ALL", "Endpoints", "Incoming", "PeerLeft", "PeerUnavailable", "Transport", "ZmqTransport"]

log = logging.getLogger(__name__)
Frame = bytes | memoryview

GOSSIP = "gossip"
DIRECT = "direct"
ALL = b"*"  # the topic every runtime subscribes to; others must not start with it


class PeerUnavailable(ConnectionError):
    """The peer is not connected (never was, or was disconnected)."""


class PeerLeft(PeerUnavailable):
    """The peer said goodbye (its session closed): nothing sent to it will be acknowledged."""


@dataclass(frozen=True)
class Endpoints:
    """Addresses a transport listens on, in order of preference for a peer of the same node."""

    pub: tuple[str, ...]
    router: tuple[str, ...]


@dataclass(frozen=True)
class Incoming:
    channel: str  # GOSSIP or DIRECT
    frames: list[Frame]


@runtime_checkable
class Transport(Protocol):
    """Moves frame lists between runtimes. All methods are called from the loop thread only."""

    async def start(self) -> Endpoints:
        """Bind and return where peers can reach us."""
        ...

    def connect(self, peer: int, pub: str, router: str) -> None:
        """Subscribe to `peer`'s gossip at `pub` and open a direct channel to `router`.

        Connecting a peer again replaces its previous addresses (a restarted peer)."""
        ...

    def disconnect(self, peer: int) -> None:
        """Forget `peer`: stop receiving its gossip; `send` to it raises PeerUnavailable."""
        ...

    def subscribe(self, topic: bytes) -> None:
        """Also take gossip published with `topic` (every transport takes `ALL`)."""
        ...

    async def publish(self, frames: Sequence[Frame], topic: bytes = ALL) -> None:
        """Fan `frames` out to the subscribers of `topic`."""
        ...

    async def send(self, peer: int, frames: Sequence[Frame]) -> None:
        """Queue `frames` to `peer`. Raises PeerUnavailable if it is not connected."""
        ...

    async def recv(self) -> Incoming:
        """Wait for the next message on either channel."""
        ...

    async def close(self) -> None:
        """Release every socket. Idempotent."""
        ...


class ZmqTransport:
    """ZeroMQ transport: PUB + ROUTER bound on TCP (and IPC), one SUB, one DEALER per peer."""

    def __init__(self, host: str = "127.0.0.1", use_ipc: bool = True, hwm: int = 10000) -> None:
        self._host = host
        self._use_ipc = use_ipc
        self._hwm = hwm
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._dealers: dict[int, zmq.asyncio.Socket] = {}
        self._subscribed: dict[int, str] = {}
        self._readable: asyncio.Event | None = None
        self._watched: list[int] = []
        self._sub_raw: zmq.Socket[Any] | None = None
        self._router_raw: zmq.Socket[Any] | None = None
        self._pending: deque[Incoming] = deque()
        self._ipc_paths: list[str] = []
        self._closed = False

    async def start(self) -> Endpoints:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self._hwm)
        self._router = self._socket(zmq.ROUTER)
        self._router.setsockopt(zmq.RCVHWM, self._hwm)
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, self._hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, ALL)
        pub = [self._bind(self._pub, "pub")]
        router = [self._bind(self._router, "router")]
        if self._use_ipc:
            pub.insert(0, self._bind_ipc(self._pub, "pub"))
            router.insert(0, self._bind_ipc(self._router, "rtr"))
        # Synchronous shadows of the same sockets, read without blocking. The loop watches their
        # notification descriptors itself: zmq.asyncio's poller costs a future, a reader
        # registration and several enum operations per wake-up, on every received message.
        self._sub_raw = zmq.Socket.shadow(self._sub.underlying)
        self._router_raw = zmq.Socket.shadow(self._router.underlying)
        self._readable = asyncio.Event()
        loop = asyncio.get_running_loop()
        for raw in (self._sub_raw, self._router_raw):
            fd = raw.getsockopt(zmq.FD)
            assert isinstance(fd, int)
            loop.add_reader(fd, self._readable.set)
            self._watched.append(fd)
        return Endpoints(tuple(pub), tuple(router))

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        return s

    def _bind(self, sock: zmq.asyncio.Socket, what: str) -> str:
        # Port 0: the kernel picks a free port in the binding process itself (race free).
        sock.bind(f"tcp://{self._host}:0")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        return endpoint.decode()

    def _bind_ipc(self, sock: zmq.asyncio.Socket, what: str) -> str:
        # IPC paths are limited to ~107 bytes: keep them short and unique.
        if not _SWEPT:
            _SWEPT.append(sweep_stale_ipc(tempfile.gettempdir()))
        path = os.path.join(tempfile.gettempdir(), f"lmr-{os.getpid()}-{secrets.token_hex(4)}-{what}")
        sock.bind(f"ipc://{path}")
        self._ipc_paths.append(path)
        return f"ipc://{path}"

    def connect(self, peer: int, pub: str, router: str) -> None:
        if self._closed or self._sub is None:
            raise PeerUnavailable("transport is closed")
        self.disconnect(peer)
        self._sub.connect(pub)
        self._subscribed[peer] = pub
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, self._hwm)
        dealer.connect(router)
        self._dealers[peer] = dealer

    def disconnect(self, peer: int) -> None:
        pub = self._subscribed.pop(peer, None)
        if pub is not None and self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):  # already gone: nothing to undo
                self._sub.disconnect(pub)
        dealer = self._dealers.pop(peer, None)
        if dealer is not None:
            dealer.close(linger=0)

    def subscribe(self, topic: bytes) -> None:
        if self._sub is None or self._closed:
            raise PeerUnavailable("transport is closed")
        _check_topic(topic)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)

    async def publish(self, frames: Sequence[Frame], topic: bytes = ALL) -> None:
        if self._pub is None or self._closed:
            raise PeerUnavailable("transport is closed")
        # The topic travels as a frame of its own, ahead of the message (ZeroMQ matches the first).
        await self._pub.send_multipart([topic, *frames], copy=_copy(frames))

    async def send(self, peer: int, frames: Sequence[Frame]) -> None:
        dealer = self._dealers.get(peer)
        if dealer is None:
            raise PeerUnavailable(f"peer {peer} is not connected")
        await dealer.send_multipart(frames, copy=_copy(frames))

    async def recv(self) -> Incoming:
        while not self._pending:
            if self._readable is None or self._sub_raw is None or self._router_raw is None or self._closed:
                raise PeerUnavailable("transport is closed")
            # ZeroMQ's descriptors signal edges, not levels: clear first, then ask each socket
            # whether something is there (reading ZMQ_EVENTS also re-arms its descriptor), drain
            # it without blocking, bounded so one channel cannot starve the other, and only sleep
            # when neither had anything.
            self._readable.clear()
            if _has_input(self._sub_raw):
                self._drain(self._sub_raw, GOSSIP)
            if _has_input(self._router_raw):
                self._drain(self._router_raw, DIRECT)
            if not self._pending:
                await self._readable.wait()
        return self._pending.popleft()

    def _drain(self, raw: zmq.Socket[Any], channel: str, limit: int = 64) -> None:
        for i in range(limit):
            if i and not _has_input(raw):  # asking is cheaper than a failed read's exception
                return
            try:
                parts = raw.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            # A ROUTER's first frame is the sender's identity, a SUB's the topic: neither is ours.
            frames: list[Frame] = [p.buffer for p in parts[1:]]
            self._pending.append(Incoming(channel, frames))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # no running loop: nothing is watched
            loop = asyncio.get_running_loop()
            for fd in self._watched:
                loop.remove_reader(fd)
        self._watched.clear()
        if self._readable is not None:
            self._readable.set()  # a receiver waiting now finds the transport closed
        for peer in list(self._dealers):
            self.disconnect(peer)
        for sock in (self._pub, self._router, self._sub):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        for path in self._ipc_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._pending.clear()


ZERO_COPY_THRESHOLD = 1 << 16


def _check_topic(topic: bytes) -> None:
    if not topic or topic.startswith(ALL):
        raise ValueError(f"topic {topic!r}: must be non-empty and not start with {ALL!r}")


def _has_input(raw: zmq.Socket[Any]) -> bool:
    events = raw.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


_IPC_NAME = re.compile(r"lmr-(\d+)-[0-9a-f]{8}-(?:pub|rtr)")
_SWEPT: list[int] = []  # once per process: how many leftovers the first IPC bind removed


def sweep_stale_ipc(folder: str) -> int:
    """Remove our IPC socket files in `folder` that nobody listens on any more: those of processes
    that ended without closing their transport (a SIGKILLed worker leaves two). Only files named as
    ours whose process is gone and that refuse a connection are removed (a process of another pid
    namespace sharing the folder still listens on its own). Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        m = _IPC_NAME.fullmatch(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(folder, name)
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(0.2)
                probe.connect(path)
                continue  # somebody listens: not ours to remove
            except ConnectionRefusedError:
                pass
            finally:
                probe.close()
            os.unlink(path)
            removed += 1
        except OSError:  # gone meanwhile, not ours to touch, or a connect that timed out
            continue
    if removed:
        log.info("removed %d IPC socket files of ended processes from %s", removed, folder)
    return removed


def _copy(frames: Sequence[Frame]) -> bool:
    """Copy small messages (cheaper than a zero-copy frame) but never large ones: zmq.asyncio copies
    every frame of a `copy=True` send, which would cap bulk transfers near memcpy speed."""
    return all(len(f) < ZERO_COPY_THRESHOLD for f in frames)
