"""GEMINI building blocks in one process: state flattening, shared-memory slots, the durable tier."""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lm_resiliency.errors import SharedMemoryError
from lm_resiliency.gemini.durable import DurableError, DurableStore
from lm_resiliency.gemini.iterators import IteratorWatch
from lm_resiliency.gemini.state import (
    apply_state,
    check_fits,
    collect_state,
    flatten,
    loader_positions,
    materialize,
    unflatten,
)
from lm_resiliency.runtime.shm import (
    HEADER_SIZE,
    CorruptSlot,
    NotACopy,
    SlotFile,
    SlotHeader,
    chunk_digests,
    n_chunks,
)
from tests.conftest import Fp32StateSGD, lone_gemini, start_runtimes

pytestmark = pytest.mark.timeout(60)


def _eq(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor) and a.layout == torch.sparse_coo:
        assert isinstance(b, torch.Tensor) and b.layout == torch.sparse_coo and a.shape == b.shape
        assert a.is_coalesced() == b.is_coalesced()
        _eq(a._indices(), b._indices())
        _eq(a._values(), b._values())
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _eq(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _eq(x, y)
    else:
        assert a == b and type(a) is type(b)


def test_state_that_cannot_be_checkpointed_is_named_with_what_to_return_instead() -> None:
    """Objects a caller's extra_state_fn may return as they are (a generator, a dataclass, a
    stateful loader): the error names the entry and the plain state to return instead."""
    import dataclasses

    @dataclasses.dataclass
    class Position:
        epoch: int = 0

    class Loader:
        def state_dict(self) -> dict[str, int]:
            return {}

    for obj, hint in (
        (torch.Generator(), "return its get_state()"),
        (Position(), "return dataclasses.asdict() of it"),
        (Loader(), "return its state_dict()"),
        (object(), "return plain data (dicts, lists"),
    ):
        with pytest.raises(TypeError) as err:
            flatten({"extra": {"data": [obj]}})
        assert str(err.value).startswith(f"state.extra.data[0]: objects of type {type(obj).__name__} cannot")
        assert hint in str(err.value), err.value


def test_a_modules_extra_state_in_a_bytesio_is_checkpointed_and_other_objects_name_the_module() -> None:
    """A module's get_extra_state() may return an io.BytesIO (TransformerEngine's FP8 metadata; torch's
    distributed checkpoint takes it). Before, the capture refused it, telling the caller to rebuild it
    in load_extra_state_fn, which never sees a module's extra state. Now its bytes round-trip into a
    new BytesIO at 0; an object that cannot be checkpointed there names the module's own methods."""
    import io

    class Fp8Linear(nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.meta = {"amax": [1.0, 2.0]}

        def get_extra_state(self) -> io.BytesIO:
            buf = io.BytesIO()
            torch.save(self.meta, buf)
            return buf  # (left at its end, as a writer leaves it)

        def set_extra_state(self, state: io.BytesIO) -> None:
            state.seek(0)
            self.meta = torch.load(state, weights_only=True)

    a, b = Fp8Linear(), Fp8Linear()
    a.meta = {"amax": [3.0, 4.5]}
    skeleton, tensors, _ = flatten({"model": a.state_dict()})
    b.load_state_dict(unflatten(skeleton, tensors)["model"])
    assert b.meta == {"amax": [3.0, 4.5]} and torch.equal(b.weight, a.weight)
    with pytest.raises(
        TypeError, match=r"state\.model\._extra_state: .* from the module's get_extra_state\(\)"
    ):
        flatten({"model": {"_extra_state": object()}})


def test_flatten_round_trip_keeps_types_exactly() -> None:
    state = {
        "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "bools": torch.tensor([True, False]),
        "ints": {1: "a", 2: (3, 4.5, None)},
        "np": np.arange(4, dtype=np.uint32),
        "big": 2**80,
        "nested": [{"x": b"bytes"}, (1,)],
        "__weird": 1,
        "seen": {3, 1, "a", (2, 5)},
        "frozen": frozenset({7}),
        "python_rng": random.getstate(),  # 625 ints: the all-ints fast path
        "mixed": [(True, 1), (1, 2**64), (1.5, 2), (-(2**63), 2**64 - 1), ()],
    }
    skeleton, tensors, specs = flatten(state)
    assert [s.nbytes for s in specs] == [12, 4, 0, 2, 16]
    back = unflatten(skeleton, [t.clone() for t in tensors])
    _eq(state, back)


def test_flatten_names_the_unsupported_object() -> None:
    with pytest.raises(TypeError, match=r"state\.extra\.fn: objects of type function"):
        flatten({"extra": {"fn": lambda: 1}})
    with pytest.raises(TypeError, match=r"^state\.k\[7\]: dict key \(1, 2\)"):
        flatten({"k": {7: {(1, 2): 3}}})
    with pytest.raises(TypeError, match=r"^state\.a\[1\]\.b\[2\]\['x'\]: objects of type object"):
        flatten({"a": [1, {"b": (0, 1, {"x": object(), 3: 4})}]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: CSR support is in beta
        csr = torch.eye(3).to_sparse_csr()
    with pytest.raises(TypeError, match=r"state\.m: only dense .*sparse_csr"):
        flatten({"m": csr})


def test_sparse_optimizer_state_is_captured_entry_for_entry_and_training_resumes_bitwise() -> None:
    """SGD's momentum for an Embedding(sparse=True) is a sparse COO tensor, uncoalesced (a sum of
    sparse gradients): captured as its indices and values as they are, not refused (which lost every
    capture of such a job), and restored from views of a buffer overwritten right after."""
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[2, 0, 2]]),
        torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
        (4, 2),
        check_invariants=True,
    )
    state = {"u": uncoalesced, "c": uncoalesced.coalesce(), "empty": torch.zeros(3, 5).to_sparse()}
    skeleton, tensors, _ = flatten(state)
    _eq(state, unflatten(skeleton, [t.clone() for t in tensors]))

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 3))
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def train(m: nn.Module, o: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            m(torch.randint(0, 20, (6, 3), generator=g)).pow(2).sum().backward()
            o.step()
            o.zero_grad()

    m, o = make()
    train(m, o, range(3))
    assert not o.state[m[0].weight]["momentum_buffer"].is_coalesced()
    skeleton, tensors, _ = flatten(collect_state(m, o, None, None, 3))
    tensors = [t.clone() for t in tensors]
    train(m, o, range(3, 6))
    m2, o2 = make()
    restored = unflatten(skeleton, tensors)
    materialize(restored, m2, o2)
    apply_state(restored, m2, o2, None, None)
    for t in tensors:
        t.fill_(7)  # the slot reused by the next capture
    train(m2, o2, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    _eq(o.state[m[0].weight]["momentum_buffer"], o2.state[m2[0].weight]["momentum_buffer"])


def test_a_zero_gradient_an_unused_parameter_held_is_held_again_after_a_restore() -> None:
    """Two heads used on alternate steps, zeroed with `set_to_none=False`: the head a step does not
    use keeps a zero gradient, and Adam moves it anyway (its moments, weight decay). A restored
    process holds no gradient until backward makes one: before, it skipped the unused head and
    ended off the uninterrupted run (outsider 40). The capture says which parameters held one."""

    def make() -> tuple[nn.ModuleDict, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.ModuleDict({"trunk": nn.Linear(4, 6), "a": nn.Linear(6, 2), "b": nn.Linear(6, 3)})
        return m, torch.optim.Adam(m.parameters(), lr=0.1, weight_decay=0.01)

    def train(m: nn.ModuleDict, o: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            o.zero_grad(set_to_none=False)
            head = m["a"] if step % 2 else m["b"]
            head(
                m["trunk"](torch.randn(3, 4, generator=torch.Generator().manual_seed(step)))
            ).sum().backward()
            o.step()

    m, o = make()
    train(m, o, range(4))
    state = collect_state(m, o, None, None, 4)
    assert state["grads_held"].tolist() == [True] * 6
    skeleton, tensors, _ = flatten(state)
    tensors = [t.clone() for t in tensors]
    train(m, o, range(4, 7))  # step 4 uses head b: a's zero gradient still moves it
    m2, o2 = make()
    apply_state(unflatten(skeleton, tensors), m2, o2, None, None)
    assert all(p.grad is not None and not p.grad.any() for p in m2.parameters())
    train(m2, o2, range(4, 7))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    # Parameters that held none (set_to_none=True) hold none after a restore either.
    o2.zero_grad(set_to_none=True)
    m3, o3 = make()
    m3["a"].weight.grad = torch.ones_like(m3["a"].weight)
    apply_state(unflatten(*flatten(collect_state(m2, o2, None, None, 7))[:2]), m3, o3, None, None)
    assert all(p.grad is None for p in m3.parameters())


def test_collect_and_apply_restore_training_bitwise() -> None:
    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
        o = torch.optim.AdamW(m.parameters(), lr=0.1)
        return m, o, torch.optim.lr_scheduler.StepLR(o, 2, 0.5)

    def train(m, o, s, n: int) -> None:  # type: ignore[no-untyped-def]
        for _ in range(n):
            m(torch.randn(3, 4)).pow(2).mean().backward()
            o.step()
            o.zero_grad()
            s.step()
            random.random()
            np.random.rand()

    m, o, s = make()
    train(m, o, s, 3)
    skeleton, tensors, _ = flatten(collect_state(m, o, s, lambda: {"pos": 3}, 3))
    tensors = [t.clone() for t in tensors]  # flatten aliases live tensors; a capture copies them at once
    train(m, o, s, 3)
    want = [p.detach().clone() for p in m.parameters()]
    m2, o2, s2 = make()
    got_extra: list[object] = []
    apply_state(unflatten(skeleton, [t.clone() for t in tensors]), m2, o2, s2, got_extra.append)
    train(m2, o2, s2, 3)
    assert got_extra == [{"pos": 3}]
    assert all(torch.equal(a, b) for a, b in zip(want, m2.parameters(), strict=True))

    # Restoring from views of a buffer (shared memory) that is overwritten right after: `materialize`
    # leaves nothing pointing into it, whether the optimizer has state to copy into (o3 stepped) or not.
    for stepped in (False, True):
        m3, o3, s3 = make()
        if stepped:
            train(m3, o3, s3, 1)
        buffers = [t.clone() for t in tensors]
        extra: list[object] = []
        state = unflatten(skeleton, buffers)
        materialize(state, m3, o3)
        apply_state(state, m3, o3, s3, extra.append)
        for b in buffers:
            b.fill_(7)  # the slot reused by the next capture
        train(m3, o3, s3, 3)
        assert all(torch.equal(a, b) for a, b in zip(want, m3.parameters(), strict=True)), stepped


@pytest.mark.parametrize("kind", ["nadam", "fp32_moments"])
def test_optimizer_state_resumes_in_the_dtype_it_was_captured_in(kind: str) -> None:
    """torch's `Optimizer.load_state_dict` casts floating state to the parameter's dtype: NAdam's
    float32 `mu_product` of a bfloat16 parameter, or a float32 master copy, came back bfloat16 and
    the resumed run drifted from the uninterrupted one. Restored into a fresh optimizer (a restarted
    process) or one that holds state already, the state keeps its dtype and training is bitwise."""

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Linear(16, 8).to(torch.bfloat16)
        o: torch.optim.Optimizer
        o = torch.optim.NAdam(m.parameters(), lr=0.01) if kind == "nadam" else Fp32StateSGD(m.parameters())
        return m, o

    def train(m: torch.nn.Module, o: torch.optim.Optimizer, steps: range) -> None:
        for i in steps:
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            m(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()

    m, o = make()
    train(m, o, range(3))
    skeleton, tensors, _ = flatten(collect_state(m, o, None, None, 3))
    tensors = [t.clone() for t in tensors]
    dtypes = {k: v.dtype for k, v in o.state[m.weight].items()}
    assert torch.float32 in dtypes.values()
    train(m, o, range(3, 8))
    want = [p.detach().clone() for p in m.parameters()] + [v.clone() for v in o.state[m.weight].values()]
    for stepped in (False, True):
        m2, o2 = make()
        if stepped:
            train(m2, o2, range(100, 101))
        state = unflatten(skeleton, [t.clone() for t in tensors])
        materialize(state, m2, o2)
        apply_state(state, m2, o2, None, None)
        assert {k: v.dtype for k, v in o2.state[m2.weight].items()} == dtypes, stepped
        train(m2, o2, range(3, 8))
        got = [p.detach() for p in m2.parameters()] + list(o2.state[m2.weight].values())
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got, strict=True)), stepped


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """A model changed under the same run id: the restart names what differs and which copy, and
    tells how to fix it, instead of torch's size mismatch from inside a half-done load_state_dict."""
    from lm_resiliency.errors import CheckpointMismatchError

    torch.manual_seed(0)
    old = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    gem = lone_gemini(tmp_path, old, None)
    try:
        assert gem.capture(3) and gem.drain(10)
    finally:
        gem.close()
    new = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    before = [p.detach().clone() for p in new.parameters()]
    gem = lone_gemini(tmp_path, new, None)
    try:
        with pytest.raises(CheckpointMismatchError) as err:
            gem.recover(lambda key, blob, timeout: {0: blob}, None, timeout=10)
    finally:
        gem.close()
    msg = str(err.value)
    assert (
        "local copy of step 3 (run id 'r')" in msg and "1.weight is [2, 8] float32 in the checkpoint" in msg
    )
    assert "[3, 8] float32 in the model" in msg and "run_id" in msg and "1.bias" in msg
    assert all(torch.equal(a, b) for a, b in zip(before, new.parameters(), strict=True))  # nothing loaded
    # Names and dtypes too, each said once.
    with pytest.raises(
        CheckpointMismatchError,
        match=r"1\.weight is missing from the checkpoint; 2\.weight is in the checkpoint, not in the "
        r"model; 0\.weight is \[8, 4\] float32 in the checkpoint, \[8, 4\] bfloat16 in the model$",
    ):
        saved = {"0.weight": torch.zeros(8, 4), "2.weight": torch.zeros(1)}
        live = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2, bias=False))
        check_fits(saved, live.to(torch.bfloat16))


def test_copies_of_another_topology_are_named_in_the_reason_nothing_restores(tmp_path: Path) -> None:
    """An elastic job that shrank (world 2 -> 1) finds its copies and cannot use them: the decision
    says so (which steps, which world size), not only "no copy at all"."""
    model = torch.nn.Linear(4, 4)
    gem = lone_gemini(tmp_path, model, None, world=2, disk_interval=1)
    try:
        assert gem.capture(5) and gem.drain(10)
    finally:
        gem.close()
    gem = lone_gemini(tmp_path, model, None, world=1, disk_interval=1)
    try:
        step, reason = gem.recover(lambda key, blob, timeout: {0: blob}, None, timeout=10)
    finally:
        gem.close()
    assert step == -1
    assert "copies of steps [5] taken with another topology (world size 2; this job: 1)" in reason, reason


def _commit(slot: SlotFile, payload: bytes, step: int = 7, chunk: int = 64) -> SlotHeader:
    h = SlotHeader(step, 0, 1, len(payload), 0, chunk, n_chunks(len(payload), chunk), "run", "topo")
    slot.ensure_size(h.file_size)
    slot.begin()
    slot.write_raw(4096, payload)
    slot.commit(h, chunk_digests(slot.payload(h), chunk))
    return h


def test_slot_commit_read_and_every_kind_of_damage(tmp_path: Path) -> None:
    path = tmp_path / "slot"
    slot = SlotFile(path)
    h = _commit(slot, bytes(range(256)) * 4)
    slot.close()
    fresh = SlotFile.open_existing(path)
    assert fresh.read_header() == h
    fresh.verify(h)
    fresh.write_raw(4096 + 300, b"\xff")  # a flipped payload byte
    with pytest.raises(CorruptSlot, match="chunk 4 fails its checksum"):
        fresh.verify(fresh.read_header())
    fresh.begin()  # a capture that never committed (interrupted): no copy, but no damage either
    with pytest.raises(NotACopy, match="empty"):
        fresh.read_header()
    fresh.write_raw(0, b"LMRGEM0X")  # a damaged header is damage
    with pytest.raises(CorruptSlot, match="bad magic") as info:
        fresh.read_header()
    assert not isinstance(info.value, NotACopy)
    fresh.close()
    empty = SlotFile(tmp_path / "never-written")
    empty.ensure_size(8192)
    empty.close()
    with pytest.raises(NotACopy, match="empty"):
        SlotFile.open_existing(tmp_path / "never-written").read_header()
    slot = SlotFile(path)
    _commit(slot, b"x" * 1000)
    slot.close()
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\x01")  # the header itself
    with pytest.raises(CorruptSlot, match="header checksum"):
        SlotFile.open_existing(path).read_header()
    slot = SlotFile(path)
    _commit(slot, b"y" * 1000)
    slot.close()
    import os

    os.truncate(path, 4096 + 500)
    with pytest.raises(CorruptSlot, match="truncated"):
        SlotFile.open_existing(path).read_header()
    with pytest.raises(CorruptSlot, match="cannot open"):
        SlotFile.open_existing(tmp_path / "missing")


def test_a_certificate_names_one_committed_capture_and_dies_with_it(tmp_path: Path) -> None:
    path = tmp_path / "slot"
    slot = SlotFile(path)
    h = _commit(slot, b"z" * 500, step=7)
    assert not slot.certified(h)
    slot.mark_certified(8)  # another step: not this capture's certificate
    assert not slot.certified(h)
    slot.mark_certified(7)
    assert slot.certified(h)
    assert bytes(slot.header_page()) != bytes(slot.view()[:4096])  # what is sent carries no mark
    slot.close()
    fresh = SlotFile.open_existing(path)  # a restarted worker reads it back
    assert fresh.certified(fresh.read_header())
    fresh.close()
    slot = SlotFile(path)
    h2 = _commit(slot, b"w" * 500, step=7)  # a new capture of the same step number
    assert not slot.certified(h2)
    slot.mark_certified(7)
    slot.clear_certificate()  # revoked (SDC found at or before it)
    assert not slot.certified(h2)
    slot.close()


def test_slot_that_cannot_be_created_fails_clearly(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(SharedMemoryError, match=r"cannot create a .* checkpoint slot .*/dev/shm"):
        SlotFile(blocker / "slot").ensure_size(1 << 20)


def test_durable_round_trip_pruning_and_failure(tmp_path: Path) -> None:
    store = DurableStore(str(tmp_path / "disk"), "run/1", rank=3, keep_last=2)
    for step in (10, 20, 30):
        store.write(step, memoryview(bytes([step]) * 5000))
    assert store.steps() == [20, 30]
    assert store.read(30) == bytes([30]) * 5000
    with pytest.raises(DurableError, match="cannot load"):
        store.read(10)
    store.path(20).write_bytes(b"garbage")
    with pytest.raises(DurableError, match="cannot load"):
        store.read(20)
    other = DurableStore(str(tmp_path / "disk"), "run/1", rank=4)
    other.path(30).parent.mkdir(parents=True, exist_ok=True)
    store.path(30).rename(other.path(30))
    with pytest.raises(DurableError, match="another rank"):
        other.read(30)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DurableError, match="failed"):
        DurableStore(str(blocker), "run", 0).write(1, memoryview(b"abc"))
    # A run id is one folder inside the disk folder, whatever it holds ('..' was the folder above).
    for run_id, name in (("..", "_.."), ("../../etc", ".._.._etc"), ("", "_"), ("a.b-c_1", "a.b-c_1")):
        assert DurableStore(str(tmp_path / "disk"), run_id, 0).root == tmp_path / "disk" / name


def test_copies_of_an_earlier_launch_set_aside_stay_unlisted_until_the_run_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh launch sets aside what the earlier one left (by file identity, in every later store
    of this rank: a restarted process reads the record); its own copy of the same step, written
    again, is listed; other ranks' copies are theirs to set aside; a launch naming the run lists
    them again; a record that cannot be read is said and lists everything."""
    disk = str(tmp_path / "disk")
    earlier = DurableStore(disk, "run", rank=0, keep_last=5)
    for step in (4, 8):
        earlier.write(step, memoryview(b"old"))
    DurableStore(disk, "run", rank=1).write(8, memoryview(b"peer"))
    assert DurableStore(disk, "run", rank=0).set_aside_earlier() == [4, 8]
    assert DurableStore(disk, "run", rank=0).steps() == [] and DurableStore(disk, "run", rank=1).steps() == [
        8
    ]
    fresh = DurableStore(disk, "run", rank=0, keep_last=5)
    fresh.write(8, memoryview(b"new"))
    assert fresh.steps() == [8] and DurableStore(disk, "run", rank=0).steps() == [8]
    assert DurableStore(disk, "run", rank=0).read(8) == b"new"
    DurableStore(disk, "run", rank=0).forget_earlier()
    assert DurableStore(disk, "run", rank=0).steps() == [4, 8]
    DurableStore(disk, "run", rank=0).set_aside_earlier()
    (fresh.root / ".earlier-launch-rank-00000.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert DurableStore(disk, "run", rank=0).steps() == [4, 8]
    assert "the record of an earlier launch's copies" in caplog.text and "is unreadable" in caplog.text


def test_a_flush_never_costs_the_cadence_steps_and_pruning_leaves_no_debris(tmp_path: Path) -> None:
    """Copies of the disk cadence (every 4 steps here) are pruned to the newest `keep_last`; a
    flush (SIGTERM, a restart) of another step prunes nothing: it may be of a step the other ranks
    never wrote, and the cadence step they all hold must stay. Pruning removes what a writer
    killed mid-write left, and the last rank to leave a step's directory removes it."""
    root = tmp_path / "disk"
    store = DurableStore(str(root), "run", rank=0, keep_last=2, regular=lambda step: step % 4 == 0)
    peer = DurableStore(str(root), "run", rank=1, keep_last=2, regular=lambda step: step % 4 == 0)
    for step in (4, 8):
        store.write(step, memoryview(b"x" * 100))
        peer.write(step, memoryview(b"y" * 100))
    store.write(9, memoryview(b"x" * 100))
    store.write(10, memoryview(b"x" * 100))  # flushed at SIGTERM: step 8 stays
    assert store.steps() == [4, 8, 9, 10]
    killed = store.path(12).with_name(store.path(12).name + ".tmp4242")
    killed.parent.mkdir(parents=True)
    killed.write_bytes(b"half")  # a write killed midway
    assert store.steps() == [4, 8, 9, 10] and store.steps(partial=True) == [4, 8, 9, 10, 12]
    for step in (16, 20):
        store.write(step, memoryview(b"x" * 100))
    assert store.steps(partial=True) == [16, 20]
    assert sorted(p.name for p in root.joinpath("run").iterdir()) == [
        ".store-id",  # the folder's id (shared storage: DurableStore.store_id)
        "step-0000000004",  # rank 1's copies are still in these two
        "step-0000000008",
        "step-0000000016",
        "step-0000000020",
    ]
    peer.remove(4)
    assert not root.joinpath("run", "step-0000000004").exists()


def test_async_capture_is_fenced_before_the_optimizer_mutates_parameters(tmp_path: Path) -> None:
    """The GPU path's ordering, with a deferred copier standing in for a side-stream D2H copy."""
    from lm_resiliency.testing.copier import DeferredCopier

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    copier = DeferredCopier()
    gem = lone_gemini(tmp_path, model, opt, copier=copier)
    try:
        model(torch.randn(2, 4)).sum().backward()
        want = [p.detach().clone() for p in model.parameters()]
        copier.release.clear()  # the worker may not see the bytes until the test says so
        assert gem.capture(1)
        assert copier.issued == 1 and copier.registered  # the slot was registered for async copies
        opt.step()  # the pre-step fence runs the pending copy before the parameters change
        assert copier.fences == 1 and copier.completed == 1
        assert not torch.equal(want[0], model.weight)  # the step did change the parameters
        copier.release.set()
        assert gem.drain(10)
        assert copier.host_waits == 1 and copier.completed == 1
        model2 = torch.nn.Linear(4, 4)
        gem.model = model2
        gem.optimizer = None
        gem._restore_from(gem._own[next(iter(gem._own_step))], 1)
        assert all(torch.equal(a, b) for a, b in zip(want, model2.parameters(), strict=True))
    finally:
        gem.close()


def test_an_async_capture_copies_the_buffers_the_next_forward_changes_before_it_runs(tmp_path: Path) -> None:
    """A BatchNorm's running statistics change in the next training forward, before the optimizer's
    fence: an asynchronous capture copies them first and lets the compute wait for those copies only
    (the rest still lands at the fence). Before, a capture could hold the next step's statistics."""
    from lm_resiliency.testing.copier import DeferredCopier

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    copier = DeferredCopier()
    gem = lone_gemini(tmp_path, model, opt, copier=copier)
    try:
        model(torch.randn(16, 4)).sum().backward()
        opt.step()
        want = {n: v.clone() for n, v in model.state_dict().items()}
        copier.release.clear()  # the "device" has copied nothing of the rest yet
        assert gem.capture(1)
        assert copier.early == [3]  # running_mean, running_var, num_batches_tracked
        model(torch.randn(16, 4)).sum().backward()  # the next forward updates the statistics
        assert not torch.equal(want["1.running_mean"], model[1].running_mean)
        opt.step()  # the fence: the parameters' copies land before the step changes them
        copier.release.set()
        assert gem.drain(10)
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        gem.model, gem.optimizer = fresh, None
        gem._restore_from(gem._own[next(k for k, s in gem._own_step.items() if s == 1)], 1)
        got = fresh.state_dict()
        assert all(torch.equal(v, got[n]) for n, v in want.items()), [
            n for n, v in want.items() if not torch.equal(v, got[n])
        ]
    finally:
        gem.close()


def test_a_restarted_gpu_rank_restores_through_its_page_locked_slot(tmp_path: Path) -> None:
    """A new process restores from its own slot through the mapping its captures will use, page
    locked first (copies to a GPU from pageable memory are staged and slow); the next capture into
    that slot finds it registered. With `pin_memory=False` no slot is ever page-locked."""
    from lm_resiliency.testing.copier import DeferredCopier

    for pin in (True, False):
        shm = tmp_path / f"pin-{pin}"
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        gem = lone_gemini(shm, model, opt, copier=DeferredCopier())
        try:
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            assert gem.capture(1) and gem.drain(10)
            k = next(iter(gem._own_step))
            size = gem._own[k].size
            want = dict(model.state_dict()), {n: v.clone() for n, v in opt.state[model.weight].items()}
        finally:
            gem.close()
        fresh = torch.nn.Linear(64, 64)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)  # no state yet, as after a restart
        copier = DeferredCopier()
        gem = lone_gemini(shm, fresh, fresh_opt, copier=copier, pin_memory=pin)
        try:
            assert gem._own[k].mapping is None
            gem._restore_from(gem._own[k], 1)
            assert all(torch.equal(v, fresh.state_dict()[n]) for n, v in want[0].items())
            assert all(torch.equal(v, fresh_opt.state[fresh.weight][n]) for n, v in want[1].items())
            assert copier.registered == ([size] if pin else [])
            assert (k in gem._pinned and gem._pinned[k] is gem._own[k].mapping) is pin
            for step in (2, 3):  # into the other slot (registered now), then into slot k (it was)
                assert gem.capture(step) and gem.drain(10)
            assert len(copier.registered) == (2 if pin else 0)
        finally:
            gem.close()


def test_a_slot_cut_short_under_its_mapping_is_found_truncated_not_read(tmp_path: Path) -> None:
    """Reading a mapping past the end of its file raises SIGBUS: a restore through the slot's own
    mapping checks the file's length first."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    gem = lone_gemini(tmp_path, model, None)
    try:
        assert gem.capture(1) and gem.drain(10)
        slot = gem._own[next(iter(gem._own_step))]
        os.truncate(slot.path, slot.size // 2)
        with pytest.raises(CorruptSlot, match="truncated"):
            gem._restore_from(slot, 1)
    finally:
        gem.close()


def test_verify_integrity_finds_a_copy_damaged_at_rest_and_drops_it(tmp_path: Path) -> None:
    """With `verify_integrity`, each commit is followed by a second look at every other held copy: a
    byte flipped in a committed slot (the capture's bytes at rest) is reported with its step, the
    copy leaves the inventory and its header is invalidated, so no restart can load it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    faults: list[dict[str, Any]] = []
    gem = lone_gemini(tmp_path, model, None, verify_integrity=True, on_fault=faults.append)
    try:
        for step in (1, 2):
            assert gem.capture(step) and gem.drain(10)
        assert gem.stats.scrubbed == 1 and not faults  # step 1's slot, after step 2 committed
        k = next(k for k, s in gem._own_step.items() if s == 2)
        with open(gem._own[k].path, "r+b") as f:  # one bit of a weight, behind the slot's back
            f.seek(HEADER_SIZE + 9000)
            byte = f.read(1)[0]
            f.seek(HEADER_SIZE + 9000)
            f.write(bytes([byte ^ 0x10]))
        assert gem.capture(3) and gem.drain(10)  # into step 1's slot; then step 2's is checked
        assert [(f["kind"], f["failed_ranks"], f["steps"]) for f in faults] == [
            ("checkpoint_corruption", [0], [2])
        ]
        assert "fails its checksum" in faults[0]["detail"]
        assert gem.inventory().local == (3,) and gem.stats.scrub_failures == 1
        with pytest.raises(NotACopy):
            SlotFile.open_existing(gem._own[k].path).read_header()
    finally:
        gem.close()


def test_verify_integrity_holds_a_copy_it_has_not_checked_while_the_commit_goes_on(tmp_path: Path) -> None:
    """A commit's disk write (or replication) takes a while, and the slot it left behind is no
    longer the newest: a capture then must not overwrite it before the check that follows the
    commit read it, or a copy damaged at rest is erased unreported (the capture waits for a slot,
    and is skipped when none comes)."""
    import threading

    from lm_resiliency.gemini.durable import DurableStore

    writing, released = threading.Event(), threading.Event()

    class SlowDisk(DurableStore):
        def write(self, step: int, slot_bytes: memoryview) -> Path:
            writing.set()  # (after the commit)
            released.wait(60)
            return super().write(step, slot_bytes)

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    faults: list[dict[str, Any]] = []
    gem = lone_gemini(
        tmp_path / "shm", model, None, verify_integrity=True, on_fault=faults.append, disk_interval=3
    )
    gem.durable = SlowDisk(str(tmp_path / "disk"), "r", 0)
    try:
        for step in (1, 2):
            assert gem.capture(step) and gem.drain(10)
        k = next(k for k, s in gem._own_step.items() if s == 2)
        with open(gem._own[k].path, "r+b") as f:  # step 2's copy rots
            f.seek(HEADER_SIZE + 3000)
            byte = f.read(1)[0]
            f.seek(HEADER_SIZE + 3000)
            f.write(bytes([byte ^ 0x10]))
        assert gem.capture(3)  # into step 1's slot; its disk write waits
        assert writing.wait(30) and gem._own_step.get(1 - k) == 3  # committed
        assert not gem.capture(4)  # step 2's slot is held for its check: no free slot
        released.set()
        assert gem.drain(10)
        assert [(f["kind"], f["steps"]) for f in faults] == [("checkpoint_corruption", [2])], faults
        assert gem.inventory().local == (3,) and gem.stats.skipped_busy == 1
    finally:
        released.set()
        gem.close()


def test_an_inventory_handed_on_late_is_followed_by_a_current_one(tmp_path: Path) -> None:
    """Two threads announce at once (the receiver after a replica arrives, the worker after a
    commit): the one that computed its inventory first hands it on last. The newest handed on is
    what the torchrun backend's leader plans the restart from, so a current one must follow."""
    import threading

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    gem = lone_gemini(tmp_path, model, None)
    handed: list[tuple[int, ...]] = []
    inside, release = threading.Event(), threading.Event()
    late = threading.Thread(target=gem._announce)  # as the receiver does

    def sink(inv: Any) -> None:
        if threading.current_thread() is late and not release.is_set():
            inside.set()
            release.wait(30)  # preempted after computing its inventory, before handing it on
        handed.append(inv.local)

    try:
        assert gem.capture(1) and gem.drain(10)
        gem.on_inventory = sink
        late.start()
        assert inside.wait(30)
        assert gem.capture(2) and gem.drain(10)  # the worker hands on (1, 2) meanwhile
        release.set()
        late.join(30)
        assert handed[-1] == (1, 2), handed
    finally:
        release.set()
        gem.close()


def test_verify_integrity_reads_each_durable_write_back(tmp_path: Path) -> None:
    """A disk that stores other bytes than it was given (a fake of faulty hardware): the file read
    back fails its checksums, is deleted and reported as an I/O error; training goes on."""
    from lm_resiliency.gemini.durable import DurableStore

    class LyingDisk(DurableStore):
        def write(self, step: int, slot_bytes: memoryview) -> Path:
            path = super().write(step, slot_bytes)
            data = bytearray(path.read_bytes())
            data[data.index(b"LMRGEM01") + HEADER_SIZE + 50] ^= 1  # a payload byte, as read back
            path.write_bytes(bytes(data))
            return path

    model = torch.nn.Linear(64, 64)
    faults: list[dict[str, Any]] = []
    gem = lone_gemini(
        tmp_path / "shm", model, None, verify_integrity=True, on_fault=faults.append, disk_interval=1
    )
    try:
        assert gem.capture(1) and gem.drain(10)
        assert gem.stats.disk_writes == 1 and not faults  # a good disk: read back and kept
        good = gem.durable.root
        gem.durable = LyingDisk(str(tmp_path / "bad"), "r", 0)
        assert gem.capture(2) and gem.drain(10)
        assert [f["kind"] for f in faults] == ["io_error"] and "reads back damaged" in faults[0]["detail"]
        assert not gem.durable.steps() and 2 not in gem.inventory().disk
        assert gem.inventory().local == (1, 2) and DurableStore(str(good.parent), "r", 0).steps() == [1]
    finally:
        gem.close()


def test_the_durable_tier_writes_every_disk_interval_when_captures_do_not_divide_it(tmp_path: Path) -> None:
    """Captures every 3 steps with a disk interval of 4: the first capture at or past each multiple
    of 4 goes to disk (6, 9, 12, 18, 21, 24), one write per 4 steps; not only the common multiples
    (12, 24), which with captures every 7 steps and the default 100 is one write in 700 steps."""
    model = torch.nn.Linear(8, 8)
    gem = lone_gemini(tmp_path / "a", model, None, interval=3, disk_interval=4, keep_last=100)
    try:
        for step in range(3, 25, 3):  # the steps the session captures
            assert gem.capture(step) and gem.drain(10)
        assert sorted(gem._on_disk) == [6, 9, 12, 18, 21, 24]
        assert [s for s in range(1, 25) if gem.durable.path(s).exists()] == [6, 9, 12, 18, 21, 24]
    finally:
        gem.close()


def test_a_restart_offers_the_durable_copies_whose_headers_hold(tmp_path: Path) -> None:
    """The durable tier is a recovery tier: a restart's scan lists each step whose file has an
    intact header for this run, rank and topology; a damaged file is reported and left out, a
    missing one is not listed; the copy is verified chunk by chunk when loaded, and restores
    bitwise."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    gem = lone_gemini(tmp_path / "a", model, None, disk_interval=1, keep_last=3)
    try:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            assert gem.capture(step) and gem.drain(10)
        want = model.weight.detach().clone()
        disk = gem.durable
    finally:
        gem.close()
    data = bytearray(disk.path(1).read_bytes())
    data[data.index(b"LMRGEM01") + 30] ^= 1  # a header field: its checksum fails
    disk.path(1).write_bytes(bytes(data))
    disk.path(2).rename(disk.path(2).with_name("rank-00000.pt.moved"))  # step 2's file is gone
    faults: list[dict[str, Any]] = []
    fresh = torch.nn.Linear(64, 64)
    gem = lone_gemini(tmp_path / "b", fresh, None, disk_interval=1, keep_last=3, on_fault=faults.append)
    gem.durable = disk
    try:
        inv = gem.scan()
        assert inv["disk"] == [3] and inv["local"] == [] and gem.inventory().disk == (3,)
        assert [f["kind"] for f in faults] == ["checkpoint_corruption"] and "header" in faults[0]["detail"]
        gem._restore_from(gem._own[gem._load_from_disk(3)], 3)
        assert torch.equal(fresh.weight, want)
    finally:
        gem.close()


def _train_with_an_sdc_at_9(gem: Any, model: torch.nn.Linear, steps: int) -> dict[int, torch.Tensor]:
    """Steps 1..`steps` captured, each adding 1 to the weight; SCOUT certifies steps up to 8 and
    finds an SDC at 9 (the slot of step 8 is kept from then on). Returns each step's weight."""
    gem.certifier = lambda step: step <= 8  # SCOUT's certificates
    weights = {}
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights[step] = model.weight.detach().clone()
        assert gem.capture(step) and gem.drain(10)
        if step <= 8:
            gem.certify(step)
        if step == 9:
            gem.revoke(9)
    return weights


def test_a_restore_drops_the_copies_of_later_steps_a_restart_would_otherwise_take(tmp_path: Path) -> None:
    """An SDC at step 9: the restart restores the certified step 8. The copies of steps 9 to 12
    (memory, disk) are of the corrupted run. Kept, the next restart after a node lost its memory
    took step 12 from disk (newer than 8, and `latest` needs no certificate). They are dropped
    when 8 is restored, and that next restart restores 8 again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    gem = lone_gemini(tmp_path / "a", model, None, disk_interval=4, disk_folder=str(tmp_path / "disk"))
    try:
        weights = _train_with_an_sdc_at_9(gem, model, 12)
        assert sorted(gem._on_disk) == [8, 12] and gem.durable.steps() == [8, 12]
        assert sorted(gem._own_step.values()) == [8, 12]
    finally:
        gem.close()
    exchange = lambda key, blob, timeout: {0: blob}  # noqa: E731 (one rank: its own inventory)
    gem = lone_gemini(tmp_path / "a", model, None, disk_interval=4, disk_folder=str(tmp_path / "disk"))
    try:
        assert gem.recover(exchange, None, timeout=10, verified_only=True)[0] == 8
        assert torch.equal(model.weight, weights[8])
        assert gem.durable.steps() == [8] and gem.inventory().disk == (8,)
        assert gem.inventory().local == (8,)  # the other slot held step 12: dropped
    finally:
        gem.close()
    fresh = torch.nn.Linear(32, 32)  # the node lost its memory: a new shared-memory directory
    gem = lone_gemini(tmp_path / "b", fresh, None, disk_interval=4, disk_folder=str(tmp_path / "disk"))
    try:
        step, reason = gem.recover(exchange, None, timeout=10, verified_only=False)
        assert step == 8 and reason.startswith("disk"), reason
        assert torch.equal(fresh.weight, weights[8])
    finally:
        gem.close()


def test_a_flush_writes_the_older_capture_too_while_a_peer_lacks_the_newest(tmp_path: Path) -> None:
    """A SIGTERM finds some ranks one capture ahead of others: a rank whose peers are not known to
    hold its newest capture writes its older one too, so a step every rank wrote exists; once
    every rank holds the newest, only that (a group restart is not delayed by a second write). A
    restarted rank that has not captured yet (its slots known from the scan, not mapped) flushes
    as well."""
    from lm_resiliency.core.messages import GeminiInventory

    model = torch.nn.Linear(16, 16)
    gem = lone_gemini(tmp_path / "a", model, None, world=2, disk_interval=10**6)
    try:
        for step in (1, 2):
            assert gem.capture(step) and gem.drain(10)
        gem._inventories[1] = GeminiInventory(1, (1,), {}, ())  # rank 1 committed step 1 only
        assert gem.flush_for_restart(replicate=False) == 2 and gem.durable.steps() == [1, 2]
        disk = gem.durable
        for step in (1, 2):
            disk.path(step).unlink()
        gem._on_disk.clear()
        gem._inventories[1] = GeminiInventory(1, (1, 2), {}, ())  # now it holds step 2 as well
        assert gem.flush_for_restart(replicate=False) == 2 and disk.steps() == [2]
        disk.path(2).unlink()
    finally:
        gem.close()
    gem = lone_gemini(tmp_path / "a", torch.nn.Linear(16, 16), None, world=2)
    gem.durable = disk
    try:
        assert gem.scan()["local"] == [1, 2] and all(slot.mapping is None for slot in gem._own)
        assert gem.flush_for_restart(replicate=False) == 2 and disk.steps() == [1, 2]  # rank 1 unheard
    finally:
        gem.close()


def test_verify_image_checks_header_and_every_chunk(tmp_path: Path) -> None:
    from lm_resiliency.runtime.shm import verify_image

    slot = SlotFile(tmp_path / "s")
    h = _commit(slot, bytes(range(256)) * 3, step=5)
    image = bytes(slot.view()[: h.file_size])
    slot.close()
    assert verify_image("s", image) == h
    for at, what in ((HEADER_SIZE + 70, "chunk 1 fails"), (20, "header checksum"), (0, "bad magic")):
        damaged = bytearray(image)
        damaged[at] ^= 1
        with pytest.raises(CorruptSlot, match=what):
            verify_image("s", bytes(damaged))
    with pytest.raises(CorruptSlot, match="truncated"):
        verify_image("s", image[: h.file_size - 1])
    with pytest.raises(CorruptSlot, match="truncated"):
        verify_image("s", image[:10])


def test_a_fresh_optimizer_state_goes_straight_to_its_parameters_device() -> None:
    """A restored optimizer state with no live tensor to copy into is copied once, to where the
    optimizer's load_state_dict would move it (here the meta device stands in for a GPU); "step"
    stays on the host as torch keeps it, and an optimizer that loads its own way gets host clones."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    saved = opt.state[model.weight]

    def restored(optimizer: Any) -> dict[str, Any]:
        # The restore's views into the slot; here the saved tensors themselves, in dicts of their own.
        state = {"optimizer": {**opt.state_dict(), "state": {0: dict(saved)}}}
        materialize(state, torch.nn.Linear(4, 4), optimizer)
        return state["optimizer"]["state"][0]

    meta = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in ((4, 4), (4,))]
    entry = restored(torch.optim.AdamW(meta, lr=0.1))
    assert entry["exp_avg"].device.type == "meta" and entry["exp_avg_sq"].device.type == "meta"
    assert entry["step"].device.type == "cpu"
    assert entry["step"].data_ptr() != saved["step"].data_ptr()  # a clone: the slot's view is let go

    class OwnLoading(torch.optim.AdamW):
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)

    entry = restored(OwnLoading(meta, lr=0.1))
    assert entry["exp_avg"].device.type == "cpu"
    assert entry["exp_avg"].data_ptr() != saved["exp_avg"].data_ptr()
    assert torch.equal(entry["exp_avg"], saved["exp_avg"])


def test_stale_runs_are_reclaimed_live_and_recent_ones_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import subprocess
    import sys

    from lm_resiliency.cli.main import main as cli
    from lm_resiliency.gemini.hygiene import reclaim_stale_runs, usage, write_owner

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    for run, pid in (("old-dead", dead_pid), ("old-live", os.getpid()), ("new-dead", dead_pid)):
        node = tmp_path / run / "node-a"
        write_owner(node, 0)
        (node / ".owner-r0").write_text(str(pid))
        (node / "own-r0-s0").write_bytes(b"x" * 1000)
        if run.startswith("old"):
            for f in node.iterdir():
                os.utime(f, (0, 0))
    by_run = {u.run: u for u in usage(tmp_path)}
    assert by_run["old-live"].live_owners == (os.getpid(),) and by_run["old-dead"].live_owners == ()
    assert by_run["old-dead"].bytes >= 1000
    assert [u.run for u in reclaim_stale_runs(tmp_path, stale_after_s=3600)] == ["old-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new-dead", "old-live"]
    assert cli(["shm", "--dir", str(tmp_path), "--clean", "--older-than", "0"]) == 0
    out = capsys.readouterr().out
    assert "reclaimed new-dead/node-a" in out and "old-live/node-a" in out
    # Without --dir: the folder the jobs use, LM_RESILIENCY_SHM_DIR (it listed /dev/shm/lm_resiliency).
    monkeypatch.setenv("LM_RESILIENCY_SHM_DIR", str(tmp_path))
    assert cli(["shm"]) == 0
    assert capsys.readouterr().out.startswith("old-live/node-a: ")


def test_checksums_on_a_thread_pool_equal_the_serial_ones() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from lm_resiliency.runtime.shm import chunk_digests

    payload = memoryview(bytes(range(256)) * 4099)  # 17 chunks of 64 KiB, the last one short
    serial = chunk_digests(payload, 1 << 16)
    with ThreadPoolExecutor(3) as pool:
        assert chunk_digests(payload, 1 << 16, pool) == serial
        assert chunk_digests(memoryview(b""), 1 << 16, pool) == chunk_digests(memoryview(b""), 1 << 16)
    assert len(serial) == 17


def test_a_copy_the_scan_verified_is_not_hashed_again_but_a_changed_one_is(tmp_path: Path) -> None:
    """Recovery verifies each copy once: `scan()` hashes it; the restore of that same commit does
    not hash it again, while a slot recommitted after the scan is verified before it is loaded."""
    from unittest import mock

    from lm_resiliency.runtime.shm import SlotFile

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    gem = lone_gemini(tmp_path, model, None)
    try:
        assert gem.capture(1) and gem.drain(10)
        assert gem.scan()["local"] == [1]
        k = next(k for k, s in gem._own_step.items() if s == 1)
        with mock.patch.object(SlotFile, "verify", autospec=True, side_effect=SlotFile.verify) as verify:
            gem._restore_from(gem._own[k], 1)
            assert verify.call_count == 0  # the scan's verification stands
            with torch.no_grad():
                model.weight.add_(1.0)
            assert gem.capture(2) and gem.drain(10)
            assert gem.scan()["local"] == [1, 2]
            k2 = next(k for k, s in gem._own_step.items() if s == 2)
            with torch.no_grad():
                model.weight.add_(1.0)
            gem._own_step.pop(k2)
            assert gem.capture(3) and gem.drain(10)  # recommits the slot step 2 was in
            gem._own_step[k2] = 3
            verify.reset_mock()  # the second scan's own hashing
            gem._restore_from(gem._own[k2], 3)
            assert verify.call_count == 1  # not the commit the scan saw: verified before loading
    finally:
        gem.close()


def test_shm_usage_tolerates_files_vanishing_while_it_looks(tmp_path: Path) -> None:
    """A fresh run's ranks drop their old slots while a peer scans the folder for stale runs: a
    file deleted between listing and `stat` is not counted, never an error (it crashed a rank's
    `enable_resiliency` once)."""
    import threading

    from lm_resiliency.gemini.hygiene import reclaim_stale_runs, usage, write_owner

    node = tmp_path / "run" / "node"
    write_owner(node, 0)
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            f = node / f"own-r1-s{i % 2}"
            f.write_bytes(b"x")
            f.unlink()
            i += 1

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for _ in range(3000):
            (u,) = usage(tmp_path)
            assert u.live_owners == (os.getpid(),)
            assert reclaim_stale_runs(tmp_path, stale_after_s=0.0, keep_run="run") == []
    finally:
        stop.set()
        t.join(timeout=10)


def test_a_second_live_job_with_the_same_run_id_keeps_its_copies_apart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two jobs on one node under one run id (torchrun's default "none") would overwrite each other's
    in-memory copies: the second keeps its own in a folder of its own, with a warning naming the
    fix, and captures there; the live job's files are untouched. A dead owner (the worker an earlier
    generation lost) is not in the way, and a closed session gives its claim up."""
    import subprocess
    import sys

    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    owner = tmp_path / "r" / "n" / ".owner-r0"
    try:
        owner.parent.mkdir(parents=True)
        owner.write_text(str(other.pid))
        (owner.parent / "own-r0-s0").write_bytes(b"the live job's copy")
        model = torch.nn.Linear(2, 2)
        gem = lone_gemini(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            with caplog.at_level("WARNING"):
                gem.claim()
            assert f"another live process (pid {other.pid})" in caplog.text and "--rdzv-id" in caplog.text
            assert gem.dir == tmp_path / f"r.pid{os.getpid()}" / "n"
            gem.prepare()
            model(torch.ones(1, 2)).sum().backward()
            assert gem.capture(1) and gem.drain(10)
            assert sorted(p.name for p in gem.dir.glob("own-r0-s*"))
        finally:
            gem.close()
        assert owner.read_text() == str(other.pid)  # the live job's claim and copy are untouched
        assert (owner.parent / "own-r0-s0").read_bytes() == b"the live job's copy"
    finally:
        other.stdin.close()  # type: ignore[union-attr]
        other.wait(timeout=30)
    gem = lone_gemini(tmp_path, torch.nn.Linear(2, 2), None)
    try:
        gem.claim()  # its owner is gone now
        assert gem.dir == owner.parent and owner.read_text() == str(os.getpid())
    finally:
        gem.close()
    assert not owner.exists()


def test_a_captured_loader_position_of_another_shape_is_left_out_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The RNG state an instrumented loader's iterator was made at only makes a resume's random
    numbers the uninterrupted run's: a malformed one is logged and not used, never raised."""
    rng = torch.get_rng_state()
    saved = {
        "train": {"torch": rng},
        "short": {"torch": rng[:10]},
        "floats": {"torch": rng.float()},
        "none": None,
        7: {"torch": rng},
    }
    got = loader_positions(saved)
    assert list(got) == ["train"] and torch.equal(got["train"], rng)
    assert got["train"].data_ptr() != rng.data_ptr()  # its own copy, not a view into a slot
    assert loader_positions(None) == {} and loader_positions([rng]) == {}
    assert caplog.text.count("is malformed: not used") == 5


def test_a_full_shared_memory_folder_reclaims_dead_runs_idle_a_minute_not_a_restarting_one(
    tmp_path: Path,
) -> None:
    """A job that ended minutes ago left its copies (kept an hour for a restart that may come); the
    next job on the node found /dev/shm full and could not start. Under pressure, dead runs idle
    for a minute go; a dead run that changed seconds ago (its worker group restarting) stays, and
    with nothing to reclaim the error is the clear one."""
    import os
    import subprocess
    import sys

    from lm_resiliency.gemini.hygiene import write_owner

    shm = tmp_path / "tmpfs"
    shm.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(shm)], check=True, capture_output=True
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here: {exc}")
    try:
        dead_pid = int(
            subprocess.run(
                [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
            ).stdout
        )
        for run, size, age in (("ended", 2 << 20, 600.0), ("restarting", 400 << 10, 0.0)):
            node = shm / run / "node-a"
            write_owner(node, 0)
            (node / ".owner-r0").write_text(str(dead_pid))
            (node / "own-r0-s0").write_bytes(b"x" * size)
            for f in node.iterdir():
                os.utime(f, (time.time() - age, time.time() - age))
        torch.manual_seed(0)
        model = nn.Linear(384, 384)  # two slots of ~0.6 MiB: no room beside the dead runs
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gem = lone_gemini(shm, model, opt, pin_memory=False)
        try:
            gem.prepare()
            assert sorted(p.name for p in shm.iterdir()) == ["r", "restarting"]
        finally:
            gem.close()
        # Nothing left to reclaim: the clear error.
        big = nn.Linear(1024, 1024)
        gem = lone_gemini(shm, big, torch.optim.SGD(big.parameters(), lr=0.1), pin_memory=False)
        try:
            with pytest.raises(SharedMemoryError, match="is /dev/shm large enough"):
                gem.prepare()
        finally:
            gem.close()
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=False)


def test_with_several_replica_groups_the_capture_kept_is_one_every_group_certified(tmp_path: Path) -> None:
    """Rank 0 of replica group (0, 2) in a job whose other group (1, 3) has an SDC at step 9 (its
    replay names the culprit a few steps later). Rank 0's own group certifies every step; kept by
    its own certificates alone, it rotated past step 8, and a recovery-verified restart found no
    step every rank held (the 2 x 2 job restarted from step 0). It keeps step 8, the newest step
    the other group certified too (its inventories say so), and says what it certified."""
    from lm_resiliency.core.messages import GeminiInventory

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    gem = lone_gemini(tmp_path, model, None, world=4, groups=[[0, 2], [1, 3]])
    gem.certifier = lambda step: True  # rank 0's group agreed on every step
    try:
        for step in range(1, 13):
            assert gem.capture(step) and gem.drain(10)
            # The other group, in step with this one: its captures, certified up to step 8.
            held = (step - 1, step) if step <= 9 else (8, step)
            for r in (1, 3):
                gem._inventories[r] = GeminiInventory(r, held, {}, (), tuple(s for s in held if s <= 8))
        assert sorted(gem._own_step.values()) == [8, 12]
        assert gem.inventory().certified == (8, 12)
    finally:
        gem.close()


def test_a_durable_copy_of_a_certified_step_is_certified_in_the_inventory(tmp_path: Path) -> None:
    """Step 4 went to disk and SCOUT certified it; memory holds 5 and 6 by now. The inventory
    says 4 is certified too: when the ranks of a group keep different captures in memory (one
    whose messages were dropped certified what the others judged without it), a disk copy every
    rank wrote may be the only step all of them hold. Before, only steps in memory were said
    certified, and a recovery-verified restart found none and began from step 0 (an outsider run:
    a 15 s message drop on one rank, then an SDC on another node)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    gem = lone_gemini(tmp_path, model, None, disk_interval=4)
    gem.certifier = lambda step: True
    try:
        for step in range(1, 7):
            assert gem.capture(step) and gem.drain(10)
        inv = gem.inventory()
        assert inv.disk == (4,) and 4 not in inv.local, inv
        assert inv.certified == (4, 5, 6), inv
    finally:
        gem.close()


def test_the_durable_folder_has_one_id_for_every_rank_that_writes_to_it(tmp_path: Path) -> None:
    """Ranks writing to one folder (shared storage) report one id, whoever wrote first; another
    folder (a node's own disk) has another. None before anything is written."""
    from lm_resiliency.gemini.durable import DurableStore

    blob = memoryview(bytes(64))
    a, b = (DurableStore(str(tmp_path / "shared"), "run", r) for r in (0, 1))
    other = DurableStore(str(tmp_path / "local"), "run", 0)
    assert a.store_id() == "" and not (tmp_path / "shared").exists()
    b.write(4, blob)
    a.write(4, blob)
    other.write(4, blob)
    assert a.store_id() == b.store_id() != "" and other.store_id() not in ("", a.store_id())
    assert DurableStore(str(tmp_path / "shared"), "run", 2).store_id() == a.store_id()  # a restart
    assert sorted(p.name for p in (tmp_path / "shared" / "run").iterdir()) == [".store-id", "step-0000000004"]


def test_the_restart_note_carries_the_failure_kind_to_the_next_generation(tmp_path: Path) -> None:
    """SCOUT's revoke notes `recovery_verified` with the kind it found (sdc, stale_state); the next
    generation's recover reads both on any rank: it restores a certified step and names the kind.
    A note of an earlier version (the mode alone) or a damaged one names no kind, and recover
    consumes the note."""
    model = torch.nn.Linear(4, 4)
    exchange = lambda key, blob, timeout: {0: blob}  # noqa: E731 (one rank: its own inventory)
    gem = lone_gemini(tmp_path, model, None)
    try:
        assert gem.capture(1) and gem.drain(10)
        gem.certify(1)
        assert gem.noted_restart_mode() is None and gem.noted_failure_kind() is None
        gem.revoke(2, "stale_state")
        assert (gem.noted_restart_mode(), gem.noted_failure_kind()) == ("recovery_verified", "stale_state")
        assert gem.recover(exchange, None, timeout=10, verified_only=None)[0] == 1
        assert gem.restored_verified and gem.noted_kind == "stale_state"
        assert gem.noted_restart_mode() is None  # consumed
        gem.note_restart_mode("latest", "tensor_corruption")  # prepare_recovery: the caller's word
        assert gem.recover(exchange, None, timeout=10, verified_only=None)[0] == 1
        assert not gem.restored_verified and gem.noted_kind == "tensor_corruption"
        for text in ("recovery_verified", "recovery_verified gremlins", "latest sdc extra", "\xff"):
            gem._mode_path().write_text(text)
            assert gem.noted_failure_kind() is None, text
        assert gem.recover(exchange, None, timeout=10, verified_only=None)[0] == 1
        assert gem.noted_kind is None
    finally:
        gem.close()


def test_held_first_rank_is_the_lowest_own_slot_of_the_run_on_the_node(tmp_path: Path) -> None:
    from lm_resiliency.gemini.hygiene import held_first_rank

    node = tmp_path / "run" / "n0"
    assert held_first_rank(tmp_path, "run", "n0") == -1  # nothing there
    node.mkdir(parents=True)
    for name in ("own-r5-s0", "own-r4-s1", "replica-r0-h4-s0", ".owner-r4", "own-r1-s2", "own-rx-s0"):
        (node / name).write_bytes(b"")
    assert held_first_rank(tmp_path, "run", "n0") == 4  # replicas and strays do not count
    assert held_first_rank(tmp_path, "other", "n0") == -1


@pytest.mark.parametrize(
    ("exact", "verified", "want"),
    [(None, False, 4), (8, False, 4), (8, True, -1)],
    ids=["newest", "asked_for_8", "asked_for_8_among_certified"],
)
def test_a_durable_copy_failing_its_checksums_when_restored_is_left_out_and_an_older_step_restored(
    tmp_path: Path, exact: int | None, verified: bool, want: int
) -> None:
    """The node lost its memory, and the newest durable copy (step 8) has a chunk flipped after it
    was written: the scan reads only headers and checksum tables, so the plan chooses it. Fetched
    and verified before anything is loaded, it fails; it is reported, left out, and the plan made
    again restores step 4 from disk, bitwise. Before, the restore raised CorruptSlot: every restart
    of the job chose the same copy and died, until the run gave up. A restart that asked for step 8
    (the leader's plan) gets the newest older step at the trust level it asked for: none here among
    certified steps (nothing was certified), so nothing is loaded."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    disk = str(tmp_path / "disk")
    gem = lone_gemini(tmp_path / "a", model, None, disk_interval=4, disk_folder=disk)
    weights = {}
    try:
        for step in range(1, 9):
            with torch.no_grad():
                model.weight.add_(1.0)
            weights[step] = model.weight.detach().clone()
            assert gem.capture(step) and gem.drain(10)
        assert gem.durable.steps() == [4, 8]
        path = gem.durable.path(8)
    finally:
        gem.close()
    raw = bytearray(path.read_bytes())
    raw[len(raw) * 2 // 3] ^= 0x40  # inside the slot's payload, past the header
    path.write_bytes(bytes(raw))
    faults: list[dict] = []
    fresh = torch.nn.Linear(64, 64)
    gem = lone_gemini(tmp_path / "b", fresh, None, disk_interval=4, disk_folder=disk, on_fault=faults.append)
    exchange = lambda key, blob, timeout: {0: blob}  # noqa: E731 (one rank: its own inventory)
    try:
        before = fresh.weight.detach().clone()
        step, reason = gem.recover(exchange, exact, timeout=10, verified_only=verified)
        assert step == want, reason
        if want < 0:
            assert torch.equal(fresh.weight, before) and "rank 0 disk step 8" in reason, reason
            return
        assert reason.startswith("disk:"), reason
        assert torch.equal(fresh.weight, weights[4])
        bad = [f for f in faults if f["kind"] == "checkpoint_corruption" and f.get("steps") == [8]]
        assert bad and "fails its checksum" in bad[0]["detail"] and str(path) in bad[0]["detail"], faults
    finally:
        gem.close()


@pytest.mark.timeout(30)
def test_a_flush_from_a_signal_handler_in_the_middle_of_a_capture_does_not_wait_for_that_capture(
    tmp_path: Path,
) -> None:
    """torchrun's SIGTERM runs our handler on the training thread, which may be in the middle of a
    capture's copy (with a capture every step, often). That capture goes on only once the handler
    returns, so the flush must not wait for it: before, it waited its whole timeout (5 s on
    SIGTERM), and the group's restart with it, and wrote only what was committed before."""
    model = torch.nn.Linear(16, 16)
    gem = lone_gemini(tmp_path, model, None, disk_interval=10**6)
    flushed: list[int] = []

    def extra() -> dict[str, int]:  # called inside capture(3): where the signal lands
        flushed.append(gem.flush_for_restart(timeout=60.0, replicate=False))
        return {}

    try:
        for step in (1, 2):
            assert gem.capture(step) and gem.drain(10)
        gem.extra_state_fn = extra
        assert gem.capture(3)
        assert flushed == [2] and gem.durable.steps() == [2]
        gem.extra_state_fn = None
        assert gem.drain(10) and gem.flush_for_restart(timeout=10.0) == 3  # the capture itself went on
    finally:
        gem.close()


def test_every_dtype_is_copied_bitwise_through_slot_views_kept_while_the_layout_stays(tmp_path: Path) -> None:
    """A capture copies each tensor into a view of the slot typed and shaped like it (one
    `_foreach_copy_`), kept from one capture into that slot to the next while the layout stays the
    same, and made anew when it changes; every dtype comes back bit for bit, a NaN's payload too."""
    nan = torch.tensor([0x7FC12345, -1], dtype=torch.int32).view(torch.float32)  # odd NaN payloads
    grown = torch.nn.Parameter(torch.randn(3))

    def extra_state(n: int) -> dict[str, Any]:
        return {
            "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) / 7,
            "c64": torch.randn(4, dtype=torch.complex64),
            "bools": torch.tensor([True, False, True]),
            "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "f64": torch.randn(2, 2, dtype=torch.float64),
            "nan": nan,
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "transposed": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
            "param": grown,  # requires grad
            "grows": torch.arange(float(n)),
        }

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sizes = {1: 5, 2: 5, 3: 5, 4: 5, 5: 9}
    got: dict[str, Any] = {}
    gem = lone_gemini(tmp_path, model, opt)
    try:
        views: dict[int, list[Any]] = {}
        for step, n in sizes.items():
            gem.extra_state_fn = lambda n=n: extra_state(n)
            assert gem.capture(step, wait_for_verdict=False) and gem.drain(10)
            k = next(s for s, at in gem._own_step.items() if at == step)
            held = gem._views[k][3]
            if step in (3, 4):  # the same layout as two captures before, into the same slot
                assert held is views[k]
            if step == 5:  # a tensor grew: views made anew
                assert held is not views[k]
            views[k] = held
            gem.load_extra_state_fn = got.update
            gem._restore_from(gem._own[k], step)
            want = extra_state(n)
            assert got.keys() == want.keys()
            for name, t in want.items():
                back = got[name]
                assert back.dtype == t.dtype and back.shape == t.shape, name
                assert torch.equal(
                    back.reshape(-1).view(torch.uint8), t.detach().reshape(-1).view(torch.uint8)
                ), name
    finally:
        gem.close()
    assert not gem._views  # the views let go of the slots' mappings


def test_no_collection_runs_while_a_capture_holds_its_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture of a model of hundreds of tensors makes thousands of objects (state dicts, the
    walk's entries) and drops them at its end. With the collector running, they started collections
    in the middle of the walk that traversed them and moved them to older generations, whose full
    collections then cost the training thread tens of ms in a large process. The collector is off
    while the capture holds them: no collection starts during the walk."""
    import gc

    import lm_resiliency.gemini.component as component

    walk = component.flatten

    def watched(state: Any) -> Any:
        capturing.set()
        try:
            return walk(state)
        finally:
            capturing.clear()

    monkeypatch.setattr(component, "flatten", watched)

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(100)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    inside: list[bool] = []
    capturing = threading.Event()

    def started(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and capturing.is_set():
            inside.append(True)

    gem = lone_gemini(tmp_path, model, opt)
    gc.callbacks.append(started)
    try:
        for step in range(1, 11):
            assert gem.drain(10) and gem.capture(step, wait_for_verdict=False)
        assert gem.drain(10) and gem.stats.captures == 10
    finally:
        gc.callbacks.remove(started)
        gem.close()
    assert not inside, f"{len(inside)} collections started during 10 captures' walks"


def test_the_cpu_copier_takes_typed_views_and_byte_views_alike() -> None:
    """Typed views of a slot go through one `_foreach_copy_`; a byte view (a dtype with no typed
    view of the slot) makes it copy each pair by itself, the bytes as they are."""
    from lm_resiliency.gemini.copier import SyncCopier

    typed_src = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    float_src = torch.randn(3, 5)
    typed_dst = torch.empty(2, 3, dtype=torch.int16)
    byte_dst = torch.empty(60, dtype=torch.uint8)
    SyncCopier().copy([(typed_dst, typed_src)])
    assert torch.equal(typed_dst, typed_src)
    typed_dst.zero_()
    SyncCopier().copy([(typed_dst, typed_src), (byte_dst, float_src)])
    assert torch.equal(typed_dst, typed_src)
    assert torch.equal(byte_dst, float_src.reshape(-1).view(torch.uint8))


OUTSIDE_DAMAGE = """
import os, sys
from pathlib import Path
import torch
from lm_resiliency.runtime.shm import HEADER_SIZE, SlotFile
from tests.conftest import lone_gemini

torch.manual_seed(0)
m = torch.nn.Linear(64, 64)
o = torch.optim.AdamW(m.parameters(), lr=0.1)
gem = lone_gemini(Path(sys.argv[1]), m, o)

def step() -> None:
    m(torch.randn(4, 64)).sum().backward()
    o.step()
    o.zero_grad()

for s in (1, 2):
    step()
    assert gem.capture(s, wait_for_verdict=False) and gem.drain(10)
damaged = gem._own[next(k for k, s in gem._own_step.items() if s == 2)].path
if sys.argv[2] == "truncated":
    os.truncate(damaged, HEADER_SIZE + 100)
else:
    damaged.unlink()
step()
assert gem.capture(3, wait_for_verdict=False) and gem.drain(10)
# Seen at the commit of step 3: dropped from what this rank holds, and reported.
assert 2 not in gem._own_step.values() and gem.stats.scrub_failures == 1, gem.stats
assert str(damaged.name) in gem.stats.rejected_copies[0], gem.stats.rejected_copies
for s in range(4, 7):  # the damaged slot is captured into again at step 4 and step 6
    step()
    assert gem.capture(s, wait_for_verdict=False) and gem.drain(10)
assert gem.stats.scrub_failures == 1, gem.stats
gem.close()
held = {}
for k in (0, 1):
    slot = SlotFile.open_existing(damaged.with_name(damaged.name[:-1] + str(k)))
    header = slot.read_header()
    slot.verify(header)
    held[k] = header.step
    slot.close()
print(sorted(held.values()))
"""


@pytest.mark.parametrize("damage", ["truncated", "removed"])
def test_a_slot_truncated_or_removed_from_outside_is_mapped_anew_at_the_next_capture(
    tmp_path: Path, damage: str
) -> None:
    """Something outside the job truncates or removes a rank's slot file (a cleanup script; the
    campaigns' checkpoint_truncation and checkpoint_missing). The copy it held is dropped and
    reported at the next commit (without `verify_integrity`: found before only by the restart that
    needed it). The next capture into the slot wrote through the old mapping: into pages the file
    no longer had, which killed the worker with SIGBUS, or into the removed file, lost to a
    restart. It now maps the file as it is, and every capture after the damage is in a file a
    restart reads."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "run.py").write_text(OUTSIDE_DAMAGE)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "shm"), damage],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split("\n")[-2] == "[5, 6]", done.stdout
    assert "mapped anew" in done.stderr


def test_a_capture_into_a_mapped_slot_stats_its_file_once(tmp_path: Path, monkeypatch: Any) -> None:
    """A capture looks once at whether its slot's file is still the one it mapped (two stats, on
    the training thread); mapping it for the capture's size does not look again."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    looks: list[Path] = []
    real = SlotFile.intact

    def counted(self: SlotFile) -> bool:
        if threading.current_thread() is threading.main_thread():
            looks.append(self.path)
        return real(self)

    gem = lone_gemini(tmp_path, model, opt)
    try:
        for step in (1, 2):  # both slots mapped
            assert gem.capture(step, wait_for_verdict=False) and gem.drain(10)
        monkeypatch.setattr(SlotFile, "intact", counted)
        for step in range(3, 7):
            assert gem.capture(step, wait_for_verdict=False) and gem.drain(10)
    finally:
        gem.close()
    assert len(looks) == 4, looks


def test_an_inventory_lost_on_the_way_reaches_peers_once_the_rank_stops_capturing(tmp_path: Path) -> None:
    """A rank's inventory went to its peers only when it changed: one lost on the way (a message
    drop, a partition, a peer not yet connected) and no capture after it (the job ended, it waits
    on a stalled peer, its interval is long) left the peers planning from a step this rank had
    moved past for good. The worker now hands it on again while none went out for a while, less
    often each time."""
    from lm_resiliency.config import InMemoryCkptConfig, RuntimeConfig
    from lm_resiliency.core.topology import Topology
    from lm_resiliency.gemini.component import Gemini
    from lm_resiliency.testing import InMemoryNetwork, InMemoryTransport

    net = InMemoryNetwork()
    cfg = RuntimeConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=5.0)
    rts = start_runtimes(2, lambda: InMemoryTransport(net), nodes=["n", "n"], config=cfg)
    heard: list[tuple[int, ...]] = []
    when: list[float] = []
    got = threading.Condition()

    def on_inventory(sealed: Any, msg: Any) -> None:
        with got:
            heard.append(msg.local)
            when.append(time.monotonic())
            got.notify_all()

    rts[0].add_handler("ginv", on_inventory)
    gem = None
    try:
        model = torch.nn.Linear(4, 4)
        gem = Gemini(
            rank=1,
            world_size=2,
            node_id="n",
            run_id="r",
            topology=Topology.build(["n", "n"], [[0, 1]]),
            runtime=rts[1],
            model=model,
            optimizer=None,
            scheduler=None,
            extra_state_fn=None,
            load_extra_state_fn=None,
            config=InMemoryCkptConfig(pin_memory=False),
            interval=1,
            shm_dir=str(tmp_path / "shm"),
            disk_folder=str(tmp_path / "checkpoints"),
        )
        assert gem.capture(1, wait_for_verdict=False) and gem.drain(10)
        with got:
            assert got.wait_for(lambda: (1,) in heard, 10), heard
        rts[1].mute(0.5)  # the commit of step 2 is announced into the drop
        assert gem.capture(2, wait_for_verdict=False) and gem.drain(10)
        with got:
            assert got.wait_for(lambda: (1, 2) in heard, 10), heard
            # Sent again after 0.2 s, then 0.4 s, 0.8 s...: an idle rank of a large job does not
            # keep every peer receiving its inventory every 0.2 s.
            first = len(heard) - 1
            assert got.wait_for(lambda: len(heard) >= first + 3, 10), heard
            assert when[first + 2] - when[first] >= 1.0, when[first:]
    finally:
        if gem is not None:
            gem.close()
        for rt in rts:
            rt.close()


def test_a_disk_that_fails_between_copies_is_reported_by_the_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The durable folder is probed with a byte between copies: a folder that takes no write (a
    file in its place here, as root writes through permissions; or a campaign's I/O error) is
    reported as `io_error` at the next capture, once while it lasts, and again after a probe went
    well. Before, nothing showed until the disk cadence's next copy (100 steps by default)."""
    import lm_resiliency.gemini.component as component
    from lm_resiliency.gemini.durable import DurableError, DurableStore

    store = DurableStore(str(tmp_path / "ok"), "r", 3)
    store.probe()  # a folder that takes writes: nothing left in it
    assert [p.name for p in store.root.iterdir()] == []
    store.fail_writes(1)
    with pytest.raises(DurableError, match="takes no write: Input/output error"):
        store.probe()
    store.probe()  # the injected error was the next write's, once

    monkeypatch.setattr(component, "DISK_PROBE_S", 0.0)
    model = torch.nn.Linear(8, 8)
    faults: list[dict[str, Any]] = []
    gem = lone_gemini(tmp_path / "shm", model, None, on_fault=faults.append, disk_interval=100)
    try:
        blocked = tmp_path / "blocked"
        blocked.write_text("not a folder")
        gem.durable = DurableStore(str(blocked), "r", 0)
        for step in (1, 2, 3):
            assert gem.capture(step) and gem.drain(10)
        assert [(f["kind"], f["reason"]) for f in faults] == [("io_error", "durable_probe_failed")]
        assert str(blocked) in faults[0]["detail"] and gem.stats.disk_errors == 3
        gem.durable = DurableStore(str(tmp_path / "fine"), "r", 0)
        assert gem.capture(4) and gem.drain(10)
        gem.durable.fail_writes(1, errno.EROFS)
        assert gem.capture(5) and gem.drain(10)
        assert [f["reason"] for f in faults] == ["durable_probe_failed"] * 2
        assert "Read-only file system" in faults[1]["detail"] and gem.inventory().local == (4, 5)
    finally:
        gem.close()


@pytest.fixture
def watch() -> Iterator[IteratorWatch]:
    """The DataLoader iterator watch of an open GEMINI, installed for the test and removed after."""
    w = IteratorWatch()
    w.install()
    try:
        yield w
    finally:
        w.uninstall()


def test_the_iterator_watch_skips_malformed_records_and_loaders_with_their_own_generator(
    caplog: pytest.LogCaptureFixture, watch: IteratorWatch
) -> None:
    """A capture's `iterators` entry that is not (shape, RNG states, ended) is left out with a
    warning, never raised into a restore; a DataLoader with its own `generator=` draws from it, and
    the watch neither records it nor touches the global RNG around it."""
    from torch.utils.data import DataLoader

    bad = torch.zeros(3, dtype=torch.uint8)  # not an RNG state's size
    watch.restore(
        [
            {"shape": 1},
            "x",
            {"shape": "a", "torch": bad},
            {"shape": "a", "ended": "no"},
            {"shape": "a", "torch": None, "first": bad},
        ]
    )
    assert caplog.text.count("malformed: not used") == 5
    watch.first_step()  # nothing made, nothing to draw
    own = DataLoader(list(range(8)), batch_size=2, generator=torch.Generator().manual_seed(0))
    before = torch.get_rng_state()
    kept = iter(own)
    assert torch.equal(torch.get_rng_state(), before) and watch.snapshot() == []
    plain = DataLoader(list(range(8)), batch_size=2)
    it = iter(plain)
    (entry,) = watch.snapshot()
    assert torch.equal(entry["torch"], before) and entry["ended"] is False
    assert entry["shape"] == "list/SequentialSampler/2/4"
    assert len(list(it)) == 4 and watch.snapshot()[0]["ended"] is True
    del kept


def test_a_loader_without_workers_made_again_mid_epoch_draws_its_permutation_where_it_did(
    watch: IteratorWatch,
) -> None:
    """Without workers a RandomSampler draws its permutation at the iterator's first batch, not as
    it is made. A loop resumed mid-epoch makes its iterator again and skips to its position: the
    batches after it, and the random numbers after them, are the uninterrupted run's. Before, the
    remade iterator drew its permutation from the restored state (a 4-rank outsider job with
    num_workers=0 ended off the uninterrupted run after a kill, with or without torch.compile)."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    loader = DataLoader(list(range(16)), batch_size=2, shuffle=True)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    saved, state = watch.snapshot(), torch.get_rng_state()  # a capture at this step
    rest = [b.tolist() for b in it]
    after = torch.rand(3)
    watch.restore(saved)
    torch.set_rng_state(state)
    again = iter(loader)
    assert [next(again).tolist() for _ in range(3)] == seen  # the loop skips to its position
    assert [b.tolist() for b in again] == rest
    assert torch.equal(torch.rand(3), after)


@pytest.mark.parametrize("captured", ["mid-epoch", "before its first batch", "as it fetches its first batch"])
def test_two_loaders_made_again_mid_epoch_draw_their_permutations_where_they_did(
    captured: str, watch: IteratorWatch
) -> None:
    """A multi-task loop reads two loaders without workers. It makes the auxiliary loader's
    iterator, then the main one's (which draws its seed from the global RNG), then fetches from
    both: the auxiliary RandomSampler draws its permutation at its first batch, after the main
    iterator's making. Made again mid-epoch, it draws where it drew (the state at its first batch),
    not at the state it was made at; captured before its first batch (or as it fetches it: a
    step's capture taken at the next step's first fetch, where an epoch begins), it draws at that
    batch as the uninterrupted run did, after the restore. Before, an outsider's multi-task job
    resumed with another auxiliary order after a kill and ended off its uninterrupted run, and a
    capture at an epoch's first fetch resumed one draw behind."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    aux = DataLoader(list(range(16)), batch_size=2, shuffle=True)
    main = DataLoader(list(range(100, 124)), batch_size=3, shuffle=True)

    def fetch(its: list[Any], n: int) -> list[list[int]]:
        return [next(it).tolist() for it in its for _ in range(n)]

    a, m = iter(aux), iter(main)
    seen = fetch([a, m], 2) if captured == "mid-epoch" else []
    if captured == "as it fetches its first batch":  # (GEMINI's capture, at the fetch)
        taken: list[Any] = []
        watch.on_fetch = lambda: (
            taken.append((watch.snapshot(), torch.get_rng_state())) if not taken else None
        )
        rest = fetch([a, m], 3)
        watch.on_fetch = None
        saved, state = taken[0]
    else:
        saved, state = watch.snapshot(), torch.get_rng_state()  # a capture at this step
        rest = fetch([a, m], 3)
    assert [e["first"] is None for e in saved] == [captured != "mid-epoch"] * 2
    after = torch.rand(3)
    watch.restore(saved)
    torch.set_rng_state(state)
    a2, m2 = iter(aux), iter(main)  # the resumed loop makes both again, in the same order
    assert fetch([a2, m2], 2 if captured == "mid-epoch" else 0) == seen  # skipped to its position
    assert fetch([a2, m2], 3) == rest
    assert torch.equal(torch.rand(3), after)
    del a, m
    again = watch.snapshot()  # the remade iterators keep where they drew, for the next capture
    if captured == "mid-epoch":
        assert all(torch.equal(x["first"], y["first"]) for x, y in zip(again, saved, strict=True))


@pytest.mark.parametrize("raised", ["mid-epoch", "after the epoch's last batch"])
def test_an_iterator_an_exception_unwound_before_the_exit_capture_is_recorded_as_it_last_fetched(
    raised: str, watch: IteratorWatch
) -> None:
    """The loop raises after a step; the exception unwinds the loop's DataLoader iterator before
    the capture GEMINI takes as the worker dies. That iterator is recorded as it was at its last
    fetch: the resumed loop's iterator is made again at its state mid-epoch (no draw), or, after
    the epoch's last batch, from the restored state (the draw the uninterrupted run made for the
    next epoch). Before, it was left out: the resumed run's random numbers (dropout) were one draw
    off the uninterrupted run's (outsider 56: an exception at an epoch's last step, zero-import, and
    mid-epoch with enable_resiliency, both ended off their uninterrupted runs)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(8)), batch_size=2)  # no generator: iter() draws a seed
    last = 3 if raised != "mid-epoch" else 1

    def epoch(stop: int | None) -> list[Any]:
        seen = []
        for b in loader:
            seen.append((b.tolist(), torch.rand(2)))  # (dropout)
            if len(seen) - 1 == stop:
                raise RuntimeError("the loop's own error")
        return seen

    torch.manual_seed(0)
    want = epoch(None) + epoch(None)  # uninterrupted: two epochs
    torch.manual_seed(0)
    with pytest.raises(RuntimeError):
        epoch(last)
    saved, state = watch.snapshot(), torch.get_rng_state()  # the capture as the worker dies
    assert [e["ended"] for e in saved] == [raised != "mid-epoch"]
    watch.restore(saved)
    torch.set_rng_state(state)
    resumed = []
    if raised == "mid-epoch":  # the loop skips to its position, then goes on
        it = iter(loader)
        for _ in range(last + 1):
            next(it)
        resumed = [(b.tolist(), torch.rand(2)) for b in it]
        del it
    resumed += epoch(None)
    rest = want[last + 1 :]
    assert [b for b, _ in resumed] == [b for b, _ in rest]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(resumed, rest, strict=True))
    # Dropped with another made since (the next epoch's): that one stands for it, alone.
    watch.first_step()
    old = iter(loader)
    next(old)
    new = iter(loader)
    del old
    assert [e["first"] for e in watch.snapshot()] == [None]  # (new's: no batch fetched)
    del new


def test_an_ended_iterator_skipped_again_while_the_loop_holds_it_is_no_capture_of_its_successor(
    watch: IteratorWatch,
) -> None:
    """Restored where an epoch ended, the loop makes that epoch's iterator again, skips it to its end
    while it still holds it (`it = iter(loader)` rebinds it after the next one is made) and makes
    the next: a later capture records the next one as an iterator of its own. Before, the ended one
    was recorded in its place and the capture failed (an outsider's multi-task job died of an
    AttributeError at the step after such a restore, on every rank)."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    it = iter(loader)
    order = [b.tolist() for b in it]
    saved, state = watch.snapshot(), torch.get_rng_state()  # a capture where the epoch ended
    nxt = iter(loader)
    want = [b.tolist() for b in nxt]
    watch.restore(saved)
    torch.set_rng_state(state)
    it = iter(loader)
    assert [b.tolist() for b in it] == want  # (made as torch makes it: the next epoch's order)
    it = iter(loader)  # the loop asks for another while it holds the ended one
    next(it)
    (entry,) = [e for e in watch.snapshot() if not e["ended"]]
    assert isinstance(entry["first"], torch.Tensor)  # (the RNG state at its first batch)
    assert order != want


def test_what_a_restart_trusts_is_kept_with_the_durable_copies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Certificates and the next restart's trust level live beside the copies on disk, for a
    relaunch whose node memory is gone. A certificate names its capture by the header digest: a
    copy of the same step from another lineage (a restart that went past it, or a copy written
    again) is not certified by it. An SDC's revocation drops the steps from it on; a fresh launch's
    set-aside drops the earlier launch's trust level; a damaged record is said and trusts nothing."""
    from lm_resiliency.runtime.shm import header_digest

    disk = str(tmp_path / "disk")
    store = DurableStore(disk, "run", rank=0, keep_last=5)

    def image(tag: int) -> bytes:
        return bytes([tag]) * 8192

    for step in (4, 8, 9):
        store.write(step, memoryview(image(step)))
    store.certify(4, header_digest(image(4)))
    store.certify(8, header_digest(image(99)))  # another capture of step 8 was certified: not this copy
    store.certify(9, header_digest(image(9)))
    store.certify(12, header_digest(image(12)))  # no copy on disk: nothing to record
    assert DurableStore(disk, "run", rank=0).certified() == {4, 9}
    assert DurableStore(disk, "run", rank=1).certified() == set()  # each rank its own record
    store.write(4, memoryview(image(44)))  # written again, by another capture
    assert store.certified() == {9}
    store.revoke(9)
    assert store.certified() == set()
    store.certify(8, header_digest(image(8)))
    store.note_mode("recovery_verified sdc")
    assert DurableStore(disk, "run", rank=0).noted_mode() == "recovery_verified sdc"
    assert DurableStore(disk, "run", rank=0).certified() == {8}
    DurableStore(disk, "run", rank=0).set_aside_earlier()
    assert store.noted_mode() == "" and DurableStore(disk, "run", rank=0).certified() == set()
    DurableStore(disk, "run", rank=0).forget_earlier()
    assert store.certified() == {8}
    (store.root / ".trust-rank-00000.json").write_text('{"certified": {"8": "zz"}}')
    with caplog.at_level(logging.WARNING):
        assert store.certified() == set() and store.noted_mode() == ""
    assert ".trust-rank-00000.json is unreadable" in caplog.text


def test_a_relaunch_whose_memory_is_gone_after_an_sdc_restores_the_certified_copy_from_disk(
    tmp_path: Path,
) -> None:
    """An SDC at step 9; the script asks `flush_for_restart()` and the job is relaunched on nodes
    whose memory is gone (found by an outsider script: plain torchrun, every rank flushed after the
    SDC report). Before, the flush wrote only the newest capture (every rank held it), the trust
    level lived in the lost memory, and the relaunch restored step 10: the corruption. Now the
    certified step 8 is flushed too, with its certificate and the trust level beside it, and the
    relaunch restores 8; the note is consumed by that restore."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    folder = str(tmp_path / "disk")
    gem = lone_gemini(tmp_path / "a", model, None, disk_interval=10**6, disk_folder=folder)
    try:
        weights = _train_with_an_sdc_at_9(gem, model, 10)
        assert sorted(gem._own_step.values()) == [8, 10]
        assert gem.flush_for_restart(replicate=False) == 10
        assert gem.durable.steps() == [8, 10] and gem.durable.certified() == {8}
    finally:
        gem.close()
    exchange = lambda key, blob, timeout: {0: blob}  # noqa: E731 (one rank: its own inventory)
    fresh = torch.nn.Linear(16, 16)
    gem = lone_gemini(tmp_path / "b", fresh, None, disk_interval=10**6, disk_folder=folder)
    try:
        step, reason = gem.recover(exchange, None, timeout=10, verified_only=None)
        assert step == 8 and reason.startswith("disk"), reason
        assert torch.equal(fresh.weight, weights[8]) and gem.noted_kind == "sdc"
        assert gem.durable.noted_mode() == ""
    finally:
        gem.close()


def test_a_fresh_start_drops_the_trust_level_an_earlier_run_noted(tmp_path: Path) -> None:
    """An earlier run of this run id found an SDC and ended without a restart: its note (verified
    restore, kind sdc) stayed in the node's memory and on disk. A fresh start reclaims the slots and
    sets the disk copies aside: the note goes with them. Before, the fresh run's first restart (a
    crash) restored only certified steps and was reported as recovering from an SDC."""
    model = torch.nn.Linear(4, 4)
    folder = str(tmp_path / "disk")
    gem = lone_gemini(tmp_path / "a", model, None, disk_interval=1, disk_folder=folder)
    try:
        assert gem.capture(1) and gem.drain(10)
        gem.revoke(1)
        assert gem.noted_restart_mode() == "recovery_verified" and gem.noted_failure_kind() == "sdc"
    finally:
        gem.close()
    gem = lone_gemini(tmp_path / "a", model, None, disk_interval=1, disk_folder=folder)
    try:
        gem.reclaim()
        gem.set_aside_earlier()
        assert gem.noted_restart_mode() is None and gem.noted_failure_kind() is None
    finally:
        gem.close()


@pytest.mark.parametrize("thread", ["lm-resiliency-rank0", "the-scripts-own"])
def test_a_loader_iterator_finalized_on_our_thread_shuts_its_workers_down_on_another(
    thread: str, watch: IteratorWatch
) -> None:
    """A DataLoader iterator with workers, garbage in a reference cycle, is finalized on whichever
    thread allocates when a collection is due, one of this library's too: torch joins its workers
    there, up to 5 s each, and the runtime's event loop stalled that long (a session's start timed
    out after 10 s in a test, the loop thread in `_shutdown_workers` under an anyio call). Run on
    one of our threads, that shutdown runs on a thread of its own now; on any other, in place."""
    from torch.utils.data import DataLoader

    ran_on: list[str] = []
    it = iter(DataLoader(list(range(8)), batch_size=2, num_workers=1))
    assert next(it).tolist() == [0, 1]
    shutdown = it._shutdown_workers

    def recorded() -> None:
        ran_on.append(threading.current_thread().name)
        shutdown()

    it._shutdown_workers = recorded
    finalizer = threading.Thread(target=type(it).__del__, args=(it,), name=thread)  # as the collector
    finalizer.start()
    finalizer.join(timeout=60)
    for other in [t for t in threading.enumerate() if t.name == "lm-resiliency-loader-shutdown"]:
        other.join(timeout=60)
    assert it._shutdown  # (its workers are down)
    assert ran_on == ["lm-resiliency-loader-shutdown" if thread.startswith("lm-resiliency") else thread]
