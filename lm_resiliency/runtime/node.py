"""The rank runtime: decode -> core -> effects, on the loop thread.

`RankRuntime` owns one `LoopThread`, one `Transport`, the authentication state and the failure
detector. The training thread reaches it through `submit*` (non-blocking), `view()` (a snapshot) and
`wait_for` (a condition with a timeout). Later capabilities plug in through `add_handler` (messages of
a type tag) and `add_membership_listener` (join/death/leave events); both run in the loop thread.

Nothing a peer sends can crash this runtime: frames that fail authentication or decoding, messages
that claim another sender, and handler errors are counted and dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import anyio

from lm_resiliency._proc import host_key, pid_exited
from lm_resiliency.config import RuntimeConfig
from lm_resiliency.core import codec
from lm_resiliency.core.auth import BufferCorrupt, Sealed, Signer, Verifier
from lm_resiliency.core.clock import Clock
from lm_resiliency.core.membership import EventKind, FailureDetector, MembershipEvent, PeerState
from lm_resiliency.core.messages import (
    Batch,
    BulkAck,
    BulkChunk,
    Goodbye,
    Heartbeat,
    Message,
    PeerAnnouncement,
    StepTelemetry,
)
from lm_resiliency.core.taxonomy import CLOSED
from lm_resiliency.core.topology import machine_of
from lm_resiliency.errors import AuthError, CodecError
from lm_resiliency.runtime.clock import SystemClock
from lm_resiliency.runtime.loop import LoopThread
from lm_resiliency.runtime.transport import ALL, DIRECT, Endpoints, PeerLeft, PeerUnavailable, Transport

__all__ = ["ClusterView", "PeerView", "RankRuntime"]

log = logging.getLogger(__name__)
Frame = bytes | memoryview
Handler = Callable[[Sealed, Message], None]
MembershipListener = Callable[[MembershipEvent], None]
# Called with (sender, transfer_id, meta, chunks) when a bulk transfer completes; returning True
# means the listener took the chunks and the runtime need not keep them for `take_transfer`.
TransferListener = Callable[[int, str, dict[str, str], list["Frame"]], bool]
# Called with (sender, transfer_id, meta, index, count, chunk) for each verified chunk as it arrives;
# returning True means the sink consumed the chunk (a large transfer streamed to its destination,
# never held whole in memory): the runtime keeps only its length, and the transfer listeners later
# see an empty frame in its place.
ChunkSink = Callable[[int, str, dict[str, str], int, int, "Frame"], bool]

MAX_BULK_CHUNKS = 1 << 20
MAX_BATCH = 64  # gossip messages sealed together at most
# A same-host peer's process seen ended is declared dead this long after (see `_exited_peers`).
EXIT_GRACE_S = 0.05
MAX_RESENDS = 3  # per chunk: a link that corrupts more than this is reported, not retried forever


@dataclass(frozen=True)
class PeerView:
    rank: int
    state: PeerState
    incarnation: int
    step: int
    progress: int
    # The peer's last step telemetry; None for peers outside this rank's replica group once SCOUT
    # scoped telemetry to the group (`RankRuntime.scope_to_group`).
    telemetry: StepTelemetry | None


@dataclass(frozen=True)
class ClusterView:
    """A consistent snapshot of what this rank's runtime knows about the job."""

    rank: int
    world_size: int
    peers: dict[int, PeerView]
    stats: dict[str, int]

    @property
    def live(self) -> frozenset[int]:
        """Ranks known alive, this rank included."""
        return frozenset(r for r, p in self.peers.items() if p.state is PeerState.ALIVE)

    def telemetry_step(self, rank: int) -> int:
        t = self.peers[rank].telemetry
        return t.step if t is not None else -1


@dataclass
class _Transfer:
    sender: int
    count: int
    total_bytes: int
    chunks: list[Frame | None]
    meta: dict[str, str] = field(default_factory=dict)
    received: int = 0
    received_bytes: int = 0


@dataclass
class _Stats:
    codec_errors: int = 0
    impersonation: int = 0
    handler_errors: int = 0
    send_failures: int = 0
    gossip_sent: int = 0
    direct_sent: int = 0
    messages_received: int = 0
    bulk_rejected: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class RankRuntime:
    """One rank's runtime: authenticated gossip, direct messages, bulk transfers and membership."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        node_id: str,
        key: bytes,
        incarnation: int,
        config: RuntimeConfig,
        transport_factory: Callable[[], Transport],
        clock: Clock | None = None,
        replica_group: Sequence[int] = (),
        peer_group: Sequence[int] = (),
        dims: Mapping[str, Sequence[int]] | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.node_id = node_id
        self.incarnation = incarnation
        self.config = config
        self.replica_group = tuple(replica_group)
        # Gossip of the tags in `_group_tags` reaches the replica group only (its own topic), when
        # the group is not the whole job; everything else reaches every rank.
        self._group_topic = _group_topic(self.replica_group, rank, world_size)
        self._group_tags: set[str] = set()
        # Likewise the tags in `_peer_tags` reach the peer group only (the ranks doing the same work:
        # a superset of the replica group).
        self.peer_group = tuple(peer_group) or self.replica_group
        self._peer_topic = _group_topic(self.peer_group, rank, world_size)
        self._peer_tags: set[str] = set()
        self.dims = {k: tuple(v) for k, v in (dims or {}).items()}
        self.settings = dict(settings or {})  # announced: the settings every rank must share
        self._clock = clock or SystemClock()
        self._muted_until = float("-inf")  # see mute()
        self._transport_factory = transport_factory
        self._transport: Transport | None = None
        self._signer = Signer(key, rank, incarnation)
        self._verifier = Verifier(key)
        self._loop = LoopThread(name=f"lm-resiliency-rank{rank}", cleanup=self._close_transport)
        # The timers tick at least every heartbeat interval: a tick half a timeout late (and three
        # intervals) means this rank stood still (SIGSTOP, a paused VM), not that its peers did.
        self._detector = FailureDetector(
            (r for r in range(world_size) if r != rank),
            config.heartbeat_timeout_s,
            self._clock.monotonic(),
            pause_s=max(3 * config.heartbeat_interval_s, config.heartbeat_timeout_s / 2),
        )
        self._announcement: PeerAnnouncement | None = None
        self._known: dict[int, PeerAnnouncement] = {}
        self._exit_seen: dict[tuple[int, int], float] = {}  # (rank, incarnation) -> first seen ended
        self._handlers: dict[str, list[Handler]] = {}
        self._listeners: list[MembershipListener] = []
        self._corruption_listeners: list[Callable[[int, str], None]] = []
        self._damage_sends = 0  # see damage_outgoing()
        self._transfer_listeners: list[TransferListener] = []
        self._chunk_sinks: list[ChunkSink] = []
        self._cond = threading.Condition()
        self._telemetry: dict[int, StepTelemetry] = {}
        self._progress: dict[int, tuple[int, int]] = {}
        self._stats = _Stats()
        # Training-thread side of submit(): a deque and one pending wake-up at a time.
        self._outbox: deque[tuple[int | None, Message]] = deque()
        self._wake_pending = False
        self._lingering = False  # the publisher sends what is submitted at the end of its linger
        # When the outbox was last sent (loop thread), and whether the holder of `hold()` submitted
        # anything that must go at once (see submit: a step's telemetry may wait).
        self._published_at = float("-inf")
        self._held_urgent = False
        self._draining = asyncio.Lock()
        self._holder: int | None = None  # the thread inside `hold()`
        self._wake: asyncio.Event | None = None
        self._step = 0
        self._progress_counter = 0
        self._last_beat = float("-inf")  # when this rank's last heartbeat was published
        # Bulk transfers.
        self._incoming: dict[tuple[int, str], _Transfer] = {}
        self._completed: dict[tuple[int, str], list[Frame]] = {}
        self._acks: dict[tuple[int, str], asyncio.Future[BulkAck]] = {}
        self._resend: dict[tuple[int, str], Callable[[int], None]] = {}
        self._closed = False

    # -- lifecycle (caller's thread) --------------------------------------------------------------
    def start(self) -> PeerAnnouncement:
        """Start the loop thread and bind the transport; return where peers reach us."""
        self._loop.start()
        try:
            endpoints = self._loop.call(self._start_in_loop, timeout=10.0)
        except BaseException:
            self._loop.close()
            raise
        self._announcement = PeerAnnouncement(
            rank=self.rank,
            incarnation=self.incarnation,
            node_id=self.node_id,
            pid=os.getpid(),
            pub=endpoints.pub,
            router=endpoints.router,
            replica_group=self.replica_group,
            dims=self.dims,
            peer_group=self.peer_group,
            settings=dict(self.settings),
            host=host_key(),
        )
        with self._cond:
            self._progress[self.rank] = (0, 0)
        return self._announcement

    async def _start_in_loop(self) -> Endpoints:
        self._transport = self._transport_factory()
        endpoints = await self._transport.start()
        for topic in {self._group_topic, self._peer_topic} - {ALL}:
            self._transport.subscribe(topic)
        self._wake = asyncio.Event()
        self._loop.spawn(self._receive_forever, name="receive", forever=True)
        self._loop.spawn(self._publish_forever, name="publish", forever=True)
        self._loop.spawn(self._timers_forever, name="timers", forever=True)
        return endpoints

    def connect_peers(self, announcements: Iterable[PeerAnnouncement], announce: bool = False) -> None:
        """Connect to peers found by discovery. With `announce`, tell each where we now are (a rejoin)."""
        anns = [a for a in announcements if a.rank != self.rank]
        self._loop.call(self._connect_all, anns, announce, timeout=10.0)

    async def _connect_all(self, anns: list[PeerAnnouncement], announce: bool) -> None:
        for ann in anns:
            self._connect(ann)
        if announce and self._announcement is not None:
            for ann in anns:
                await self._send_direct(ann.rank, self._announcement)

    def _connect(self, ann: PeerAnnouncement) -> None:
        assert self._transport is not None
        known = self._known.get(ann.rank)
        if known is not None and known.incarnation > ann.incarnation:
            return
        if known is not None and known == ann:
            return
        # IPC only within one machine: a shared node id is not enough (hosts cloned from one image
        # share /etc/machine-id, and an ipc:// path on another machine is never reached).
        mine = self._announcement.host if self._announcement is not None else ""
        same_node = ann.node_id == self.node_id and machine_of(ann.host) == machine_of(mine)
        pub = _pick(ann.pub, same_node and self.config.use_ipc)
        router = _pick(ann.router, same_node and self.config.use_ipc)
        self._transport.connect(ann.rank, pub, router)
        self._known[ann.rank] = ann
        log.debug(
            "rank %d connected to rank %d (incarnation %d) at %s", self.rank, ann.rank, ann.incarnation, pub
        )

    def close(self, timeout: float = 1.0, reason: str = CLOSED) -> None:
        """Say goodbye to peers (with `reason`: why this rank leaves), close every socket and join the
        loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop.alive:
            with contextlib.suppress(TimeoutError, RuntimeError, concurrent.futures.CancelledError):
                self._loop.call(self._shutdown, reason, timeout=timeout)
        self._loop.close(timeout)
        with self._cond:
            self._cond.notify_all()

    async def _shutdown(self, reason: str) -> None:
        if self._transport is None:
            return
        with anyio.move_on_after(0.2):
            await self._drain_outbox()  # what the rank submitted last (its final step's evidence)
            await self._publish(Goodbye(self.rank, self.incarnation, reason))

    async def _close_transport(self) -> None:
        for fut in self._acks.values():
            if not fut.done():
                fut.cancel()
        if self._transport is not None:
            await self._transport.close()

    def __enter__(self) -> RankRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._loop.alive and not self._closed

    @property
    def loop(self) -> LoopThread:
        return self._loop

    @property
    def announcement(self) -> PeerAnnouncement:
        if self._announcement is None:
            raise RuntimeError("runtime not started")
        return self._announcement

    # -- training-thread API ----------------------------------------------------------------------
    def set_progress(self, step: int) -> None:
        """Record a completed step (cheap: two attribute writes, read by the heartbeat task)."""
        self._step = step
        self._progress_counter += 1

    def submit(self, msg: Message, peer: int | None = None) -> None:
        """Hand a message to the runtime: gossip when `peer` is None, else direct. Never blocks.

        A step's telemetry within `telemetry_batch_s` of the last send waits in the outbox for the
        next send (whatever is submitted next that must go at once, a later step's telemetry, the
        timer's next tick): short steps cost peers one receive per batch of steps, not per step."""
        lazy = False
        if peer is None and isinstance(msg, StepTelemetry):
            self._record_telemetry(msg)  # our own view is current the moment the step ends
            lazy = (
                not msg.extra
                and not self._closed  # (a closed runtime says so: see _kick)
                and self._clock.monotonic() - self._published_at < self.config.telemetry_batch_s
            )
        self._outbox.append((peer, msg))
        if self._holder == threading.get_ident():
            self._held_urgent = self._held_urgent or not lazy
            return  # `hold()`: sent with the rest when the holder is done
        if not lazy:
            self._kick()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Messages this thread submits inside the block go out together at its end (gossip ones as
        one batch): a step's telemetry and evidence cost peers one receive, not several."""
        if self._holder is not None:  # nested, or another thread holds: plain submits
            yield
            return
        self._holder = threading.get_ident()
        self._held_urgent = False
        try:
            yield
        finally:
            self._holder = None
            if self._outbox and self._held_urgent:
                try:
                    self._kick()
                except RuntimeError:  # closed meanwhile (RuntimeClosedError; the loop's own): not the step's
                    log.debug("rank %d: runtime closed; %d messages not sent", self.rank, len(self._outbox))

    def _kick(self) -> None:
        if self._loop.in_loop_thread():
            # A task of our own loop (SCOUT's progress, link probes): wake the publisher directly.
            # Going through call_soon_threadsafe would raise once close() began, and crash the loop.
            self._wakeup()
            return
        if self._lingering:
            # The publisher sends the outbox when its linger ends; it clears the flag before it
            # looks, and we appended before we looked at the flag, so nothing is left behind.
            return
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self._loop.submit(self._wakeup)
            except RuntimeError:
                self._wake_pending = False
                raise

    def _wakeup(self) -> None:
        self._wake_pending = False
        if self._wake is not None:
            self._wake.set()

    def live(self) -> frozenset[int]:
        """Ranks alive now, this one included (cheaper than `view()` for per-message checks)."""
        with self._cond:
            return self._detector.alive() | {self.rank}

    def silent(self) -> frozenset[int]:
        """Ranks declared dead: their heartbeats stopped without a goodbye."""
        with self._cond:
            return frozenset(r for r, st in self._detector.snapshot().items() if st is PeerState.DEAD)

    def departed(self) -> dict[int, str]:
        """Ranks that said goodbye, each with the reason it gave ("close": its session closed)."""
        with self._cond:
            return self._detector.departed()

    def view(self) -> ClusterView:
        with self._cond:
            return self._view_locked()

    def _view_locked(self) -> ClusterView:
        peers = {}
        snapshot = self._detector.snapshot()
        for r in range(self.world_size):
            if r == self.rank:
                state, inc = PeerState.ALIVE if self.alive else PeerState.LEFT, self.incarnation
                step, prog = self._step, self._progress_counter
            else:
                state, inc = snapshot[r], self._detector.incarnation(r)
                step, prog = self._progress.get(r, (-1, 0))
            peers[r] = PeerView(r, state, inc, step, prog, self._telemetry.get(r))
        a = self._verifier.stats
        s = self._stats
        stats = {
            "accepted": a.accepted,
            "rejected_auth": a.bad_mac + a.malformed,
            "corrupt_in_flight": a.corrupt_buffer,
            "rejected_replay": a.replayed + a.stale_incarnation,
            "codec_errors": s.codec_errors,
            "impersonation": s.impersonation,
            "handler_errors": s.handler_errors,
            "send_failures": s.send_failures,
            "gossip_sent": s.gossip_sent,
            "direct_sent": s.direct_sent,
            "bulk_rejected": s.bulk_rejected,
            **s.extra,
        }
        return ClusterView(self.rank, self.world_size, peers, stats)

    def wait_for(self, predicate: Callable[[ClusterView], bool], timeout: float) -> bool:
        """Block until `predicate(view)` holds (True) or `timeout` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self._view_locked()) or self._closed, timeout) and (
                predicate(self._view_locked())
            )

    # -- seams for later capabilities (callbacks run in the loop thread) -------------------------
    def scope_to_group(self, *tags: str) -> None:
        """Gossip messages of `tags` only to this rank's replica group (the peers that judge them),
        not to the whole job. Peers outside the group no longer see them, in `view()` either."""
        self._group_tags.update(tags)
        self._peer_tags.difference_update(tags)

    def scope_to_peers(self, *tags: str) -> None:
        """Gossip messages of `tags` only to this rank's peer group (see `Topology.peer_group_of`)."""
        self._peer_tags.update(tags)
        self._group_tags.difference_update(tags)

    def add_handler(self, tag: str, handler: Handler) -> None:
        self._handlers.setdefault(tag, []).append(handler)

    def add_membership_listener(self, listener: MembershipListener) -> None:
        self._listeners.append(listener)

    def add_corruption_listener(self, listener: Callable[[int, str], None]) -> None:
        """`listener(sender, detail)` for each authentic bulk chunk that arrived damaged (its
        checksum failed in flight; the chunk is asked for again). On the loop thread."""
        self._corruption_listeners.append(listener)

    def damage_outgoing(self, chunks: int = 1) -> None:
        """Flip one byte in the payload of the next `chunks` bulk chunks this rank sends, after
        they are sealed (a fault campaign's payload corruption in flight; the receiver's checksum
        rejects each and asks again, and the resent copy goes out intact). Any thread."""
        self._damage_sends += max(0, chunks)

    def add_transfer_listener(self, listener: TransferListener) -> None:
        self._transfer_listeners.append(listener)

    def add_chunk_sink(self, sink: ChunkSink) -> None:
        self._chunk_sinks.append(sink)

    def send_bulk(
        self,
        peer: int,
        transfer_id: str,
        buffers: Sequence[Frame],
        meta: dict[str, str] | None = None,
        timeout: float = 60.0,
        digests: Sequence[bytes] | None = None,
    ) -> concurrent.futures.Future[BulkAck]:
        """Send `buffers` (one chunk each) to `peer`; the future resolves with the receiver's ack.

        The buffers are sent without copying: do not modify them until the future resolves.
        `digests`: the buffers' `core.auth.frame_digest`s if the caller already has them."""
        return self._loop.run_coroutine(
            self.send_bulk_async(peer, transfer_id, buffers, meta or {}, timeout, digests)
        )

    async def send_bulk_async(
        self,
        peer: int,
        transfer_id: str,
        buffers: Sequence[Frame],
        meta: dict[str, str],
        deadline_s: float,
        digests: Sequence[bytes] | None = None,
    ) -> BulkAck:
        if digests is not None and len(digests) != len(buffers):
            raise ValueError(f"{len(digests)} digests for {len(buffers)} buffers")
        with self._cond:
            state = self._detector.state(peer)
        if state in (PeerState.LEFT, PeerState.DEAD):
            # Nobody would acknowledge it: the sender is not kept waiting for its deadline.
            raise (PeerLeft if state is PeerState.LEFT else PeerUnavailable)(f"rank {peer} is {state.value}")
        key = (peer, transfer_id)
        fut: asyncio.Future[BulkAck] = asyncio.get_running_loop().create_future()
        self._acks[key] = fut
        total = sum(len(b) for b in buffers)
        resent = [0] * len(buffers)

        async def send_chunk(i: int) -> None:
            chunk = BulkChunk(self.rank, transfer_id, i, len(buffers), total, meta, (buffers[i],))
            given = None if digests is None else (digests[i],)
            await self._send_direct(peer, chunk, raise_errors=True, digests=given)

        def resend(i: int) -> None:
            if not 0 <= i < len(buffers) or fut.done():
                return
            resent[i] += 1
            self._stats.extra["bulk_resent"] = self._stats.extra.get("bulk_resent", 0) + 1
            if resent[i] > MAX_RESENDS:
                fut.set_exception(PeerUnavailable(f"chunk {i} of {transfer_id} failed {MAX_RESENDS} resends"))
                return
            self._loop.spawn(send_chunk, i)

        self._resend[key] = resend
        try:
            with anyio.fail_after(deadline_s):
                for i in range(len(buffers)):
                    await send_chunk(i)
                return await fut
        finally:
            self._acks.pop(key, None)
            self._resend.pop(key, None)

    def take_transfer(self, sender: int, transfer_id: str) -> list[Frame] | None:
        """Pop a completed incoming transfer's chunks (zero-copy views), or None if not complete."""
        with self._cond:
            return self._completed.pop((sender, transfer_id), None)

    # -- loop-thread internals --------------------------------------------------------------------
    async def _publish(self, msg: Message, topic: bytes = ALL) -> None:
        await self._publish_encoded(codec.encode(msg), topic)

    def mute(self, seconds: float) -> None:
        """Drop everything this rank sends for `seconds` (gossip, heartbeats, direct messages,
        bulk chunks): a fault campaign's message drop or network partition, confined to our
        transport. The process, its training and its collectives go on. Any thread."""
        self._muted_until = self._clock.monotonic() + max(0.0, seconds)

    def _muted(self) -> bool:
        if self._clock.monotonic() < self._muted_until:
            self._stats.extra["muted_drops"] = self._stats.extra.get("muted_drops", 0) + 1
            return True
        return False

    async def _publish_encoded(self, frames: list[Frame], topic: bytes = ALL) -> None:
        assert self._transport is not None
        if self._muted():
            return
        await self._transport.publish(self._signer.seal(frames), topic)
        self._stats.gossip_sent += 1

    def _topic(self, msg: Message) -> bytes:
        if msg.TAG in self._group_tags:
            return self._group_topic
        return self._peer_topic if msg.TAG in self._peer_tags else ALL

    async def _send_direct(
        self, peer: int, msg: Message, raise_errors: bool = False, digests: Sequence[bytes] | None = None
    ) -> None:
        assert self._transport is not None
        if self._muted():
            return
        frames = self._signer.seal(codec.encode(msg), digests)
        if self._damage_sends > 0 and isinstance(msg, BulkChunk) and len(frames) > 2 and len(frames[-1]):
            self._damage_sends -= 1
            bad = bytearray(frames[-1])  # a copy: the payload is a view of the sender's own slot
            bad[len(bad) // 2] ^= 0x01
            frames = [*frames[:-1], bytes(bad)]
        try:
            await self._transport.send(peer, frames)
            self._stats.direct_sent += 1
        except PeerUnavailable:
            self._stats.send_failures += 1
            if raise_errors:
                raise
            log.debug("rank %d: %s to unavailable peer %d dropped", self.rank, type(msg).__name__, peer)

    async def _publish_forever(self) -> None:
        """Send what is submitted. After each send the publisher lingers `publish_coalesce_s`: what
        other threads submit meanwhile waits for its end and goes out in one batch, with no wakeup of
        this loop from their side (each costs the training thread a syscall and a handoff of the
        GIL to this thread, a large share of a short step). The loop's own messages (heartbeats,
        votes, hang evidence) still go out at once."""
        assert self._wake is not None
        gap = min(self.config.publish_coalesce_s, self.config.heartbeat_interval_s)
        self._lingering = False  # (started again after a failure: not lingering)
        while True:
            if not self._outbox:
                await self._wake.wait()
            self._wake.clear()
            await self._drain_outbox()
            if gap > 0:
                self._lingering = True
                with anyio.move_on_after(gap):
                    await self._wake.wait()
                self._lingering = False  # before the outbox is looked at again: see _kick

    async def _drain_outbox(self) -> None:
        async with self._draining:  # the publisher's and close()'s, one after the other: in order
            await self._drain_outbox_locked()

    async def _drain_outbox_locked(self) -> None:
        if self._outbox:
            # (Before the sends: a peer may receive them, and the training thread hear of it and
            # submit its next step, before this task runs again.)
            self._published_at = self._clock.monotonic()
        while self._outbox:
            peer, msg = self._outbox.popleft()
            if peer is not None:
                await self._send_direct(peer, msg)
                continue
            batch, topic = [msg], self._topic(msg)
            while (
                self._outbox
                and self._outbox[0][0] is None
                and len(batch) < MAX_BATCH
                and self._topic(self._outbox[0][1]) == topic
            ):
                batch.append(self._outbox.popleft()[1])
            await self._publish_batch(batch, topic)
            for m in batch:
                self._loopback(m)

    async def _publish_batch(self, msgs: list[Message], topic: bytes = ALL) -> None:
        """Gossip `msgs` (all of one topic): those without buffers sealed as one `Batch` when there
        are several.

        Gossip to every rank carries this rank's heartbeat too (in the batch) when the last one is
        half an interval old: while steps are published (every step's telemetry), the timer's own
        heartbeats are not needed, and all-to-all heartbeats are most of the gossip of a large job.
        Gossip to the replica group only does not: the other ranks would not hear it."""
        encoded = [codec.encode(m) for m in msgs]
        headers = [bytes(f[0]) for f in encoded if len(f) == 1]
        now = self._clock.monotonic()
        if headers and topic == ALL and now - self._last_beat >= self.config.heartbeat_interval_s / 2:
            beat = Heartbeat(self.rank, self.incarnation, self._step, self._progress_counter)
            headers.append(bytes(codec.encode(beat)[0]))
            self._last_beat = now
        if len(headers) > 1:
            await self._publish(Batch(self.rank, tuple(headers)), topic)
            encoded = [f for f in encoded if len(f) != 1]
        for frames in encoded:
            await self._publish_encoded(frames, topic)

    def _loopback(self, msg: Message) -> None:
        """Our own gossip reaches our own handlers too: every rank judges the same evidence set."""
        sealed = Sealed(self.rank, self.incarnation, 0)
        for handler in self._handlers.get(msg.TAG, ()):
            try:
                handler(sealed, msg)
            except Exception:  # as for peers' messages: count, log, carry on
                self._stats.handler_errors += 1
                log.exception("rank %d: handler for own %s failed", self.rank, msg.TAG)

    async def _timers_forever(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            now = self._clock.monotonic()
            if now >= self._last_beat + interval:  # nothing carried one since (see _publish_batch)
                self._last_beat = now
                await self._publish(
                    Heartbeat(self.rank, self.incarnation, self._step, self._progress_counter)
                )
            next_beat = self._last_beat + interval
            if self._outbox and now >= self._published_at + self.config.telemetry_batch_s:
                self._wakeup()  # telemetry that waited for a send (see submit): the training thread stopped
            self._apply_events(self._detector.tick(now) + self._exited_peers(now, EXIT_GRACE_S))
            deadline = self._detector.next_deadline()
            wake = next_beat if deadline is None else min(next_beat, deadline)
            if self._exit_seen:  # a peer's process ended: judged once its goodbye had time to land
                wake = min(wake, min(self._exit_seen.values()) + EXIT_GRACE_S)
            await anyio.sleep(max(0.0, wake - self._clock.monotonic()))

    def _exited_peers(self, now: float, grace: float = 0.0) -> list[MembershipEvent]:
        """Peers on this host (same boot id and pid namespace) whose process ended: declared dead
        `grace` seconds after it was first seen ended, not after the heartbeat timeout (a SIGKILLed
        worker's peers see their collective fail within milliseconds, and die of it long before that
        timeout would name it). The grace lets a goodbye sent just before the end be received first:
        a peer that said why it went (SIGTERM, its exception, its loop's end) has left, not died.
        Loop thread."""
        own = self._announcement.host if self._announcement is not None else ""
        if not own:
            return []
        events = []
        with self._cond:
            # (An incarnation another replaced meanwhile is judged no more: its mark goes, or the
            # timer loop would wake for it without end.)
            if self._exit_seen:
                current = {(rank, ann.incarnation) for rank, ann in self._known.items()}
                for key in [k for k in self._exit_seen if k not in current]:
                    del self._exit_seen[key]
            for rank, ann in self._known.items():
                key = (rank, ann.incarnation)
                if (
                    ann.host == own
                    and self._detector.state(rank) is PeerState.ALIVE
                    and self._detector.incarnation(rank) == ann.incarnation
                    and pid_exited(ann.pid)
                ):
                    if now - self._exit_seen.setdefault(key, now) < grace:
                        continue
                    events += self._detector.exited(
                        rank, ann.incarnation, now, f"process_exited: pid {ann.pid} on this host ended"
                    )
                self._exit_seen.pop(key, None)
        return events

    def check_exited_peers(self, timeout: float = 1.0, settle_s: float = 0.0) -> frozenset[int]:
        """Look now for same-host peers whose process ended (see `_exited_peers`); return the
        ranks known dead afterwards. Any thread; for a rank about to die of a failed collective.

        With `settle_s`, look again (every 20 ms) until a peer is found ended or says goodbye, for
        at most that long: a SIGKILLed peer's sockets close while the kernel still tears the
        process down, so its collective partner can fail before /proc shows it ended."""
        before, left = self.silent(), len(self.departed())
        deadline = time.monotonic() + settle_s

        async def probe() -> None:
            self._apply_events(self._exited_peers(self._clock.monotonic()))

        while True:
            if not self._loop.alive or self._closed:
                return self.silent()
            with contextlib.suppress(TimeoutError, RuntimeError, concurrent.futures.CancelledError):
                self._loop.call(probe, timeout=timeout)
            now = self.silent()
            if now != before or len(self.departed()) != left or time.monotonic() >= deadline:
                return now
            time.sleep(0.02)  # polling /proc: a process's end raises no event here

    async def _receive_forever(self) -> None:
        assert self._transport is not None
        while True:
            incoming = await self._transport.recv()
            self._stats.messages_received += 1
            try:
                sealed, frames = self._verifier.open(incoming.frames)
            except BufferCorrupt as exc:
                await self._on_corrupt(exc, incoming.frames)
                continue
            except AuthError as exc:
                log.debug("rank %d rejected a message: %s", self.rank, exc)
                continue
            try:
                msg = codec.decode(frames)
            except CodecError as exc:
                self._stats.codec_errors += 1
                log.warning(
                    "rank %d dropped a malformed message from rank %d: %s", self.rank, sealed.sender, exc
                )
                continue
            claimed = getattr(msg, "rank", sealed.sender)
            if (
                claimed != sealed.sender
                or not 0 <= sealed.sender < self.world_size
                or sealed.sender == self.rank
            ):
                self._stats.impersonation += 1
                log.warning(
                    "rank %d dropped %s claiming rank %s from sender %d",
                    self.rank,
                    msg.TAG,
                    claimed,
                    sealed.sender,
                )
                continue
            if not isinstance(msg, Batch):
                await self._dispatch(sealed, msg, incoming.channel)
                continue
            for item in msg.items:
                try:
                    inner = codec.decode([item])
                except CodecError as exc:
                    self._stats.codec_errors += 1
                    log.warning(
                        "rank %d dropped a malformed batched message from rank %d: %s",
                        self.rank,
                        sealed.sender,
                        exc,
                    )
                    continue
                if isinstance(inner, Batch) or getattr(inner, "rank", sealed.sender) != sealed.sender:
                    self._stats.impersonation += 1
                    log.warning(
                        "rank %d dropped a batched %s from rank %d", self.rank, inner.TAG, sealed.sender
                    )
                    continue
                await self._dispatch(sealed, inner, incoming.channel)

    async def _on_corrupt(self, exc: BufferCorrupt, frames: Sequence[Frame]) -> None:
        """An authentic bulk chunk arrived damaged: ask its sender for that chunk again."""
        log.warning("rank %d: %s", self.rank, exc)
        try:
            msg = codec.decode([frames[1], *(b"" for _ in frames[2:])])
        except CodecError:
            self._stats.codec_errors += 1
            return
        if isinstance(msg, BulkChunk) and msg.rank == exc.sealed.sender:
            reason = "checksum mismatch in flight"
            await self._send_direct(msg.rank, BulkAck(self.rank, msg.transfer_id, msg.index, False, reason))
            detail = f"chunk {msg.index} of {msg.transfer_id} from rank {msg.rank}: {exc}"
            for listener in self._corruption_listeners:
                try:
                    listener(msg.rank, detail)
                except Exception:
                    self._stats.handler_errors += 1
                    log.exception("rank %d: corruption listener failed", self.rank)

    async def _dispatch(self, sealed: Sealed, msg: Message, channel: str) -> None:
        now = self._clock.monotonic()
        with self._cond:
            events = self._detector.heard(sealed.sender, sealed.incarnation, now)
            if isinstance(msg, Heartbeat):
                self._progress[msg.rank] = (msg.step, msg.progress)
            elif isinstance(msg, StepTelemetry):
                self._telemetry[msg.rank] = msg
                prev = self._progress.get(msg.rank, (-1, 0))
                self._progress[msg.rank] = (max(prev[0], msg.step), prev[1])
            elif isinstance(msg, Goodbye):
                events += self._detector.goodbye(msg.rank, msg.incarnation, now, msg.reason)
            self._cond.notify_all()
        self._apply_events(events)
        if isinstance(msg, PeerAnnouncement) and channel == DIRECT:
            self._connect(msg)
        elif isinstance(msg, BulkChunk):
            await self._on_bulk_chunk(msg)
        elif isinstance(msg, BulkAck):
            key = (msg.rank, msg.transfer_id)
            fut = self._acks.get(key)
            if fut is not None and not fut.done() and msg.index == -1:
                fut.set_result(msg)
            elif fut is not None and not fut.done() and not msg.ok and key in self._resend:
                self._resend[key](msg.index)
        for handler in self._handlers.get(msg.TAG, ()):
            try:
                handler(sealed, msg)
            except Exception:  # a plug-in's bug must not kill the runtime; it is logged with its trace
                self._stats.handler_errors += 1
                log.exception("rank %d: handler for %s failed", self.rank, msg.TAG)

    def _apply_events(self, events: list[MembershipEvent]) -> None:
        """Tell the listeners, then wake the threads in `wait_for`: one that saw a peer DIED finds
        the listeners told (before, a test's listener could still be empty when it looked)."""
        if not events:
            return
        for ev in events:
            if ev.kind in (EventKind.DIED, EventKind.LEFT):
                # Transfers it has not acknowledged never will be: their senders learn it now (a
                # replica of the last step sent to a peer whose session just closed waited for its
                # two-minute deadline, and the sender's close for its commits).
                for (to, _), fut in self._acks.items():
                    if to == ev.peer and not fut.done():
                        gone = PeerLeft if ev.kind is EventKind.LEFT else PeerUnavailable
                        fut.set_exception(gone(f"rank {ev.peer} {ev.kind.value}: {ev.reason}"))
            log.info(
                "rank %d: peer %d %s (incarnation %d): %s",
                self.rank,
                ev.peer,
                ev.kind.value,
                ev.incarnation,
                ev.reason,
            )
            for listener in self._listeners:
                try:
                    listener(ev)
                except Exception:  # as for handlers: count, log, carry on
                    self._stats.handler_errors += 1
                    log.exception("rank %d: membership listener failed", self.rank)
        with self._cond:
            self._cond.notify_all()

    def _offer_transfer(
        self, sender: int, transfer_id: str, meta: dict[str, str], chunks: list[Frame]
    ) -> bool:
        for listener in self._transfer_listeners:
            try:
                if listener(sender, transfer_id, meta, chunks):
                    return True
            except Exception:  # as for handlers: count, log, keep the chunks for take_transfer
                self._stats.handler_errors += 1
                log.exception("rank %d: transfer listener failed", self.rank)
        return False

    def _sink(self, chunk: BulkChunk, meta: dict[str, str]) -> bool:
        for sink in self._chunk_sinks:
            try:
                if sink(chunk.rank, chunk.transfer_id, meta, chunk.index, chunk.count, chunk.buffers[0]):
                    return True
            except Exception:  # as for handlers: count, log, keep the chunk
                self._stats.handler_errors += 1
                log.exception("rank %d: chunk sink failed", self.rank)
        return False

    def _record_telemetry(self, msg: StepTelemetry) -> None:
        with self._cond:
            self._telemetry[self.rank] = msg
            self._cond.notify_all()

    async def _on_bulk_chunk(self, chunk: BulkChunk) -> None:
        key = (chunk.rank, chunk.transfer_id)
        t = self._incoming.get(key)
        if t is None:
            if not 0 < chunk.count <= MAX_BULK_CHUNKS or chunk.total_bytes < 0:
                self._stats.bulk_rejected += 1
                return
            t = self._incoming[key] = _Transfer(
                chunk.rank, chunk.count, chunk.total_bytes, [None] * chunk.count, dict(chunk.meta)
            )
        if (
            chunk.count != t.count
            or chunk.total_bytes != t.total_bytes
            or not 0 <= chunk.index < t.count
            or len(chunk.buffers) != 1
        ):
            self._stats.bulk_rejected += 1
            return
        buf = chunk.buffers[0]
        if t.chunks[chunk.index] is None:
            t.received += 1
            t.received_bytes += len(buf)
        t.chunks[chunk.index] = b"" if self._sink(chunk, t.meta) else buf
        if t.received < t.count:
            return
        del self._incoming[key]
        ok = t.received_bytes == t.total_bytes
        if ok:
            chunks = [c for c in t.chunks if c is not None]
            if not self._offer_transfer(chunk.rank, chunk.transfer_id, t.meta, chunks):
                with self._cond:
                    self._completed[key] = chunks
                    self._cond.notify_all()
        else:
            self._stats.bulk_rejected += 1
        reason = "" if ok else f"{t.received_bytes} bytes arrived, {t.total_bytes} announced"
        await self._send_direct(chunk.rank, BulkAck(self.rank, chunk.transfer_id, -1, ok, reason))


def _group_topic(group: Sequence[int], rank: int, world_size: int) -> bytes:
    """The gossip topic of `rank`'s replica group: `ALL` when the group is the whole job (or
    unknown), else one topic per group, the same on each of its members."""
    members = sorted(set(group))
    if rank not in members or len(members) >= world_size:
        return ALL
    return b"g" + hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=8).digest()


def _pick(endpoints: Sequence[str], allow_ipc: bool) -> str:
    for ep in endpoints:
        if allow_ipc or not ep.startswith("ipc://"):
            return ep
    raise ValueError(f"no usable endpoint in {list(endpoints)}")
