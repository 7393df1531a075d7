"""Bitwise fingerprints of tensors: equal iff (up to hash collisions) the bytes are equal.

CPU tensors are hashed with XXH3-128 over their bytes. CUDA tensors are folded on the device and only
the folds cross to the host: `fingerprint` waits for them (one synchronisation per fingerprint);
`fingerprint_async` copies them into pinned host memory behind an event and returns at once, so the
training thread never waits for the device (whoever needs the bytes waits). The fold reads each byte once
and needs no temporaries the size of the tensor (a 500M-element embedding on a device that training
has filled): the tensor's 32-bit words, laid out in rows of `MOD` columns, are summed down each
column (one reduction, wrapping modulo 2**32); the `MOD` column sums are then folded into their sum
and a column-weighted sum, the same as a position-weighted sum of the words with weights that
repeat every `MOD` words, so a permutation of words changes it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import xxhash

__all__ = ["MOD", "Fingerprint", "device_fold", "fingerprint", "fingerprint_async"]

MOD = 65521  # columns of the fold (a prime): the position weights are 2..MOD, repeating
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _hash(tensors: Iterable[torch.Tensor | None]) -> tuple[Any, torch.Tensor | None]:
    """The hasher fed with every CPU tensor (and the size of every CUDA one), and the CUDA tensors'
    folds stacked on their device (None when there is none): the folds' bytes come last."""
    h = xxhash.xxh3_128()
    device_folds: list[torch.Tensor] = []

    def feed(t: torch.Tensor) -> None:
        if t.is_cuda:
            h.update(t.numel().to_bytes(8, "little"))
            device_folds.append(device_fold(t))
        else:
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    for t in tensors:
        if t is None:
            h.update(b"\0none")
            continue
        t = t.detach()
        to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard is what replicas share
        if callable(to_local):
            t = to_local()
        if t.layout == torch.sparse_coo:  # an Embedding(sparse=True)'s gradient: its entries, in order
            t = t.coalesce()
            h.update(b"\0coo" + repr(tuple(t.shape)).encode())
            feed(t.indices())
            feed(t.values())
        else:
            feed(t if t.layout == torch.strided else t.to_dense())  # other sparse layouts: dense
    return h, (torch.stack(device_folds) if device_folds else None)


def fingerprint(tensors: Iterable[torch.Tensor | None]) -> bytes:
    h, folds = _hash(tensors)
    if folds is not None:
        h.update(folds.cpu().numpy().tobytes())  # waits for the device
    digest: bytes = h.digest()
    return digest


class Fingerprint:
    """A fingerprint whose device folds may still be on their way to the host.

    `ready()` says whether `result()` would return without waiting; `result()` waits for the
    copy's event (releasing the GIL) and gives the bytes `fingerprint` gives for the same tensors.
    Resolve it on one thread."""

    __slots__ = ("_digest", "_event", "_hasher", "_host")

    def __init__(self, hasher: Any, host: torch.Tensor | None = None, event: Any = None) -> None:
        self._hasher, self._host, self._event = hasher, host, event
        self._digest: bytes | None = None

    def ready(self) -> bool:
        return self._digest is not None or self._event is None or bool(self._event.query())

    def result(self) -> bytes:
        if self._digest is None:
            if self._event is not None:
                self._event.synchronize()
            if self._host is not None:
                self._hasher.update(self._host.numpy().tobytes())
            self._digest = self._hasher.digest()
            self._hasher = self._host = self._event = None
        return self._digest


def fingerprint_async(tensors: Iterable[torch.Tensor | None]) -> Fingerprint:
    """`fingerprint` without waiting for the device: the folds of CUDA tensors are copied into
    pinned host memory on the current stream (after the kernels that computed them), with an event
    recorded after the copy. CPU tensors are hashed now, as `fingerprint` does."""
    h, folds = _hash(tensors)
    if folds is None:
        return Fingerprint(h)
    host = torch.empty(folds.shape, dtype=folds.dtype, pin_memory=True)
    host.copy_(folds, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(folds.device))
    return Fingerprint(h, host, event)


def device_fold(t: torch.Tensor) -> torch.Tensor:
    """[sum of words, position-weighted sum] as int64 on `t`'s device, no sync.

    The words are the tensor's bytes read as int32; a trailing 1-3 bytes are zero-padded into one
    more word. Works on any device (tested on CPU; used for CUDA)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() - raw.numel() % 4
    head = raw[:whole]
    try:
        words = head.view(torch.int32)
    except RuntimeError:  # a view at an offset that is not 4-byte aligned: fold a copy of it
        words = head.clone().view(torch.int32)
    n = words.numel()
    rows = n // MOD
    if rows:
        # Integer sums wrap the same way in any order: the same on every device and replica.
        columns = words[: rows * MOD].view(rows, MOD).sum(0, dtype=torch.int32)
    else:
        columns = torch.zeros(MOD, dtype=torch.int32, device=t.device)
    rest = n - rows * MOD
    if rest:
        columns[:rest] += words[rows * MOD :]
    if whole < raw.numel():  # the last word, zero-padded, at its place after the whole ones
        tail = torch.zeros(4, dtype=torch.uint8, device=t.device)
        tail[: raw.numel() - whole] = raw[whole:]
        columns[rest : rest + 1] += tail.view(torch.int32)
    folded = columns.to(torch.int64)
    return torch.stack([folded.sum(), (folded * _weights(t.device)).sum()])


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.arange(2, MOD + 2, dtype=torch.int64, device=device)
    return w
