"""A rank's last collective states in a file that outlives its process (the collective trail).

SCOUT compares the hash chains of the collectives replicas entered while they run (desync_verdict).
A mismatch of sizes is no hang under gloo: it aborts a process within milliseconds (a C++ assertion,
SIGABRT), often not the culprit's, and the others die of the broken collective before their next
progress message, so nothing said which rank issued the other collective. Each rank therefore also
writes its newest states into a small memory-mapped file under the torchrun backend (the agent names
the folder in `LM_RESILIENCY_TRAIL_DIR`); the agent reads its workers' files once they stopped and
the leader compares them (adapters/torchrun.py).

File: a header (magic, generation, digest of the rank's replica group) and `SLOTS` records
`(count, chain, check)`, the state after collective `count` in slot `count % SLOTS`. A record is
written in place with no lock (one writer, the training thread); one cut short by the process's end
fails its check and is skipped.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path

import xxhash

__all__ = ["SLOTS", "CollectiveTrail", "group_digest", "read_trail", "read_trails"]

MAGIC = b"LMRTRL01"
SLOTS = 16
_HEADER = struct.Struct("<8sq8s")  # magic, generation, replica group digest
_RECORD = struct.Struct("<q8sQ")  # collectives entered, hash chain, check
SIZE = _HEADER.size + SLOTS * _RECORD.size
_NAME = re.compile(r"r(\d+)")


def group_digest(group: Sequence[int]) -> bytes:
    """8 bytes naming a replica group: ranks with equal digests must enter the same collectives."""
    return xxhash.xxh3_64_digest(",".join(map(str, sorted(group))).encode())


def _check(count: int, chain: bytes) -> int:
    return xxhash.xxh3_64_intdigest(count.to_bytes(8, "little", signed=True) + chain)


class CollectiveTrail:
    """The writer: `record` after each collective entered (about a microsecond)."""

    def __init__(self, folder: str | Path, rank: int, generation: int, group: Sequence[int]) -> None:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"r{rank}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map: mmap.mmap | None = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, MAGIC, generation, group_digest(group))

    def record(self, count: int, chain: bytes) -> None:
        m = self._map
        if m is None or len(chain) != 8:
            return
        off = _HEADER.size + (count % SLOTS) * _RECORD.size
        _RECORD.pack_into(m, off, count, chain, _check(count, chain))

    def close(self) -> None:
        """No more records. The mapping is released with its last reference, not closed here: a
        `record` on the training thread while another thread closes the session may still hold it."""
        self._map = None


def read_trail(path: str | Path, generation: int) -> tuple[bytes, list[tuple[int, bytes]]] | None:
    """(group digest, states oldest first) of a trail written in `generation`; None when the file is
    absent, of another generation or not a trail."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    if len(raw) != SIZE:
        return None
    magic, gen, group = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC or gen != generation:
        return None
    states = []
    for i in range(SLOTS):
        count, chain, check = _RECORD.unpack_from(raw, _HEADER.size + i * _RECORD.size)
        if count > 0 and count % SLOTS == i and check == _check(count, chain):
            states.append((count, chain))
    return group, sorted(states)


def read_trails(folder: str | Path, generation: int) -> dict[int, tuple[bytes, list[tuple[int, bytes]]]]:
    """Every rank's trail of `generation` in `folder`, by rank."""
    out = {}
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return {}
    for f in entries:
        m = _NAME.fullmatch(f.name)
        if m is None:
            continue
        got = read_trail(f, generation)
        if got is not None:
            out[int(m.group(1))] = got
    return out
