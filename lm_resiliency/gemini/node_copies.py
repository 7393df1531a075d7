"""The replicas a node holds, served by its torchrun agent to a worker of another node that restores
with no session.

A zero-import worker (`worker_boot`) restores at its model's first forward, in a session whose
recovery pulls a replica from the peer rank that holds it. A restart that resumes at the loop's
last step runs no forward, so no session opens on any rank: a rank whose own copy is not in this
node's memory (its node replaced a lost one) found no copy to restore when the script read its
state (`local.restore_planned`), and the script saved the fresh model's state (NOT RESTORED). The
copy was in a peer node's memory, which no session of that node serves then.

Each agent (`adapters/torchrun`) runs a `NodeCopies` server for the run: a ZeroMQ ROUTER on its
address whose endpoint it publishes in the control store (`endpoint_key`), answering two requests,
each authenticated with the run's key (`key_name`, made once in the control store by the first
agent: a process that cannot read the store cannot read the copies):

  find  {owner, step}                  -> the name and size of a replica of it this node holds
  read  {name, offset, length}         -> those bytes of that replica file

`fetch_replica` (in the worker) asks the agents of the generation's other nodes in turn and returns
the first whole image whose header and every chunk's checksum verify: a copy torn by a capture under
way, truncated or damaged is refused, and the next node is asked.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import zmq

from lm_resiliency.runtime.shm import CorruptSlot, SlotFile, SlotHeader, verify_image

__all__ = ["NodeCopies", "endpoint_key", "fetch_replica", "key_name"]

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # bytes per read request
_REQUEST_MAX = 64 << 10  # bytes in a request's frame, at most
_NAME = re.compile(r"replica-r(\d+)-h(\d+)-s[01]")


def key_name() -> str:
    """The key, under the run's prefix in the control store, of the run's key for these requests."""
    return "copies/key"


def endpoint_key(node: str) -> str:
    """The key, under the run's prefix, of `node`'s server endpoint."""
    return f"copies/node/{node}"


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


class NodeCopies:
    """Serves the replica files in `folder` (this node's folder of the run's in-memory checkpoints)
    on a thread of its own until `close`."""

    def __init__(self, folder: Path, key: bytes, host: str, poll_ms: int = 200) -> None:
        self.folder, self.key, self.poll_ms = folder, key, poll_ms
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.maxmsgsize = _REQUEST_MAX  # (a larger request drops its connection: never held)
        try:
            if ":" in host:  # an IPv6 literal
                self._sock.ipv6 = True
                port = self._sock.bind_to_random_port(f"tcp://[{host}]")
                self.endpoint = f"tcp://[{host}]:{port}"
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
                self.endpoint = f"tcp://{host}:{port}"
        except zmq.ZMQError:  # (a host name: every interface, reached by its name)
            port = self._sock.bind_to_random_port("tcp://*")
            self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._closing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lm-resiliency-node-copies", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (once; from any thread)."""
        with self._closing:
            if self._stop.is_set():
                return
            self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        if not self._thread.is_alive():  # (else its socket is closed with the process)
            self._sock.close(linger=0)
            self._ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(self.poll_ms):
                    continue
                frames = self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                log.warning("node copies: receive failed: %s", exc)
                continue
            try:
                reply = self.answer(frames[1:])
            except Exception as exc:  # a request this code did not foresee: said, never fatal
                log.exception("node copies: answering a request failed")
                reply = [_status(False, f"{type(exc).__name__}: {exc}")]
            with contextlib.suppress(zmq.ZMQError):  # (the asker went away)
                self._sock.send_multipart([frames[0], *reply])

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """The reply frames to one request's frames ([mac, body])."""
        if len(frames) != 2 or not hmac.compare_digest(frames[0], _mac(self.key, frames[1])):
            return [_status(False, "not authenticated with this run's key")]
        try:
            req = json.loads(frames[1])
        except ValueError:
            return [_status(False, "malformed request (not JSON)")]
        op = req.get("op") if isinstance(req, dict) else None
        if op == "find" and _ints(req, "owner", "step"):
            return [self._find(req["owner"], req["step"])]
        if op == "read" and _ints(req, "offset", "length") and isinstance(req.get("name"), str):
            return self._read(req["name"], req["offset"], req["length"])
        return [_status(False, f"malformed request: {str(req)[:200]}")]

    def _find(self, owner: int, step: int) -> bytes:
        seen = []
        for path in sorted(self.folder.glob(f"replica-r{owner}-h*-s*")):
            if not _NAME.fullmatch(path.name):
                continue
            try:
                slot = SlotFile.open_existing(path)
            except CorruptSlot as exc:
                seen.append(str(exc))
                continue
            try:
                h = slot.read_header()
            except CorruptSlot as exc:
                seen.append(str(exc))
                continue
            finally:
                slot.close()
            if h.owner == owner and h.step == step:
                return _status(True, name=path.name, size=h.file_size)
            seen.append(f"{path.name}: step {h.step}")
        return _status(False, f"no replica of rank {owner} step {step} here ({'; '.join(seen) or 'none'})")

    def _read(self, name: str, offset: int, length: int) -> list[bytes]:
        if not _NAME.fullmatch(name) or offset < 0 or not 0 < length <= CHUNK:
            return [_status(False, f"refused: read of {name[:80]!r} at {offset}, {length} bytes")]
        try:
            fd = os.open(self.folder / name, os.O_RDONLY)
        except OSError as exc:
            return [_status(False, f"{name}: {exc.strerror}")]
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        return [_status(True), data]


def _ints(req: dict[str, Any], *names: str) -> bool:
    return all(isinstance(req.get(n), int) and not isinstance(req.get(n), bool) for n in names)


def _status(ok: bool, why: str = "", **fields: Any) -> bytes:
    return json.dumps({"ok": ok, "why": why, **fields}).encode()


def fetch_replica(
    control_address: str,
    prefix: str,
    node: str,
    owner: int,
    step: int,
    accept: Callable[[str, SlotHeader], None],
    timeout_s: float = 10.0,
) -> tuple[bytearray, SlotHeader, str]:
    """Rank `owner`'s copy of `step` from the replicas the other nodes of the current generation
    hold: (its whole slot image, its header, a name for it saying which node sent it). Each image is
    verified (its header and every chunk's checksum) and `accept`ed (raising CorruptSlot where the
    header is not the copy wanted) before it is returned; one refused, the next node is asked.
    `prefix` is the run's prefix in the control store at `control_address`; `node` this node, not
    asked. Raises LookupError naming why each node gave none (or could not be asked)."""
    from lm_resiliency.core.rendezvous import state as rs
    from lm_resiliency.runtime.control import open_store

    try:
        store = open_store(control_address, timedelta(seconds=min(timeout_s, 5.0)))
        if not store.check([prefix + "state"]) or not store.check([prefix + key_name()]):
            raise LookupError("no node serves its copies: the control store names none")
        s = rs.decode(store.get(prefix + "state"))
        key = bytes.fromhex(store.get(prefix + key_name()).decode())
        others = {n: "" for n in s.slots if n is not None and n != node}
        for other in others:
            if store.check([prefix + endpoint_key(other)]):
                others[other] = store.get(prefix + endpoint_key(other)).decode()
    except LookupError:
        raise
    except Exception as exc:  # (the store unreachable, its documents malformed)
        raise LookupError(f"the control store at {control_address} could not say: {exc}") from exc
    why: list[str] = []
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        for other, endpoint in others.items():
            if not endpoint:
                why.append(f"node {other} serves no copies")
                continue
            name = f"node {other}'s replica of rank {owner} step {step}"
            try:
                image = _fetch_from(ctx, endpoint, key, owner, step, timeout_s)
                h = verify_image(name, memoryview(image))
                accept(name, h)
                return image, h, name
            except (LookupError, zmq.ZMQError) as exc:
                why.append(f"node {other}: {exc}")
            except CorruptSlot as exc:
                why.append(str(exc))
    finally:
        ctx.destroy(linger=0)
    raise LookupError("; ".join(why) or "no other node in this generation")


def _fetch_from(
    ctx: zmq.Context[Any], endpoint: str, key: bytes, owner: int, step: int, timeout_s: float
) -> bytearray:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if endpoint.startswith("tcp://["):
        sock.ipv6 = True
    sock.connect(endpoint)

    def ask(req: dict[str, Any]) -> list[bytes]:
        body = json.dumps(req).encode()
        sock.send_multipart([_mac(key, body), body])
        if not sock.poll(int(timeout_s * 1000)):
            raise LookupError(f"{endpoint} did not answer within {timeout_s:.0f} s")
        frames = sock.recv_multipart()
        try:
            status = json.loads(frames[0])
            ok, said = bool(status["ok"]), str(status.get("why", ""))
        except (ValueError, KeyError, TypeError):
            raise LookupError(f"{endpoint} answered malformed: {frames[0][:80]!r}") from None
        if not ok:
            raise LookupError(said)
        return [frames[0], *frames[1:]]

    try:
        found = json.loads(ask({"op": "find", "owner": owner, "step": step})[0])
        name, size = found.get("name"), found.get("size")
        if not isinstance(name, str) or not isinstance(size, int) or size <= 0:
            raise LookupError(f"{endpoint} answered malformed: {found}")
        image = bytearray(size)
        for offset in range(0, size, CHUNK):
            length = min(CHUNK, size - offset)
            frames = ask({"op": "read", "name": name, "offset": offset, "length": length})
            if len(frames) != 2 or len(frames[1]) != length:
                got = len(frames[1]) if len(frames) == 2 else 0
                raise LookupError(f"{name} ended at {offset + got} of {size} bytes")
            image[offset : offset + length] = frames[1]
        return image
    finally:
        sock.close()
