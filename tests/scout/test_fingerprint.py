"""The device fold behind CUDA fingerprints, run on CPU through the same code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_resiliency.scout.fingerprint import MOD, device_fold, fingerprint

pytestmark = pytest.mark.timeout(60)


def reference_fold(t: torch.Tensor) -> list[int]:
    """The fold by its definition: words (zero-padded to whole ones) summed per column of `MOD`,
    modulo 2**32 as signed int32, then the column sums' sum and weighted sum (weights 2..MOD+1)."""
    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    raw += b"\0" * (-len(raw) % 4)
    words = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    columns = [0] * MOD
    for i, w in enumerate(words.tolist()):
        columns[i % MOD] += w
    signed = [((c + 2**31) % 2**32) - 2**31 for c in columns]
    return [sum(signed), sum((j + 2) * c for j, c in enumerate(signed))]


@settings(max_examples=25, deadline=None)
@given(
    n=st.sampled_from([0, 1, 3, 7, 300, MOD - 1, MOD, MOD + 5, 2 * MOD + 77]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float64]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_the_fold_is_its_definition(n: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g) * 1e4).to(dtype)
    assert device_fold(t).tolist() == reference_fold(t)


def test_fold_tells_bit_flips_and_permutations_apart() -> None:
    x = torch.randn(3 * MOD + 1001)
    base = device_fold(x)
    for at in (0, 500, MOD + 17, 3 * MOD + 1000):
        for bit in (0, 3, 31):
            flipped = x.clone()
            flipped.view(torch.int32)[at] ^= 1 << bit
            assert not torch.equal(base, device_fold(flipped)), (at, bit)
    swapped = x.clone()
    swapped[[3, 900]] = swapped[[900, 3]]
    assert not torch.equal(base, device_fold(swapped))


def test_fold_reads_views_at_unaligned_offsets_and_partial_words() -> None:
    flat = torch.randn(11).bfloat16()
    view = flat[1:8]  # 2 bytes into its storage: cannot be read as int32 in place
    assert torch.equal(device_fold(view), device_fold(view.clone()))
    odd = torch.arange(7, dtype=torch.uint8)  # a tail of 3 bytes
    tweaked = odd.clone()
    tweaked[6] += 1
    assert not torch.equal(device_fold(odd), device_fold(tweaked))
    long_odd = torch.arange(MOD * 4 + 3, dtype=torch.uint8)  # whole rows, then a partial word
    assert device_fold(long_odd).tolist() == reference_fold(long_odd)


def test_cpu_fingerprints_are_bitwise() -> None:
    x = torch.randn(64)
    y = x.clone()
    assert fingerprint([x, None]) == fingerprint([y, None]) != fingerprint([y, x])
    y.view(torch.int32)[0] ^= 1
    assert fingerprint([x]) != fingerprint([y])
