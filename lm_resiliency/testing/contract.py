"""The transport contract: one scenario suite every `Transport` implementation must pass.

Each check is an async function taking a factory that returns a fresh, unstarted transport of the
implementation under test (all from the same medium). Run them under anyio on asyncio:

    @pytest.mark.anyio
    @pytest.mark.parametrize("check", CONTRACT)
    async def test_contract(check, make_transport):
        await check(make_transport)
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import anyio

from lm_resiliency.runtime.transport import ALL, DIRECT, GOSSIP, Endpoints, PeerUnavailable, Transport

__all__ = ["CONTRACT", "TransportFactory"]

TransportFactory = Callable[[], Transport]
TIMEOUT = 10.0


async def _pair(make: TransportFactory) -> tuple[Transport, Endpoints, Transport, Endpoints]:
    a, b = make(), make()
    ea, eb = await a.start(), await b.start()
    a.connect(1, eb.pub[-1], eb.router[-1])
    b.connect(0, ea.pub[-1], ea.router[-1])
    return a, ea, b, eb


async def check_direct_frames_intact_and_ordered(make: TransportFactory) -> None:
    a, _, b, _ = await _pair(make)
    try:
        big = os.urandom(1 << 20)
        with anyio.fail_after(TIMEOUT):
            for i in range(50):
                await a.send(1, [b"hdr", i.to_bytes(4, "big"), big if i % 10 == 0 else b""])
            for i in range(50):
                msg = await b.recv()
                assert msg.channel == DIRECT
                assert len(msg.frames) == 3 and bytes(msg.frames[0]) == b"hdr"
                assert int.from_bytes(bytes(msg.frames[1]), "big") == i, "direct messages reordered"
                assert bytes(msg.frames[2]) == (big if i % 10 == 0 else b"")
    finally:
        await a.close()
        await b.close()


async def check_gossip_reaches_every_subscriber(make: TransportFactory) -> None:
    pub, subs = make(), [make(), make()]
    ep = await pub.start()
    for s in subs:
        await s.start()
        s.connect(0, ep.pub[-1], ep.router[-1])
    try:
        with anyio.fail_after(TIMEOUT):
            for s in subs:
                # Gossip is best effort until a subscription is established: publish until it lands.
                got = None
                while got is None:
                    await pub.publish([b"hello"])
                    with anyio.move_on_after(0.05):
                        got = await s.recv()
                assert got.channel == GOSSIP and [bytes(f) for f in got.frames] == [b"hello"]
    finally:
        for t in (pub, *subs):
            await t.close()


async def check_gossip_topics_reach_their_subscribers_only(make: TransportFactory) -> None:
    pub, inside, outside = make(), make(), make()
    ep = await pub.start()
    for s in (inside, outside):
        await s.start()
        s.connect(0, ep.pub[-1], ep.router[-1])
    inside.subscribe(b"g-one")
    try:
        for bad in (b"", ALL + b"x"):
            try:
                inside.subscribe(bad)
                raise AssertionError(f"topic {bad!r} must be refused")
            except ValueError:
                pass
        with anyio.fail_after(TIMEOUT):
            # Subscriptions take effect at the publisher a moment later: publish until both landed.
            got = None
            while got is None:
                await pub.publish([b"group"], topic=b"g-one")
                with anyio.move_on_after(0.05):
                    got = await inside.recv()
            assert got.channel == GOSSIP and [bytes(f) for f in got.frames] == [b"group"]
            got = None
            while got is None:
                await pub.publish([b"everyone"])
                with anyio.move_on_after(0.05):
                    got = await outside.recv()
            # Everything the outsider ever received is ALL gossip, none of the group's.
            assert [bytes(f) for f in got.frames] == [b"everyone"]
            await pub.publish([b"group"], topic=b"g-one")
            await pub.publish([b"last"])
            while True:
                frames = [bytes(f) for f in (await outside.recv()).frames]
                if frames == [b"last"]:
                    break
                assert frames == [b"everyone"], frames
    finally:
        for t in (pub, inside, outside):
            await t.close()


async def check_send_to_unknown_or_disconnected_peer_raises(make: TransportFactory) -> None:
    a, _, b, _ = await _pair(make)
    try:
        try:
            await a.send(7, [b"x"])
            raise AssertionError("send to a never-connected peer must raise PeerUnavailable")
        except PeerUnavailable:
            pass
        a.disconnect(1)
        a.disconnect(1)  # idempotent
        try:
            await a.send(1, [b"x"])
            raise AssertionError("send to a disconnected peer must raise PeerUnavailable")
        except PeerUnavailable:
            pass
    finally:
        await a.close()
        await b.close()


async def check_reconnect_reaches_a_restarted_peer(make: TransportFactory) -> None:
    a, _, b, _ = await _pair(make)
    await b.close()
    b2 = make()
    eb2 = await b2.start()
    a.connect(1, eb2.pub[-1], eb2.router[-1])  # replaces the dead peer's addresses
    try:
        with anyio.fail_after(TIMEOUT):
            await a.send(1, [b"again"])
            msg = await b2.recv()
            assert [bytes(f) for f in msg.frames] == [b"again"]
    finally:
        await a.close()
        await b2.close()


async def check_close_is_idempotent_and_final(make: TransportFactory) -> None:
    a, _, b, _ = await _pair(make)
    await a.close()
    await a.close()
    await b.close()
    for op in (lambda: a.send(1, [b"x"]), lambda: a.publish([b"x"]), a.recv):
        try:
            with anyio.fail_after(TIMEOUT):
                await op()
            raise AssertionError("a closed transport must raise PeerUnavailable")
        except PeerUnavailable:
            pass


CONTRACT: list[Callable[[TransportFactory], Awaitable[None]]] = [
    check_direct_frames_intact_and_ordered,
    check_gossip_reaches_every_subscriber,
    check_gossip_topics_reach_their_subscribers_only,
    check_send_to_unknown_or_disconnected_peer_raises,
    check_reconnect_reaches_a_restarted_peer,
    check_close_is_idempotent_and_final,
]
