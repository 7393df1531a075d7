"""Bitwise fingerprints of tensors: equal iff (up to hash collisions) the bytes are equal.

CPU tensors are hashed with XXH3-128 over their bytes. CUDA tensors are folded on the device (two
int64 sums of their 32-bit words, one weighted by position, so a permutation changes it too) and only
the folds cross to the host, in one synchronisation per fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash

__all__ = ["fingerprint"]


def fingerprint(tensors: Iterable[torch.Tensor | None]) -> bytes:
    h = xxhash.xxh3_128()
    device_folds: list[torch.Tensor] = []
    for t in tensors:
        if t is None:
            h.update(b"\0none")
            continue
        t = t.detach()
        to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard is what replicas share
        if callable(to_local):
            t = to_local()
        if t.is_cuda:
            words = t.contiguous().reshape(-1).view(torch.uint8)
            pad = (-words.numel()) % 4
            if pad:
                words = torch.cat([words, words.new_zeros(pad)])
            w = words.view(torch.int32).to(torch.int64)
            pos = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64) % 65521 + 1
            device_folds.append(
                torch.stack([w.sum(), (w * pos).sum(), torch.tensor(t.numel(), device=w.device)])
            )
        else:
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    if device_folds:
        h.update(torch.stack(device_folds).cpu().numpy().tobytes())
    return h.digest()
