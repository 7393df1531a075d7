"""Rank runtimes in one process, on real ZeroMQ sockets and on the in-memory twin."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest

from lm_resiliency.config import RuntimeConfig
from lm_resiliency.core import codec
from lm_resiliency.core.auth import Signer
from lm_resiliency.core.membership import EventKind, PeerState
from lm_resiliency.core.messages import BulkChunk, Goodbye, Heartbeat, PeerAnnouncement, StepTelemetry
from lm_resiliency.errors import RuntimeClosedError
from lm_resiliency.runtime.node import RankRuntime
from lm_resiliency.runtime.transport import PeerLeft, ZmqTransport
from lm_resiliency.testing import InMemoryNetwork, InMemoryTransport
from tests.conftest import start_runtimes as _start

pytestmark = pytest.mark.timeout(60)
KEY = b"j" * 32
CFG = RuntimeConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _tap_steps(net: InMemoryNetwork, rank: int) -> list[list[int]]:
    """The steps of `rank`'s telemetry on the wire, one list per message (a batch's in order)."""
    from lm_resiliency.core.messages import Batch

    sent: list[list[int]] = []

    def tap(sender: str, frames: list[bytes]) -> list[bytes]:
        msg = codec.decode(frames[1:])
        items = [msg] if not isinstance(msg, Batch) else [codec.decode([i]) for i in msg.items]
        steps = [m.step for m in items if isinstance(m, StepTelemetry) and m.rank == rank]
        if steps:
            sent.append(steps)
        return frames

    net.tamper = tap
    return sent


def _steps_heard(rt: RankRuntime) -> tuple[list[int], Callable[[int], bool]]:
    """The telemetry steps `rt` receives, in order, and a wait for the first `n` of them."""
    got: list[int] = []
    arrived = threading.Condition()

    def on_step(sealed: object, msg: StepTelemetry) -> None:
        with arrived:
            got.append(msg.step)
            arrived.notify_all()

    def until(n: int) -> bool:
        with arrived:
            return arrived.wait_for(lambda: len(got) >= n, 5.0)

    rt.add_handler("step", on_step)
    return got, until


def _tap_heartbeats(net: InMemoryNetwork, rank: int) -> tuple[list[int], list[int]]:
    """Steps of `rank`'s heartbeats on the wire: (sent alone, carried inside batches)."""
    from lm_resiliency.core.messages import Batch

    alone: list[int] = []
    carried: list[int] = []

    def tap(sender: str, frames: list[bytes]) -> list[bytes]:
        msg = codec.decode(frames[1:])
        if isinstance(msg, Heartbeat) and msg.rank == rank:
            alone.append(msg.step)
        if isinstance(msg, Batch) and msg.rank == rank:
            carried.extend(
                m.step for m in map(codec.decode, ([i] for i in msg.items)) if isinstance(m, Heartbeat)
            )
        return frames

    net.tamper = tap
    return alone, carried


@pytest.fixture(params=["zmq", "memory"])
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[list[RankRuntime], InMemoryNetwork | None]]:
    if request.param == "zmq":
        rts, net = _start(3, lambda: ZmqTransport("127.0.0.1")), None
    else:
        net = InMemoryNetwork()
        rts = _start(3, lambda: InMemoryTransport(net))
    try:
        yield rts, net
    finally:
        for rt in rts:
            rt.close()


def test_membership_telemetry_and_goodbye(cluster) -> None:  # type: ignore[no-untyped-def]
    rts, _ = cluster
    for rt in rts:
        assert rt.wait_for(lambda v: len(v.live) == 3, 2.0)
    rts[1].set_progress(4)
    rts[1].submit(StepTelemetry(rank=1, step=4, step_s=0.5, compute_s=0.4))
    for rt in rts:
        assert rt.wait_for(lambda v: v.telemetry_step(1) == 4, 2.0)
    assert rts[0].view().peers[1].telemetry.compute_s == 0.4  # type: ignore[union-attr]
    events = []
    rts[0].add_membership_listener(events.append)
    rts[2].close()
    assert rts[0].wait_for(lambda v: v.peers[2].state is PeerState.LEFT, 2.0)
    assert [(e.kind, e.peer) for e in events] == [(EventKind.LEFT, 2)]


def test_silence_is_death_and_return_is_life() -> None:
    net = InMemoryNetwork()
    rts = _start(3, lambda: InMemoryTransport(net))
    try:
        _silence(rts, net)
    finally:
        for rt in rts:
            rt.close()


def _silence(rts: list[RankRuntime], net: InMemoryNetwork) -> None:
    for rt in rts:
        assert rt.wait_for(lambda v: len(v.live) == 3, 2.0)
    net.partition(rts[2]._transport)  # type: ignore[arg-type]
    t0 = time.monotonic()
    assert rts[0].wait_for(lambda v: v.peers[2].state is PeerState.DEAD, 2.0)
    assert time.monotonic() - t0 <= CFG.heartbeat_timeout_s + 0.3
    net.heal(rts[2]._transport)  # type: ignore[arg-type]
    assert rts[0].wait_for(lambda v: v.peers[2].state is PeerState.ALIVE, 2.0)


def test_ranks_on_two_machines_with_one_machine_id_talk_over_tcp() -> None:
    """Hosts cloned from one image share /etc/machine-id, so their ranks announce one node id.
    An ipc:// path names a file on its own machine: here each rank sees the other's as a path its
    machine lacks. Before, the shared id alone chose IPC and the ranks never heard each other."""
    rts = [
        RankRuntime(
            rank=r,
            world_size=2,
            node_id="cloned-image",
            key=KEY,
            incarnation=1,
            config=CFG,
            transport_factory=lambda: ZmqTransport("127.0.0.1"),
        )
        for r in range(2)
    ]
    try:
        anns = [rt.start() for rt in rts]
        assert all(any(ep.startswith("ipc://") for ep in a.pub) for a in anns)

        def elsewhere(a: PeerAnnouncement, machine: str) -> PeerAnnouncement:
            def away(eps: tuple[str, ...]) -> tuple[str, ...]:
                return tuple(
                    "ipc:///nonexistent/other-machine" if ep.startswith("ipc://") else ep for ep in eps
                )

            return dataclasses.replace(
                a, host=f"{machine}:4026531836", pub=away(a.pub), router=away(a.router)
            )

        rts[0].connect_peers([anns[0], elsewhere(anns[1], "boot-of-machine-b")], announce=True)
        rts[1].connect_peers([elsewhere(anns[0], "boot-of-machine-a"), anns[1]], announce=True)
        for rt in rts:
            assert rt.wait_for(lambda v: len(v.live) == 2, 5.0)
    finally:
        for rt in rts:
            rt.close()


def test_close_leaks_no_thread_socket_or_fd_and_is_quick() -> None:
    before_fds, before_threads = _fds(), set(threading.enumerate())
    before_ipc = _ipc_files()  # an earlier test's runtime is that test's business, as with fds
    rts = _start(3, lambda: ZmqTransport("127.0.0.1"))
    assert rts[0].wait_for(lambda v: len(v.live) == 3, 2.0)
    t0 = time.monotonic()
    for rt in rts:
        rt.close()
        rt.close()  # idempotent
    assert time.monotonic() - t0 < 3 * 1.0
    assert set(threading.enumerate()) - before_threads == set()
    assert _fds() == before_fds
    assert _ipc_files() == before_ipc  # ipc files removed


def _ipc_files() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(f"lmr-{os.getpid()}-")}


def test_hostile_messages_are_counted_and_never_acted_on() -> None:
    net = InMemoryNetwork()
    captured: list[tuple[str, list[bytes]]] = []

    def tap(sender: str, frames: list[bytes]) -> list[bytes]:
        captured.append((sender, frames))
        return frames

    net.tamper = tap
    rts = _start(2, lambda: InMemoryTransport(net))
    try:
        assert rts[0].wait_for(lambda v: len(v.live) == 2, 2.0)
        t1 = rts[1]._transport
        assert t1 is not None

        def inject(frames: list) -> None:  # type: ignore[type-arg]
            rts[1].loop.call(t1.send, 0, frames)

        genuine = next(f for s, f in reversed(captured) if s == t1.name)  # type: ignore[attr-defined]
        # 1. a forged goodbye signed with another key
        inject(Signer(b"x" * 32, 1, 1).seal(codec.encode(Goodbye(1, 1, "forged"))))
        # 2. a replay of a message rank 1 really sent
        inject(genuine)
        # 3. a correctly signed but malformed payload
        inject(rts[1]._signer.seal([msgpack.packb(["hb", 1, {"rank": "one"}, 0])]))
        # 4. rank 1's key used to claim to be rank 0
        inject(rts[1]._signer.seal(codec.encode(Heartbeat(0, 1, 99, 99))))
        # 5. a plug-in handler that raises
        rts[0].add_handler("step", lambda sealed, msg: 1 / 0)
        rts[1].submit(StepTelemetry(rank=1, step=1, step_s=0.1))

        def counted(v) -> bool:  # type: ignore[no-untyped-def]
            s = v.stats
            return (
                s["rejected_auth"] >= 1
                and s["rejected_replay"] >= 1
                and s["codec_errors"] >= 1
                and s["impersonation"] >= 1
                and s["handler_errors"] >= 1
            )

        assert rts[0].wait_for(counted, 2.0), str(rts[0].view().stats)
        v = rts[0].view()
        assert v.peers[1].state is PeerState.ALIVE  # the forged goodbye did nothing
        assert v.peers[0].step != 99
        assert rts[0].alive
    finally:
        for rt in rts:
            rt.close()


def test_wrong_job_key_never_joins() -> None:
    net = InMemoryNetwork()
    a = RankRuntime(
        rank=0,
        world_size=2,
        node_id="n",
        key=KEY,
        incarnation=1,
        config=CFG,
        transport_factory=lambda: InMemoryTransport(net),
    )
    b = RankRuntime(
        rank=1,
        world_size=2,
        node_id="n",
        key=b"z" * 32,
        incarnation=1,
        config=CFG,
        transport_factory=lambda: InMemoryTransport(net),
    )
    try:
        anns = [a.start(), b.start()]
        a.connect_peers(anns, announce=True)
        b.connect_peers(anns, announce=True)
        assert a.wait_for(lambda v: v.stats["rejected_auth"] >= 3, 2.0)
        assert a.view().peers[1].state is not PeerState.ALIVE
    finally:
        a.close()
        b.close()


def test_bulk_transfer_zmq() -> None:
    rts = _start(2, lambda: ZmqTransport("127.0.0.1"))
    try:
        data = [os.urandom(1 << 20) for _ in range(5)]
        ack = rts[0].send_bulk(1, "t1", data).result(10)
        assert ack.ok
        got = rts[1].take_transfer(0, "t1")
        assert got is not None and [bytes(g) for g in got] == data
        assert rts[1].take_transfer(0, "t1") is None
    finally:
        for rt in rts:
            rt.close()


def _corrupt_first_64k_buffer(net: InMemoryNetwork) -> list[int]:
    """Flip one byte of the first 64 KiB buffer that passes through `net`, once; the returned
    list is non-empty once it happened."""
    flipped: list[int] = []

    def corrupt_once(sender: str, frames: list[bytes]) -> list[bytes]:
        if not flipped and len(frames) == 3 and len(frames[2]) == 1 << 16:
            flipped.append(1)
            damaged = bytearray(frames[2])
            damaged[100] ^= 0x01
            return [frames[0], frames[1], bytes(damaged)]
        return frames

    net.tamper = corrupt_once
    return flipped


def test_bulk_chunk_corrupted_in_flight_is_resent() -> None:
    net = InMemoryNetwork()
    flipped = _corrupt_first_64k_buffer(net)
    rts = _start(2, lambda: InMemoryTransport(net))
    try:
        data = [os.urandom(1 << 16) for _ in range(4)]
        ack = rts[0].send_bulk(1, "t", data).result(10)
        assert ack.ok and flipped
        got = rts[1].take_transfer(0, "t")
        assert got is not None and [bytes(g) for g in got] == data
        assert rts[1].view().stats["corrupt_in_flight"] == 1
        assert rts[0].view().stats["bulk_resent"] == 1
    finally:
        for rt in rts:
            rt.close()


def test_a_sender_told_to_damage_its_next_chunk_has_it_resent_and_is_named() -> None:
    """damage_outgoing (a campaign's payload corruption): the next chunk leaves with a byte flipped
    after sealing; the receiver's checksum rejects it, its corruption listeners hear the sender,
    and the resent chunk arrives intact."""
    net = InMemoryNetwork()
    rts = _start(2, lambda: InMemoryTransport(net))
    heard: list[tuple[int, str]] = []
    rts[1].add_corruption_listener(lambda sender, detail: heard.append((sender, detail)))
    try:
        data = [os.urandom(1 << 16) for _ in range(3)]
        rts[0].damage_outgoing(1)
        assert rts[0].send_bulk(1, "t", data).result(10).ok
        got = rts[1].take_transfer(0, "t")
        assert got is not None and [bytes(g) for g in got] == data
        assert [s for s, _ in heard] == [0] and "chunk 0 of t from rank 0" in heard[0][1]
        assert rts[0].view().stats["bulk_resent"] == 1
    finally:
        for rt in rts:
            rt.close()


def test_chunk_sink_streams_a_transfer_and_sees_a_resent_chunk() -> None:
    """A sink takes each verified chunk as it arrives (GEMINI writes replicas this way); the runtime
    keeps only lengths, and a chunk damaged in flight reaches the sink once, after its resend."""
    net = InMemoryNetwork()
    flipped = _corrupt_first_64k_buffer(net)
    rts = _start(2, lambda: InMemoryTransport(net))
    sunk: dict[int, bytes] = {}
    done: list[list[bytes]] = []

    def sink(sender: int, tid: str, meta: dict[str, str], index: int, count: int, chunk: bytes) -> bool:
        if meta.get("stream") != "yes":
            return False
        assert index not in sunk
        sunk[index] = bytes(chunk)
        return True

    rts[1].add_chunk_sink(sink)
    rts[1].add_transfer_listener(lambda s, tid, meta, chunks: bool(done.append([bytes(c) for c in chunks])))
    try:
        data = [os.urandom(1 << 16) for _ in range(4)]
        assert rts[0].send_bulk(1, "s", data, {"stream": "yes"}).result(10).ok and flipped
        assert [sunk[i] for i in range(4)] == data
        assert rts[1].wait_for(lambda v: bool(done), 2.0) and done == [[b""] * 4]
        assert rts[0].send_bulk(1, "plain", data[:2]).result(10).ok  # not the sink's: kept whole
        assert rts[1].wait_for(lambda v: len(done) == 2, 2.0) and done[1] == data[:2]
    finally:
        for rt in rts:
            rt.close()


def test_messages_submitted_under_hold_travel_as_one_batch() -> None:
    """A step's gossip leaves as one sealed batch; every item reaches the handlers, in order; a
    batched item claiming another rank, a batch inside a batch and a malformed item are dropped."""
    from lm_resiliency.core.messages import Batch

    net = InMemoryNetwork()
    wire: list[str] = []  # the tag of every message on the wire

    def tap(sender: str, frames: list[bytes]) -> list[bytes]:
        wire.append(codec.decode_header(frames[1])[0])
        return frames

    net.tamper = tap
    rts = _start(2, lambda: InMemoryTransport(net))
    got: list[int] = []
    try:
        assert rts[0].wait_for(lambda v: len(v.live) == 2, 2.0)
        rts[0].add_handler("step", lambda sealed, msg: got.append(msg.step))
        with rts[1].hold():
            for step in (1, 2, 3):
                rts[1].submit(StepTelemetry(rank=1, step=step, step_s=0.1))
        assert rts[0].wait_for(lambda v: v.telemetry_step(1) == 3, 2.0)
        assert got == [1, 2, 3]
        assert wire.count("bat") == 1 and "step" not in wire  # one sealed message for the three

        def inject(msg: Batch) -> None:
            t1 = rts[1]._transport
            assert t1 is not None
            rts[1].loop.call(t1.publish, rts[1]._signer.seal(codec.encode(msg)))

        forged = codec.encode(StepTelemetry(rank=0, step=50, step_s=0.1))[0]
        nested = codec.encode(Batch(1, (codec.encode(StepTelemetry(rank=1, step=60, step_s=0.1))[0],)))[0]
        inject(
            Batch(
                1,
                (
                    bytes(forged),
                    bytes(nested),
                    b"not msgpack",
                    bytes(codec.encode(StepTelemetry(rank=1, step=7, step_s=0.1))[0]),
                ),
            )
        )

        def counted(v) -> bool:  # type: ignore[no-untyped-def]
            return v.stats["impersonation"] >= 2 and v.stats["codec_errors"] >= 1 and 7 in got

        assert rts[0].wait_for(counted, 2.0), str(rts[0].view().stats)
        assert 50 not in got and 60 not in got
    finally:
        for rt in rts:
            rt.close()


def test_a_step_held_while_the_runtime_closes_is_dropped_not_raised_into_training() -> None:
    """SIGTERM closes the runtime from the training thread's own signal handler, possibly inside a
    step's `hold()`: the step's messages have nowhere to go, and the step must not fail for it."""
    rts = _start(2, lambda: InMemoryTransport(InMemoryNetwork()))
    try:
        with rts[1].hold():
            rts[1].close()  # (the handler ran between two of the step's submits)
            rts[1].submit(StepTelemetry(rank=1, step=1, step_s=0.1))
        with pytest.raises(RuntimeClosedError):  # outside a step's hold, a closed runtime still says so
            rts[1].submit(StepTelemetry(rank=1, step=2, step_s=0.1))
    finally:
        for rt in rts:
            rt.close()


@pytest.mark.parametrize("coalesce", [0.0, 1.0])
def test_steps_submitted_while_the_publisher_lingers_go_out_together(coalesce: float) -> None:
    """Steps the training thread submits within `publish_coalesce_s` of the last send wait for it
    and leave as one batch (no wakeup of the runtime per step); with 0 each leaves at once. Nothing
    is lost or reordered either way: what still waits when the rank closes goes out first."""

    net = InMemoryNetwork()
    sent = _tap_steps(net, 1)
    cfg = RuntimeConfig(
        heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0, publish_coalesce_s=coalesce, telemetry_batch_s=0.0
    )
    rts = _start(2, lambda: InMemoryTransport(net), config=cfg)

    try:
        assert rts[0].wait_for(lambda v: len(v.live) == 2, 2.0)
        got, until = _steps_heard(rts[0])
        for step in range(1, 7):
            with rts[1].hold():
                rts[1].submit(StepTelemetry(rank=1, step=step, step_s=0.01))
            if step == 1 or coalesce == 0:  # on the wire before the next is submitted
                assert until(step)
        rts[1].close()  # within the linger: what waits still reaches the peer, before the goodbye
        assert until(6)
        assert got == [1, 2, 3, 4, 5, 6]
        assert sent == ([[1], [2, 3, 4, 5, 6]] if coalesce else [[s] for s in got])
    finally:
        for rt in rts:
            rt.close()


def test_published_steps_carry_the_heartbeat_and_the_timer_stays_quiet() -> None:
    """While a rank publishes steps more often than its heartbeat interval, its heartbeats travel
    inside those batches and no stand-alone heartbeat is sent; peers still see it alive, at its step.
    Once the steps stop, the timer beats again."""
    from lm_resiliency.core.clock import ManualClock

    net = InMemoryNetwork()
    alone, carried = _tap_heartbeats(net, 1)
    clock = ManualClock(100.0)
    cfg = RuntimeConfig(
        heartbeat_interval_s=0.05, heartbeat_timeout_s=5.0, telemetry_batch_s=0.0
    )  # each step sent
    rts = _start(2, lambda: InMemoryTransport(net), config=cfg, clocks=[None, clock])
    try:
        assert rts[0].wait_for(lambda v: len(v.live) == 2, 2.0)
        assert rts[1].wait_for(lambda v: len(v.live) == 2, 2.0)
        beats_before = len(alone)
        for step in range(1, 21):
            clock.advance(0.03)  # 0.6 of an interval per step: a heartbeat would be due every 2nd
            rts[1].set_progress(step)
            with rts[1].hold():
                rts[1].submit(StepTelemetry(rank=1, step=step, step_s=0.03))
                rts[1].submit(StepTelemetry(rank=1, step=step, step_s=0.03))
            assert rts[0].wait_for(lambda v, s=step: v.telemetry_step(1) == s, 2.0)
        assert len(alone) == beats_before  # the timer stayed quiet
        assert len(carried) == 20 and carried[-1] == 20  # every step's batch carried one
        view = rts[0].view()
        assert 1 in view.live and view.peers[1].step == 20
        clock.advance(0.06)  # no step for more than an interval: the timer beats again
        assert rts[0].wait_for(lambda v: len(alone) > beats_before, 2.0)
    finally:
        for rt in rts:
            rt.close()


@pytest.mark.parametrize("kind", ["zmq", "memory"])
def test_group_scoped_gossip_reaches_the_replica_group_only(kind: str) -> None:
    """Tags scoped to the group travel on the group's topic (the publisher filters): replicas get
    them, other ranks never do, yet still get job-wide gossip and keep everyone alive, with the
    heartbeat no longer riding in group-only batches. Tags scoped to the peer group (replicas and
    ranks doing the same work) reach exactly it."""
    from lm_resiliency.core.messages import Progress, Vote

    net = InMemoryNetwork()
    factory = (lambda: ZmqTransport("127.0.0.1")) if kind == "zmq" else (lambda: InMemoryTransport(net))
    rts = _start(6, factory, groups=[(0, 1), (2, 3)], peers=[(0, 1, 2, 3)])
    seen: dict[int, list[str]] = {r: [] for r in range(6)}
    try:
        for rt in rts:
            rt.scope_to_group("step")
            rt.scope_to_peers("vote")  # the peer group: (0, 1, 2, 3), never 4 or 5
            rt.add_handler("step", lambda sealed, msg, r=rt.rank: seen[r].append(f"step{msg.rank}"))
            rt.add_handler("vote", lambda sealed, msg, r=rt.rank: seen[r].append(f"vote{msg.rank}"))
            rt.add_handler("prog", lambda sealed, msg, r=rt.rank: seen[r].append(f"prog{msg.rank}"))
            assert rt.wait_for(lambda v: len(v.live) == 6, 5.0)
        # A ZeroMQ subscription reaches the publisher a moment after connecting: publish until the
        # replica has one step, then a job-wide marker; no rank may have more than it is owed.
        step = 0
        while not rts[1].wait_for(lambda v: v.telemetry_step(0) >= 0, 0.05):
            step += 1
            assert step < 200, "the replica never got the group's gossip"
            rts[0].submit(StepTelemetry(rank=0, step=step, step_s=0.1))
        for r in (2, 3):
            while "vote0" not in seen[r]:
                rts[0].submit(Vote(0, "k", "straggler", (0,), step, "r"))
                rts[r].wait_for(lambda v, r=r: "vote0" in seen[r], 0.05)
        for r in (2, 3, 4, 5):
            while "prog0" not in seen[r]:
                rts[0].submit(Progress(0, step, 0, 0.0, 0.0))
                rts[r].wait_for(lambda v, r=r: "prog0" in seen[r], 0.05)
        for r in (2, 3, 4, 5):
            assert "step0" not in seen[r] and rts[r].view().peers[0].telemetry is None
        for r in (4, 5):
            assert "vote0" not in seen[r]
        assert "step0" in seen[1] and "step0" in seen[0]  # looped back to its own handlers too
        for rt in rts:
            assert rt.view().live == frozenset(range(6))
        assert rts[0]._group_topic == rts[1]._group_topic != rts[2]._group_topic
        assert rts[0]._peer_topic == rts[3]._peer_topic != rts[4]._peer_topic
    finally:
        for rt in rts:
            rt.close()


def test_a_group_that_is_the_whole_job_gossips_on_the_common_topic() -> None:
    from lm_resiliency.runtime.node import _group_topic
    from lm_resiliency.runtime.transport import ALL

    assert _group_topic((0, 1, 2), 1, 3) == ALL
    assert _group_topic((), 1, 3) == ALL
    assert _group_topic((0, 2), 1, 3) == ALL  # not a member: nothing to scope to
    assert _group_topic((2, 0), 0, 3) == _group_topic((0, 2), 2, 3) != ALL


def test_group_only_gossip_does_not_carry_the_heartbeat() -> None:
    """A rank whose steps go to its replica group only must still beat for the rest of the job."""
    from lm_resiliency.core.clock import ManualClock

    net = InMemoryNetwork()
    alone, carried = _tap_heartbeats(net, 0)
    clock = ManualClock(100.0)
    cfg = RuntimeConfig(
        heartbeat_interval_s=0.05, heartbeat_timeout_s=5.0, telemetry_batch_s=0.0
    )  # each step sent
    rts = _start(3, lambda: InMemoryTransport(net), config=cfg, clocks=[clock, None, None], groups=[(0, 1)])
    try:
        rts[0].scope_to_group("step")
        assert rts[2].wait_for(lambda v: len(v.live) == 3, 2.0)
        for step in range(1, 11):
            clock.advance(0.03)
            rts[0].set_progress(step)
            with rts[0].hold():
                rts[0].submit(StepTelemetry(rank=0, step=step, step_s=0.03))
                rts[0].submit(StepTelemetry(rank=0, step=step, step_s=0.03))
            assert rts[1].wait_for(lambda v, s=step: v.telemetry_step(0) == s, 2.0)
            if step % 2 == 0:  # a beat is due (0.06 s since the last): rank 2 hears it from the timer
                assert rts[2].wait_for(lambda v, s=step: v.peers[0].step == s, 2.0)
        assert carried == [] and len(alone) >= 5  # the timer kept beating: every 2nd step
        clock.advance(0.06)
        assert rts[2].wait_for(lambda v: v.peers[0].step == 10, 2.0)  # from the timer's heartbeats
        assert rts[2].view().peers[0].telemetry is None
    finally:
        for rt in rts:
            rt.close()


def test_a_same_host_peer_whose_process_ends_is_dead_before_the_timeout() -> None:
    """Peers on one host (same boot id and pid namespace) watch each other's pid: a SIGKILLed
    worker is dead at the next heartbeat tick, not after the timeout (its peers' collectives fail
    at once and they die of it first). Rank 1's announcement points at a child process that the test
    kills (and leaves unreaped: a zombie has ended too); rank 1's own runtime, in this process, keeps
    sending: what that incarnation sends after it was seen ending must not revive it."""
    import dataclasses
    import signal
    import subprocess
    import sys

    from lm_resiliency._proc import host_key

    config = RuntimeConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0)
    net = InMemoryNetwork()
    rts = _start(2, lambda: InMemoryTransport(net), config=config)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert rts[0].wait_for(lambda v: len(v.live) == 2, 2.0)
        ann = rts[1].announcement
        assert ann.host == host_key() != ""
        events: list = []
        rts[0].add_membership_listener(events.append)
        # On another host, the same pid number is another process: never judged by ours.
        rts[0].connect_peers([dataclasses.replace(ann, pid=child.pid, host="another-boot:1")])
        child.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, left a zombie (not reaped)
        assert rts[0].check_exited_peers() == frozenset()
        rts[0].connect_peers([dataclasses.replace(ann, pid=child.pid)])
        t0 = time.monotonic()
        assert rts[0].wait_for(lambda v: v.peers[1].state is PeerState.DEAD, 2.0)
        assert time.monotonic() - t0 < 1.0  # ticks of 0.05 s; the timeout is 30 s
        # The listeners are told before wait_for wakes; the state itself may be seen a moment before.
        assert rts[0].wait_for(lambda v: bool(events), 2.0)
        assert [(e.kind, e.peer) for e in events] == [(EventKind.DIED, 1)]
        assert events[0].reason == f"process_exited: pid {child.pid} on this host ended"
        rts[1].set_progress(3)  # its heartbeats go on: ignored
        assert not rts[0].wait_for(lambda v: v.peers[1].state is PeerState.ALIVE, 0.3)
        assert rts[0].check_exited_peers() == frozenset({1})
    finally:
        child.kill()
        child.wait(10)
        for rt in rts:
            rt.close()


def test_a_transfer_to_a_peer_that_leaves_fails_at_its_goodbye_not_its_deadline() -> None:
    """A replica sent to a holder whose session closes (the job's end: ranks close in any order)
    was waited for until its deadline, two minutes for GEMINI, and the sender's close timed out
    under it and unmapped the slots its commit was reading. The peer's goodbye now fails the
    transfer, and one started after it fails at once."""
    net = InMemoryNetwork()
    rts = _start(2, lambda: InMemoryTransport(net))
    try:
        for rt in rts:
            assert rt.wait_for(lambda v: len(v.live) == 2, 2.0)

        def drop_chunks(sender: str, frames: list[bytes]) -> list[bytes] | None:
            # The holder never receives the chunks (its session is closing): no ack can come.
            return None if isinstance(codec.decode(frames[1:]), BulkChunk) else frames

        net.tamper = drop_chunks
        pending = rts[0].send_bulk(1, "in-flight", [b"x" * 1024] * 3, timeout=60.0)
        assert not pending.done()
        rts[1].close()
        with pytest.raises(PeerLeft, match="rank 1 left"):
            pending.result(5.0)
        with pytest.raises(PeerLeft, match="rank 1 is left"):
            rts[0].send_bulk(1, "after", [b"y"], timeout=60.0).result(1.0)
    finally:
        for rt in rts:
            rt.close()


@pytest.mark.timeout(30)
def test_a_rank_dying_of_a_failed_collective_waits_briefly_to_see_its_peer_end() -> None:
    """A SIGKILLed worker's sockets close while the kernel still tears it down, so its partner's
    collective can fail before /proc shows the end: `check_exited_peers(settle_s=...)` looks again
    until the peer is seen ended (or that time passes). The peer here ends 0.3 s after the check
    starts; heartbeat ticks (10 s apart) play no part."""
    import dataclasses
    import subprocess
    import sys

    config = RuntimeConfig(heartbeat_interval_s=10.0, heartbeat_timeout_s=60.0)
    net = InMemoryNetwork()
    rts = _start(2, lambda: InMemoryTransport(net), config=config)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert rts[0].wait_for(lambda v: len(v.live) == 2, 5.0)
        rts[0].connect_peers([dataclasses.replace(rts[1].announcement, pid=child.pid)])
        assert rts[0].check_exited_peers() == frozenset()  # alive: one look, no wait
        timer = threading.Timer(0.3, child.stdin.close)  # type: ignore[union-attr]
        timer.start()
        t0 = time.monotonic()
        assert rts[0].check_exited_peers(settle_s=5.0) == frozenset({1})
        assert time.monotonic() - t0 < 4.0
        timer.join()
    finally:
        child.kill()
        child.wait(10)
        for rt in rts:
            rt.close()


def test_telemetry_of_short_steps_waits_for_the_next_send_and_is_never_stuck() -> None:
    """Steps shorter than `telemetry_batch_s` no longer cost a send each: their telemetry waits in
    the outbox until something must go at once (here another message: evidence, a vote) or the
    timer's next tick (the training thread stopped); a step past the bound goes at once, as the
    first does. Nothing is lost or reordered, and the receiver sees each step."""
    from lm_resiliency.core.clock import ManualClock
    from lm_resiliency.core.messages import GeminiInventory

    net = InMemoryNetwork()
    sent = _tap_steps(net, 1)
    clock = ManualClock(100.0)
    cfg = RuntimeConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=60.0, telemetry_batch_s=0.5)
    rts = _start(2, lambda: InMemoryTransport(net), config=cfg, clocks=[None, clock])

    def step(n: int, advance: float = 0.01) -> None:
        clock.advance(advance)
        with rts[1].hold():
            rts[1].submit(StepTelemetry(rank=1, step=n, step_s=advance))

    try:
        assert rts[0].wait_for(lambda v: len(v.live) == 2, 2.0)
        got, until = _steps_heard(rts[0])
        step(1)  # the first goes at once (nothing sent for longer than the bound)
        assert until(1)
        for n in (2, 3, 4):
            step(n)  # within the bound of that send: they wait
        assert sent == [[1]] and got == [1]
        with rts[1].hold():  # something that must go at once takes them along
            rts[1].submit(StepTelemetry(rank=1, step=5, step_s=0.01))
            rts[1].submit(GeminiInventory(rank=1, local=(5,), replicas={}))
        assert until(5) and sent == [[1], [2, 3, 4, 5]]
        step(6)  # the last step before the training thread stops: the timer sends it
        clock.advance(0.6)
        assert until(6) and sent[-1] == [6]
        assert got == [1, 2, 3, 4, 5, 6]
    finally:
        for rt in rts:
            rt.close()
