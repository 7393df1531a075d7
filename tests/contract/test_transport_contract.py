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


def test_ipc_socket_files_of_ended_processes_are_swept() -> None:
    """A process killed without closing its transport leaves its two IPC socket files behind (4,269
    had piled up in this machine's /tmp). The first IPC bind of a process removes those of ended
    processes that nobody listens on; a file another pid namespace's process still listens on,
    one that is no socket, and this process's own stay."""
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile

    from lm_resiliency.runtime.transport import sweep_stale_ipc

    ended = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    folder = tempfile.mkdtemp(prefix="lmr-sweep-")  # (short: socket paths have ~107 bytes)
    listening: socket.socket | None = None
    try:

        def bound(name: str) -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(os.path.join(folder, name))
            return s

        bound(f"lmr-{ended}-0123abcd-pub").close()  # its process ended: nobody listens
        listening = bound(f"lmr-{ended}-89abcdef-rtr")
        listening.listen()
        open(os.path.join(folder, f"lmr-{ended}-deadbeef-pub"), "w").close()  # not a socket
        bound(f"lmr-{os.getpid()}-00000000-rtr").close()  # this process lives
        bound("other-pub").close()
        assert sweep_stale_ipc(folder) == 1
        assert sorted(os.listdir(folder)) == sorted(
            [
                f"lmr-{ended}-89abcdef-rtr",
                f"lmr-{ended}-deadbeef-pub",
                f"lmr-{os.getpid()}-00000000-rtr",
                "other-pub",
            ]
        )
        assert sweep_stale_ipc(os.path.join(folder, "missing")) == 0
    finally:
        if listening is not None:
            listening.close()
        shutil.rmtree(folder, ignore_errors=True)
