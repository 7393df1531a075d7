"""Finding peers through the job's torch.distributed Store. No extra service.

Keys live under `lm_resiliency/<run_id>/g<generation>/` so a new generation never reads a dead one's
addresses:
    secret            32 random bytes, set once by whichever rank's compare-and-set wins
    incarnation/<r>   a counter: each (re)start of rank r takes the next value
    peer/<r>          rank r's PeerAnnouncement (msgpack, through the codec)

Store calls block, so they run on the caller's thread (startup) or in a worker thread, never on the
event loop. Store errors are translated once, here, into DiscoveryError.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any, Protocol

from lm_resiliency.core import codec
from lm_resiliency.core.messages import PeerAnnouncement
from lm_resiliency.errors import CodecError, DiscoveryError

__all__ = ["Store", "StoreDiscovery"]

log = logging.getLogger(__name__)


class Store(Protocol):
    """The part of `torch.distributed.Store` we use (TCPStore, FileStore, PrefixStore, HashStore)."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: Any = ...) -> None: ...


class StoreDiscovery:
    """Generation-scoped peer discovery and key exchange for one rank."""

    def __init__(self, store: Store, run_id: str, generation: int | str, rank: int, world_size: int) -> None:
        self._store = store
        self._prefix = f"lm_resiliency/{run_id}/g{generation}/"
        self.rank = rank
        self.world_size = world_size

    def _key(self, name: str) -> str:
        return self._prefix + name

    def shared_secret(self) -> bytes:
        """The job's authentication key for this generation (the first proposal wins)."""
        candidate = os.urandom(32)
        try:
            value = bytes(self._store.compare_set(self._key("secret"), "", candidate))
        except Exception as exc:  # torch raises DistStoreError/RuntimeError variants; translate once
            raise DiscoveryError(f"cannot exchange the job key through the store: {exc}") from exc
        if len(value) != 32:
            raise DiscoveryError(f"store key {self._key('secret')} holds {len(value)} bytes, expected 32")
        return value

    def next_incarnation(self) -> int:
        try:
            return int(self._store.add(self._key(f"incarnation/{self.rank}"), 1))
        except Exception as exc:
            raise DiscoveryError(f"cannot draw an incarnation number: {exc}") from exc

    def publish(self, ann: PeerAnnouncement) -> None:
        try:
            self._store.set(self._key(f"peer/{ann.rank}"), codec.encode_value(ann))
        except Exception as exc:
            raise DiscoveryError(f"cannot publish rank {ann.rank}'s endpoints: {exc}") from exc

    def wait_all(self, timeout: float, ranks: Iterable[int] | None = None) -> dict[int, PeerAnnouncement]:
        """Wait until every rank in `ranks` (default: all) has published; return their announcements."""
        wanted = sorted(range(self.world_size) if ranks is None else ranks)
        keys = [self._key(f"peer/{r}") for r in wanted]
        deadline = time.monotonic() + timeout
        # Poll with check(): a blocking wait() cannot be interrupted and reports no progress.
        delay = 0.005
        while True:
            try:
                if self._store.check(keys):
                    break
            except Exception as exc:
                raise DiscoveryError(f"store unreachable while waiting for peers: {exc}") from exc
            if time.monotonic() >= deadline:
                missing = [r for r, k in zip(wanted, keys, strict=True) if not self._safe_check(k)]
                raise DiscoveryError(f"ranks {missing} did not publish their endpoints within {timeout:.1f}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return {r: self.read(r) for r in wanted}

    def _safe_check(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:  # only used to word an error message
            return False

    def exchange(self, name: str, value: bytes, timeout: float) -> dict[int, bytes]:
        """Publish `value` under `name` for this rank and return every rank's value once all are there."""
        try:
            self._store.set(self._key(f"{name}/{self.rank}"), value)
        except Exception as exc:
            raise DiscoveryError(f"cannot publish {name}: {exc}") from exc
        keys = [self._key(f"{name}/{r}") for r in range(self.world_size)]
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            try:
                if self._store.check(keys):
                    return {r: bytes(self._store.get(k)) for r, k in enumerate(keys)}
            except Exception as exc:
                raise DiscoveryError(f"store unreachable while exchanging {name}: {exc}") from exc
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not self._safe_check(k)]
                raise DiscoveryError(f"ranks {missing} did not publish {name} within {timeout:.1f}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def read(self, rank: int) -> PeerAnnouncement:
        key = self._key(f"peer/{rank}")
        try:
            raw = bytes(self._store.get(key))
        except Exception as exc:
            raise DiscoveryError(f"cannot read {key}: {exc}") from exc
        try:
            ann = codec.decode_value(raw, PeerAnnouncement)
        except CodecError as exc:
            raise DiscoveryError(f"store key {key} holds a malformed announcement: {exc}") from exc
        if ann.rank != rank:
            raise DiscoveryError(f"store key {key} announces rank {ann.rank}")
        return ann
