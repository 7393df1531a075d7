"""Bitwise fingerprints of tensors: equal iff (up to hash collisions) the bytes are equal.

Each tensor has a part: CPU tensors are hashed with XXH3-128 over their bytes; CUDA tensors are folded
on the device and only the folds cross to the host; the fingerprint is XXH3-128 over the parts (which
also say which tensors two fingerprints share). `fingerprint` waits for the folds (one
synchronisation per fingerprint); `fingerprint_async` copies them into pinned host memory behind an
event and returns at once, so the training thread never waits for the device (whoever needs the
bytes waits). The fold reads each byte once and needs no temporaries the size of the tensor (a
500M-element embedding on a device that training has filled): the tensor's 32-bit words, laid out in
rows of `MOD` columns, are summed down each column (one reduction, wrapping modulo 2**32); the `MOD`
column sums are then folded into their sum and a column-weighted sum, the same as a position-weighted
sum of the words with weights that repeat every `MOD` words, so a permutation of words changes it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import xxhash

__all__ = ["MOD", "Fingerprint", "device_fold", "fingerprint", "fingerprint_async", "zero_parts", "zeroed"]

MOD = 65521  # columns of the fold (a prime): the position weights are 2..MOD, repeating
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_ZERO_PARTS: dict[int, bytes] = {}  # bytes of a CPU tensor -> the part of one holding only zeros
_ZEROS = bytes(1 << 20)
_CUDA = b"\0cuda"


def _parts(tensors: Iterable[torch.Tensor | None]) -> tuple[list[bytes], list[int], torch.Tensor | None]:
    """One part per tensor: the XXH3-128 digest of a CPU tensor's bytes; for a CUDA tensor its size,
    its fold to come (see `Fingerprint`) at the returned positions, the folds stacked on their device
    (None when there is none). A sparse COO tensor is three parts (its shape, indices and values)."""
    parts: list[bytes] = []
    at: list[int] = []
    device_words: list[_Split] = []
    device = None  # of the CUDA tensors (one, as a rank's state has)

    def feed(t: torch.Tensor) -> None:
        nonlocal device
        if t.is_cuda:
            at.append(len(parts))
            parts.append(_CUDA + t.numel().to_bytes(8, "little"))
            device_words.append(_split(t))
            device = t.device
        else:
            t = t.resolve_conj().resolve_neg()  # a conjugate (or negative) view: its values' bytes
            parts.append(xxhash.xxh3_128_digest(t.contiguous().reshape(-1).view(torch.uint8).numpy().data))

    plain, strided = (torch.Tensor, torch.nn.Parameter), torch.strided
    for t in tensors:
        if t is None:
            parts.append(b"\0none")
            continue
        if type(t) in plain and not t.is_cuda and t.layout == strided and t.is_contiguous():
            # The common case with as little Python per tensor as it takes (a fingerprint of a large
            # model's state is thousands of them, every checked step): NumPy's view of the tensor
            # hands its bytes to the hash as they are in memory, the same bytes `feed` hashes.
            try:
                parts.append(xxhash.xxh3_128_digest(t.detach().numpy().data))
                continue
            except (TypeError, RuntimeError):  # no NumPy dtype (bfloat16, float8), a conjugate view
                pass
        t = t.detach()
        to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard is what replicas share
        if callable(to_local):
            t = to_local()
        if t.layout == torch.sparse_coo:  # an Embedding(sparse=True)'s gradient: its entries, in order
            t = t.coalesce()
            parts.append(b"\0coo" + repr(tuple(t.shape)).encode())
            feed(t.indices())
            feed(t.values())
        else:
            feed(t if t.layout == torch.strided else t.to_dense())  # other sparse layouts: dense
    return parts, at, (_folds(device_words, device) if device is not None else None)


def fingerprint(tensors: Iterable[torch.Tensor | None]) -> bytes:
    parts, at, folds = _parts(tensors)
    return Fingerprint(parts, folds, None, at).result()  # a CUDA fold's copy to the host waits


class Fingerprint:
    """A fingerprint whose device folds may still be on their way to the host.

    The digest is XXH3-128 over the tensors' parts (`_parts`), so equal tensors give equal parts
    and `parts()` tells which tensors two fingerprints share. `ready()` says whether `result()`
    would return without waiting; `result()` waits for the copy's event (releasing the GIL) and
    gives the bytes `fingerprint` gives for the same tensors. Resolve it on one thread."""

    __slots__ = ("_at", "_digest", "_event", "_host", "_parts")

    def __init__(
        self, parts: list[bytes], host: torch.Tensor | None = None, event: Any = None, at: Iterable[int] = ()
    ) -> None:
        """`host`: the folds of the CUDA tensors whose parts are at `at`, in that order, copied to the
        host behind `event` (each part then ends with its fold's bytes)."""
        self._parts, self._host, self._event, self._at = parts, host, event, tuple(at)
        self._digest: bytes | None = None

    def ready(self) -> bool:
        return self._digest is not None or self._event is None or bool(self._event.query())

    def result(self) -> bytes:
        if self._digest is None:
            if self._event is not None:
                self._event.synchronize()
            if self._host is not None:
                folds = self._host.cpu().numpy()
                for row, i in enumerate(self._at):
                    self._parts[i] += folds[row].tobytes()
            self._digest = xxhash.xxh3_128_digest(b"".join(self._parts))
            self._host = self._event = None
        return self._digest

    def parts(self) -> tuple[bytes, ...]:
        """One digest per tensor (see `_parts`), once the device's folds are on the host."""
        self.result()
        return tuple(self._parts)


def fingerprint_async(tensors: Iterable[torch.Tensor | None]) -> Fingerprint:
    """`fingerprint` without waiting for the device: the folds of CUDA tensors are copied into
    pinned host memory on the current stream (after the kernels that computed them), with an event
    recorded after the copy. CPU tensors are hashed now, as `fingerprint` does."""
    parts, at, folds = _parts(tensors)
    if folds is None:
        return Fingerprint(parts)
    host = torch.empty(folds.shape, dtype=folds.dtype, pin_memory=True)
    host.copy_(folds, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(folds.device))
    return Fingerprint(parts, host, event, at)


def zero_parts(tensors: Iterable[torch.Tensor | None]) -> frozenset[bytes]:
    """The parts (see `_parts`) that CPU tensors of these tensors' sizes have when they hold only
    zeros (each size's digest computed once per process, through a zero buffer of 1 MiB)."""
    out = set()
    for t in tensors:
        if t is None or t.is_cuda or t.layout != torch.strided:
            continue
        n = t.numel() * t.element_size()
        part = _ZERO_PARTS.get(n)
        if part is None:
            h, zeros = xxhash.xxh3_128(), memoryview(_ZEROS)
            for at in range(0, n, len(_ZEROS)):
                h.update(zeros[: min(len(_ZEROS), n - at)])
            part = _ZERO_PARTS[n] = h.digest()
        out.add(part)
    return frozenset(out)


def zeroed(parts: Iterable[bytes], zeros: frozenset[bytes]) -> list[int]:
    """The positions of the tensors whose parts say they hold only zeros: a CPU tensor's part in
    `zeros` (`zero_parts` of the same tensors), a CUDA tensor's folds both zero (the folds of a
    tensor that holds anything else are both zero with a chance of 2**-64)."""
    return [
        i
        for i, p in enumerate(parts)
        if p in zeros or (p.startswith(_CUDA) and len(p) > len(_CUDA) + 8 and not any(p[len(_CUDA) + 8 :]))
    ]


def device_fold(t: torch.Tensor) -> torch.Tensor:
    """[sum of words, position-weighted sum] as int64 on `t`'s device, no sync.

    The words are the tensor's bytes read as int32; a trailing 1-3 bytes are zero-padded into one
    more word. Works on any device (tested on CPU; used for CUDA)."""
    return _folds([_split(t)], t.device)[0]


# A tensor's words as the fold reads them: its whole rows of `MOD` (a (rows, MOD) view, or None),
# and the words after them (a view), each with the column its first word falls in.
_Split = tuple[torch.Tensor | None, list[tuple[int, torch.Tensor]]]


def _split(t: torch.Tensor) -> _Split:
    """`t`'s words in whole rows and the rest (views: nothing launched, unless the tensor is not
    contiguous, not aligned to words, or ends in a partial one: then a copy or two)."""
    words = _words(t)
    tail = None
    if words is None:  # not whole words, or not aligned to them: through the bytes
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        whole = raw.numel() - raw.numel() % 4
        head = raw[:whole]
        try:
            words = head.view(torch.int32)
        except RuntimeError:  # a view at an offset that is not 4-byte aligned: fold a copy of it
            words = head.clone().view(torch.int32)
        if whole < raw.numel():  # the last word, zero-padded, after the whole ones
            tail = torch.zeros(4, dtype=torch.uint8, device=t.device)
            tail[: raw.numel() - whole] = raw[whole:]
    n = words.numel()
    rows = n // MOD
    rest = n - rows * MOD
    block = words.as_strided((rows, MOD), (MOD, 1)) if rows else None
    after = [(0, words[rows * MOD :])] if rest else []
    if tail is not None:
        after.append((rest, tail.view(torch.int32)))
    return block, after


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s bytes as int32 words in a view (the common case: a contiguous tensor of whole,
    aligned words), or None."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 4:
        return None
    flat = t.view(-1)
    if flat.dtype == torch.int32:
        return flat
    try:
        return flat.view(torch.int32)
    except RuntimeError:  # an offset not 4-byte aligned
        return None


GROUP = 16  # tensors folded together: their column sums, int32 and int64, 12.6 MB at a time


def _folds(splits: list[_Split], device: torch.device) -> torch.Tensor:
    """The folds (k, 2) of k tensors on one device. Each tensor's whole rows are summed down their
    columns (one reduction) into its row of a group's column sums, and the words after them (all
    of a small tensor: a bias, a norm's weight) added at their columns; each group of `GROUP`
    rows is then folded at once into the sums and column-weighted sums, in int64. On a GPU a
    fingerprint of many tensors costs small kernels and the host's time to launch them, not the
    reading of their bytes: one or two per tensor and a few per group, not seven per tensor. A
    group's column sums are all that is held at a time (not every tensor's: hundreds of them,
    in int64, would take gigabytes of the device's memory)."""
    k = len(splits)
    out = torch.empty((2, k), dtype=torch.int64, device=device)
    weights = _weights(device)
    for g in range(0, k, GROUP):
        group = splits[g : g + GROUP]
        columns = torch.zeros((len(group), MOD), dtype=torch.int32, device=device)
        for i, (block, after) in enumerate(group):
            row = columns[i]
            if block is not None:
                # Integer sums wrap the same way in any order: the same on every device and replica.
                torch.sum(block, 0, dtype=torch.int32, out=row)
            for column, words in after:
                row[column : column + words.numel()] += words
        torch.sum(columns, -1, dtype=torch.int64, out=out[0, g : g + len(group)])
        wide = columns.to(torch.int64)
        del columns
        wide.mul_(weights)
        torch.sum(wide, -1, out=out[1, g : g + len(group)])
    return out.t().contiguous()


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.arange(2, MOD + 2, dtype=torch.int64, device=device)
    return w
