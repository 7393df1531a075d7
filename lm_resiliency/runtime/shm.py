"""Checkpoint slots in POSIX shared memory (files under /dev/shm), so a copy outlives the process.

Layout of one slot file:
    [0, 4096)              header (struct below), written last on commit
    [4096, 4096 + P)       payload: msgpack index (skeleton + tensor specs), padding, tensor bytes
    [4096 + P, ... + 16*C) XXH3-128 of each `chunk_size` chunk of the payload

Certificate: SCOUT certifies a step after its capture committed, so the mark lives apart from the
checksummed header, at `CERT_OFFSET` in the header page: magic, step and the header's own checksum,
so a mark names exactly one committed capture and dies with it (`begin()` clears it). A restarted
worker reads it back: a recovery-verified capture stays verified across restarts.

Commit protocol: `begin()` marks the header invalid, the payload and checksums are written, then
`commit()` writes a header whose own checksum covers its fields and the checksum table. A crash at
any point leaves either the previous committed slot (double buffering) or an invalid one, never a
torn slot that reads as valid. `verify()` re-hashes every chunk; `CorruptSlot` names what is wrong.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from lm_resiliency.errors import SharedMemoryError

__all__ = [
    "HEADER_SIZE",
    "CorruptSlot",
    "NotACopy",
    "SlotFile",
    "SlotHeader",
    "chunk_digests",
    "header_digest",
    "parse_header",
    "verify_image",
]

HEADER_SIZE = 4096
MAGIC = b"LMRGEM01"
_FMT = struct.Struct("<8sIIqIIQQQI64s32s")  # magic ver state step owner world payload index chunk n run topo
_DIGEST = 16
COMMITTED = 1
CERT_OFFSET = 2048
_CERT = struct.Struct("<8sq16s")  # magic step header-checksum
CERT_MAGIC = b"LMRCERT1"


class CorruptSlot(Exception):
    """A slot that must not be loaded: missing, truncated, torn or failing its checksums.
    `header`: what its header claimed, when it parsed (a truncated copy's step and owner)."""

    def __init__(self, message: str, header: SlotHeader | None = None) -> None:
        super().__init__(message)
        self.header = header


class NotACopy(CorruptSlot):
    """A slot that holds no copy of this run, though nothing damaged it: never written, or a
    capture that was interrupted (its header is invalidated before the payload is overwritten),
    or one of another run or topology. Skipped like a damaged one, but it is no fault."""


@dataclass(frozen=True)
class SlotHeader:
    step: int
    owner: int
    world_size: int
    payload_len: int
    index_len: int
    chunk_size: int
    n_chunks: int
    run_id: str
    topology: str

    def pack(self, state: int) -> bytes:
        return _FMT.pack(
            MAGIC,
            1,
            state,
            self.step,
            self.owner,
            self.world_size,
            self.payload_len,
            self.index_len,
            self.chunk_size,
            self.n_chunks,
            self.run_id.encode()[:64],
            self.topology.encode()[:32],
        )

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.payload_len + self.n_chunks * _DIGEST


def chunk_digests(payload: memoryview, chunk_size: int, pool: Executor | None = None) -> list[bytes]:
    """XXH3-128 of each chunk; on `pool`'s threads when given (xxhash releases the GIL)."""
    starts = range(0, len(payload), chunk_size)
    if not starts:
        return [xxhash.xxh3_128_digest(b"")]
    if pool is None or len(starts) < 4:
        return [xxhash.xxh3_128_digest(payload[i : i + chunk_size]) for i in starts]
    return list(pool.map(lambda i: xxhash.xxh3_128_digest(payload[i : i + chunk_size]), starts))


def n_chunks(payload_len: int, chunk_size: int) -> int:
    return max(1, -(-payload_len // chunk_size))


def header_digest(image: bytes | memoryview | mmap.mmap) -> bytes:
    """The committed header's digest: of its fields and its chunks' checksums, so of the whole
    capture (a certificate names it; `parse_header` first, for an image that may not be one)."""
    return bytes(image[_FMT.size : _FMT.size + _DIGEST])


def parse_header(name: str, image: bytes | memoryview | mmap.mmap, size: int) -> SlotHeader:
    """The committed header of a slot image of `size` bytes (a mapping, or a file's bytes);
    raises CorruptSlot naming `name` and what is wrong."""
    raw = bytes(image[: _FMT.size + _DIGEST])
    if len(raw) < _FMT.size + _DIGEST:
        raise CorruptSlot(f"{name}: truncated to {size} bytes")
    magic, ver, state, step, owner, world, payload, index, chunk, n, run, topo = _FMT.unpack_from(raw)
    if magic == b"\0" * len(MAGIC):
        raise NotACopy(f"{name}: empty (never written, or its capture was interrupted)")
    if magic != MAGIC or ver != 1:
        raise CorruptSlot(f"{name}: not a committed checkpoint slot (bad magic)")
    if state != COMMITTED:
        raise CorruptSlot(f"{name}: capture was never committed (torn write)")
    h = SlotHeader(
        step,
        owner,
        world,
        payload,
        index,
        chunk,
        n,
        run.rstrip(b"\0").decode(errors="replace"),
        topo.rstrip(b"\0").decode(errors="replace"),
    )
    if chunk <= 0 or n != n_chunks(payload, chunk) or h.file_size > size:
        raise CorruptSlot(f"{name}: truncated ({size} bytes, header needs {h.file_size})", h)
    table = bytes(image[HEADER_SIZE + payload : HEADER_SIZE + payload + n * _DIGEST])
    if xxhash.xxh3_128_digest(raw[: _FMT.size] + table) != raw[_FMT.size :]:
        raise CorruptSlot(f"{name}: header checksum mismatch")
    return h


def verify_image(name: str, image: bytes | memoryview, pool: Executor | None = None) -> SlotHeader:
    """Check a whole slot image held in memory (a durable file read back): its header and every
    chunk's checksum. Raises CorruptSlot naming the first problem."""
    view = memoryview(image)
    h = parse_header(name, view, len(view))
    got = chunk_digests(view[HEADER_SIZE : HEADER_SIZE + h.payload_len], h.chunk_size, pool)
    table = bytes(view[HEADER_SIZE + h.payload_len : h.file_size])
    for i, digest in enumerate(got):
        if digest != table[i * _DIGEST : (i + 1) * _DIGEST]:
            raise CorruptSlot(f"{name}: chunk {i} fails its checksum (step {h.step})")
    return h


class SlotFile:
    """One memory-mapped slot file. Not thread-safe: one writer at a time (the capture pipeline)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        self.size = 0

    # -- writing ----------------------------------------------------------------------------------
    def ensure_size(self, size: int, *, checked: bool = False) -> None:
        """Map at least `size` bytes (a larger existing mapping is kept: no remap, no page faults),
        of the file at `path` as it is now (see `intact`; `checked`: the caller has just seen the
        mapping intact, or closed it, and the two stats need not be taken again)."""
        if self._mm is not None and self.size >= size and (checked or self.intact()):
            return
        # Whole pages: page-locking a mapping for asynchronous GPU copies (cudaHostRegister) wants them.
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        self.close()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                # Reserve the pages now: a full /dev/shm fails here with ENOSPC, not later with SIGBUS.
                os.posix_fallocate(fd, 0, size)
                # Map the pages in now, so the first capture does not pay a page fault per 4 KiB.
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            raise SharedMemoryError(
                f"cannot create a {size / 2**20:.1f} MiB checkpoint slot at {self.path}: "
                f"{exc.strerror or exc} (is /dev/shm large enough? docker: --shm-size)"
            ) from exc
        self._fd, self._mm, self.size = fd, mm, size

    def intact(self) -> bool:
        """Whether the mapped file is still the one at `path` and as long as the mapping. Something
        outside may truncate the file (a write to the pages it lost kills the process with SIGBUS),
        or remove or replace it (what is written then is lost to a restart, which finds no file or
        another one)."""
        if self._fd is None:
            return False
        try:
            now, mapped = os.stat(self.path), os.fstat(self._fd)
        except OSError:
            return False
        return (now.st_ino, now.st_dev) == (mapped.st_ino, mapped.st_dev) and mapped.st_size >= self.size

    def begin(self) -> None:
        """Invalidate the header before overwriting the payload."""
        mm = self._require()
        mm[: _FMT.size] = b"\0" * _FMT.size
        self.clear_certificate()

    # -- certificates -----------------------------------------------------------------------------
    def mark_certified(self, step: int) -> None:
        """Mark the committed capture of `step` recovery-verified (no-op if the slot holds another)."""
        mm = self._require()
        raw = bytes(mm[: _FMT.size + _DIGEST])
        if raw[:8] != MAGIC or _FMT.unpack_from(raw)[3] != step:
            return
        mm[CERT_OFFSET : CERT_OFFSET + _CERT.size] = _CERT.pack(CERT_MAGIC, step, header_digest(raw))

    def header_page(self) -> memoryview:
        """A copy of the header page without the certificate, for sending: SCOUT may mark the slot
        while a copy is on the wire, and a copy's holder never trusts the owner's mark anyway."""
        page = bytearray(self._require()[:HEADER_SIZE])
        page[CERT_OFFSET : CERT_OFFSET + _CERT.size] = bytes(_CERT.size)
        return memoryview(page)

    def header_digest(self) -> bytes:
        return header_digest(self._require())

    def clear_certificate(self) -> None:
        mm = self._require()
        mm[CERT_OFFSET : CERT_OFFSET + _CERT.size] = b"\0" * _CERT.size

    def certified(self, header: SlotHeader) -> bool:
        """True when the slot carries a certificate for exactly this committed capture."""
        mm = self._require()
        magic, step, digest = _CERT.unpack_from(bytes(mm[CERT_OFFSET : CERT_OFFSET + _CERT.size]))
        return bool(magic == CERT_MAGIC and step == header.step and digest == header_digest(mm))

    def view(self) -> memoryview:
        return memoryview(self._require())

    @property
    def mapping(self) -> mmap.mmap | None:
        """The current memory map (identity changes when the slot is remapped)."""
        return self._mm

    def payload(self, header: SlotHeader) -> memoryview:
        return self.view()[HEADER_SIZE : HEADER_SIZE + header.payload_len]

    def commit(self, header: SlotHeader, digests: list[bytes]) -> None:
        mm = self._require()
        table = b"".join(digests)
        if len(digests) != header.n_chunks:
            raise ValueError(f"{len(digests)} digests for {header.n_chunks} chunks")
        start = HEADER_SIZE + header.payload_len
        mm[start : start + len(table)] = table
        fields = header.pack(COMMITTED)
        mm[: _FMT.size + _DIGEST] = fields + xxhash.xxh3_128_digest(fields + table)

    def write_raw(self, offset: int, data: memoryview | bytes) -> None:
        mm = self._require()
        if len(data) >= 1 << 20:
            # A numpy copy releases the GIL: the loop thread receiving a replica does not stall the
            # training thread of this process for the length of a memcpy.
            dst = np.frombuffer(mm, dtype=np.uint8, count=len(data), offset=offset)
            np.copyto(dst, np.frombuffer(data, dtype=np.uint8))
            del dst
            return
        mm[offset : offset + len(data)] = data

    # -- reading ----------------------------------------------------------------------------------
    @classmethod
    def open_existing(cls, path: Path) -> SlotFile:
        slot = cls(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise CorruptSlot(f"{path.name}: cannot open ({exc.strerror})") from exc
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            os.close(fd)
            raise CorruptSlot(f"{path.name}: truncated to {size} bytes")
        slot._fd, slot._mm, slot.size = fd, mmap.mmap(fd, size), size
        return slot

    def read_header(self) -> SlotHeader:
        return parse_header(self.path.name, self._require(), self.size)

    def digest_table(self, header: SlotHeader) -> list[bytes]:
        start = HEADER_SIZE + header.payload_len
        table = bytes(self._require()[start : start + header.n_chunks * _DIGEST])
        return [table[i : i + _DIGEST] for i in range(0, len(table), _DIGEST)]

    def verify(self, header: SlotHeader, pool: Executor | None = None) -> None:
        """Re-hash the payload; raise CorruptSlot naming the first bad chunk."""
        got = chunk_digests(self.payload(header), header.chunk_size, pool)
        for i, (a, b) in enumerate(zip(got, self.digest_table(header), strict=True)):
            if a != b:
                raise CorruptSlot(f"{self.path.name}: chunk {i} fails its checksum (step {header.step})")

    def close(self) -> None:
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a view still exported: the GC will unmap it
                self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _require(self) -> mmap.mmap:
        if self._mm is None:
            raise RuntimeError(f"slot {self.path} is not mapped")
        return self._mm
