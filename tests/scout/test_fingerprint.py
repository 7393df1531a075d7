"""Fingerprints: the device fold behind CUDA fingerprints, run on CPU through the same code, and the
evidence that waits for a device copy (a stand-in for the CUDA event this machine lacks)."""

from __future__ import annotations

import functools
import threading
import warnings

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_resiliency.core.messages import Evidence
from lm_resiliency.scout.component import EvidenceResolver
from lm_resiliency.scout.fingerprint import MOD, Fingerprint, device_fold, fingerprint, fingerprint_async

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


def test_the_folds_of_many_tensors_at_once_are_each_ones_fold() -> None:
    """A fingerprint folds its device tensors' column sums a group at a time (a few kernels per
    group): each row is that tensor's own fold, whatever its size, dtype or trailing bytes."""
    from lm_resiliency.scout.fingerprint import _folds, _split

    tensors = [
        torch.randn(2 * MOD + 5),  # whole rows and a rest
        torch.randn(MOD),  # exactly one row
        torch.randn(17).to(torch.bfloat16),  # fewer words than a row
        torch.arange(7, dtype=torch.uint8),  # a trailing partial word
        torch.randn(3 * MOD).to(torch.float16)[1:],  # unaligned, with a rest and a tail
        torch.empty(0),
        torch.randn(MOD + 3, 2)[:, 0],  # not contiguous
        torch.randn(3 * MOD + 10)[7:],  # words at an offset in their storage
        torch.arange(4 * MOD + 9, dtype=torch.int32),  # int32 words as they are
        torch.randn(5, dtype=torch.float64),
    ]
    tensors = tensors * 2  # more than a group (GROUP): folded in two
    together = _folds([_split(t) for t in tensors], torch.device("cpu"))
    assert together.tolist() == [reference_fold(t) for t in tensors]


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


def test_a_cpu_tensors_part_is_the_digest_of_its_bytes_whatever_its_dtype_or_kind() -> None:
    """Every CPU tensor's part is XXH3-128 of its bytes in row-major order, through NumPy's view
    where the dtype has one and through the bytes where it has not (bfloat16, a conjugate view),
    for parameters that require grad, 0-d, empty and non-contiguous tensors alike."""
    complex_ = torch.randn(3, dtype=torch.complex64)
    tensors = [
        torch.randn(3, 4),
        torch.nn.Parameter(torch.randn(5)),
        torch.tensor(2.5),
        torch.empty(0, 3),
        torch.arange(5, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randn(2, 3).bfloat16(),
        complex_,
        complex_.conj(),
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        torch.arange(6, dtype=torch.int16)[1:],  # at an offset
    ]
    want = [
        xxhash.xxh3_128_digest(t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8).numpy())
        for t in tensors
    ]
    got = list(fingerprint_async(tensors).parts())
    assert got == want
    assert fingerprint(tensors) == xxhash.xxh3_128_digest(b"".join(want))


def test_parts_say_which_tensors_two_fingerprints_share() -> None:
    x, y = torch.randn(100), torch.randn(7).bfloat16()
    same = fingerprint_async([x, None, y]).parts()
    assert len(same) == 3 and same == fingerprint_async([x.clone(), None, y.clone()]).parts()
    other = fingerprint_async([x, None, y + 1]).parts()
    assert [a == b for a, b in zip(same, other, strict=True)] == [True, True, False]


def test_async_fingerprints_of_cpu_tensors_are_ready_and_equal() -> None:
    tensors = [torch.randn(1000), None, torch.arange(7, dtype=torch.int16)]
    pending = fingerprint_async(tensors)
    assert pending.ready() and pending.result() == fingerprint(tensors) == pending.result()


class DeviceCopyStandIn:
    """A CUDA event of a device-to-host copy, for a machine without CUDA: done when released."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(30)


def test_evidence_waiting_for_the_device_leaves_in_step_order_without_blocking_the_caller() -> None:
    sent: list[Evidence] = []
    arrived = threading.Condition()

    def submit(ev: Evidence) -> None:
        with arrived:
            sent.append(ev)
            arrived.notify_all()

    resolver = EvidenceResolver(3, submit)
    try:
        resolver.offer(1, None, fingerprint_async([torch.ones(4)]))  # on the host: at once
        assert [e.step for e in sent] == [1] and resolver.deferred == 0
        copy = DeviceCopyStandIn()
        folds = torch.tensor([[5, 7]], dtype=torch.int64)  # what the device copy brings
        size = b"\0cuda" + (4).to_bytes(8, "little")  # the part of a 4-element CUDA tensor, fold to come
        pending = Fingerprint([size], folds, copy, at=(0,))
        resolver.offer(2, pending, fingerprint_async([torch.zeros(2)]))
        # Ready itself, but behind step 2: it waits its turn rather than overtake it.
        resolver.offer(3, None, fingerprint_async([torch.zeros(3)]))
        assert [e.step for e in sent] == [1] and resolver.deferred == 2  # the caller did not wait
        copy.done.set()
        with arrived:
            assert arrived.wait_for(lambda: len(sent) == 3, 30)
        assert [e.step for e in sent] == [1, 2, 3] and all(e.rank == 3 for e in sent)
        want = xxhash.xxh3_128_digest(size + folds.numpy().tobytes())
        assert sent[1].grads == want and sent[2].grads == b""
        resolver.offer(4, None, fingerprint_async([torch.zeros(4)]))  # caught up: at once again
        assert [e.step for e in sent] == [1, 2, 3, 4]
    finally:
        resolver.close()


def test_evidence_counts_the_tensors_that_hold_what_they_held_one_step_before() -> None:
    """Gradients, parameters, optimizer state: (how many, which) tensors are as they were at the step
    before, when that step was checked (-1 where there is nothing to count)."""
    sent: list[Evidence] = []
    resolver = EvidenceResolver(0, sent.append)
    a, b, c = torch.ones(3), torch.zeros(2), torch.arange(4.0)
    resolver.offer(1, fingerprint_async([a, b]), fingerprint_async([c]))
    resolver.offer(2, fingerprint_async([a, b + 1]), fingerprint_async([c]))  # `a` and `c` as they were
    resolver.offer(4, fingerprint_async([a, b]), fingerprint_async([c]))  # step 3 was not checked
    assert sent[0].reused == () and sent[2].reused == ()
    (grads_n, grads_which), (params_n, params_which), optim = sent[1].reused
    assert (grads_n, params_n, optim) == (1, 1, (-1, b""))
    assert grads_which == params_which  # both: the tensor at index 0
    resolver.offer(5, fingerprint_async([a + 1, b]), fingerprint_async([c]))
    assert sent[3].reused[0][0] == 1 and sent[3].reused[0][1] != grads_which  # index 1 this time


def test_sparse_gradients_are_fingerprinted_by_their_entries() -> None:
    """An Embedding(sparse=True)'s gradient: the same entries (in any order, duplicates summed) give
    the same fingerprint, another value or another shape another one; other layouts by value."""
    # Invariant checks opted into for the whole test: torch 2.11 warns at the first sparse tensor
    # built while the global switch is unset, even when the call asks for them.
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        _sparse_gradients_are_fingerprinted_by_their_entries()


def _sparse_gradients_are_fingerprinted_by_their_entries() -> None:
    i = torch.tensor([[3, 1, 3]])
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    coo = functools.partial(torch.sparse_coo_tensor, check_invariants=True)
    a = coo(i, v, (8, 2))
    b = coo(torch.tensor([[1, 3]]), torch.tensor([[3.0, 4.0], [6.0, 8.0]]), (8, 2))
    assert fingerprint([a]) == fingerprint([b]) == fingerprint_async([b]).result()
    assert fingerprint([a]) != fingerprint([coo(i, v + 1, (8, 2))])
    assert fingerprint([a]) != fingerprint([coo(i, v, (9, 2))])
    dense = torch.eye(3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        csr = dense.to_sparse_csr()
    assert fingerprint([csr]) == fingerprint([dense])


def test_optimizer_settings_tell_replicas_stepped_differently_and_nothing_else() -> None:
    """The settings digest SCOUT compares before it calls differing parameters an SDC: a learning
    rate changed on one rank counts; objects whose repr differs between processes do not."""
    from lm_resiliency.scout.replay import optimizer_settings

    params = [torch.nn.Parameter(torch.zeros(2))]
    a, b = torch.optim.AdamW(params, lr=0.1), torch.optim.AdamW(params, lr=0.1)
    assert optimizer_settings(a) == optimizer_settings(b)
    b.param_groups[0]["lr"] = 0.05  # a ReduceLROnPlateau stepped with this rank's own loss
    assert optimizer_settings(a) != optimizer_settings(b)
    b.param_groups[0]["lr"] = 0.1
    for opt in (a, b):
        opt.param_groups[0]["hook"] = object()  # its repr names its address
        opt.param_groups[0]["betas"] = (torch.tensor(0.9), 0.999)
    assert optimizer_settings(a) == optimizer_settings(b)
