"""The device fold behind CUDA fingerprints, run on CPU through the same code."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_resiliency.scout.fingerprint import device_fold, fingerprint

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float64]),
    per_pass=st.integers(min_value=1, max_value=64),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_passes_fold_to_the_whole(n: int, dtype: torch.dtype, per_pass: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(n, generator=g) * 200).to(dtype)
    assert torch.equal(device_fold(t, words_per_pass=per_pass), device_fold(t, words_per_pass=1 << 20))


def test_fold_tells_bit_flips_permutations_and_lengths_apart() -> None:
    x = torch.randn(1001)
    base = device_fold(x, words_per_pass=64)
    flipped = x.clone()
    flipped.view(torch.int32)[500] ^= 1 << 3
    swapped = x.clone()
    swapped[[3, 900]] = swapped[[900, 3]]
    assert not torch.equal(base, device_fold(flipped, words_per_pass=64))
    assert not torch.equal(base, device_fold(swapped, words_per_pass=64))
    assert not torch.equal(device_fold(x[:1000]), device_fold(torch.cat([x[:1000], x.new_zeros(1)])))
    assert int(base[2]) == 1001


def test_fold_reads_views_at_unaligned_offsets() -> None:
    flat = torch.randn(11).bfloat16()
    view = flat[1:8]  # 2 bytes into its storage: cannot be read as int32 in place
    assert torch.equal(device_fold(view), device_fold(view.clone()))
    odd = torch.arange(7, dtype=torch.uint8)  # a tail of 3 bytes
    tweaked = odd.clone()
    tweaked[6] += 1
    assert not torch.equal(device_fold(odd), device_fold(tweaked))


def test_cpu_fingerprints_are_bitwise() -> None:
    x = torch.randn(64)
    y = x.clone()
    assert fingerprint([x, None]) == fingerprint([y, None]) != fingerprint([y, x])
    y.view(torch.int32)[0] ^= 1
    assert fingerprint([x]) != fingerprint([y])
