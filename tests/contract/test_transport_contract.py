from __future__ import annotations

from collections.abc import Callable

import pytest

from lm_resiliency.runtime.transport import Transport, ZmqTransport
from lm_resiliency.testing import InMemoryNetwork, InMemoryTransport
from lm_resiliency.testing.contract import CONTRACT

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["zmq-tcp", "zmq-ipc", "memory"])
def make_transport(request: pytest.FixtureRequest) -> Callable[[], Transport]:
    if request.param == "memory":
        net = InMemoryNetwork()
        return lambda: InMemoryTransport(net)
    if request.param == "zmq-ipc":
        # ipc endpoints come first in Endpoints; the suite connects to the last one (tcp) by default,
        # so expose only ipc here.
        return lambda: _IpcOnly(ZmqTransport("127.0.0.1", use_ipc=True))
    return lambda: ZmqTransport("127.0.0.1", use_ipc=False)


class _IpcOnly:
    """ZmqTransport seen through its IPC endpoints only."""

    def __init__(self, inner: ZmqTransport) -> None:
        self._inner = inner

    async def start(self):  # type: ignore[no-untyped-def]
        from lm_resiliency.runtime.transport import Endpoints

        ep = await self._inner.start()
        return Endpoints(ep.pub[:1], ep.router[:1])

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)


@pytest.mark.parametrize("check", CONTRACT, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_transport_contract(check, make_transport) -> None:  # type: ignore[no-untyped-def]
    await check(make_transport)


def test_implementations_satisfy_the_protocol() -> None:
    assert isinstance(ZmqTransport(), Transport)
    assert isinstance(InMemoryTransport(InMemoryNetwork()), Transport)
