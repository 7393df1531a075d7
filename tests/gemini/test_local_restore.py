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
from lm_resiliency.gemini.local import Restored, restore_planned
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


def _restore(tmp_path: Path, step: int, model: Any, opt: Any, disk: bool = False) -> Restored:
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
    assert _restore(tmp_path, 3, model, opt).tier == "local"
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
    assert _restore(tmp_path, 3, model, opt, disk=True).tier == "disk"
    assert _same(model.state_dict(), want["model"]) and _same(opt.state_dict(), want["opt"])


def _restore_step(path: Path) -> int:
    from lm_resiliency.runtime.shm import SlotFile

    slot = SlotFile.open_existing(path)
    try:
        return slot.read_header().step
    finally:
        slot.close()


def _warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=10)


def test_a_scheduler_made_after_the_restore_takes_the_steps_schedule(tmp_path: Path) -> None:
    """A script that reads its state before it makes its scheduler: the restore finds none, and the
    scheduler's constructor then sets the learning rate to the schedule's start. `apply_later`
    gives the scheduler the step's position and the optimizer its restored learning rate."""
    model, opt = _trained(0)
    sched = _warmup(opt)
    gem = lone_gemini(tmp_path, model, opt, scheduler=sched)
    try:
        for k in (1, 2, 3):
            _step(model, opt, k)
            sched.step()
            assert gem.capture(k) and gem.drain(10)
        want = {"opt": copy.deepcopy(opt.state_dict()), "sched": copy.deepcopy(sched.state_dict())}
    finally:
        gem.close()
    model, opt = _trained(1)
    restored = _restore(tmp_path, 3, model, opt)
    assert restored.scheduler_state is not None and not restored.apply_later(opt)  # none made yet
    later = _warmup(opt)
    assert opt.param_groups[0]["lr"] != want["opt"]["param_groups"][0]["lr"]  # the start's
    assert restored.apply_later(opt)
    assert _same(opt.state_dict(), want["opt"]) and _same(later.state_dict(), want["sched"])


def test_a_scheduler_that_exists_at_the_restore_leaves_nothing_for_later(tmp_path: Path) -> None:
    model, opt = _trained(0)
    sched = _warmup(opt)
    gem = lone_gemini(tmp_path, model, opt, scheduler=sched)
    try:
        _step(model, opt, 1)
        sched.step()
        assert gem.capture(1) and gem.drain(10)
        want = copy.deepcopy(sched.state_dict())
    finally:
        gem.close()
    model, opt = _trained(1)
    sched = _warmup(opt)
    assert _restore(tmp_path, 1, model, opt).scheduler_state is None
    assert _same(sched.state_dict(), want)


# -- a replica another node's agent serves (gemini/node_copies) ------------------------------------


@pytest.fixture
def agents(tmp_path: Path) -> Any:
    """A control store naming a generation of nodes "n" (this one) and "a", "b", and a `serve(node)`
    that starts that node's agent server on its folder of the run: (the store's address, serve)."""
    import dataclasses
    import os

    import torch.distributed as dist

    from lm_resiliency.core.rendezvous import state as rs
    from lm_resiliency.gemini.node_copies import NodeCopies, endpoint_key, key_name

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = "lmr/job/"
    s = dataclasses.replace(rs.RdzvState.new("x", 3, 3), slots=("n", "a", "b"))
    store.set(prefix + "state", rs.encode(s))
    key = os.urandom(32)
    store.set(prefix + key_name(), key.hex())
    servers: list[NodeCopies] = []

    def serve(node: str) -> NodeCopies:
        server = NodeCopies(tmp_path / "r" / node, key, "127.0.0.1", poll_ms=20)
        servers.append(server)
        store.set(prefix + endpoint_key(node), server.endpoint)
        return server

    yield f"tcp://127.0.0.1:{store.port}", serve
    for server in servers:
        server.close()


def _held_by(tmp_path: Path, node: str, holder: int) -> list[Path]:
    """This node's own copies of rank 0 moved to `node`'s folder, as `holder`'s replicas of them:
    this node's memory is gone (it replaced a lost one)."""
    to = tmp_path / "r" / node
    to.mkdir(parents=True, exist_ok=True)
    moved = []
    for own in sorted((tmp_path / "r" / "n").glob("own-r0-s*")):
        moved.append(own.rename(to / f"replica-r0-h{holder}-{own.name.rsplit('-', 1)[1]}"))
    return moved


def _restore_via(tmp_path: Path, control: str, step: int, model: Any, opt: Any) -> Restored:
    mid = tmp_path / "machine-id"
    mid.write_text("n\n")
    env = Environment(
        run_id="r", shm_dir=str(tmp_path), machine_id_path=str(mid), control_store=control, rdzv_run_id="job"
    )
    return restore_planned(
        model, opt, step, rank=0, world_size=1, env=env, checkpoint=InMemoryCkptConfig(), durable_folder=None
    )


def test_a_replica_another_nodes_agent_serves_is_restored_bitwise(tmp_path: Path, agents: Any) -> None:
    """A node that replaced a lost one holds no copy of its ranks: the step comes from the replica a
    peer node holds, which that node's agent serves (a zero-import restart with no step left, where
    no session runs anywhere to pull it). Before, the script saved its fresh model (NOT RESTORED)."""
    control, serve = agents
    want = _captured(tmp_path)
    _held_by(tmp_path, "b", 2)
    serve("a")  # (holds nothing of it: asked first, says so)
    serve("b")
    model, opt = _trained(1)
    assert _restore_via(tmp_path, control, 3, model, opt).tier == "peer"
    assert _same(model.state_dict(), want["model"]) and _same(opt.state_dict(), want["opt"])


def test_a_damaged_replica_is_refused_and_another_nodes_copy_is_taken(tmp_path: Path, agents: Any) -> None:
    control, serve = agents
    want = _captured(tmp_path)
    b = _mkdir(tmp_path / "r" / "b")
    for path in _held_by(tmp_path, "a", 1):  # node a's copy of step 3 damaged, b's intact
        shutil.copy(path, b / path.name)
        if _restore_step(path) == 3:
            data = bytearray(path.read_bytes())
            data[4096 + 100] ^= 0x01
            path.write_bytes(bytes(data))
    serve("a")
    model, opt = _trained(1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        LookupError, match=r"node a's replica of rank 0 step 3: chunk 0 fails its checksum"
    ) as err:
        _restore_via(tmp_path, control, 3, model, opt)
    assert "node b serves no copies" in str(err.value)
    assert _same(model.state_dict(), before)
    serve("b")
    with pytest.raises(LookupError, match=r"no replica of rank 0 step 9 here"):
        _restore_via(tmp_path, control, 9, model, opt)
    assert _restore_via(tmp_path, control, 3, model, opt).tier == "peer"
    assert _same(model.state_dict(), want["model"]) and _same(opt.state_dict(), want["opt"])


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def test_an_agent_answers_only_its_runs_key_and_only_its_replica_files(tmp_path: Path) -> None:
    import hashlib
    import hmac
    import json

    from lm_resiliency.gemini.node_copies import NodeCopies

    folder = _mkdir(tmp_path / "r" / "a")
    (folder / "own-r0-s0").write_bytes(b"x" * 64)  # (its own copies are not served)
    (tmp_path / "secret").write_bytes(b"y" * 64)
    key = b"k" * 32
    server = NodeCopies(folder, key, "127.0.0.1", poll_ms=20)
    try:

        def ask(req: Any, with_key: bytes = key) -> dict[str, Any]:
            body = req if isinstance(req, bytes) else json.dumps(req).encode()
            frames = server.answer([hmac.new(with_key, body, hashlib.sha256).digest(), body])
            out: dict[str, Any] = json.loads(frames[0])
            return out

        assert ask({"op": "find", "owner": 0, "step": 1}, with_key=b"z" * 32)["why"] == (
            "not authenticated with this run's key"
        )
        assert "not JSON" in ask(b"{")["why"]
        assert "malformed request" in ask({"op": "find", "owner": "0", "step": 1})["why"]
        assert "no replica of rank 0 step 1 here (none)" in ask({"op": "find", "owner": 0, "step": 1})["why"]
        for name in ("own-r0-s0", "../secret", "replica-r0-h1-s0/../../../secret"):
            said = ask({"op": "read", "name": name, "offset": 0, "length": 8})
            assert not said["ok"] and said["why"].startswith("refused"), said
        said = ask({"op": "read", "name": "replica-r0-h1-s0", "offset": 0, "length": 8})
        assert not said["ok"] and "No such file" in said["why"], said
        assert (
            "malformed" in ask({"op": "read", "name": "replica-r0-h1-s0", "offset": 0, "length": True})["why"]
        )
        # Over the socket: a request too large for any real one is dropped, and the server answers on.
        import zmq

        ctx = zmq.Context()
        try:
            big, ok = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
            for sock in (big, ok):
                sock.linger = 0
                sock.connect(server.endpoint)
            big.send_multipart([b"x" * 32, b"y" * (1 << 20)])
            body = json.dumps({"op": "find", "owner": 0, "step": 1}).encode()
            ok.send_multipart([hmac.new(key, body, hashlib.sha256).digest(), body])
            assert ok.poll(30_000), "the server stopped answering"
            assert b"no replica of rank 0 step 1 here" in ok.recv_multipart()[0]
            assert not big.poll(2000)  # (never answered: dropped, not held)
        finally:
            ctx.destroy(linger=0)
    finally:
        server.close()
