"""GPU paths on a real CUDA device: the asynchronous capture copier and its fence, on-device
fingerprints, a killed CUDA training resumed bitwise from shared memory, and the NVML health source.

Skipped where there is no GPU (CI); run on a GPU machine with `pytest tests/gpu`.
"""

from __future__ import annotations

import json
import mmap
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from lm_resiliency.gemini.copier import CudaCopier, copier_for
from lm_resiliency.scout.fingerprint import device_fold, fingerprint, fingerprint_async, zeroed

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_async_copy_lands_the_pre_fence_bytes_even_when_the_tensor_changes_right_after() -> None:
    dev = torch.device("cuda")
    n = 64 << 20  # 256 MiB of float32: the copy takes long enough for a missing fence to show
    src = torch.randn(n, device=dev)
    expected = src.cpu().view(torch.uint8).clone()
    buf = mmap.mmap(-1, n * 4)
    copier = copier_for([src])
    assert isinstance(copier, CudaCopier)
    copier.register_host(buf, n * 4)
    assert copier._registered, "cudaHostRegister of the slot failed"
    dst = torch.frombuffer(buf, dtype=torch.uint8)
    completion = copier.copy([(dst, src)])
    completion.fence_device()  # what the optimizer pre-step hook does
    src.mul_(2.0).add_(1.0)  # the "optimizer" mutates right away on the compute stream
    completion.wait_host()
    assert torch.equal(dst, expected)
    torch.cuda.synchronize()
    assert not torch.equal(src.cpu().view(torch.uint8), expected)
    del dst
    copier.unregister_host(buf)
    assert not copier._registered
    buf.close()


def test_a_capture_holds_the_batchnorm_statistics_the_next_forward_replaces(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The capture's copies run on a side stream while the next forward runs on the compute stream:
    that forward updates a BatchNorm's running statistics in place, so their copies go first and the
    compute stream waits for them (the parameters' copies still overlap the forward)."""
    from tests.conftest import lone_gemini

    dev = torch.device("cuda")
    torch.manual_seed(0)

    def net() -> torch.nn.Module:
        layers = [torch.nn.Linear(2048, 2048), torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 2048)]
        return torch.nn.Sequential(*layers).to(dev)

    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gem = lone_gemini(tmp_path, model, opt)
    try:
        x = torch.randn(512, 2048, device=dev)
        model(x).sum().backward()
        opt.step()
        torch.cuda.synchronize()
        want = {n: v.detach().cpu().clone() for n, v in model.state_dict().items()}
        assert gem.capture(1)
        assert isinstance(gem._copier, CudaCopier)
        for _ in range(3):  # forwards queued right behind the copies
            model(x).sum().backward()
        opt.step()
        assert gem.drain(60)
        fresh = net()
        gem.model, gem.optimizer = fresh, None
        gem._restore_from(gem._own[next(k for k, s in gem._own_step.items() if s == 1)], 1)
        got = {n: v.cpu() for n, v in fresh.state_dict().items()}
        assert [n for n, v in want.items() if not torch.equal(v, got[n])] == []
    finally:
        gem.close()


def test_slot_files_are_page_locked_and_a_failed_registration_leaves_no_cuda_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from lm_resiliency.gemini.copier import _cudart
    from lm_resiliency.runtime.shm import SlotFile

    dev = torch.device("cuda")
    # Slots live on tmpfs (/dev/shm) in production: the kernel refuses long-term pins of pages of a
    # disk-backed file, so cudaHostRegister of a slot under /tmp on a disk fails (and is only slower).
    shm_dir = Path(tempfile.mkdtemp(dir="/dev/shm")) if Path("/dev/shm").is_dir() else tmp_path
    slot = SlotFile(shm_dir / "slot-0")
    slot.ensure_size(116_496)  # an odd payload size, as a small model gives
    copier = CudaCopier(dev)
    copier.register_host(slot.mapping, slot.size)
    assert copier._registered, "cudaHostRegister of a shared-memory slot failed"
    src = torch.randn(1000, device=dev)
    dst = torch.frombuffer(slot.mapping, dtype=torch.uint8, count=4000, offset=8192)
    done = copier.copy([(dst, src)])
    done.wait_host()
    assert torch.equal(dst, src.cpu().view(torch.uint8))
    del dst
    # Register a buffer behind the copier's back: its own registration then fails (already
    # registered); the next kernel must not inherit that error.
    other = mmap.mmap(-1, 1 << 20)
    import ctypes

    view = ctypes.c_char.from_buffer(other)
    ptr = ctypes.addressof(view)
    del view  # no export left: the mapping can close
    assert int(_cudart().cudaHostRegister(ptr, 1 << 20, 0)) == 0
    copier.register_host(other, 1 << 20)
    assert ptr not in copier._registered
    assert float((torch.ones(4, device=dev) * 2).sum()) == 8.0
    _cudart().cudaHostUnregister(ptr)
    copier.unregister_host(slot.mapping)
    slot.close()
    other.close()
    shutil.rmtree(shm_dir, ignore_errors=True)


def test_device_fingerprints_are_bitwise() -> None:
    dev = torch.device("cuda")
    x = torch.randn(1 << 20, device=dev)
    assert fingerprint([x]) == fingerprint([x.clone()])
    flipped = x.clone()
    flipped.view(torch.int32)[12345] ^= 1 << 3  # one bit of one element
    assert fingerprint([x]) != fingerprint([flipped])
    swapped = x.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fingerprint([x]) != fingerprint([swapped])
    odd = torch.randn(7, dtype=torch.float16, device=dev)  # 14 bytes: padded to whole words
    assert fingerprint([odd]) == fingerprint([odd.clone()]) != fingerprint([odd + 1])
    assert fingerprint([x[:1000]]) != fingerprint([torch.cat([x[:1000], x.new_zeros(1)])])  # lengths
    # The device computes the same fold as the CPU reference.
    big = torch.randn((1 << 20) + 3, dtype=torch.bfloat16, device=dev)
    assert torch.equal(device_fold(big).cpu(), device_fold(big.cpu()))
    # It reads the tensor in place: no temporaries its size (the device may be nearly full).
    huge = torch.randn(1 << 26, device=dev)  # 256 MiB
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fingerprint([huge])
    assert torch.cuda.max_memory_allocated() - before < 64 << 20


def test_async_fingerprints_equal_the_synchronous_ones_and_never_sync() -> None:
    dev = torch.device("cuda")
    tensors = [torch.randn(1 << 20, device=dev), torch.randn(5, dtype=torch.float16, device=dev), None]
    want = fingerprint(tensors)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call on this thread raises
    try:
        pending = fingerprint_async(tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.result() == want and pending.ready()


def test_device_fingerprints_tell_the_tensors_that_hold_only_zeros() -> None:
    """A dropped gradient on the device: its folds are zero (SCOUT's `Evidence.zeroed`), those of
    a tensor with anything else in it (one bit, -0.0, a bfloat16 value) are not."""
    dev = torch.device("cuda")
    ts = [
        torch.zeros(1000, 77, device=dev),
        torch.ones(3, device=dev),
        torch.zeros(5, dtype=torch.bfloat16, device=dev),
    ]
    bit = torch.zeros(70000, device=dev)
    bit.view(torch.int32)[12345] = 1
    ts += [bit, torch.tensor([-0.0], device=dev)]
    assert zeroed(fingerprint_async(ts).parts(), frozenset()) == [0, 2]


def test_cuda_training_killed_and_resumed_is_bitwise_equal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run(
        [sys.executable, "-m", "lm_resiliency.cli.quickstart", "--device", "cuda", "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout[out.stdout.index("{") :])
    assert summary["bitwise_equal_to_uninterrupted"] and summary["resumed_at_step"] == 17
    assert summary["recovery_decision"]["checkpoint_source"] == "gemini"


def test_a_fresh_cuda_process_restores_through_a_page_locked_slot_straight_to_the_device(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The restart path: a new model and an optimizer with no state, on the GPU. The slot is
    page-locked before the copies (and stays so for the next capture), the optimizer state lands
    on the device without a host clone ("step" on the host, as torch keeps it), bitwise."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device=dev)).sum().backward()
    opt.step()
    # The slots on tmpfs, as in production: a disk-backed file's pages are not page-locked (on a
    # machine whose /tmp is on a disk, cudaHostRegister of them fails; only slower, but not this test).
    shm = Path(tempfile.mkdtemp(dir="/dev/shm")) if Path("/dev/shm").is_dir() else tmp_path
    try:
        _restore_through_a_page_locked_slot(shm, model, opt, dev)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _restore_through_a_page_locked_slot(
    tmp_path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, dev: torch.device
) -> None:
    from tests.conftest import lone_gemini

    gem = lone_gemini(tmp_path, model, opt)
    try:
        assert gem.capture(1) and gem.drain(30)
        k = next(iter(gem._own_step))
    finally:
        gem.close()
    fresh = torch.nn.Linear(1024, 1024).to(dev)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    gem = lone_gemini(tmp_path, fresh, fresh_opt)
    try:
        gem._restore_from(gem._own[k], 1)
        assert isinstance(gem._copier, CudaCopier) and gem._copier._registered, "slot not page-locked"
        assert gem._pinned.get(k) is gem._own[k].mapping
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)
            sa, sb = opt.state[a], fresh_opt.state[b]
            assert sb["exp_avg"].is_cuda and sb["step"].device.type == "cpu"
            assert all(torch.equal(sa[n], sb[n]) for n in sa)
        assert gem.capture(2) and gem.drain(30)
    finally:
        gem.close()


def test_fp16_training_with_a_grad_scaler_resumes_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 autocast with a CUDA GradScaler, overflows at two steps: the scale (a CUDA tensor,
    captured by the side-stream copy) and the skipped steps survive a restart, bitwise."""
    from torch import nn

    from lm_resiliency import enable_resiliency

    def train(upto: int) -> tuple[list[torch.Tensor], float, int]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=2)
        with enable_resiliency(m, o, interval=1, enable_detection=False) as s:
            assert s.gemini.scaler is scaler
            for step in range(s.step_count + 1, upto + 1):
                x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).cuda()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = (m(x).float() - x).pow(2).mean()
                scaler.scale(loss * (float("inf") if step in (3, 6) else 1.0)).backward()
                scaler.step(o)
                scaler.update()
                o.zero_grad()
                assert s.step_count == step
            assert s.gemini.drain(10)
            newest = s.gemini.newest_recoverable_step("latest")
        return [p.detach().cpu() for p in m.parameters()], scaler.get_scale(), newest

    want = train(8)
    assert train(5)[2] >= 4
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    got = train(8)
    assert got[1] == want[1]
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))


def test_nvml_source_reads_the_real_device() -> None:
    pynvml = pytest.importorskip("pynvml")
    from lm_resiliency.scout.health import NvmlHealthSource, default_health_source

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        pytest.skip(f"NVML not usable here: {exc}")
    source = default_health_source()
    assert isinstance(source, NvmlHealthSource)
    try:
        assert source.indices and all(name.startswith("GPU-") for name in source.names.values())
        events = [e for _ in range(3) for e in source.poll()]
        assert not [e for e in events if e.fatal], events  # a healthy device raises no fatal event
        print("NVML devices:", source.names, "unsupported queries:", sorted(source._unsupported))
    finally:
        source.close()
    source.close()  # idempotent
