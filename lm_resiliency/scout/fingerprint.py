"""Bitwise fingerprints of tensors: equal iff (up to hash collisions) the bytes are equal.

CPU tensors are hashed with XXH3-128 over their bytes. CUDA tensors are folded on the device (two
int64 sums of their 32-bit words, one weighted by position, so a permutation changes it too) and only
the folds cross to the host, in one synchronisation per fingerprint. The fold runs in passes of at
most `FOLD_WORDS` words, so its int64 temporaries stay bounded (a 500M-element embedding must not need
gigabytes of scratch on a device that training has filled); integer sums wrap the same way in any
order, so the passes give the fold of the whole.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash

__all__ = ["FOLD_WORDS", "device_fold", "fingerprint"]

FOLD_WORDS = 1 << 24  # 16 Mi words per pass: two int64 temporaries of 128 MiB at most
_MOD = 65521


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
            device_folds.append(device_fold(t))
        else:
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    if device_folds:
        h.update(torch.stack(device_folds).cpu().numpy().tobytes())
    return h.digest()


def device_fold(t: torch.Tensor, words_per_pass: int = FOLD_WORDS) -> torch.Tensor:
    """[sum of words, position-weighted sum, element count] as int64, on `t`'s device, no sync.

    The words are the tensor's bytes read as int32; a trailing 1-3 bytes are zero-padded into one
    more word. Works on any device (tested on CPU; used for CUDA)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() - raw.numel() % 4
    head = raw[:whole]
    try:
        words = head.view(torch.int32)
    except RuntimeError:  # a view at an offset that is not 4-byte aligned: fold a copy of it
        words = head.clone().view(torch.int32)
    out = torch.zeros(3, dtype=torch.int64, device=t.device)
    out[2] = t.numel()
    n = words.numel()
    for start in range(0, n, words_per_pass):
        _fold_into(out, words[start : start + words_per_pass], start)
    if whole < raw.numel():
        tail = torch.zeros(4, dtype=torch.uint8, device=t.device)
        tail[: raw.numel() - whole] = raw[whole:]
        _fold_into(out, tail.view(torch.int32), n)
    return out


def _fold_into(out: torch.Tensor, words: torch.Tensor, start: int) -> None:
    w = words.to(torch.int64)
    pos = torch.arange(start + 1, start + w.numel() + 1, device=w.device, dtype=torch.int64)
    pos.remainder_(_MOD).add_(1)
    out[0] += w.sum()
    out[1] += pos.mul_(w).sum()
