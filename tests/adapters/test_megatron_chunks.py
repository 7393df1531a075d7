"""Megatron-style model chunks (framework "megatron"): a list of modules the loop calls one by one."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.adapters.megatron import ModelChunks, model_chunks

pytestmark = pytest.mark.timeout(120)


def _chunks(
    seed: int, ddp: bool
) -> tuple[list[nn.Module], torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    first = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25))
    second = nn.Linear(16, 8)
    chunks: list[nn.Module] = [first, second]
    if ddp:
        chunks = [nn.parallel.DistributedDataParallel(c) for c in chunks]
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=0.05)
    return chunks, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(
    chunks: list[nn.Module], opt: torch.optim.Optimizer, sched: object, data: list[torch.Tensor]
) -> None:
    for x in data:
        loss = sum((chunks[1](chunks[0](half)) - half).pow(2).mean() for half in x.chunk(2))  # 2 microbatches
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        sched.step()  # type: ignore[attr-defined]


def _state(chunks: list[nn.Module], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for c in chunks for p in c.parameters()]
    for st in opt.state.values():
        out += [v for _, v in sorted(st.items())]
    return out


@pytest.mark.parametrize("ddp", [True, False])
def test_chunks_are_detected_captured_and_restored_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ddp: bool
) -> None:
    """A list of chunks (each DDP-wrapped, or plain) is detected as Megatron's; each step's first
    forward, whichever chunk runs it, opens the step; the capture holds every chunk, the scheduler
    and the RNG (dropout), and a restart into freshly built chunks continues bitwise."""
    monkeypatch.setenv("LM_RESILIENCY_SHM_DIR", str(tmp_path / "shm"))
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    ckpt = InMemoryCkptConfig(run_id=f"chunks-{ddp}", disk_folder=str(tmp_path / "disk"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        chunks, opt, sched = _chunks(0, ddp)
        with enable_resiliency(chunks, opt, opt_param_scheduler=sched, interval=1, checkpoint=ckpt) as s:
            assert s.framework == "megatron"
            assert s._adapter.topology().source == ("ddp" if ddp else "single")  # type: ignore[attr-defined]
            _train(chunks, opt, sched, data[:3])
            assert s.step_count == 3
            assert s.wait_for(lambda v: v.telemetry_step(0) == 3, 5.0)
            tel = s.cluster_view().peers[0].telemetry
            assert tel is not None and tel.compute_s > 0  # the first chunk's forward opened the step
            assert s.gemini is not None and s.gemini.drain(30)
        _train(chunks, opt, sched, data[3:])  # the uninterrupted continuation
        want, want_lr = _state(chunks, opt), sched.get_last_lr()
        chunks2, opt2, sched2 = _chunks(1, ddp)  # another init: everything comes from the capture
        torch.manual_seed(123)  # and another RNG state: the capture's comes back
        with enable_resiliency(chunks2, opt2, opt_param_scheduler=sched2, interval=1, checkpoint=ckpt) as s2:
            assert s2.recovered_step == 3 and s2.step_count == 3
            _train(chunks2, opt2, sched2, data[3:])
        got = _state(chunks2, opt2)
        assert len(got) == len(want) and sched2.get_last_lr() == want_lr
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        dist.destroy_process_group()


def test_a_hook_on_the_chunks_runs_on_every_chunk_and_is_removed_from_all() -> None:
    chunks = model_chunks((nn.Linear(2, 2), nn.Linear(2, 2)))
    seen: list[int] = []
    handle = chunks.register_forward_pre_hook(lambda m, a: seen.append(id(m)), prepend=True)
    chunks[1](chunks[0](torch.randn(1, 2)))
    assert seen == [id(chunks[0]), id(chunks[1])]
    handle.remove()
    chunks[0](torch.randn(1, 2))
    assert len(seen) == 2
    assert [k for k in chunks.state_dict()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    with pytest.raises(TypeError, match="called one by one"):
        chunks(torch.randn(1, 2))
    assert model_chunks(chunks) is chunks and isinstance(model_chunks(nn.Linear(1, 1)), ModelChunks)


class MixedPrecisionOptimizer:  # the name of a Megatron wrapper class (what the check reads)
    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner


@pytest.mark.parametrize(
    ("model", "optimizer", "kwargs", "error", "match"),
    [
        ([], None, {}, ValueError, "list of model chunks is empty"),
        ([nn.Linear(1, 1), "chunk"], None, {}, TypeError, r"model chunk 1 is not an nn.Module \(got str\)"),
        ("same", None, {}, ValueError, "listed as two model chunks"),
        ([nn.Linear(1, 1)], None, {"framework": "pytorch"}, TypeError, "framework 'megatron'"),
        (
            [nn.Linear(1, 1)],
            "wrapper",
            {},
            TypeError,
            "MixedPrecisionOptimizer is a Megatron optimizer wrapper",
        ),
    ],
)
def test_chunk_errors_name_the_problem(
    model: object, optimizer: object, kwargs: dict, error: type[Exception], match: str
) -> None:
    if model == "same":
        m = nn.Linear(1, 1)
        model = [m, m]
    if optimizer == "wrapper":
        optimizer = MixedPrecisionOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))  # type: ignore[index]
    with pytest.raises(error, match=match):
        enable_resiliency(model, optimizer, **kwargs)
    assert not [t for t in threading.enumerate() if t.name.startswith("lm-resiliency")]


def test_a_device_of_another_type_than_the_chunks_warns() -> None:
    """`device` names where the model is: for chunks, where their parameters are."""
    from lm_resiliency.api import _check_device

    with pytest.warns(UserWarning, match="parameters are on cpu"):
        _check_device("meta", [nn.Linear(1, 1), nn.Linear(1, 1)])
