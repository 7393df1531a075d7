"""A planned step restored with no session (`gemini.local.restore_planned`): a zero-import worker whose
restart has no step left to run restores it when its script reads its state (see worker_boot)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lm_resiliency.config import Environment, InMemoryCkptConfig
from lm_resiliency.gemini.local import restore_planned
from tests.conftest import lone_gemini

pytestmark = pytest.mark.timeout(60)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _captured(tmp_path: Path, disk: bool = False) -> dict[str, Any]:
    """Steps 1-3 of a model, captured at 2 and 3 (on disk too with `disk`): step 3's state."""
    model, opt = _trained(0)
    gem = lone_gemini(tmp_path, model, opt, **({"disk_interval": 1} if disk else {}))
    try:
        for k in (1, 2, 3):
            _step(model, opt, k)
            if k > 1:
                assert gem.capture(k) and gem.drain(10)
        want = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
        _step(model, opt, 4)  # (what a capture holds is the step's, not the process's last state)
    finally:
        gem.close()
    return want


def _restore(tmp_path: Path, step: int, model: Any, opt: Any, disk: bool = False) -> str:
    mid = tmp_path / "machine-id"
    mid.write_text("n\n")  # (lone_gemini's node)
    env = Environment(run_id="r", shm_dir=str(tmp_path), machine_id_path=str(mid))
    return restore_planned(
        model,
        opt,
        step,
        rank=0,
        world_size=1,
        env=env,
        checkpoint=InMemoryCkptConfig(),
        durable_folder=str(tmp_path / "checkpoints") if disk else None,
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def test_the_planned_step_is_restored_from_this_nodes_memory_bitwise(tmp_path: Path) -> None:
    want = _captured(tmp_path)
    model, opt = _trained(1)  # a fresh process's model and optimizer
    assert _restore(tmp_path, 3, model, opt) == "local"
    assert _same(model.state_dict(), want["model"]) and _same(opt.state_dict(), want["opt"])


def test_a_damaged_or_missing_copy_is_named_and_nothing_is_loaded(tmp_path: Path) -> None:
    _captured(tmp_path)
    model, opt = _trained(1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(LookupError, match=r"no copy of rank 0 step 7 in "):
        _restore(tmp_path, 7, model, opt)
    slot = next(
        p for p in (tmp_path / "r" / "n").glob("own-r0-s*") if _restore_step(p) == 3
    )  # the copy of step 3
    data = bytearray(slot.read_bytes())
    data[4096 + len(data) // 3] ^= 0x10
    slot.write_bytes(bytes(data))
    with pytest.raises(LookupError, match=r"own-r0-s\d: chunk \d+ fails its checksum \(step 3\)"):
        _restore(tmp_path, 3, model, opt)
    assert _same(model.state_dict(), before) and opt.state_dict()["state"] == {}


def test_the_durable_copy_is_restored_when_this_nodes_memory_has_none(tmp_path: Path) -> None:
    """A node whose memory was lost (its slots gone) and whose durable folder holds the step."""
    want = _captured(tmp_path, disk=True)
    shutil.rmtree(tmp_path / "r")
    model, opt = _trained(1)
    assert _restore(tmp_path, 3, model, opt, disk=True) == "disk"
    assert _same(model.state_dict(), want["model"]) and _same(opt.state_dict(), want["opt"])


def _restore_step(path: Path) -> int:
    from lm_resiliency.runtime.shm import SlotFile

    slot = SlotFile.open_existing(path)
    try:
        return slot.read_header().step
    finally:
        slot.close()
