"""SCOUT on a real 4-rank gloo DDP job: each fault injected by the workers, found by SCOUT alone."""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
WORLD = 4


def _run(
    processes,
    tmp: Path,
    scenario: str,
    steps: int,
    culprit: int = -1,
    at: int = -1,  # type: ignore[no-untyped-def]
    wait_all: bool = True,
    world: int = WORLD,
    clip: bool = False,
    audit: int = 0,
    accumulate: int = 1,
    wrap: str = "ddp",
    extra: dict[str, str] | None = None,
) -> tuple[list[dict], dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        processes.start(
            ["tests/integration/workers/scout_worker.py"],
            {
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "STORE_PORT": str(store.port),
                "RESULT_DIR": str(tmp),
                "STEPS": str(steps),
                "SCENARIO": scenario,
                "CULPRIT": str(culprit),
                "AT_STEP": str(at),
                "REPORT_DIR": str(tmp / "reports"),
                "CLIP": "1" if clip else "0",
                "AUDIT": str(audit),
                "ACCUM": str(accumulate),
                "WRAP": wrap,
                **(extra or {}),
            },
            tmp / f"rank{r}.log",
        )
        for r in range(world)
    ]
    expect = [r for r in range(world) if wait_all or r != culprit]
    deadline = time.monotonic() + 200
    while not all((tmp / f"rank{r}.json").exists() for r in expect):
        if wait_all:
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            assert not bad, (tmp / f"rank{bad[0]}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "workers did not report"
        time.sleep(0.05)  # polling files the workers write atomically
    if wait_all:
        for p in procs:
            assert p.wait(60) == 0
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in expect], store


def _start_workers(
    processes, tmp: Path, env: dict[str, str], world: int = WORLD
) -> tuple[dist.TCPStore, list]:  # type: ignore[no-untyped-def]
    """The workers of a scenario that ends them (not waited for here), and the store they use
    (keep it while they run)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {"WORLD_SIZE": str(world), "STORE_PORT": str(store.port), "RESULT_DIR": str(tmp)}
    base["REPORT_DIR"] = str(tmp / "reports")
    procs = [
        processes.start(
            ["tests/integration/workers/scout_worker.py"],
            {**base, **env, "RANK": str(r)},
            tmp / f"rank{r}.log",
        )
        for r in range(world)
    ]
    return store, procs


def _kinds(res: dict) -> list[tuple[str, list[int]]]:
    return [(f["kind"], f["failed_ranks"]) for f in res["faults"]]


@pytest.mark.parametrize(
    ("world", "culprit", "reason", "clip", "inner", "wrap"),
    [
        (4, 2, "grads_fingerprint_minority", False, False, "ddp"),
        (2, 1, "grads_replay_mismatch", False, False, "ddp"),
        (2, 0, "grads_replay_mismatch", True, False, "ddp"),
        (2, 1, "grads_replay_mismatch", False, True, "ddp"),
        (2, 1, "grads_replay_mismatch", True, False, "plain"),
    ],
    ids=[
        "majority-of-4",
        "replay-of-2",
        "replay-of-2-clipped",
        "replay-of-2-inner-module-passed",
        "replay-of-2-reduced-by-the-caller",
    ],
)
def test_bit_flip_in_a_gradient_after_reduction_is_named_sdc_and_not_certified(
    processes, tmp_path: Path, world: int, culprit: int, reason: str, clip: bool, inner: bool, wrap: str
) -> None:  # type: ignore[no-untyped-def]
    """Four replicas outvote the corrupted one; two cannot, so the step is replayed: the reduction
    is recomputed from both ranks' contributions and the rank that held other gradients is named.
    A caller that passes the module DDP wraps (not the DDP) gets the same: its wrapper is found.
    So does a plain module whose script all-reduces (then averages and clips) each gradient itself,
    given `group=`: each share is recorded as the script's `dist.all_reduce` takes it (before, the
    flip stayed ambiguous: nobody named)."""
    results, _ = _run(
        processes,
        tmp_path,
        "sdc",
        steps=12,
        culprit=culprit,
        at=6,
        world=world,
        clip=clip,
        wrap=wrap,
        extra={"PASS_INNER": "1"} if inner else None,
    )
    for res in results:
        sdc = [f for f in res["faults"] if f["kind"] == "sdc"]
        assert sdc and sdc[0]["failed_ranks"] == [culprit] and sdc[0]["steps"] == [6], res["faults"]
        assert sdc[0]["reason"] == reason and sdc[0]["confidence"] == 1.0, sdc
        # Latency counts from the end of step 6 on the reporting rank: the verdict lands a step or
        # two later; a replay's round trip spans a few more of these millisecond steps under load.
        assert 0 <= sdc[0]["detection_latency_steps"] <= 4 and 0 <= sdc[0]["detection_latency_s"] < 10, sdc
        assert res["certified"]["5"] and not res["certified"]["6"], res["certified"]
        # After SDC, recovery goes back to the last certified capture; after a crash, the latest.
        assert res["sdc_decision"]["recovery_mode"] == "recovery_verified"
        assert res["sdc_decision"]["checkpoint_step"] == 5, res["sdc_decision"]
        assert res["crash_decision"]["recovery_mode"] == "latest"
        assert res["crash_decision"]["checkpoint_step"] == 12, res["crash_decision"]
    lines = (tmp_path / "reports" / "reports-rank0.jsonl").read_text().splitlines()
    assert any(json.loads(line)["kind"] == "sdc" for line in lines)


def test_a_gradient_flipped_on_one_of_two_hsdp_replicas_names_both_without_waiting(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """HSDP (FSDP2 over two nodes' replicas): rank 2 flips a bit of its reduced gradient shard at
    step 6. The two replicas of that shard disagree; FSDP2 reduces its gradients itself, so no
    contribution was recorded to reduce again, and neither can be told right: both are named at
    once (ambiguous; the torchrun leader restarts them in place from a verified step). Before, each
    replica waited for the other's contributions for the stall threshold before saying so (30 s
    by default), while the job trained on with the divergent replica (an outsider's HSDP job)."""
    results, _ = _run(processes, tmp_path, "sdc", steps=12, culprit=2, at=6, world=4, wrap="hsdp")
    for res in results:
        sdc = [f for f in res["faults"] if f["kind"].startswith("sdc")]
        if res["rank"] not in (0, 2):
            assert not sdc, res["faults"]
            continue
        assert [(f["failed_ranks"], f["steps"], f["reason"]) for f in sdc] == [
            ([0, 2], [6], "grads_replay_inconclusive")
        ], res["faults"]
        assert "a sharded model reduces its own gradients" in sdc[0]["detail"], sdc
        assert not res["certified"]["6"], res["certified"]


@pytest.mark.parametrize("world", [4, 2], ids=["four", "two"])
def test_compute_slowdown_is_named_a_compute_straggler_within_3_steps(
    processes, tmp_path: Path, world: int
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 computes slowly. In a job of two too (before: never named there, 'no others to
    compare against'): its peer waits for it, and is not named for that wait."""
    results, _ = _run(processes, tmp_path, "compute", steps=15, culprit=1, world=world)
    assert len(results) == world
    for res in results:
        found = [f for f in res["faults"] if f["kind"] == "straggler"]
        assert [(f["failed_ranks"], f["straggler_type"]) for f in found] == [([1], "compute")], res["faults"]
        assert found[0]["confirmations"] == 3
        # From the first slow step: the 3 confirming steps, then the telemetry's arrival.
        assert 2 <= found[0]["detection_latency_steps"] <= 4, found
        assert 0 < found[0]["detection_latency_s"] < 10, found
        assert res["first_seen_step"]["straggler:[1]"] <= 3 + 2  # evidence of step 3 lands during step 4-5


@pytest.mark.parametrize("scenario", ["input", "prep"], ids=["slow-loader", "slow-preparation"])
def test_slow_data_loader_is_named_an_input_straggler(processes, tmp_path: Path, scenario: str) -> None:  # type: ignore[no-untyped-def]
    """Rank 3's loader is slow, or (with the loader instrumented and fast) the loop spends long on
    each batch before the forward: both are its input time."""
    results, _ = _run(processes, tmp_path, scenario, steps=15, culprit=3)
    for res in results:
        found = [(f["failed_ranks"], f["straggler_type"]) for f in res["faults"] if f["kind"] == "straggler"]
        assert found == [([3], "input")], res["faults"]


def test_marked_checkpoint_io_and_evaluations_between_steps_are_no_input_straggler(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 saves a checkpoint of its own (inside `session.checkpoint_io`) or evaluates (gradients
    off) for 80 ms after every step, as the slow-preparation rank does before its forward: that
    one is an input straggler, this one is not (both counted as input before)."""
    results, _ = _run(processes, tmp_path, "own-work", steps=15, culprit=1)
    for res in results:
        assert [f for f in res["faults"] if f["kind"] == "straggler"] == [], res["faults"]


@pytest.mark.parametrize("wrap", ["fsdp2", "tp"])  # FSDP1's peers: the hang test
def test_sharded_stragglers_are_named_among_the_mesh_peers(processes, tmp_path: Path, wrap: str) -> None:  # type: ignore[no-untyped-def]
    """No two ranks of an FSDP2 or tensor-parallel job hold the same state, but all do the same work:
    step times are compared across the mesh. A slow rank's peers wait for it inside the collectives
    (FSDP2's all-gathers, TP's functional all-reduce), so only the time outside them is its compute.
    Rank 2 computes 3x slower, rank 3's loader is slow: each named, with its type."""
    results, _ = _run(
        processes, tmp_path, "compute", steps=15, culprit=2, wrap=wrap, extra={"SLOW_LOADER": "3"}
    )
    for res in results:
        found = sorted(
            (f["failed_ranks"], f["straggler_type"]) for f in res["faults"] if f["kind"] == "straggler"
        )
        assert found == [([2], "compute"), ([3], "input")], res["faults"]
        assert {f["kind"] for f in res["faults"]} == {"straggler"}, res["faults"]


@pytest.mark.parametrize("wrap", ["ddp", "plain", "fsdp2", "fsdp1", "tp"])
def test_rank_that_never_enters_a_collective_is_named_before_gloo_times_out(
    processes, tmp_path: Path, wrap: str
) -> None:  # type: ignore[no-untyped-def]
    """Under DDP the peers wait in its all-reduce (our comm hook); without DDP, in the script's own
    `dist.all_reduce` of the gradients (seen through the wrapped torch.distributed functions); under
    FSDP2 in its all-gather; under tensor parallelism in the row-wise layer's functional all-reduce."""
    results, store = _run(processes, tmp_path, "hang", steps=50, culprit=0, at=8, wait_all=False, wrap=wrap)
    stalled_at = float(store.get("test/stalled_at"))
    for res in results:
        hang = [f for f in res["faults"] if f["kind"] == "hang"]
        assert hang and hang[0]["failed_ranks"] == [0] and hang[0]["reason"] == "never_entered_collective", (
            res
        )
        latency = res["hang_seen_at"] - stalled_at
        assert latency <= 2 * 2.0, f"hang named {latency:.2f}s after the stall (threshold 2s)"
        assert latency < 30.0  # gloo's timeout in this job


@pytest.mark.parametrize("inner", [False, True], ids=["ddp-passed", "inner-module-passed"])
def test_a_rank_that_stops_after_its_first_step_is_named_while_ddp_rebuilds_its_buckets(
    processes, tmp_path: Path, inner: bool
) -> None:  # type: ignore[no-untyped-def]
    """DDP rebuilds its buckets in the second training forward of a process, where rank 0 broadcasts
    the new layout: rank 0 stopping after its first step (as a restarted worker whose fault comes
    back at once) leaves its peers blocked there. Before, that broadcast was not tracked: the peers
    looked idle, no hang was named, and they waited for gloo's timeout (a campaign's second hang
    after a restart sat for 14 minutes). The same when the script passed the module DDP wraps."""
    extra = {"PASS_INNER": "1"} if inner else None
    results, store = _run(processes, tmp_path, "hang", steps=50, culprit=0, at=2, wait_all=False, extra=extra)
    for res in results:
        hang = [f for f in res["faults"] if f["kind"] == "hang"]
        assert [(f["failed_ranks"], f["reason"]) for f in hang] == [([0], "never_entered_collective")], res
        assert res["hang_seen_at"] - float(store.get("test/stalled_at")) < 30.0  # gloo's timeout


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_hang_is_named_when_ddp_broadcasts_buffers_in_the_forward(
    processes, tmp_path: Path, culprit: int
) -> None:  # type: ignore[no-untyped-def]
    """A model with buffers (BatchNorm): DDP broadcasts them from rank 0 at each training forward,
    so the peers of a rank that stops wait in that broadcast, not in the all-reduce. Rank 0
    stopping left every peer there (no hang named at all); rank 1 stopping named ranks 0 and 3
    with it (they were stuck in the broadcast, which looked like never entering the step)."""
    results, _ = _run(
        processes, tmp_path, "hang", steps=50, culprit=culprit, at=8, wait_all=False, extra={"BN": "1"}
    )
    for res in results:
        hang = [f for f in res["faults"] if f["kind"] == "hang"]
        assert hang and hang[0]["failed_ranks"] == [culprit], res["faults"]


def test_a_data_loader_that_blocks_is_named_a_data_stall(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1's loader blocks for 3 s (threshold 1 s): a data stall naming it, from its own
    runtime's out-of-band progress, while its training thread is still inside `next()`. When its
    peers have waited in the all-reduce for the hang threshold (2 s), the stall is named again as
    one its peers wait on (what the torchrun leader acts on), and not as a hang."""
    results, _ = _run(processes, tmp_path, "datastall", steps=10, culprit=1, at=5, extra={"LOADER_S": "1.0"})
    for res in results:
        found = [(f["kind"], f["failed_ranks"], f["reason"]) for f in res["faults"]]
        assert found == [
            ("data_stall", [1], "dataloader_stalled"),
            ("data_stall", [1], "dataloader_stalled_peers_wait"),
        ], res["faults"]
        assert 1.0 <= res["faults"][0]["stall_duration_s"] < 3.0, res["faults"]
        assert 2.0 <= res["faults"][1]["stall_duration_s"] < 3.0, res["faults"]


@pytest.mark.parametrize(("world", "culprit"), [(4, 2), (2, 1)], ids=["four", "two"])
def test_a_frozen_rank_is_named_for_the_hang_although_it_fell_silent(
    processes, tmp_path: Path, world: int, culprit: int
) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP freezes the culprit, runtime thread included: its heartbeats stop (process_failure
    after 1 s), and when its peers have waited in the all-reduce for the hang threshold (2 s), the
    silent rank is the hang's culprit (before: 'every rank is stuck', naming the waiting ones). In a
    job of two the lone survivor names it too (before: it judged no hang with no live peer left)."""
    results, _ = _run(
        processes,
        tmp_path,
        "sigstop",
        steps=60,
        culprit=culprit,
        at=6,
        wait_all=False,
        world=world,
        extra={"HB_TIMEOUT": "1.0"},
    )
    assert len(results) == world - 1
    for res in results:
        hangs = [f for f in res["faults"] if f["kind"] == "hang"]
        assert [(f["failed_ranks"], f["reason"]) for f in hangs] == [
            ([culprit], "silent_while_peers_wait")
        ], res
        assert ("process_failure", [culprit]) in _kinds(res), res["faults"]
        assert {tuple(f["failed_ranks"]) for f in res["faults"]} == {(culprit,)}, res["faults"]


def test_a_rank_continued_after_a_stop_accuses_none_of_its_peers(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 is SIGSTOPped at step 6 and continued once rank 0 has named it (hang, after 2 s; its
    heartbeat timeout is 1 s). Resumed, rank 1 had heard nothing for seconds because it listened to
    nothing: before, its first tick declared rank 0 dead (a process failure naming a healthy rank).
    Now its own pause does not count; the job then completes."""
    env = {"STEPS": "12", "SCENARIO": "sigstop", "CULPRIT": "1", "AT_STEP": "6", "HB_TIMEOUT": "1.0"}
    _store, procs = _start_workers(processes, tmp_path, env, world=2)
    deadline = time.monotonic() + 120
    while not any(f["kind"] == "hang" for f in _reports(tmp_path, 0)):
        assert time.monotonic() < deadline, _reports(tmp_path, 0)
        time.sleep(0.05)  # polling the report file rank 0 appends to
    os.kill(procs[1].pid, signal.SIGCONT)
    assert [p.wait(120) for p in procs] == [0, 0]
    assert [f for f in _reports(tmp_path, 1) if 0 in f["failed_ranks"]] == [], _reports(tmp_path, 1)
    assert {tuple(f["failed_ranks"]) for f in _reports(tmp_path, 0)} == {(1,)}, _reports(tmp_path, 0)


@pytest.mark.parametrize(("world", "steps"), [(4, 500), (2, 300)], ids=["four", "two"])
def test_clean_run_of_500_steps_with_jitter_has_no_verdict(
    processes, tmp_path: Path, world: int, steps: int
) -> None:  # type: ignore[no-untyped-def]
    results, _ = _run(processes, tmp_path, "clean", steps=steps, world=world)
    for res in results:
        assert res["faults"] == [], res["faults"]


def test_a_weight_corrupted_after_the_step_is_not_in_a_certified_capture(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The loop reads an instrumented loader, so GEMINI captures a step when the next one fetches
    (the loop's own code after the step belongs to it). A weight flipped in that gap is in the
    capture: SCOUT fingerprints the parameters with the capture, names the flip at that step and
    leaves its capture uncertified, so recovery goes back to the step before, which every replica
    holds clean (fingerprinted before the capture, the flip slipped into a certified capture)."""
    results, _ = _run(
        processes, tmp_path, "weight", steps=12, culprit=2, at=6, world=4, extra={"CHECKPOINT": "1"}
    )
    for res in results:
        sdc = [f for f in res["faults"] if f["kind"] == "sdc"]
        assert sdc and sdc[0]["failed_ranks"] == [2] and sdc[0]["steps"] == [6], res["faults"]
        assert res["certified"]["5"] and not res["certified"]["6"], res["certified"]
        assert res["sdc_decision"]["checkpoint_step"] == 5, res["sdc_decision"]


@pytest.mark.parametrize("scenario", ["sdc", "weight"], ids=["gradient", "weight-after-it"])
def test_a_flip_in_the_last_step_is_named_before_the_session_closes(
    processes, tmp_path: Path, scenario: str
) -> None:  # type: ignore[no-untyped-def]
    """Each rank closes its session right after the loop. A gradient flipped on rank 1 in the last
    step (after its reduction), or a weight flipped after the last optimizer step (the capture,
    taken at the close, holds it): the close waits for the last step's judgment, and the fault
    report reaches the callback before close returns. Before, the sessions closed before the last
    step's evidence was judged: nothing was said, and rank 1's state stayed corrupted."""
    results, _ = _run(
        processes,
        tmp_path,
        scenario,
        steps=8,
        culprit=1,
        at=8,
        world=4,
        extra={"CHECKPOINT": "1", "CLOSE_FIRST": "1"},
    )
    for res in results:
        sdc = [f for f in res["faults"] if f["kind"] == "sdc"]
        assert sdc and sdc[0]["failed_ranks"] == [1] and sdc[0]["steps"] == [8], res["faults"]


@pytest.mark.parametrize("rest", [1, 0], ids=["at-rest", "no-rest-checks"])
def test_two_replicas_settle_a_corrupted_weight_by_replaying_the_optimizer_step(
    processes, tmp_path: Path, rest: int
) -> None:  # type: ignore[no-untyped-def]
    """A weight flipped on rank 1 after step 5 was checked. Checked at rest (the default), rank 1's
    state changed between step 5 and step 6 while its replica's did not: named at step 5. Without
    checks at rest: at step 6 the gradients agree (the all-reduce averages the corrupted
    contribution away) and the parameters do not. Rank 1's replay starts from its corrupted copy,
    but its parameters changed between the end of step 5 (agreed) and the start of step 6, which
    no optimizer did: rank 1 is named, not both."""
    results, _ = _run(
        processes, tmp_path, "weight", steps=10, culprit=1, at=5, world=2, extra={"REST": str(rest)}
    )
    named = ([1], [5], "state_changed_at_rest") if rest else ([1], [6], "params_changed_outside_step")
    for res in results:
        sdc = [f for f in res["faults"] if f["kind"] == "sdc"]
        assert [(f["failed_ranks"], f["steps"], f["reason"]) for f in sdc] == [named], res["faults"]


@pytest.mark.parametrize(("wrap", "world", "culprit"), [("ddp", 2, 1), ("hsdp", 4, 2)])
def test_two_replicas_name_the_one_whose_optimizer_step_wrote_a_wrong_weight(
    processes, tmp_path: Path, wrap: str, world: int, culprit: int
) -> None:  # type: ignore[no-untyped-def]
    """A device computes step 5 wrongly on one replica: a bit of a weight the optimizer just wrote.
    The gradients agree and nothing changed between the steps: the step is replayed from its record
    on both replicas, and the one off the replayed parameters is named. HSDP (FSDP2 over a 2-D mesh,
    each shard held by two replicas on the two nodes) replays its local shards, as its optimizer
    steps them; before, DTensor parameters were not replayed and both replicas were named
    (`params_replay_inconclusive`): the torchrun leader restarted both nodes in place and the
    faulty device stayed."""
    results, _ = _run(
        processes, tmp_path, "step-flip", steps=8, culprit=culprit, at=5, world=world, wrap=wrap
    )
    replicas = {culprit, culprit % 2 if wrap == "hsdp" else 1 - culprit}
    for res in results:
        sdc = [f for f in res["faults"] if f["kind"].startswith("sdc")]
        if res["rank"] in replicas:
            assert [(f["failed_ranks"], f["steps"], f["reason"]) for f in sdc] == [
                ([culprit], [5], "params_replay_mismatch")
            ], res["faults"]


@pytest.mark.parametrize(
    ("opt", "wrap", "world", "culprit"),
    [("zero", "ddp", 4, 0), ("zero", "ddp", 4, 3), ("", "ddp", 2, 1), ("", "hsdp", 4, 2)],
    ids=["zero-owner", "zero-not-owner", "two-ddp-replicas", "two-hsdp-replicas"],
)
def test_a_weight_flipped_between_checks_is_named_at_rest(
    processes, tmp_path: Path, opt: str, wrap: str, world: int, culprit: int
) -> None:  # type: ignore[no-untyped-def]
    """Checks every 5 steps, a weight flipped on one rank after step 6. It is named at rest, at step
    6 (the state changed between two steps on that rank), no step from 6 on is certified, and an SDC
    restart resumes from step 5 (its capture kept).
    - ZeRO-1 (`ZeroRedundancyOptimizer`): each rank steps the parameters it owns and broadcasts
      them, so by the check at 10 the flip is in every replica's parameters alike (through the
      owner's broadcast, or through the gradients the rank that does not own it computes with it).
      Before, it was never named (an outsider's job ended off its uninterrupted run).
    - Two replicas (DDP, or HSDP over two nodes): at the check of step 10 they disagree with no
      majority, and each one's replay starts from its own copy (the flipped one too), so the replay
      cannot tell them apart. Before, both were named at step 10 (`params_replay_inconclusive`),
      and the torchrun leader restarted both nodes in place, keeping the faulty device (found by an
      outsider HSDP job)."""
    results, _ = _run(
        processes,
        tmp_path,
        "weight",
        steps=12,
        culprit=culprit,
        at=6,
        world=world,
        wrap=wrap,
        extra={"OPT": opt, "INTERVAL": "5", "CHECKPOINT": "1"},
    )
    for res in results:
        sdc = [f for f in res["faults"] if f["kind"].startswith("sdc")]
        assert [(f["failed_ranks"], f["steps"], f["reason"]) for f in sdc] == [
            ([culprit], [6], "state_changed_at_rest")
        ], res["faults"]
        assert res["certified"]["5"] and not any(res["certified"][str(s)] for s in range(6, 13)), res
        assert res["sdc_decision"]["checkpoint_step"] == 5, res["sdc_decision"]  # (its capture kept)


def test_a_rank_that_corrupts_again_is_reported_as_recurring_sdc_for_quarantine(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    results, _ = _run(processes, tmp_path, "recurring", steps=12, culprit=0, at=4, world=2)
    for res in results:
        sdc = [(f["failed_ranks"], f["steps"], f["reason"], f.get("quarantine")) for f in res["faults"]]
        assert sdc == [
            ([0], [4], "grads_replay_mismatch", None),
            ([0], [8], "grads_replay_mismatch", None),
            ([0], [8], "recurring_sdc", True),
        ], res["faults"]


@pytest.mark.parametrize("world", [2, 4])
def test_the_rank_that_dropped_its_gradients_is_named_by_their_zeros(
    processes, tmp_path: Path, world: int
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 zeroes its gradients after the all-reduce (a bucket dropped): it holds only zeros in
    tensors its replicas hold values in. Named with the reason `grads_dropped` (a restart in place,
    not a device to replace; FAILURES.md's `drop`), among two replicas without a replay. Before,
    `sdc` by the replay (two) or the minority (four), and its node replaced."""
    results, _ = _run(processes, tmp_path, "drop", steps=10, culprit=1, at=6, world=world)
    for res in results:
        faults = [(f["kind"], f["failed_ranks"], f["steps"], f["reason"]) for f in res["faults"]]
        assert faults == [("sdc", [1], [6], "grads_dropped")], res["faults"]
        assert res["faults"][0]["confidence"] == 1.0 and "hold only zeros" in res["faults"][0]["detail"]


@pytest.mark.parametrize("world", [2, 4])
def test_audits_pause_while_the_replicas_parameters_are_apart(processes, tmp_path: Path, world: int) -> None:  # type: ignore[no-untyped-def]
    """Every step audited; rank 1 drops its gradients at step 6 and its parameters part from its
    replicas' for good (nothing restarts this job). The drop is named once. Before, every audit
    after it replayed a peer's step on parameters that differ and accused someone: an inconclusive
    SDC of both ranks at each step (two replicas), and with four, rank 1 named again and again,
    as recurring SDC (a device to quarantine)."""
    results, _ = _run(processes, tmp_path, "drop", steps=14, culprit=1, at=6, world=world, audit=1)
    for res in results:
        faults = [(f["kind"], f["failed_ranks"], f["steps"], f["reason"]) for f in res["faults"]]
        assert faults == [("sdc", [1], [6], "grads_dropped")], res["faults"]


@pytest.mark.parametrize(
    ("world", "scenario", "reason", "interval"),
    [
        (4, "stale-grads", "grads_reused", 1),
        (2, "stale-grads", "grads_reused", 1),
        (4, "stale-params", "params_reused", 5),
        (2, "stale-params", "params_reused", 1),
        (2, "stale-one-grad", "grads_reused", 1),
        (4, "stale-one-param", "params_reused", 1),
    ],
)
def test_a_rank_that_steps_with_the_previous_steps_gradients_is_stale_state(
    processes, tmp_path: Path, world: int, scenario: str, reason: str, interval: int
) -> None:  # type: ignore[no-untyped-def]
    """Stale state (FAILURES.md): a restart from a recovery-verified step, not a device to replace.
    Its parameters then stay apart from the others': the same incident, not reported again. The
    same for a rank whose step counted but whose update was not applied: it holds the parameters
    all held one step before (before, named `sdc`, and its node replaced). And where that happened
    to one tensor only (one gradient reused, one parameter left as it was): it holds more tensors as
    they were one step before than its replicas (before, `sdc`). Checked every 5 steps, at a checked
    step: each rank fingerprints the step before a check for itself, to count against."""
    at = 6 if interval == 1 else 2 * interval
    extra = {"INTERVAL": str(interval)}
    results, _ = _run(processes, tmp_path, scenario, steps=at + 4, culprit=1, at=at, world=world, extra=extra)
    for res in results:
        faults = [(f["kind"], f["failed_ranks"], f["steps"], f["reason"]) for f in res["faults"]]
        assert faults == [("stale_state", [1], [at], reason)], res["faults"]
        assert res["faults"][0]["confidence"] == 1.0 and f"step {at - 1}" in res["faults"][0]["detail"]


def test_uneven_inputs_under_ddp_join_are_not_taken_for_a_fault(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Three ranks with 4, 7 and 10 batches an epoch under DDP's Join: the ranks that run out
    shadow the others' all-reduces, so their step counts and optimizer states differ by design.
    Before, healthy ranks were named `stale_state` (they had entered the collectives of later
    steps), on which the torchrun backend restarts the job. SCOUT stops comparing steps across
    ranks once a step runs inside the Join, and says so."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"WORLD_SIZE": "3", "STORE_PORT": str(store.port), "RESULT_DIR": str(tmp_path), "EPOCHS": "3"}
    procs = [
        processes.start(
            ["tests/integration/workers/join_worker.py"], {**env, "RANK": str(r)}, tmp_path / f"rank{r}.log"
        )
        for r in range(3)
    ]
    for r, p in enumerate(procs):
        assert p.wait(120) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [res["steps"] for res in results] == [12, 21, 30]
    assert all(res["faults"] == [] for res in results), [res["faults"] for res in results]
    assert "runs inside DDP's Join (uneven inputs)" in (tmp_path / "rank0.log").read_text()


def test_a_rank_that_skipped_an_optimizer_step_is_stale_state_not_recurring_sdc(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Rank 3 skips its step 6: from then on its step k holds the others' step k + 1 gradients, and
    it has entered their step k + 1's collectives. Told at the first check, from the collectives
    (before, that check named an SDC, on which the leader replaces a node, and only the second
    told the skipped step); it is no recurring SDC (a device to quarantine), and later checks are
    the same incident."""
    results, _ = _run(processes, tmp_path, "skip-step", steps=12, culprit=3, at=6)
    for res in results:
        faults = [(f["kind"], f["failed_ranks"], f["steps"], f["reason"]) for f in res["faults"]]
        assert faults == [("stale_state", [3], [6], "grads_step_behind")], res["faults"]


def test_of_two_replicas_the_one_that_skipped_an_optimizer_step_is_named_with_no_replay(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Two replicas that disagree have no majority: the one that entered more collectives by the
    step skipped it. Before, the first check was ambiguous and went to replay."""
    results, _ = _run(processes, tmp_path, "skip-step", steps=10, culprit=1, at=5, world=2)
    for res in results:
        faults = [(f["kind"], f["failed_ranks"], f["steps"], f["reason"]) for f in res["faults"]]
        assert faults == [("stale_state", [1], [5], "grads_step_behind")], res["faults"]


@pytest.mark.parametrize("rest", [1, 0], ids=["at-rest", "no-rest-checks"])
def test_two_replicas_name_the_rank_whose_optimizer_state_changed_between_steps(
    processes, tmp_path: Path, rest: int
) -> None:  # type: ignore[no-untyped-def]
    """An AdamW moment flipped on rank 0 after step 5: checked at rest, named at step 5; without,
    its parameters part from rank 1's at step 6, and rank 0's optimizer state before step 6 is not
    what it held after step 5."""
    results, _ = _run(
        processes, tmp_path, "optstate", steps=10, culprit=0, at=5, world=2, extra={"REST": str(rest)}
    )
    named = ([0], [5], "state_changed_at_rest") if rest else ([0], [6], "params_changed_outside_step")
    for res in results:
        sdc = [f for f in res["faults"] if f["kind"] == "sdc"]
        assert [(f["failed_ranks"], f["steps"], f["reason"]) for f in sdc] == [named], res["faults"]


def test_an_optimizer_that_shards_its_state_over_the_replicas_is_no_sdc(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A ZeRO-like optimizer of the script's own (each rank keeps every fourth parameter's state):
    the replicas' optimizer states differ by design. Their layouts differ too, so they are not
    compared; gradients and parameters still are, and agree."""
    results, _ = _run(processes, tmp_path, "sharded-optim", steps=8)
    for res in results:
        assert res["faults"] == [], res["faults"]


@pytest.mark.parametrize(
    ("scenario", "world", "culprit", "reason"),
    [
        ("output", 4, 2, "forward_replay_mismatch"),
        ("localgrad", 4, 1, "backward_replay_mismatch"),
        ("output-once", 2, 1, "forward_replay_mismatch"),
    ],
    ids=["output-of-4", "local-gradient-of-4", "intermittent-output-of-2"],
)
def test_corruption_before_the_all_reduce_is_found_by_an_audit(
    processes, tmp_path: Path, scenario: str, world: int, culprit: int, reason: str
) -> None:  # type: ignore[no-untyped-def]
    """A corrupted forward output or local gradient is averaged into every replica's gradients:
    fingerprints agree, and only re-executing the culprit's micro-batch on a peer finds it. With
    four replicas the culprit corrupts its replays too (it audits a peer and accuses it), but it is
    accused itself, so its accusation does not stand."""
    results, _ = _run(processes, tmp_path, scenario, steps=10, culprit=culprit, at=6, world=world, audit=1)
    for res in results:
        assert [(f["kind"], f["failed_ranks"], f["reason"], f["steps"]) for f in res["faults"]] == [
            ("sdc", [culprit], reason, [6])
        ], res["faults"]
        assert res["certified"]["5"] and not any(res["certified"][str(s)] for s in range(6, 11))
        assert res["audits"].get("skipped", 0) == 0, res["audits"]


def test_fsdp2_corruption_is_found_by_a_peer_replaying_the_unit(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """FSDP2: no two ranks hold the same shards, so fingerprints have nothing to compare, but every
    rank gathers the same weights for a unit's forward. A peer replays the culprit's micro-batch
    of one unit with its own copy of the gathered weights (the units take turns: layer 2 at odd
    steps, layer 0 at even ones) and finds the corrupted output (rank 2, step 5) and, in the same
    run, the whole gradient rank 1 corrupted before FSDP2's reduce-scatter averaged it into every
    shard (step 4); 12 clean steps, each audited forward and backward, accuse nobody."""
    for sub in ("sdc", "clean"):
        (tmp_path / sub).mkdir()
    results, _ = _run(
        processes,
        tmp_path / "sdc",
        "output",
        steps=8,
        culprit=2,
        at=5,
        audit=1,
        wrap="fsdp2",
        extra={"LOCALGRAD_ALSO": "1:4"},
    )
    for res in results:
        assert [(f["kind"], f["failed_ranks"], f["reason"], f["steps"]) for f in res["faults"]] == [
            ("sdc", [1], "backward_replay_mismatch", [4]),
            ("sdc", [2], "forward_replay_mismatch", [5]),
        ], res["faults"]
        assert res["audits"].get("skipped", 0) == 0, res["audits"]
    results, _ = _run(processes, tmp_path / "clean", "clean", steps=12, audit=1, wrap="fsdp2")
    for res in results:
        assert res["faults"] == [] and res["audits"] == {"ok": 12}, (res["faults"], res["audits"])


def test_two_replicas_that_accuse_each_other_stay_ambiguous(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A device that corrupts its replay of the peer's work exactly as it corrupted its own: each
    replica's audit accuses the other, and two cannot tell which is right."""
    results, _ = _run(processes, tmp_path, "output", steps=8, culprit=0, at=4, world=2, audit=2)
    for res in results:
        assert [(f["kind"], f["failed_ranks"], f["reason"]) for f in res["faults"]] == [
            ("sdc", [0, 1], "audit_inconclusive")
        ], res["faults"]
        assert res["faults"][0]["confidence"] == 0.5


@pytest.mark.parametrize("accumulate", [1, 3], ids=["one-micro-batch", "accumulating-3"])
def test_clean_run_audited_every_step_has_no_verdict(processes, tmp_path: Path, accumulate: int) -> None:  # type: ignore[no-untyped-def]
    steps = 60 if accumulate == 1 else 20
    results, _ = _run(processes, tmp_path, "clean", steps=steps, audit=1, accumulate=accumulate)
    for res in results:
        assert res["faults"] == [], res["faults"]
        assert res["audits"] == {"ok": steps}, res["audits"]  # every step re-executed on a peer, bitwise


def test_a_model_no_replay_reproduces_is_not_audited_and_nobody_is_accused(  # type: ignore[no-untyped-def]
    processes, tmp_path: Path
) -> None:
    """Each rank first replays its own step: a forward that reads the clock never reproduces, so the
    model is dropped from audits on every rank, with no finding against anyone."""
    results, _ = _run(processes, tmp_path, "nondeterministic", steps=8, audit=2)
    for res in results:
        assert res["faults"] == [], res["faults"]
        assert set(res["audits"]) <= {"skipped"}, res["audits"]


@pytest.mark.parametrize("wrap", ["ddp", "plain"], ids=["ddp", "reduced-by-the-caller"])
def test_local_gradient_corruption_is_found_with_gradient_accumulation(  # type: ignore[no-untyped-def]
    processes, tmp_path: Path, wrap: str
) -> None:
    """DDP: the gradients come from our comm hook. Without DDP (the script all-reduces after
    backward): from `.grad` as backward accumulated it, before that all-reduce."""
    results, _ = _run(
        processes, tmp_path, "localgrad", steps=8, culprit=3, at=4, audit=2, accumulate=2, wrap=wrap
    )
    for res in results:
        assert [(f["kind"], f["failed_ranks"], f["reason"]) for f in res["faults"]] == [
            ("sdc", [3], "backward_replay_mismatch")
        ], res["faults"]


@pytest.mark.parametrize(
    ("scenario", "module", "reason", "wrap"),
    [
        # The other replica group (ranks 0 and 2) runs clean in each: every audit "ok", no verdict.
        ("output-once", "expert", "forward_replay_mismatch", "plain"),
        ("grad-once", "expert", "backward_replay_mismatch", "plain"),
        # Dense units embed, gate, head are audited in turn (name order): step 5 is head's.
        ("grad-once", "head", "backward_replay_mismatch", "plain"),
        # Dense weights under DDP: their gradients come from our comm hook, scaled by 1/4.
        ("grad-once", "head", "backward_replay_mismatch", "ddp"),
    ],
    ids=["expert-output", "expert-grad", "dense-grad", "ddp-dense-grad"],
)
def test_an_expert_parallel_model_is_audited_by_replicas(  # type: ignore[no-untyped-def]
    processes, tmp_path: Path, scenario: str, module: str, reason: str, wrap: str
) -> None:
    """Expert parallelism: the forward's all-to-all keeps the whole model from being replayed on one
    rank, so each expert module is audited by the rank holding the same expert, and the dense layers
    (torch's own layers outside the experts) one per audited step in turn. A corrupted output or local
    gradient is averaged into every replica's gradients (fingerprints agree); the audit names it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    steps = 8
    procs = [
        processes.start(
            ["tests/integration/workers/moe_worker.py"],
            {
                "RANK": str(r),
                "WORLD_SIZE": "4",
                "STORE_PORT": str(store.port),
                "RESULT_DIR": str(tmp_path),
                "STEPS": str(steps),
                "SCENARIO": scenario,
                "MODULE": module,
                "WRAP": wrap,
                "CULPRIT": "3",
                "AT_STEP": "5",
            },
            tmp_path / f"rank{r}.log",
        )
        for r in range(4)
    ]
    for r, p in enumerate(procs):
        assert p.wait(180) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    for r in range(4):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        # The replica group's gossip (telemetry, evidence, audits, votes) reached the group alone,
        # while every rank still knows every other alive.
        assert res["telemetry_from"] == [r % 2, r % 2 + 2] and res["live"] == [0, 1, 2, 3], res
        found = [(f["kind"], f["failed_ranks"], f["reason"], f["steps"]) for f in res["faults"]]
        if r in (1, 3):  # the replica group of the culprit decides
            assert found == [("sdc", [3], reason, [5])], res
        else:
            assert found == [] and res["audits"] == {"ok": steps}, res


def test_a_worker_that_dies_of_an_uncaught_error_is_named_with_its_error(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The culprit's allocation fails at step 5 and nothing catches it: it reports itself (resource
    exhaustion, with the allocator's text) and its goodbye tells the peers why; the peers, whose next
    collective then breaks, are casualties and accuse nobody else."""
    _store, procs = _start_workers(
        processes, tmp_path, {"STEPS": "30", "SCENARIO": "oom", "CULPRIT": "2", "AT_STEP": "5"}
    )
    codes = [p.wait(90) for p in procs]
    assert all(c != 0 for c in codes), codes  # the culprit, then every peer's broken collective
    assert "DefaultCPUAllocator" in (tmp_path / "rank2.log").read_text()  # the user's traceback still prints
    for r in range(WORLD):
        path = tmp_path / "reports" / f"reports-rank{r}.jsonl"
        reports = [json.loads(line) for line in path.read_text().splitlines()]
        failures = [f for f in reports if f["kind"] == "process_failure"]
        assert [f["failed_ranks"] for f in failures] == [[2]], reports
        assert failures[0]["reason"] == "resource_exhaustion", failures
        assert "DefaultCPUAllocator" in failures[0]["error"], failures
        assert failures[0]["sources"] == (["self"] if r == 2 else ["goodbye"]), failures


def _reports(tmp: Path, rank: int) -> list[dict]:
    """The reports a rank appended so far (complete lines only: it may be writing one)."""
    path = tmp / "reports" / f"reports-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


@pytest.mark.parametrize(
    ("linger", "world"), [(True, 4), (False, 4), (True, 2)], ids=["keeps-its-process-group", "ends", "of-two"]
)
def test_a_rank_whose_loop_ends_early_is_named_by_the_peers_it_leaves_waiting(
    processes, tmp_path: Path, linger: bool, world: int
) -> None:  # type: ignore[no-untyped-def]
    """The culprit's loop ends at step 6 (uneven inputs): it closes its session, which is no fault,
    but its peers wait in step 6's all-reduce. Kept open (as NCCL would wait), its process group
    leaves them stuck: a hang naming it after the 2 s threshold (before: a collective stall naming
    the waiting ranks; in a job of two, nothing: the lone survivor judged no hang). Closed, gloo
    fails their collective at once: each names it as it dies (before: nobody was named)."""
    culprit = 2 if world > 2 else 1
    env = {
        "STEPS": "40",
        "SCENARIO": "leave",
        "CULPRIT": str(culprit),
        "AT_STEP": "6",
        "LINGER": "1" if linger else "0",
    }
    _store, procs = _start_workers(processes, tmp_path, env, world)
    others = [r for r in range(world) if r != culprit]
    deadline = time.monotonic() + 120
    while not all(_reports(tmp_path, r) for r in others):
        assert time.monotonic() < deadline, [_reports(tmp_path, r) for r in range(world)]
        time.sleep(0.1)  # polling report files the workers append to
    if not linger:
        assert [p.wait(60) for p in procs][culprit] == 0
    for r in others:
        reports = _reports(tmp_path, r)
        assert [(f["kind"], f["failed_ranks"], f["reason"], f["steps"]) for f in reports] == [
            ("hang", [culprit], "left_while_peers_wait", [6])
        ], reports
        # Closed: named as it dies, from the goodbye; or, when its collective failed before the
        # goodbye arrived (the rank then looks up to 1 s for a peer's end), by SCOUT as the
        # goodbye lands. Either way once, with the same verdict.
        assert reports[0]["sources"] in ([["scout"]] if linger else [["goodbye"], ["scout"]]), reports
    assert _reports(tmp_path, culprit) == []


def test_a_worker_terminated_by_sigterm_is_named_by_its_peers(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 2 gets SIGTERM at step 6 (a scheduler or a campaign stopping one worker): it writes its
    newest capture to disk and says goodbye before it ends. Its peers name it (terminated), though
    their next collective breaks and they die of that at once; nobody is called hung."""
    _store, procs = _start_workers(
        processes,
        tmp_path,
        {"STEPS": "40", "SCENARIO": "sigterm", "CULPRIT": "2", "AT_STEP": "6", "CHECKPOINT": "1"},
    )
    codes = [p.wait(90) for p in procs]
    assert codes[2] == -signal.SIGTERM and all(c != 0 for c in codes), codes
    assert "SIGTERM, newest capture (step 5) flushed to disk" in (tmp_path / "rank2.log").read_text()
    assert _reports(tmp_path, 2) == []
    for r in (0, 1, 3):
        reports = _reports(tmp_path, r)
        assert [(f["kind"], f["failed_ranks"], f["reason"]) for f in reports] == [
            ("process_failure", [2], "terminated")
        ], reports
        assert reports[0]["sources"] == ["goodbye"] and "SIGTERM" in reports[0]["detail"], reports


def test_a_worker_group_stopped_as_a_whole_reports_nothing(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """torchrun stops its worker group by SIGTERMing every worker: nobody's fault. Each rank
    writes its capture to disk and goes; no rank reports a termination, a death or a hang."""
    env = {"STEPS": "100000", "SCENARIO": "group-stop", "AT_STEP": "6", "CHECKPOINT": "1", "HB_TIMEOUT": "1"}
    store, procs = _start_workers(processes, tmp_path, env)
    store.wait([f"test/at/{r}" for r in range(WORLD)], datetime.timedelta(seconds=120))
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes = [p.wait(60) for p in procs]
    assert codes == [-signal.SIGTERM] * WORLD, codes
    for r in range(WORLD):
        assert "newest capture (step" in (tmp_path / f"rank{r}.log").read_text()
        assert _reports(tmp_path, r) == [], _reports(tmp_path, r)


def test_a_collective_issued_differently_between_steps_is_a_desync_not_a_hang(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """After its optimizer step, every rank all-reduces a 4-element metric; at step 6 rank 1
    all-reduces 5. Gloo pairs them anyway, then the ranks are stuck in different collectives.
    Every rank names rank 1 for a collective desync (before, nobody: collectives between steps were
    not chained, and the hang that followed named ranks 1 and 2, stuck in the metric's all-reduce),
    and the hang it causes is not reported besides."""
    _store, procs = _start_workers(
        processes, tmp_path, {"STEPS": "40", "SCENARIO": "desync", "CULPRIT": "1", "AT_STEP": "6"}
    )
    deadline = time.monotonic() + 120
    while not all(any(f["kind"] == "collective_desync" for f in _reports(tmp_path, r)) for r in range(WORLD)):
        assert time.monotonic() < deadline, [_reports(tmp_path, r) for r in range(WORLD)]
        assert all(p.poll() is None for p in procs), (tmp_path / "rank0.log").read_text()[-3000:]
        time.sleep(0.1)  # polling report files the workers append to
    # Three times the workers' hang threshold (2 s): a hang would have been named by now.
    time.sleep(6.0)
    for r in range(WORLD):
        reports = _reports(tmp_path, r)
        assert [(f["kind"], f["failed_ranks"]) for f in reports] == [("collective_desync", [1])], reports
        assert reports[0]["reason"] == "collective_sequence_minority", reports


def test_a_rank_evaluating_alone_between_steps_is_not_hung(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Every 8 steps rank 0 alone evaluates for 4 s (twice the workers' 2 s hang threshold) while
    its peers wait for it in the next step's all-reduce. Before, every evaluation was a hang naming
    rank 0 (under the torchrun backend, a restart); now it is excused below
    `evaluation_latency_threshold_s` (600 s by default)."""
    res, _ = _run(processes, tmp_path, "evaluation", steps=20, culprit=0, at=8)
    for r in res:
        assert [f for f in r["faults"] if f["kind"] == "hang"] == [], r["faults"]


@pytest.mark.parametrize("io_threshold_s", [120.0, 1.5])
def test_a_checkpoint_rank_0_saves_without_marking_it_is_checkpoint_io_not_a_hang(  # type: ignore[no-untyped-def]
    processes, tmp_path: Path, io_threshold_s: float
) -> None:
    """Rank 0 alone writes a checkpoint with plain torch.save for 4 s (twice the 2 s hang threshold)
    while its peers wait in the next all-reduce, without session.checkpoint_io. Before, it was
    named hung (under the torchrun backend: a restart, and the same save again after it). Its stack
    says it is in checkpoint I/O: below that phase's threshold it is excused; past it, a checkpoint
    stall the peers wait on, never a hang."""
    res, _ = _run(processes, tmp_path, "save", steps=10, culprit=0, at=5, extra={"IO_S": str(io_threshold_s)})
    for r in res:
        assert [f for f in r["faults"] if f["kind"] == "hang"] == [], r["faults"]
    stalls = {(f["kind"], f["reason"], tuple(f["failed_ranks"])) for r in res for f in r["faults"]}
    if io_threshold_s > 4:
        assert stalls == set()
    else:
        assert ("checkpoint_stall", "checkpoint_io_stalled_peers_wait", (0,)) in stalls, stalls


def test_a_rank_evaluating_another_model_alone_between_steps_is_not_hung(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Every 5 steps rank 0 alone runs an EMA copy of the model (not the module passed, so no hook
    of ours sees its forward) for 4 s, twice the 2 s hang threshold, with gradients on. Before, it
    was named hung; its stack (a module running between steps) now marks an evaluation."""
    res, _ = _run(processes, tmp_path, "ema", steps=12, culprit=0, at=5)
    for r in res:
        assert [f for f in r["faults"] if f["kind"] == "hang"] == [], r["faults"]


def test_replicas_the_script_steps_with_different_learning_rates_are_not_an_sdc(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A rank that lowers its own learning rate (ReduceLROnPlateau stepped with its local loss) makes
    its parameters differ from its replicas' by the script's doing. Named once as config_drift (not
    acted on), never an SDC (which had its node replaced, and the restarts repeated until the run gave
    up); no step certified after it, and a crash restores the newest capture, not the last certified."""
    results, _ = _run(processes, tmp_path, "lr-drift", steps=12, culprit=2, at=6, extra={"CHECKPOINT": "1"})
    for res in results:
        assert _kinds(res) == [("config_drift", [2])], res["faults"]
        assert res["faults"][0]["reason"] == "optimizer_settings_differ", res["faults"]
        assert not any(res["certified"][str(s)] for s in range(7, 13)), res["certified"]
        assert res["crash_decision"]["checkpoint_step"] == 12, res["crash_decision"]


def test_a_plain_module_whose_script_reduces_its_gradients_is_named_data_parallel_in_the_log(  # type: ignore[no-untyped-def]
    processes, tmp_path: Path
) -> None:
    """No DDP and no `group=`: SCOUT has no replicas to compare, and a weight corrupted on one rank
    goes unseen. The script's own all-reduce of every gradient shows data parallelism: the log says
    to pass `group=`, once, on the group's first rank. With `group=` (the other scenarios) nothing is said."""
    hint = "all-reduces its gradients over ranks [0, 1] itself"
    for sub in ("bare", "named"):
        (tmp_path / sub).mkdir()
    _run(processes, tmp_path / "bare", "clean", steps=4, world=2, wrap="plain", extra={"NO_GROUP": "1"})
    assert [(tmp_path / "bare" / f"rank{r}.log").read_text().count(hint) for r in range(2)] == [1, 0]
    _run(processes, tmp_path / "named", "clean", steps=4, world=2, wrap="plain")
    assert hint not in (tmp_path / "named" / "rank0.log").read_text()
