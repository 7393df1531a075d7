"""Message authentication and replay protection (pure).

Every message on the wire is `[auth, header, *buffers]`. The auth frame is

    magic "LMR1" | sender u32 | incarnation u64 | seq u64 | n u16 | n x 16-byte buffer digests | mac 32

with `mac = HMAC-SHA256(key, everything before the mac || header)`. The buffer digests are XXH3-128:
they bind every bulk byte to the MAC at ~20 GB/s, where SHA-256 would halve the transport's throughput.
Threat model: the per-job key lives in the job's store; a process without it (another job, a stale
generation, a stray client) cannot produce a valid header, and a captured message cannot be replayed
(per-sender incarnation + sliding sequence window). XXH3 is not collision-resistant against an
adversary who can both read and rewrite traffic on the wire; against that, run the job on a trusted
network (as NCCL and gloo already require).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from lm_resiliency.errors import AuthError

__all__ = ["REPLAY_WINDOW", "AuthStats", "Sealed", "Signer", "Verifier"]

MAGIC = b"LMR1"
_PREFIX = struct.Struct("<4sIQQH")
_DIGEST = 16
_MAC = 32
REPLAY_WINDOW = 4096
Frame = bytes | memoryview


def frame_digest(buffer: Frame) -> bytes:
    """The 16-byte XXH3-128 digest that binds a buffer to a message's MAC.

    Producers that already checksum their data (GEMINI at capture time) compute it once and pass it
    to `Signer.seal`, so bulk bytes are hashed once at the source and once at the receiver."""
    return xxhash.xxh3_128_digest(buffer)


def _digests(buffers: Sequence[Frame]) -> bytes:
    return b"".join(xxhash.xxh3_128_digest(b) for b in buffers)


@dataclass(frozen=True)
class Sealed:
    """Who sent an authenticated message."""

    sender: int
    incarnation: int
    seq: int


class Signer:
    """Seals outgoing messages of one sender incarnation with the job key."""

    def __init__(self, key: bytes, sender: int, incarnation: int) -> None:
        if len(key) < 16:
            raise ValueError("authentication key must be at least 16 bytes")
        self._key = key
        self.sender = sender
        self.incarnation = incarnation
        self._seq = 0

    def seal(self, frames: Sequence[Frame], digests: Sequence[bytes] | None = None) -> list[Frame]:
        """Return `[auth, *frames]` for `frames = [header, *buffers]`.

        `digests`, when given, are the buffers' `frame_digest`s computed earlier by the producer; a
        wrong one makes every receiver reject the message."""
        self._seq += 1
        header, buffers = frames[0], frames[1:]
        if len(buffers) > 0xFFFF:
            raise ValueError("too many buffers in one message")
        if digests is None:
            joined = _digests(buffers)
        elif len(digests) != len(buffers) or any(len(d) != _DIGEST for d in digests):
            raise ValueError(f"expected {len(buffers)} digests of {_DIGEST} bytes")
        else:
            joined = b"".join(digests)
        prefix = _PREFIX.pack(MAGIC, self.sender, self.incarnation, self._seq, len(buffers)) + joined
        mac = hmac.new(self._key, prefix, hashlib.sha256)
        mac.update(header)
        return [prefix + mac.digest(), *frames]


class BufferCorrupt(AuthError):
    """An authentic message whose buffer(s) `bad` fail their digest: corrupted in flight."""

    def __init__(self, sealed: Sealed, bad: list[int]) -> None:
        super().__init__("corrupt_buffer", f"sender {sealed.sender} buffers {bad} fail their digests")
        self.sealed = sealed
        self.bad = bad


@dataclass
class AuthStats:
    accepted: int = 0
    corrupt_buffer: int = 0
    bad_mac: int = 0
    malformed: int = 0
    replayed: int = 0
    stale_incarnation: int = 0

    @property
    def rejected(self) -> int:
        return self.bad_mac + self.malformed + self.replayed + self.stale_incarnation + self.corrupt_buffer


@dataclass
class _Window:
    incarnation: int
    top: int = 0  # highest sequence number accepted
    bits: int = 0  # bit i set: seq (top - i) accepted


class Verifier:
    """Checks the MAC and rejects replays, per sender. One per receiving runtime."""

    def __init__(self, key: bytes, window: int = REPLAY_WINDOW) -> None:
        self._key = key
        self._window = window
        self._peers: dict[int, _Window] = {}
        self.stats = AuthStats()

    def open(self, frames: Sequence[Frame]) -> tuple[Sealed, list[Frame]]:
        """Verify `[auth, header, *buffers]`; return the sender and `[header, *buffers]`.

        Raises:
            AuthError: reason is one of "malformed", "bad_mac", "stale_incarnation", "replayed".
        """
        try:
            sealed = self._check_mac(frames)
        except AuthError as exc:
            setattr(self.stats, exc.reason, getattr(self.stats, exc.reason) + 1)
            raise
        self._admit(sealed)
        self.stats.accepted += 1
        return sealed, list(frames[1:])

    def _check_mac(self, frames: Sequence[Frame]) -> Sealed:
        if len(frames) < 2:
            raise AuthError("malformed", "missing auth or header frame")
        auth = bytes(frames[0])
        if len(auth) < _PREFIX.size + _MAC:
            raise AuthError("malformed", f"auth frame of {len(auth)} bytes")
        magic, sender, incarnation, seq, n = _PREFIX.unpack_from(auth)
        if magic != MAGIC:
            raise AuthError("malformed", "bad magic")
        buffers = frames[2:]
        if n != len(buffers) or len(auth) != _PREFIX.size + n * _DIGEST + _MAC:
            raise AuthError("malformed", f"auth frame announces {n} buffers, {len(buffers)} arrived")
        prefix, mac = auth[:-_MAC], auth[-_MAC:]
        expected = hmac.new(self._key, prefix, hashlib.sha256)
        expected.update(frames[1])
        if not hmac.compare_digest(expected.digest(), mac):
            raise AuthError("bad_mac", f"claimed sender {sender}")
        claimed = prefix[_PREFIX.size :]
        bad = [
            i
            for i, b in enumerate(buffers)
            if claimed[i * _DIGEST : (i + 1) * _DIGEST] != xxhash.xxh3_128_digest(b)
        ]
        if bad:
            # The header is authentic (the MAC covers it and the digests) but a buffer changed on
            # the way: corruption in flight, not forgery. The caller may ask for the buffer again.
            raise BufferCorrupt(Sealed(sender, incarnation, seq), bad)
        return Sealed(sender, incarnation, seq)

    def _admit(self, s: Sealed) -> None:
        w = self._peers.get(s.sender)
        if w is None or s.incarnation > w.incarnation:
            self._peers[s.sender] = _Window(s.incarnation, s.seq, 1)
            return
        if s.incarnation < w.incarnation:
            self.stats.stale_incarnation += 1
            raise AuthError("stale_incarnation", f"sender {s.sender} incarnation {s.incarnation}")
        if s.seq > w.top:
            shift = s.seq - w.top
            w.bits = ((w.bits << shift) | 1) & ((1 << self._window) - 1) if shift < self._window else 1
            w.top = s.seq
            return
        age = w.top - s.seq
        if age >= self._window or (w.bits >> age) & 1:
            self.stats.replayed += 1
            raise AuthError("replayed", f"sender {s.sender} seq {s.seq}")
        w.bits |= 1 << age
