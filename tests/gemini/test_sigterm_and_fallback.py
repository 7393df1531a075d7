from __future__ import annotations

import functools
import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lm_resiliency import OrchestrationHooks, enable_resiliency
from tests.conftest import worker_env

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("worker", "printed"),
    [
        ("sigterm_worker.py", "trained"),
        ("sigterm_while_dying_worker.py", "SIGTERM while closing"),
        ("sigterm_worker.py native", "waiting in native code"),
        ("sigterm_worker.py loader", "loading"),
        ("sigterm_worker.py again", "signalled again and again"),
    ],
    ids=[
        "while_training",
        "while_an_exception_ends_the_worker",
        "while_waiting_in_native_code",
        "while_its_loader_workers_die_of_it_too",
        "while_more_sigterms_come",
    ],
)
def test_sigterm_flushes_the_newest_capture_then_terminates(
    tmp_path: Path, worker: str, printed: str
) -> None:
    """SIGTERM (torchrun stopping the group) writes the newest capture to disk before the process
    ends: while training; while the worker is dying of an exception (a peer's failure broke its
    collective) with its exit still committing that capture, which the restart must find; and
    while the main thread waits in native code (a hung collective), where Python's handler cannot
    run: a thread of ours takes it over. Before, that worker lived until torchrun's shutdown
    timeout killed it (30 s, SIGKILL, nothing flushed), here until its 10-minute wait ended. And
    while its DataLoader's worker processes die of the same SIGTERM (torchrun sends it to the
    process group): the loader's SIGCHLD handler raised into the flush, which left no copy on disk
    (an outsider's 4-rank job, preempted, lost one rank's). And while more SIGTERMs come (a
    preemption signals every process, torchrun passes it on to its workers): a second one during
    the flush waited for the first's claim, on the same thread, until torchrun's SIGKILL."""
    env = worker_env({"LM_RESILIENCY_SHM_DIR": str(tmp_path / "shm")})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/gemini" / worker.split()[0]), *worker.split()[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -15, proc.stderr[-2000:]
    assert printed in proc.stdout, proc.stdout
    assert "newest capture (step 3) flushed to disk" in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "default" / "step-0000000003" / "rank-00000.pt").exists()


def test_a_forked_child_that_takes_sigterm_ends_alone(tmp_path: Path) -> None:
    """A DataLoader worker (a forked child) that its loader terminates inherited our SIGTERM handler
    and the socket our SIGTERM watch reads: it ends as it would have without us (nothing flushed
    from it), and its signal is not written where its parent's watch would take it for its own."""
    env = worker_env({"LM_RESILIENCY_SHM_DIR": str(tmp_path / "shm")})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/gemini/sigterm_in_forked_child_worker.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["child wakeup fd -1", "child exit -15", "parent done"], proc.stdout
    assert "SIGTERM" not in proc.stderr, proc.stderr[-2000:]


def test_a_flush_after_close_unmapped_the_slots_flushes_nothing_and_does_not_raise() -> None:
    """A SIGTERM may reach a dying worker at the very end of GEMINI's close: nothing is left to flush."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, interval=1, enable_detection=False) as s:
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
        gem = s.gemini
        assert gem is not None and gem.drain(10)
    assert gem.flush_for_restart(timeout=1.0, replicate=False) == -1


def test_load_fallback_is_asked_when_no_copy_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")  # a restart, with nothing in memory or on disk
    asked: list[object] = []

    def fallback(step: int | None) -> int:
        asked.append(step)
        return 42

    model = nn.Linear(2, 2)
    with enable_resiliency(model, torch.optim.SGD(model.parameters(), lr=0.1), load_fallback=fallback) as s:
        assert asked == [None]
        assert s.recovered_step == 42 and s.step_count == 42
        assert s.last_recovery_decision["reason"].startswith("fallback")  # type: ignore[index]


def test_a_load_fallback_answer_that_is_no_step_is_named_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fallback that restored its checkpoint but says so as a string (or a float) is taken as
    nothing restored: the run starts at step 0 with the weights it loaded. The log says why."""
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, load_fallback=lambda step: "42") as s:
        assert s.recovered_step == -1
    assert "load_fallback returned '42' (str): expected the step it restored" in caplog.text
    caplog.clear()
    with enable_resiliency(model, opt, load_fallback=lambda step: -1) as s:
        assert s.recovered_step == -1
    assert "load_fallback returned" not in caplog.text


def test_a_step_a_restart_plan_names_is_reported_at_the_plans_trust_level(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A restart context (the torchrun leader's plan) names step 3, chosen at `latest` after a
    process failure, while the session asks for recovery-verified steps: step 3 is restored, and
    the decision says so: `latest`, the plan's failure kind. Before, it said `recovery_verified`
    (the session's wish) for a step nobody had checked against a certificate."""

    def train(upto: int, **kw: Any) -> Any:
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        with enable_resiliency(m, o, interval=1, **kw) as s:
            for _ in range(s.step_count, upto):
                m(torch.ones(2, 4)).sum().backward()
                o.step()
            assert s.gemini.drain(10)
            return s.last_recovery_decision

    train(3)
    ctx = tmp_path / "context.json"
    plan = {
        "schema_version": 1,
        "failure_kind": "process_failure",
        "recovery_mode": "latest",
        "checkpoint_step": 3,
    }
    ctx.write_text(json.dumps(plan))
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    monkeypatch.setenv("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT", str(ctx))
    monkeypatch.setenv("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "3")
    decision = train(5, recovery_mode="recovery_verified")
    assert decision["checkpoint_step"] == 3 and decision["recovery_mode"] == "latest", decision
    assert decision["failure_kind"] == "process_failure", decision


def test_restart_without_any_copy_starts_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    model = nn.Linear(2, 2)
    with enable_resiliency(model, torch.optim.SGD(model.parameters(), lr=0.1)) as s:
        assert s.recovered_step == -1 and s.step_count == 0
        assert not s.last_recovery_decision["available"]  # type: ignore[index]


def test_single_process_restart_restores_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 4))
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    def train(s, m, o, upto: int) -> None:  # type: ignore[no-untyped-def]
        for step in range(s.step_count + 1, upto + 1):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            (m(x) - x).pow(2).mean().backward()
            o.step()
            o.zero_grad()

    m, o = make()
    with enable_resiliency(m, o, interval=1) as s:
        train(s, m, o, 6)
    want = [p.detach().clone() for p in m.parameters()]
    m, o = make()
    with enable_resiliency(m, o, interval=1) as s:
        train(s, m, o, 3)
        s.gemini.drain(10)
        # A capture finding both slots busy is skipped (never overwrite the only committed copy), so
        # under load the newest capture may be step 2.
        expected = s.gemini.newest_recoverable_step("latest")
        assert expected >= 2
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    m, o = make()
    recoveries: list[dict] = []
    hooks = OrchestrationHooks(report_recovery=recoveries.append)
    with enable_resiliency(m, o, interval=1, orchestration=hooks) as s:
        assert s.recovered_step == expected
        assert [r["checkpoint_step"] for r in recoveries] == [expected]
        assert recoveries[0]["checkpoint_source"] == "gemini" and recoveries[0]["available"]
        train(s, m, o, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, m.parameters(), strict=True))


def test_what_the_loop_does_after_the_step_is_captured_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop reading an instrumented loader bumps its counter and draws random numbers after the
    optimizer and scheduler steps: the capture is taken when the next step fetches its batch, so a
    restart resumes with the counter and the generators as the uninterrupted run had them there."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 4))
        o = torch.optim.AdamW(m.parameters(), lr=0.01)
        return m, o, torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.9**i)

    def train(stop_at: int = 7) -> tuple[list[torch.Tensor], dict[str, Any], torch.Tensor, int]:
        m, o, sched = make()
        caller = {"seen": 0, "noise": 0.0}
        with enable_resiliency(
            m,
            o,
            opt_param_scheduler=sched,
            interval=1,
            extra_state_fn=lambda: dict(caller),
            load_extra_state_fn=caller.update,
        ) as s:
            start = s.step_count
            batches = (
                (i, torch.randn(8, 4, generator=torch.Generator().manual_seed(i)))
                for i in range(start + 1, 7)
            )
            for step, x in s.instrument_dataloader(batches):
                if step == stop_at:  # its batch fetched, then the worker dies
                    break
                (m(x) - x).pow(2).mean().backward()
                o.step()
                sched.step()
                o.zero_grad()
                caller["seen"] += len(x)  # after the step, as loops count
                caller["noise"] += float(torch.rand(()))
            assert s.gemini.drain(10) and s.gemini.stats.capture_failures == 0
            newest = s.gemini.newest_recoverable_step("latest")
        return [p.detach().clone() for p in m.parameters()], caller, torch.get_rng_state(), newest

    # An evaluation loader read now and then is not the loop's: the capture stays at the boundary.
    m, o, _ = make()
    with enable_resiliency(m, o, interval=1) as s:
        for step in range(1, 4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            (m(x) - x).pow(2).mean().backward()
            o.step()
            assert s.gemini._deferred is None, step
            if step == 1:
                list(s.instrument_dataloader([x], name="eval"))
    want = train()
    _, caller, _, newest = train(stop_at=4)
    # Under load a capture finding both slots still busy is skipped: the newest may be step 2.
    assert newest >= 2 and caller["seen"] == 24
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    got = train()
    assert got[1] == want[1] and torch.equal(got[2], want[2])
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))


@pytest.mark.parametrize(
    ("scheduler", "late"),
    [(False, False), (True, False), (False, True)],
    ids=["scaler", "scaler+scheduler", "scaler-made-after-enable"],
)
def test_a_loss_scaler_is_captured_and_the_steps_it_skips_are_steps(
    monkeypatch: pytest.MonkeyPatch, scheduler: bool, late: bool
) -> None:
    """fp16-style training with a GradScaler whose loss overflows at steps 3 and 6: the skipped steps
    count (`step_count` follows the loop), and a restart resumes the scale and growth tracker as
    the uninterrupted run had them: captured after `scaler.update()` (and `scheduler.step()`). A
    scaler made after enable_resiliency (before the loop) is adopted at the first forward, before
    it scales anything, and given the restored state then."""
    overflow = (3, 6)

    def train(upto: int) -> tuple[list[torch.Tensor], tuple[float, int], int, int]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 4))
        o = torch.optim.AdamW(m.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.9**i) if scheduler else None
        make = functools.partial(torch.amp.GradScaler, "cpu", init_scale=2.0**10, growth_interval=2)
        scaler = None if late else make()
        with enable_resiliency(m, o, interval=1) as s:
            scaler = scaler or make()
            assert s.gemini.scaler is (None if late else scaler) and s.gemini.scheduler is sched
            for step in range(s.step_count + 1, upto + 1):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
                loss = (m(x) - x).pow(2).mean() * (float("inf") if step in overflow else 1.0)
                scaler.scale(loss).backward()
                scaler.step(o)
                scaler.update()
                if sched is not None:
                    sched.step()
                o.zero_grad()
                assert s.step_count == step, (s.step_count, step)
            assert s.gemini.scaler is scaler
            assert s.gemini.drain(10) and s.gemini.stats.capture_failures == 0
            newest = s.gemini.newest_recoverable_step("latest")
            skipped = s._scaler_watch.skipped
        assert type(scaler) is torch.amp.GradScaler  # the watch is gone with the session
        state = (scaler.get_scale(), int(scaler._growth_tracker))
        return [p.detach().clone() for p in m.parameters()], state, newest, skipped

    want = train(8)
    assert want[3] == len(overflow) and want[1][0] != 2.0**10
    _, _, newest, _ = train(5)
    assert newest >= 4  # step 5, or under load the one before
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    got = train(8)
    assert got[1] == want[1], (got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))


def test_a_scaler_the_loop_does_not_use_does_not_hold_captures_back(caplog: pytest.LogCaptureFixture) -> None:
    """A GradScaler exists but the loop steps the optimizer itself: after the first step without
    `scaler.update()`, captures stop waiting for it (a warning says so) and none is lost."""
    m = nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with caplog.at_level(logging.WARNING), enable_resiliency(m, o, interval=1, enable_detection=False) as s:
        assert s.gemini.scaler is scaler
        for _ in range(4):
            m(torch.ones(1, 2)).sum().backward()
            o.step()
        assert s.gemini.drain(10)
        # Step 1's capture waited for the next forward; steps 2 and 3 were taken at once; step 4's
        # too (it would otherwise wait for a forward that never comes).
        assert s.gemini.newest_recoverable_step("latest") == 4
    assert caplog.text.count("did not update() after step 1") == 1


def test_unserialisable_extra_state_fails_at_enable_naming_the_path() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"state\.extra\.bad: objects of type Random"):
        enable_resiliency(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            extra_state_fn=lambda: {"bad": random.Random(0)},  # its getstate() would do
            load_extra_state_fn=lambda state: None,
        )


def test_a_capture_that_cannot_be_taken_is_reported_not_raised_into_training() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reports: list[dict] = []
    calls = {"n": 0}

    def extra() -> dict:
        calls["n"] += 1
        return {"pos": calls["n"]} if calls["n"] < 3 else {"bad": random.Random(0)}  # breaks mid-run

    with enable_resiliency(
        model,
        opt,
        interval=1,
        fault_callback=reports.append,
        extra_state_fn=extra,
        load_extra_state_fn=lambda state: None,
    ) as s:
        for _ in range(4):
            model(torch.randn(4, 2)).sum().backward()
            opt.step()  # from the 2nd step on the capture inside this hook fails: training goes on
        assert s.step_count == 4 and s.gemini.stats.capture_failures == 3
    assert reports and reports[0]["kind"] == "checkpoint_capture_failed"
    assert "state.extra.bad: objects of type Random" in reports[0]["detail"]


def test_replica_slots_keep_the_newest_certified_copy() -> None:
    """A holder overwrites the replica slot that is not the newest recovery-verified one, so a node
    replaced after an SDC can still restore a verified step from its peer."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with enable_resiliency(model, opt, interval=10**6, enable_detection=False) as s:
        gem = s.gemini

        def store_copy_of(step: int, keeps: int = -1) -> None:
            assert gem.capture(step) and gem.drain(10)
            k = next(k for k, v in gem._own_step.items() if v == step)
            raw = gem._own[k].path.read_bytes()
            size = gem._own[k].read_header().file_size
            gem._store_replica(0, step, size, [raw[:4096], raw[4096:size]], keeps)

        gem.certifier = lambda step: step <= 1
        for step in (1, 2, 3):
            store_copy_of(step)
        assert sorted(gem._replica_step[0].values()) == [1, 3]
        gem.certifier = None
        store_copy_of(4)
        assert sorted(gem._replica_step[0].values()) == [3, 4]
        # The owner names the capture it left in place: the holder keeps that one, whatever its own
        # certificates say (here none: without the hint it would keep the newest, 4).
        store_copy_of(5, keeps=3)
        assert sorted(gem._replica_step[0].values()) == [3, 5]
        store_copy_of(6, keeps=99)  # a hint the holder has no replica of: its own rule again
        assert sorted(gem._replica_step[0].values()) == [5, 6]


def test_a_capture_waits_for_scouts_verdict_on_the_previous_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which slot a capture overwrites hangs on SCOUT's verdict on the previous capture (the newest
    certified one stays), so the capture waits for it: decided on whatever certificates had come
    by then, ranks would keep different verified steps. A certificate or an SDC ends the wait; a
    verdict that never comes ends it after VERDICT_WAIT_S; an empty slot is taken at once."""
    import lm_resiliency.gemini.component as gemini_component

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(gemini_component, "VERDICT_WAIT_S", 30.0)  # only a verdict ends these waits
    with enable_resiliency(model, opt, interval=10**6, enable_detection=False) as s:
        gem = s.gemini
        gem.interval = 1  # captures every step, taken by hand here
        certified: set[int] = set()
        sdc_from = [10**9]
        gem.certifier = lambda step: step in certified
        gem.awaiting = lambda step: step not in certified and step < sdc_from[0]

        def capture(step: int) -> bool:
            taken = gem.capture(step)
            assert gem.drain(10)
            return taken

        def capture_answered(step: int, verdict: Callable[[], None]) -> bool:
            """Capture `step` while SCOUT's verdict comes from another thread once it waits."""
            waits = gem.stats.verdict_waits

            def answer() -> None:
                deadline = time.monotonic() + 10
                while gem.stats.verdict_waits == waits and time.monotonic() < deadline:
                    time.sleep(0.001)  # until the capture waits
                verdict()

            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(answer)
                taken = capture(step)
                done.result(timeout=10)
            assert gem.stats.verdict_waits == waits + 1
            return taken

        def certify(*steps: int) -> Callable[[], None]:
            def verdict() -> None:
                for step in steps:
                    certified.add(step)
                    gem.certify(step)

            return verdict

        def held() -> list[int]:
            return sorted(gem._own_step.values())

        assert capture(1) and capture(2) and held() == [1, 2]  # empty slots: no wait
        assert capture_answered(3, certify(1, 2)) and held() == [2, 3]  # the newest certified stays
        assert capture_answered(4, certify(3)) and held() == [3, 4]

        def sdc_at_4() -> None:
            sdc_from[0] = 4
            gem.revoke(4)

        assert capture_answered(5, sdc_at_4) and held() == [3, 5]
        assert capture(6) and held() == [3, 6]  # SDC open: nothing to wait for
        assert gem.stats.verdict_waits == 3
        sdc_from[0] = 10**9
        monkeypatch.setattr(gemini_component, "VERDICT_WAIT_S", 0.0)  # a verdict that never comes
        assert capture(7) and held() == [3, 7]
        assert gem.stats.verdict_waits == 3


def test_sigterm_while_a_capture_waits_for_a_verdict_takes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SIGTERM (torchrun stopping the group) reaches the training thread while a capture waits for
    SCOUT's verdict: the handler takes the capture there and then, and flushes it to disk, rather
    than lose it with the process."""
    import signal
    import threading

    import lm_resiliency.gemini.component as gemini_component
    from lm_resiliency import InMemoryCkptConfig

    monkeypatch.setattr(gemini_component, "VERDICT_WAIT_S", 60.0)  # only the signal ends this wait
    terms: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
    try:
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = InMemoryCkptConfig(disk_folder=str(tmp_path))
        with enable_resiliency(model, opt, interval=10**6, enable_detection=False, checkpoint=ckpt) as s:
            gem = s.gemini
            gem.interval = 1
            gem.certifier = lambda step: False
            gem.awaiting = lambda step: True  # no verdict ever comes
            assert gem.capture(1) and gem.capture(2) and gem.drain(10)
            main = threading.main_thread().ident
            assert main is not None

            def stop() -> None:
                deadline = time.monotonic() + 10
                while gem.stats.verdict_waits == 0 and time.monotonic() < deadline:
                    time.sleep(0.001)  # until the capture waits
                signal.pthread_kill(main, signal.SIGTERM)

            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(stop)
                assert gem.capture(3)
                done.result(timeout=10)
            assert terms == [signal.SIGTERM] and gem.stats.verdict_wait_s < 30
            assert sorted(gem._own_step.values()) == [2, 3]
            assert (tmp_path / gem.run_id / "step-0000000003" / "rank-00000.pt").exists()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train_scheduled(s, m, o, sched, upto: int) -> None:  # type: ignore[no-untyped-def]
    """Steps after the session's count up to `upto`: batch by step, optimizer then scheduler."""
    for step in range(s.step_count + 1, upto + 1):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        (m(x) - x).pow(2).mean().backward()
        o.step()
        sched.step()
        o.zero_grad()


def test_zero_redundancy_optimizer_partition_restores_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO-1 (`ZeroRedundancyOptimizer`): its `state_dict()` needs a collective consolidation, so
    a capture takes this rank's partition and the wrapper's hyperparameters (a scheduler's lr), and
    a restart restores both bitwise. A checkpoint restored into the other kind of optimizer is
    refused, naming both."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lm_resiliency.gemini.state import apply_state, collect_state

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:

        def make() -> tuple[nn.Module, ZeroRedundancyOptimizer, torch.optim.lr_scheduler.LambdaLR]:
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4))
            o = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
            return m, o, torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.9**i)

        m, o, sched = make()
        with enable_resiliency(m, o, opt_param_scheduler=sched, interval=1) as s:
            _train_scheduled(s, m, o, sched, 6)
        want = [p.detach().clone() for p in m.parameters()] + [o.optim.state_dict()["state"][0]["exp_avg"]]
        m, o, sched = make()
        with enable_resiliency(m, o, opt_param_scheduler=sched, interval=1) as s:
            _train_scheduled(s, m, o, sched, 3)
            assert s.gemini.drain(10) and s.gemini.stats.capture_failures == 0
            expected = s.gemini.newest_recoverable_step("latest")
            assert expected >= 2
        monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
        m, o, sched = make()
        with enable_resiliency(m, o, opt_param_scheduler=sched, interval=1) as s:
            assert s.recovered_step == expected
            assert o.param_groups[0]["lr"] == pytest.approx(0.01 * 0.9**expected)
            _train_scheduled(s, m, o, sched, 6)
        got = [p.detach() for p in m.parameters()] + [o.optim.state_dict()["state"][0]["exp_avg"]]
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))

        state = collect_state(m, o, None, None, 6)
        plain = torch.optim.AdamW(m.parameters(), lr=0.01)
        with pytest.raises(ValueError, match="with a ZeroRedundancyOptimizer, the live optimizer is AdamW"):
            apply_state(state, m, plain, None, None)
    finally:
        dist.destroy_process_group()


def test_a_scheduler_not_passed_is_found_and_restored(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A scheduler stepping the optimizer but not passed as opt_param_scheduler is still training
    state: it is found, captured and restored (else a restart resets the learning rate). One made of
    others (SequentialLR) counts as one; two independent ones are ambiguous: a warning, none taken."""
    from lm_resiliency.adapters.pytorch import find_scheduler

    def make() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return m, o, torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.5**i)

    m, o, sched = make()
    with enable_resiliency(m, o, interval=1) as s:
        _train_scheduled(s, m, o, sched, 5)
    want = [p.detach().clone() for p in m.parameters()]
    m, o, sched = make()
    with enable_resiliency(m, o, interval=1) as s:
        _train_scheduled(s, m, o, sched, 3)
        assert s.gemini.drain(10)
        expected = s.gemini.newest_recoverable_step("latest")
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    m, o, sched = make()
    with enable_resiliency(m, o, interval=1) as s:
        assert s.recovered_step == expected >= 2
        assert sched.last_epoch == expected and o.param_groups[0]["lr"] == 0.1 * 0.5**expected
        _train_scheduled(s, m, o, sched, 5)
    assert all(torch.equal(a, b) for a, b in zip(want, m.parameters(), strict=True))

    m = nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2)
    decay = torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)
    seq = torch.optim.lr_scheduler.SequentialLR(o, [warm, decay], milestones=[2])
    assert find_scheduler(o) == (seq, [seq])
    with pytest.warns(UserWarning, match=r"opt_param_scheduler \(LinearLR\) is part of a SequentialLR"):
        s = enable_resiliency(m, o, opt_param_scheduler=warm, enable_checkpoint=False, enable_detection=False)
    s.close()
    monkeypatch.delenv("LM_RESILIENCY_GENERATION")
    m = nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with enable_resiliency(m, o, interval=1, enable_detection=False) as s, caplog.at_level(logging.WARNING):
        late = torch.optim.lr_scheduler.StepLR(o, 1)  # made after enable: said at the first step
        m(torch.ones(1, 2)).sum().backward()
        o.step()
        late.step()
    assert "StepLR steps the optimizer but was made after enable_resiliency" in caplog.text

    # Several step it and none is named (a zero-import script cannot name them): a ReduceLROnPlateau
    # stepped per epoch beside a StepLR stepped per step. Every one is captured, in an order every
    # restart finds again (by type). Before, none was, with a warning, and an outsider's
    # zero-import job restarted its schedule and ended off its run.
    def two() -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=5)
        return m, o, plateau, torch.optim.lr_scheduler.StepLR(o, 1, 0.5)

    m, o, plateau, step_lr = two()
    assert find_scheduler(o) == (None, [plateau, step_lr])
    with enable_resiliency(m, o, interval=1, enable_detection=False) as s:
        plateau.step(1.0)
        plateau.step(2.0)  # (an epoch no better: one bad epoch)
        _train_scheduled(s, m, o, step_lr, 3)
        assert s.gemini.drain(10)
        expected = s.gemini.newest_recoverable_step("latest")
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    m, o, plateau, step_lr = two()
    with enable_resiliency(m, o, interval=1, enable_detection=False) as s:
        assert s.recovered_step == expected >= 2 and step_lr.last_epoch == expected
        assert (plateau.best, plateau.num_bad_epochs) == (1.0, 1)
    monkeypatch.delenv("LM_RESILIENCY_GENERATION")


def test_a_planned_step_that_cannot_be_restored_is_corrected_in_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The plan names step 9 but only steps up to 3 exist here: step 3 is restored, and
    LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP says 3 from then on, so a script that reads its data
    position from it after enable_resiliency resumes its data where its state resumed."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with enable_resiliency(m, o, interval=1) as s:
        for _ in range(3):
            m(torch.ones(2, 4)).sum().backward()
            o.step()
        assert s.gemini.drain(10)
    ctx = tmp_path / "context.json"
    ctx.write_text(json.dumps({"schema_version": 1, "recovery_mode": "latest", "checkpoint_step": 9}))
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    monkeypatch.setenv("LM_RESILIENCY_TORCHRUN_RESTART_CONTEXT", str(ctx))
    monkeypatch.setenv("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "9")
    with enable_resiliency(m, o, interval=1) as s:
        assert s.step_count == 3
        assert os.environ["LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"] == "3"


def test_a_fresh_launch_never_restores_an_earlier_launchs_disk_copies(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Launch A (its run id not named: torchrun's --rdzv-id, here the default) flushes step 6 to
    disk and ends. Launch B, another experiment under the same run id, loses its process after step
    3: its restart resumes B's own step 3. Before, it resumed A's step 6 (another experiment's
    weights) with no word. B's start says how to resume A instead; a launch naming the run does."""

    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Linear(4, 4)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def train(m: nn.Module, o: torch.optim.Optimizer, n: int) -> None:
        for i in range(n):
            m(torch.full((2, 4), float(i))).square().sum().backward()
            o.step()
            o.zero_grad()

    m, o = make(0)
    with enable_resiliency(m, o, interval=1, enable_detection=False) as s:
        train(m, o, 6)
        assert s.flush_for_restart() == 6
    a6 = [p.detach().clone() for p in m.parameters()]
    m, o = make(1)
    with caplog.at_level(logging.WARNING, logger="lm_resiliency"):
        s = enable_resiliency(m, o, interval=1, enable_detection=False)
    said = caplog.text
    train(m, o, 3)
    assert s.gemini is not None and s.gemini.drain(10)
    b3 = [p.detach().clone() for p in m.parameters()]
    s.close()
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")  # B's worker restarted
    m, o = make(1)
    with enable_resiliency(m, o, interval=1, enable_detection=False) as s:
        assert s.recovered_step == 3
        assert all(torch.equal(a, b) for a, b in zip(b3, m.parameters(), strict=True))
    assert "copies of steps [6] from an earlier launch of run 'default'" in said
    assert "LM_RESILIENCY_RUN_ID=default" in said
    monkeypatch.delenv("LM_RESILIENCY_GENERATION")
    monkeypatch.setenv("LM_RESILIENCY_RUN_ID", "default")  # a launch that names the run: A goes on
    m, o = make(2)
    with enable_resiliency(m, o, interval=1, enable_detection=False) as s:
        assert s.recovered_step == 6
        assert all(torch.equal(a, b) for a, b in zip(a6, m.parameters(), strict=True))
