"""enable_resiliency in one process (no process group): the session surface and its argument checks."""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lm_resiliency import (
    ConfigError,
    InMemoryCkptConfig,
    OrchestrationHooks,
    RecoveryMode,
    ResiliencySession,
    UnsupportedFrameworkError,
    enable_resiliency,
)
from lm_resiliency.adapters.detect import detect_framework

pytestmark = pytest.mark.timeout(60)


def _train(session, model, opt, steps: int, loader=None) -> None:  # type: ignore[no-untyped-def]
    data = loader if loader is not None else [torch.randn(4, 8) for _ in range(steps)]
    for x in data:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _keeping(state: dict[str, int], model: nn.Module, opt: Any, ckpt: InMemoryCkptConfig, **kw: Any) -> Any:
    """A session capturing every step, no detection, the caller's `state` captured and restored."""
    return enable_resiliency(
        model,
        opt,
        interval=1,
        checkpoint=ckpt,
        enable_detection=False,
        extra_state_fn=lambda: dict(state),
        load_extra_state_fn=state.update,
        **kw,
    )


def test_single_process_session_surface() -> None:
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, interval=2) as session:
        assert isinstance(session, ResiliencySession)
        assert session.step_count == 0 and session.recovered_step == -1
        loader = session.instrument_dataloader([torch.randn(4, 8) for _ in range(3)])
        assert len(loader) == 3
        _train(session, model, opt, 3, loader)
        assert session.step_count == 3
        assert session.wait_for(lambda v: v.telemetry_step(0) == 3, 5.0)
        tel = session.cluster_view().peers[0].telemetry
        assert tel is not None and tel.step_s > 0 and tel.input_s > 0
        # An iterator (what Megatron-style loops pass around): `next()` on the proxy, timed too.
        slow = (time.sleep(0.05) or torch.randn(4, 8) for _ in range(2))
        data_iterator = session.instrument_dataloader(slow)
        _train(session, model, opt, 1, [next(data_iterator)])
        assert session.wait_for(lambda v: v.telemetry_step(0) == 4, 5.0)
        tel = session.cluster_view().peers[0].telemetry
        assert tel is not None and tel.input_s >= 0.05
        next(data_iterator)
        with pytest.raises(StopIteration):
            next(data_iterator)
        with pytest.raises(TypeError, match="not an iterator"):
            next(session.instrument_dataloader([1, 2]))  # a list, as next() on it says
        with session.checkpoint_io("write", name="dcp"):
            pass
        with pytest.raises(ValueError, match="read"), session.checkpoint_io("append"):
            pass
        assert session.prepare_recovery("sdc") is RecoveryMode.RECOVERY_VERIFIED
        assert session.gemini.drain(10)
        assert session.prepare_recovery("process_failure") is RecoveryMode.LATEST
        decision = session.last_recovery_decision
        assert decision is not None and decision["checkpoint_step"] == 4 and decision["available"]
        assert decision["recovery_mode"] == "latest" and decision["checkpoint_source"] == "gemini"
        assert decision["checkpoint_id"] == "gemini-step-4"
        # The digest a restart context names (the layout, not the machines): the two compare.
        assert decision["topology_digest"] == session.topology.shape_digest()
        with pytest.raises(ValueError, match=r"unknown failure kind 'gremlins'.*tensor_corruption"):
            session.prepare_recovery("gremlins")
        # FAILURES.md's canonical types too, recovered as the kind that catches each.
        assert session.prepare_recovery("tensor_corruption") is RecoveryMode.RECOVERY_VERIFIED
        assert session.last_recovery_decision["failure_kind"] == "tensor_corruption"
        assert session.prepare_recovery("process_termination") is RecoveryMode.LATEST
        assert session.flush_for_restart() == 4
        assert (Path("checkpoints") / "default" / "step-0000000004" / "rank-00000.pt").exists()
        assert session.topology.world_size == 1
    session.close()  # idempotent
    assert not [t for t in threading.enumerate() if t.name.startswith("lm-resiliency")]
    _train(session, model, opt, 1)  # hooks are gone: training goes on untouched
    assert session.step_count == 4


def test_a_thread_of_the_scripts_own_fetching_or_saving_says_nothing_of_the_training_thread() -> None:
    """A prefetching thread reads the instrumented loader into a queue, and an asynchronous save
    runs inside checkpoint_io on a thread of its own: while either waits, the training thread is
    in no phase (a hang of it is a hang, named at the hang threshold), and the training goes on
    from the queue. Before, the prefetcher's fetch marked the training thread as in its data
    loader, and the save excused it as checkpoint I/O until the save ended (outsider 50: a hang
    named after 21 s, not 6, beside a 15 s save)."""
    import queue

    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, interval=1, enable_checkpoint=False) as session:
        adapter = session._adapter
        inside, leave = threading.Event(), threading.Event()

        def batches() -> Any:
            for i in range(3):
                if i == 2:
                    inside.set()
                    leave.wait(30)
                yield torch.randn(4, 8)

        ready: queue.Queue[torch.Tensor] = queue.Queue()
        prefetcher = threading.Thread(
            target=lambda: [ready.put(x) for x in session.instrument_dataloader(batches())]
        )
        prefetcher.start()
        try:
            _train(session, model, opt, 2, (ready.get(timeout=30) for _ in range(2)))
            assert inside.wait(30)
            assert adapter.phase is None, adapter.phase
        finally:
            leave.set()
            prefetcher.join(30)
        assert session.step_count == 2
        inside.clear()
        leave.clear()

        def save() -> None:
            with session.checkpoint_io("write", name="async"):
                inside.set()
                leave.wait(30)

        saver = threading.Thread(target=save)
        saver.start()
        try:
            assert inside.wait(30)
            assert adapter.phase is None, adapter.phase
        finally:
            leave.set()
            saver.join(30)
        with session.checkpoint_io("write"):  # on the training thread: marked
            assert adapter.phase is not None and adapter.phase[0] == "checkpoint_io"


def test_without_checkpoints_nothing_is_recoverable() -> None:
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, interval=1, enable_checkpoint=False) as s:
        _train(s, model, opt, 2)
        s.prepare_recovery("hang")
        assert s.last_recovery_decision["reason"] == "no_checkpoint_component"  # type: ignore[index]
        assert s.flush_for_restart() == -1 and s.gemini is None


def test_without_an_optimizer_the_session_says_it_sees_no_steps() -> None:
    model = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="no optimizer given"), enable_resiliency(model) as s:
        assert s.step_count == 0


def test_an_optimizer_stepping_parameters_the_model_lacks_is_warned_of() -> None:
    """Their values are in no capture: a restart would put their restored moments on fresh values."""
    model, other = nn.Linear(2, 2), nn.Linear(3, 5)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with (
        pytest.warns(
            UserWarning,
            match=r"2 of the 4 parameters the optimizer steps are not the model's \(\(5, 3\), \(5,\)\)",
        ),
        enable_resiliency(model, opt),
    ):
        pass
    frozen = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    sub = torch.optim.SGD(frozen[1].parameters(), lr=0.1)  # a subset (the rest frozen) is fine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with enable_resiliency(frozen, sub):
            pass


def test_another_optimizer_stepping_the_models_parameters_is_warned_of() -> None:
    """Muon for the matrices and AdamW for the rest: only the optimizer passed is captured, so a
    restart resumed the other's momentum from fresh, silently. Said now, with the way to keep it.
    A ZeroRedundancyOptimizer-like wrapper's own inner optimizer is the one passed, not another."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    adamw = torch.optim.AdamW(model[1].parameters(), lr=0.1)
    muon_like = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    with (
        pytest.warns(UserWarning, match=r"another optimizer \(SGD\) steps 2 parameters of the model"),
        enable_resiliency(model, adamw),
    ):
        pass
    del muon_like

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, params: list[nn.Parameter]) -> None:
            self.optim = torch.optim.SGD(params, lr=0.1)
            super().__init__(params, {})

        def step(self, closure: object = None) -> None:
            self.optim.step()

    solo = nn.Linear(2, 2)
    wrapped = Wrapper(list(solo.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with enable_resiliency(solo, wrapped):
            pass


def test_two_optimizers_passed_as_a_list_are_captured_and_restored_with_their_schedulers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Muon for the matrices and AdamW for the rest, each with a schedule found by the session:
    a step is the iteration (both stepped), and a restart restores both optimizers and both
    schedules, so the resumed run ends bitwise the uninterrupted one. No warning of another
    optimizer."""

    def make() -> tuple[nn.Module, list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LRScheduler]]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        muon = torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02)
        adamw = torch.optim.AdamW([p for p in m.parameters() if p.ndim == 1], lr=0.01)
        scheds = [
            torch.optim.lr_scheduler.LambdaLR(muon, lambda i: 0.9**i),
            torch.optim.lr_scheduler.StepLR(adamw, 2),
        ]
        return m, [muon, adamw], scheds

    def train(s: object, m: nn.Module, opts: list, scheds: list, until: int) -> None:  # type: ignore[type-arg]
        g = torch.Generator().manual_seed(7)
        for step in range(until):
            x = torch.randn(3, 4, generator=g)
            if step < s.step_count:  # type: ignore[attr-defined]
                continue  # (the data of the steps the restart resumed after)
            loss = m(x).pow(2).mean()
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o in opts:
                o.step()
            for sc in scheds:
                sc.step()

    m, opts, scheds = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = enable_resiliency(m, opts, interval=1)
    with s:
        train(s, m, opts, scheds, 6)
        assert s.step_count == 6
    want = [p.detach().clone() for p in m.parameters()]
    m, opts, scheds = make()
    with enable_resiliency(m, opts, interval=1) as s:
        train(s, m, opts, scheds, 4)
        assert s.gemini.drain(10)
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    m, opts, scheds = make()
    with enable_resiliency(m, opts, interval=1) as s:
        assert s.recovered_step == s.step_count == 4
        assert [sc.last_epoch for sc in scheds] == [4, 4] and opts[1].param_groups[0]["lr"] == pytest.approx(
            1e-4
        )
        assert all(len(o.state) == len(o.param_groups[0]["params"]) for o in opts)  # both restored
        train(s, m, opts, scheds, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, m.parameters(), strict=True))


def test_schedulers_passed_as_a_list_go_with_their_optimizers() -> None:
    """One optimizer in a list is that optimizer (its checkpoints stay a plain optimizer's), with
    its scheduler from a list of one; with two, the one passed for the first and the one found
    stepping the second are captured together."""
    from lm_resiliency.adapters.chain import SchedulerChain

    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    a = torch.optim.SGD(m[0].parameters(), lr=0.1)
    b = torch.optim.AdamW(m[1].parameters(), lr=0.1)
    sa, sb = torch.optim.lr_scheduler.StepLR(a, 2), torch.optim.lr_scheduler.LambdaLR(b, lambda i: 1.0)
    with enable_resiliency(nn.Sequential(m[0]), [a], opt_param_scheduler=[sa], enable_detection=False) as s:
        assert s._adapter.optimizer is a and s.gemini.scheduler is sa
    with enable_resiliency(m, [a, b], opt_param_scheduler=sa, enable_detection=False) as s:
        both = s.gemini.scheduler
        assert isinstance(both, SchedulerChain) and both.members == (sa, sb)
    with pytest.raises(TypeError, match="a list of them for a list of optimizers; got int"):
        enable_resiliency(m, [a, b], opt_param_scheduler=[sa, 3])


def test_configured_recovery_mode_wins() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, recovery_mode="recovery_verified") as s:
        assert s.prepare_recovery("hang") is RecoveryMode.RECOVERY_VERIFIED


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"framework": "jax"}, ValueError, "unknown framework"),
        ({"interval": 0}, ValueError, "interval"),
        ({"interval": "10"}, TypeError, "interval"),
        ({"checkpoint": {"interval": 3}}, TypeError, "InMemoryCkptConfig"),
        ({"recovery_mode": "newest"}, ConfigError, "recovery_mode"),
        ({"fault_callback": 3}, TypeError, "fault_callback"),
        # Called only on a restart or a fault: a wrong signature is refused now, not in the recovery.
        (
            {"load_fallback": lambda: None},
            TypeError,
            r"load_fallback is called with one argument \(load_fallback\(step\)\), but its signature is \(\)",
        ),
        (
            {"load_extra_state_fn": lambda: None, "extra_state_fn": dict},
            TypeError,
            r"load_extra_state_fn is called with one argument",
        ),
        (
            {"extra_state_fn": lambda pos: pos, "load_extra_state_fn": print},
            TypeError,
            r"extra_state_fn is called with no arguments \(extra_state_fn\(\)\), "
            r"but its signature is \(pos\)",
        ),
        ({"fault_callback": lambda a, b: None}, TypeError, r"fault_callback is called with one argument"),
        (
            {"orchestration": OrchestrationHooks(report_recovery=lambda: None)},
            TypeError,
            r"orchestration\.report_recovery is called with one argument "
            r"\(orchestration\.report_recovery\(decision\)\)",
        ),
        ({"framework": "deepspeed"}, TypeError, "optimizer"),
        ({"framework": "torchtitan"}, TypeError, "optimizer"),
        ({"parallelism_info": [0, 1]}, TypeError, "parallelism_info must be a mapping"),
        ({"group": 3}, TypeError, r"group must be a torch.distributed process group \(.*\), got int"),
        ({"opt_param_scheduler": 5}, TypeError, "opt_param_scheduler must be a scheduler .*got int"),
    ],
)
def test_argument_errors(kwargs: dict, error: type[Exception], needle: str) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=needle):
        enable_resiliency(model, opt, **kwargs)
    assert not [t for t in threading.enumerate() if t.name.startswith("lm-resiliency")]


@pytest.mark.parametrize("given", ["extra_state_fn", "load_extra_state_fn"])
def test_one_of_the_caller_state_pair_alone_is_warned_of(given: str) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = (lambda: {"i": 1}) if given == "extra_state_fn" else (lambda state: None)
    with pytest.warns(UserWarning, match=f"{given} without"):
        enable_resiliency(model, opt, **{given: fn}).close()


def test_a_framework_without_an_adapter_is_named() -> None:
    with pytest.raises(UnsupportedFrameworkError, match="no torchtitan adapter"):
        enable_resiliency(nn.Linear(2, 2), framework="torchtitan")


def test_checkpoint_config_is_accepted() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, checkpoint=InMemoryCkptConfig(interval=5)) as s:
        assert s.settings["checkpoint"].interval == 5


def test_framework_detection() -> None:
    class DeepSpeedEngine(nn.Module):
        pass

    class Trainer:
        model_parts: list[nn.Module] = []

    assert detect_framework(DeepSpeedEngine()) == "deepspeed"
    assert detect_framework(Trainer()) == "torchtitan"
    assert detect_framework([nn.Linear(1, 1), nn.Linear(1, 1)]) == "megatron"
    assert detect_framework(nn.Linear(1, 1)) == "pytorch"
    with pytest.raises(TypeError, match="cannot detect"):
        detect_framework(object())
    assert detect_framework([1, 2]) == "megatron"  # enable_resiliency names the chunk that is no module
    with pytest.raises(TypeError, match=r"model chunk 0 is not an nn.Module \(got int\)"):
        enable_resiliency([1, 2])
    with pytest.raises(TypeError, match=r"framework 'deepspeed' takes the engine deepspeed.initialize\(\)"):
        enable_resiliency(DeepSpeedEngine())  # (no module: not what deepspeed.initialize returns)


def test_an_exception_leaving_the_sessions_with_block_is_reported_as_the_workers_failure() -> None:
    """As an uncaught exception is (its reason and text): the block's exit closed the session first,
    the excepthook then found nothing to report, and the peers heard only that this rank was done."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reports: list[dict[str, object]] = []
    with pytest.raises(MemoryError), enable_resiliency(model, opt, fault_callback=reports.append) as session:
        raise MemoryError("the allocator refused")
    assert [(r["kind"], r["reason"], r["failed_ranks"]) for r in reports] == [
        ("process_failure", "resource_exhaustion", [0])
    ]
    assert "MemoryError: the allocator refused" in str(reports[0]["error"])
    assert session._closed and not session.runtime.alive  # closed all the same
    with enable_resiliency(model, opt, fault_callback=reports.append):
        pass
    assert len(reports) == 1


def test_a_device_torch_does_not_know_is_refused_and_another_type_than_the_models_warns() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"device: 'tpu:0' names no torch device"):
        enable_resiliency(model, opt, device="tpu:0")
    with pytest.warns(UserWarning, match=r"device='cuda:0', but the model's parameters are on cpu"):
        enable_resiliency(model, opt, device="cuda:0").close()


def test_fsdp2_dtensor_state_is_captured_and_resumed_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP2 (DTensor parameters and optimizer state): capture, then a new model with another init
    restores the shard and continues exactly as the original did."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    monkeypatch.setenv("LM_RESILIENCY_SHM_DIR", str(tmp_path / "shm"))
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    ckpt = InMemoryCkptConfig(run_id="fsdp2-resume", disk_folder=str(tmp_path / "disk"))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        return model, torch.optim.AdamW(model.parameters(), lr=0.05)

    def local(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        out = [p.to_local() for p in model.parameters()]
        for st in opt.state.values():
            out += [v.to_local() if isinstance(v, DTensor) else v for _, v in sorted(st.items())]
        return out

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, opt = build(0)
        assert isinstance(next(model.parameters()), DTensor)
        with enable_resiliency(model, opt, interval=1, checkpoint=ckpt, enable_detection=False) as s:
            _train(s, model, opt, 3, loader=data[:3])
            assert s.gemini is not None and s.gemini.drain(30)
        _train(None, model, opt, 2, loader=data[3:])  # the uninterrupted continuation
        want = local(model, opt)
        model2, opt2 = build(1)  # another init: everything must come from the capture
        with enable_resiliency(model2, opt2, interval=1, checkpoint=ckpt, enable_detection=False) as s2:
            assert s2.recovered_step == 3
            assert isinstance(next(model2.parameters()), DTensor)
            _train(s2, model2, opt2, 2, loader=data[3:])
        got = local(model2, opt2)
        assert len(got) == len(want)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        dist.destroy_process_group()


def test_a_compiled_ddp_model_is_seen_through_and_its_capture_loads_uncompiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile(DDP(model)): the replica group is DDP's (not a group of one, which would check
    nothing), and the capture's keys are the plain model's, so it restores into the
    same model without compile and continues bitwise."""
    import torch.distributed as dist

    from lm_resiliency.adapters.base import is_compiled, uncompiled

    monkeypatch.setenv("LM_RESILIENCY_SHM_DIR", str(tmp_path / "shm"))
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    ckpt = InMemoryCkptConfig(run_id="compiled-resume", disk_folder=str(tmp_path / "disk"))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=0.05)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp, opt = build(0)
        compiled = torch.compile(ddp, backend="eager")
        assert uncompiled(compiled) is ddp and is_compiled(compiled) and not is_compiled(ddp)
        inner_compiled = torch.compile(nn.Linear(2, 2), backend="eager")
        assert is_compiled(nn.parallel.DistributedDataParallel(inner_compiled))
        with enable_resiliency(compiled, opt, interval=1, checkpoint=ckpt) as s:
            assert s._adapter.topology().source == "ddp"  # type: ignore[attr-defined]
            _train(s, compiled, opt, 3, loader=data[:3])
            assert s.gemini is not None and s.gemini.drain(30)
        _train(None, ddp, opt, 2, loader=data[3:])  # the uninterrupted continuation
        want = [p.detach().clone() for p in ddp.parameters()]
        ddp2, opt2 = build(1)  # not compiled this time, another init
        with enable_resiliency(ddp2, opt2, interval=1, checkpoint=ckpt, enable_detection=False) as s2:
            assert s2.recovered_step == 3
            _train(s2, ddp2, opt2, 2, loader=data[3:])
        assert all(torch.equal(a, b) for a, b in zip(ddp2.parameters(), want, strict=True))
    finally:
        dist.destroy_process_group()


def test_hang_threshold_comes_before_the_process_group_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """The default 30 s threshold with a 10 s gloo timeout could never name a hang: gloo would
    raise first. The session halves the group's timeout instead, and says so."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
    )
    try:
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with enable_resiliency(model, opt, enable_checkpoint=False) as s:
            assert s.scout is not None and s.scout.config.hang_stall_threshold_s == 5.0
        assert "before the process group's collective timeout (10.0 s); using 5.0 s" in caplog.text
    finally:
        dist.destroy_process_group()


def test_a_second_open_session_in_one_process_is_refused() -> None:
    """Two sessions of one rank (a GAN's two models, each enabled) would keep their captures in the
    same shared-memory slots, each overwriting the other's, and a restart would load one model's
    state into the other (a size mismatch, or worse, one that fits). Refused, saying what to do."""
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    with (
        enable_resiliency(g, og, interval=1),
        pytest.raises(
            RuntimeError, match=r"already has an open session \(rank 0, model Linear\).*ModuleDict"
        ),
    ):
        enable_resiliency(d, od, interval=1)
    with enable_resiliency(d, od, interval=1) as second:  # once the first is closed
        assert second.step_count == 0


@pytest.mark.parametrize("shuffle", ["distributed", "random"])
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
@pytest.mark.parametrize(
    ("at", "style"),
    [(4, "skip"), (10, "skip"), (10, "next_epoch")],
    ids=["mid-epoch", "epoch-end-skipped", "epoch-end"],
)
def test_a_plain_data_loader_made_again_on_resume_draws_what_the_uninterrupted_run_drew(
    tmp_path: Path, at: int, style: str, persistent: bool, shuffle: str
) -> None:
    """The same, for a DataLoader the loop iterates itself (not instrumented), as most scripts do:
    resumed mid-epoch (the loop makes the epoch's iterator again and skips 4 batches), or where
    epoch 0 ended (it makes epoch 0's again and skips all of it, or goes on to epoch 1 at once).
    The uninterrupted run drew once for epoch 1's iterator after the capture; the resumed one draws
    as often. Before, mid-epoch and epoch-end-skipped drew once more, and dropout shifted. With
    persistent workers, no epoch after the first draws (its iterator is reset, not made). With a
    RandomSampler (`shuffle=True`), which draws its order from the global RNG (without workers, at
    the iterator's first batch)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(torch.randn(40, 8, generator=torch.Generator().manual_seed(0)))
    ckpt = InMemoryCkptConfig(
        run_id=f"plain-loader-{at}-{style}-{persistent}-{shuffle}", disk_folder=str(tmp_path / "disk")
    )
    workers = {"num_workers": 1, "persistent_workers": True} if persistent else {"num_workers": 0}

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader, DistributedSampler]:  # type: ignore[type-arg]
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if shuffle == "random":
            return model, opt, DataLoader(data, batch_size=4, shuffle=True, **workers), sampler
        return model, opt, DataLoader(data, batch_size=4, sampler=sampler, **workers), sampler

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: list[torch.Tensor]) -> None:
        loss = model(batch[0]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    model, opt, loader, sampler = build(0)
    with enable_resiliency(model, opt, interval=1, checkpoint=ckpt, enable_detection=False) as s:
        batches = iter(loader)
        for _ in range(at):
            step(model, opt, next(batches))
        assert s.gemini is not None and s.gemini.drain(30)
    for batch in batches:  # the uninterrupted run goes on: the rest of epoch 0, then epoch 1
        step(model, opt, batch)
    sampler.set_epoch(1)
    for batch in loader:
        step(model, opt, batch)
    want = [p.detach().clone() for p in model.parameters()]

    model2, opt2, loader2, sampler2 = build(1)  # another init: everything comes from the capture
    with enable_resiliency(model2, opt2, interval=1, checkpoint=ckpt, enable_detection=False) as s2:
        assert s2.recovered_step == at
        if style == "skip":
            for i, batch in enumerate(loader2):  # the loop skips to its position
                if i >= at:
                    step(model2, opt2, batch)
        sampler2.set_epoch(1)
        for batch in loader2:
            step(model2, opt2, batch)
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), want, strict=True))


@pytest.mark.parametrize("at", [7, 10], ids=["mid-epoch", "epoch-end"])
def test_a_position_the_loop_advances_after_the_step_goes_with_the_step_it_ends(
    tmp_path: Path, at: int
) -> None:
    """Most loops count their data position after `optimizer.step()` and `scheduler.step()` and
    read a DataLoader they iterate themselves (not instrumented). Each step is now captured as the
    loop fetches the next batch, so the position bumped after the step is in that step's capture;
    before, the capture was taken at the scheduler's step, the position came back one batch behind,
    the resumed loop trained that batch again and ended off the uninterrupted run. The job dies
    after fetching the batch of the step after `at` (its capture of `at` taken), then resumes at
    its saved position (dropout, a scheduler, the epoch's iterator made again and skipped to it):
    bitwise the uninterrupted run."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(torch.randn(40, 8, generator=torch.Generator().manual_seed(0)))
    ckpt = InMemoryCkptConfig(run_id=f"position-after-step-{at}", disk_folder=str(tmp_path / "disk"))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, DataLoader, DistributedSampler]:  # type: ignore[type-arg]
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return model, opt, sched, DataLoader(data, batch_size=4, sampler=sampler), sampler

    def train(model, opt, sched, loader, sampler, pos, until: int, fetched=None) -> None:  # type: ignore[no-untyped-def]
        while pos["step"] < until:
            sampler.set_epoch(pos["step"] // len(loader))
            for i, batch in enumerate(loader):
                if i < pos["step"] % len(loader):
                    continue  # (resumed mid-epoch: to its position)
                if fetched is not None:
                    fetched(pos["step"])
                loss = model(batch[0]).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                pos["step"] += 1  # after the step, as most loops count
                if pos["step"] == until:
                    return

    model, opt, sched, loader, sampler = build(0)
    pos = {"step": 0}
    s = _keeping(pos, model, opt, ckpt, opt_param_scheduler=sched)

    def fetched(step: int) -> None:
        if step == at:  # the batch of the step after `at` fetched: the capture of `at` is taken
            assert s.gemini is not None and s.gemini.settle(30)
            assert s.gemini.newest_recoverable_step(RecoveryMode.LATEST) == at
            s.close()  # the job dies here; the uninterrupted run goes on (without a session)

    train(model, opt, sched, loader, sampler, pos, 16, fetched)
    want = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2, loader2, sampler2 = build(1)  # another init: everything comes from the capture
    pos2 = {"step": -1}
    with _keeping(pos2, model2, opt2, ckpt, opt_param_scheduler=sched2) as s2:
        assert s2.recovered_step == at
        assert pos2 == {"step": at}
        train(model2, opt2, sched2, loader2, sampler2, pos2, 16)
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), want, strict=True))


@pytest.mark.parametrize("loop", ["for", "while", "for, evaluating", "for, evaluating a loader"])
def test_a_loop_without_a_data_loader_has_its_work_after_the_step_captured_with_the_step(
    tmp_path: Path, loop: str
) -> None:
    """A loop that draws its batches from the global RNG and keeps an EMA of the weights and a
    counter, both updated after `optimizer.step()` and `scheduler.step()` (an outsider's SimCLR
    script): the capture waits for the loop's back edge, so it holds the EMA and the counter of its
    step and the random numbers before the next step's draws. Before, it was taken at the
    scheduler's step: the resumed EMA missed an update and the run ended off its uninterrupted one.
    The job dies as the step after `at` begins (its capture of `at` taken); the resumed run (another
    init) ends bitwise the uninterrupted one, EMA included. Evaluating (eval mode, `no_grad`)
    between the step and the EMA update is the step's work too: such a forward does not begin the
    next step (before, it took the capture early and the EMA came back one update behind)."""
    from torch.utils.data import DataLoader, TensorDataset

    at = 4
    ckpt = InMemoryCkptConfig(
        run_id=f"work-after-step-{loop.replace(' ', '')}", disk_folder=str(tmp_path / "disk")
    )
    val = DataLoader(TensorDataset(torch.ones(4, 8)), batch_size=2)

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, dict[str, torch.Tensor]]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model, opt, sched, ema

    def one(
        model: nn.Module, opt: Any, sched: Any, ema: dict[str, torch.Tensor], pos: dict[str, int]
    ) -> None:
        loss = model(torch.randn(4, 8)).pow(2).mean()  # the batch: drawn from the global RNG
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if "evaluating" in loop:
            model.eval()
            with torch.no_grad():
                for (batch,) in val if loop.endswith("loader") else [(torch.ones(2, 8),)]:
                    model(batch)  # (a fetch of an evaluation is not the next step's either)
            model.train()
        with torch.no_grad():  # after the step, as EMA loops do
            for k, v in model.state_dict().items():
                ema[k].mul_(0.9).add_(v, alpha=0.1)
        pos["step"] += 1

    def train(model, opt, sched, ema, pos, until: int, began=None) -> None:  # type: ignore[no-untyped-def]
        if loop.startswith("for"):
            for _ in range(pos["step"], until):
                if began is not None:
                    began(pos["step"])
                one(model, opt, sched, ema, pos)
        else:
            while pos["step"] < until:
                if began is not None:
                    began(pos["step"])
                one(model, opt, sched, ema, pos)

    model, opt, sched, ema = build(0)
    pos = {"step": 0}

    def extra() -> dict[str, Any]:
        return {"pos": dict(pos), "ema": ema}

    s = enable_resiliency(
        model,
        opt,
        opt_param_scheduler=sched,
        interval=1,
        checkpoint=ckpt,
        enable_detection=False,
        extra_state_fn=extra,
        load_extra_state_fn=lambda state: None,
    )

    def began(step: int) -> None:
        if step == at:  # `at` steps done, the next begins: the capture of `at` is taken
            assert s.gemini is not None and s.gemini.settle(30)
            assert s.gemini.newest_recoverable_step(RecoveryMode.LATEST) == at
            s.close()  # the job dies here; the uninterrupted run goes on (without a session)

    train(model, opt, sched, ema, pos, 10, began)
    want = [p.detach().clone() for p in model.parameters()] + [v.clone() for v in ema.values()]

    model2, opt2, sched2, ema2 = build(1)  # another init: everything comes from the capture
    pos2 = {"step": -1}

    def load(state: dict[str, Any]) -> None:
        pos2.update(state["pos"])
        for k, v in state["ema"].items():
            ema2[k].copy_(v)

    with enable_resiliency(
        model2,
        opt2,
        opt_param_scheduler=sched2,
        interval=1,
        checkpoint=ckpt,
        enable_detection=False,
        extra_state_fn=lambda: {"pos": dict(pos2), "ema": ema2},
        load_extra_state_fn=load,
    ) as s2:
        assert s2.recovered_step == at and pos2 == {"step": at}
        train(model2, opt2, sched2, ema2, pos2, 10)
    got = [p.detach() for p in model2.parameters()] + list(ema2.values())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epochs_iterator_made_before_a_restore_at_its_epochs_start_draws_after_it(
    tmp_path: Path, workers: int
) -> None:
    """A zero-import script's session opens at its first forward: on resume the loop has already
    made the epoch's DataLoader iterator and fetched its first batch. Restored at an epoch's end
    (the capture taken at the fetch that ended epoch 0), the uninterrupted run made epoch 1's
    iterator after the capture, from the restored state; the resumed one made it before the
    restore. Its draw is made again from the restored state, so dropout draws what the
    uninterrupted run drew. Before, the run resumed at an epoch's start ended off its
    uninterrupted one (an outsider's zero-import DDP and FSDP2 jobs restarted after a hang at the
    epoch's last step; with 2 workers, outsider 56 after an exception or a hang there)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(torch.randn(40, 8, generator=torch.Generator().manual_seed(0)))
    ckpt = InMemoryCkptConfig(run_id=f"premade-epoch-iterator-{workers}", disk_folder=str(tmp_path / "disk"))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader, DistributedSampler]:  # type: ignore[type-arg]
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        return (
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers),
            sampler,
        )

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    model, opt, loader, sampler = build(0)
    with enable_resiliency(model, opt, interval=1, checkpoint=ckpt, enable_detection=False) as s:
        for (x,) in loader:  # epoch 0: its last step's capture is taken at the fetch that ends it
            step(model, opt, x)
        assert s.gemini is not None and s.gemini.drain(30)
        assert s.gemini.newest_recoverable_step(RecoveryMode.LATEST) == len(loader)
    sampler.set_epoch(1)
    for (x,) in loader:  # the uninterrupted run goes on with epoch 1
        step(model, opt, x)
    want = [p.detach().clone() for p in model.parameters()]

    model2, opt2, loader2, sampler2 = build(1)
    sampler2.set_epoch(1)  # the resumed loop's epoch, its iterator and first batch before the session
    batches = iter(loader2)
    (x,) = next(batches)
    with enable_resiliency(model2, opt2, interval=1, checkpoint=ckpt, enable_detection=False) as s2:
        assert s2.recovered_step == len(loader2)
        step(model2, opt2, x)
        for (x,) in batches:
            step(model2, opt2, x)
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), want, strict=True))


@pytest.mark.parametrize("stop", ["at an epoch's end", "by an exception mid-epoch"])
def test_an_instrumented_loader_resumed_at_an_epochs_end_or_after_an_exception_draws_as_uninterrupted(
    tmp_path: Path, stop: str
) -> None:
    """An instrumented loader (no `generator=`: its iterators draw a seed from the global RNG) and
    dropout. Resumed at an epoch's end (the capture taken at the fetch that ends it), the loop's
    next epoch iterator is made from the restored state, as the uninterrupted run's was; resumed
    from the capture a worker takes as it dies of an exception mid-epoch, the iterator is made
    again where the lost one was. Before, the first was made at the ended iterator's state and the
    second anew (the capture at exit held no loader positions): each one draw off the
    uninterrupted run (outsider 56: a kill at an epoch's first step, an exception, a SIGTERM)."""
    import contextlib

    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(24, 8, generator=torch.Generator().manual_seed(0)))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:  # type: ignore[type-arg]
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4)

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    model, opt, loader = build(0)
    for _ in range(2):  # the uninterrupted run: two epochs of 6 steps
        for (x,) in loader:
            step(model, opt, x)
    want = [p.detach().clone() for p in model.parameters()]

    raises = stop != "at an epoch's end"
    ckpt = InMemoryCkptConfig(run_id=f"instrumented-{int(raises)}", disk_folder=str(tmp_path / "disk"))
    model, opt, loader = build(0)
    failing = pytest.raises(RuntimeError) if raises else contextlib.nullcontext()
    with failing, enable_resiliency(model, opt, interval=1, checkpoint=ckpt, enable_detection=False) as s:
        for i, (x,) in enumerate(s.instrument_dataloader(loader)):
            step(model, opt, x)
            if raises and i == 2:
                raise RuntimeError("the loop's own error")
    at = 3 if raises else 6

    model2, opt2, loader2 = build(1)
    with enable_resiliency(model2, opt2, interval=1, checkpoint=ckpt, enable_detection=False) as s2:
        assert s2.recovered_step == at
        timed = s2.instrument_dataloader(loader2)
        for epoch in range(at // 6, 2):
            for i, (x,) in enumerate(timed):
                if epoch * 6 + i >= at:  # (skipped to the position)
                    step(model2, opt2, x)
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), want, strict=True))


def test_a_data_loader_iterator_made_before_the_session_ends_steps_at_its_fetches_too(
    tmp_path: Path,
) -> None:
    """`it = iter(loader)` before `enable_resiliency`, `next(it)` in the loop, the position counted
    after the step: the session finds the iterator and sees its fetches as well, so the capture of
    step 5 (taken at the fetch of step 6's batch) holds position 5 (before: 4)."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(40, 8)), batch_size=4)
    ckpt = InMemoryCkptConfig(run_id="iterator-made-before", disk_folder=str(tmp_path / "disk"))
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = iter(loader)
    pos = {"batches": 0}
    with _keeping(pos, model, opt, ckpt) as s:
        for _ in range(6):
            (x,) = next(it)
            if pos["batches"] == 5:  # step 6's batch fetched: step 5's capture is taken
                assert s.gemini is not None and s.gemini.settle(30)
                break
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            pos["batches"] += 1
        s.close()
    pos2 = {"batches": -1}
    with _keeping(pos2, model, opt, ckpt) as s2:
        assert s2.recovered_step == 5
        assert pos2 == {"batches": 5}


@pytest.mark.parametrize("sampling", ["distributed", "random"])
def test_a_loop_that_iterates_its_data_loader_again_on_resume_draws_what_it_drew_before(
    tmp_path: Path, sampling: str
) -> None:
    """`iter(DataLoader)` draws its workers' seed from the global torch RNG. A loop resumed
    mid-epoch calls it once more than the uninterrupted run did (to skip to its position), and every
    random number after it (dropout) shifted: not the uninterrupted run. The first iterator after a
    restore is made at the RNG state the captured one was made at, and the restored state goes on.
    `random`: a RandomSampler without workers draws its permutation at the first batch, not as the
    iterator is made; the remade one draws it at once, at that state (before, from the restored
    state: another order)."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

    data = TensorDataset(torch.randn(40, 8, generator=torch.Generator().manual_seed(0)))
    ckpt = InMemoryCkptConfig(run_id=f"loader-rng-{sampling}", disk_folder=str(tmp_path / "disk"))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:  # type: ignore[type-arg]
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        sampler = (
            DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
            if sampling == "distributed"
            else RandomSampler(data)
        )
        return (
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(data, batch_size=4, sampler=sampler),
        )

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: list[torch.Tensor]) -> None:
        loss = model(batch[0]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    model, opt, loader = build(0)
    with enable_resiliency(model, opt, interval=1, checkpoint=ckpt, enable_detection=False) as s:
        batches = iter(s.instrument_dataloader(loader))
        for _ in range(4):
            step(model, opt, next(batches))
        fifth = next(batches)  # step 4 is captured as this batch is fetched
        assert s.gemini is not None and s.gemini.drain(30)
    step(model, opt, fifth)  # the uninterrupted run goes on
    for batch in batches:
        step(model, opt, batch)
    want = [p.detach().clone() for p in model.parameters()]

    model2, opt2, loader2 = build(1)  # another init: everything comes from the capture
    with enable_resiliency(model2, opt2, interval=1, checkpoint=ckpt, enable_detection=False) as s2:
        assert s2.recovered_step == 4
        resumed = iter(s2.instrument_dataloader(loader2))
        for _ in range(4):  # the loop skips to its position
            next(resumed)
        for batch in resumed:
            step(model2, opt2, batch)
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), want, strict=True))


def test_an_error_of_load_extra_state_fn_says_it_came_from_there_and_what_it_was_given() -> None:
    """The caller's restore code fails (a key its new version expects): the error is its own, with
    a note naming the hook, the step and what it was given (before: a bare KeyError from inside the
    restore)."""
    import sys

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(
        model,
        opt,
        interval=1,
        checkpoint=InMemoryCkptConfig(run_id="extra"),
        extra_state_fn=lambda: {"pos": 3},
        load_extra_state_fn=lambda state: None,
    ) as s:
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
        assert s.flush_for_restart() == 2

    def load(state: dict[str, int]) -> None:
        raise KeyError("epoch")

    again = nn.Linear(2, 2)
    with pytest.raises(KeyError, match="epoch") as err:
        enable_resiliency(
            again,
            torch.optim.SGD(again.parameters(), lr=0.1),
            interval=1,
            checkpoint=InMemoryCkptConfig(run_id="extra"),
            extra_state_fn=lambda: {"pos": 0},
            load_extra_state_fn=load,
        )
    if sys.version_info >= (3, 11):
        assert err.value.__notes__ == [
            "raised by load_extra_state_fn, restoring step 2: it was given what extra_state_fn returned "
            "then (a dict with keys ['pos'])"
        ]


def test_a_restart_that_opens_no_session_still_reports_the_ranks_that_ended_unseen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zero-import restart with no step left opens no session: rank 0 reports at its exit what a
    session's start reports of the generation before (`exited_unwatched`), into the report folder,
    as a session would; an exit another report named, or another node's rank gloo aborted, is not
    reported; a context it cannot read is logged, never raised."""
    from lm_resiliency.api import EXITED_UNWATCHED, report_unwatched_exits

    exits = [
        {"rank": 1, "exitcode": -15, "reported": False, "culprit": True, "node": "n1", "at": time.time()},
        {"rank": 2, "exitcode": 1, "reported": True, "culprit": True, "node": "n1"},
        {"rank": 3, "exitcode": -6, "reported": False, "culprit": False, "node": "n2"},
    ]
    ctx = tmp_path / "ctx.json"
    ctx.write_text(json.dumps({"schema_version": 1, "generation": 1, "worker_exits": exits}))
    monkeypatch.setenv("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT", str(ctx))
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    reports = tmp_path / "reports"
    assert report_unwatched_exits(1, str(reports)) == 0 and not reports.exists()  # (rank 0 only)
    assert report_unwatched_exits(0, str(reports)) == 1
    (line,) = (reports / "reports-rank0.jsonl").read_text().splitlines()
    r = json.loads(line)
    assert (r["kind"], r["failed_ranks"], r["reason"], r["node"]) == (
        "process_failure",
        [1],
        EXITED_UNWATCHED,
        "n1",
    )
    assert r["generation"] == 1 and r["exit_code"] == "-15" and "killed by SIGTERM" in r["detail"], r
    monkeypatch.setenv("LM_RESILIENCY_REPORT_DIR", str(tmp_path / "env-reports"))
    assert (
        report_unwatched_exits(0, None) == 1 and (tmp_path / "env-reports" / "reports-rank0.jsonl").exists()
    )
    ctx.write_text("{not json")
    assert report_unwatched_exits(0, str(reports)) == 0
