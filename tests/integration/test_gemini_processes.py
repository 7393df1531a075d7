"""GEMINI on a real 4-rank gloo DDP job on 2 synthetic nodes, capturing every step.

Every scenario kills the job mid-run (SIGKILL), restarts all four processes as generation 1, and
requires the final model and optimizer state to be bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
WORLD, STEPS, PAUSE_AT = 4, 10, 6


def _run(
    processes,
    tmp: Path,
    tag: str,
    shm: Path,
    generation: int,
    disk: Path,  # type: ignore[no-untyped-def]
    pause_rank: int = -1,
    kill: bool = False,
    fsdp: bool = False,
    env: dict[str, str] | None = None,
    ok: bool = True,
) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp / tag
    out.mkdir()
    procs = []
    for r in range(WORLD):
        mid = tmp / f"machine-id-{r // 2}"
        mid.write_text(f"node-{r // 2}\n")
        procs.append(
            processes.start(
                ["tests/integration/workers/gemini_worker.py"],
                {
                    "RANK": str(r),
                    "WORLD_SIZE": str(WORLD),
                    "STORE_PORT": str(store.port),
                    "RESULT_DIR": str(out),
                    "STEPS": str(STEPS),
                    "PAUSE_RANK": str(pause_rank),
                    "PAUSE_AT": str(PAUSE_AT),
                    "DISK_FOLDER": str(disk),
                    "DISK_INTERVAL": "4",
                    "LM_RESILIENCY_RUN_ID": "gemini-test",
                    "LM_RESILIENCY_SHM_DIR": str(shm),
                    "LM_RESILIENCY_GENERATION": str(generation),
                    "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
                    "FSDP": "1" if fsdp else "0",
                    **(env or {}),
                },
                out / f"rank{r}.log",
            )
        )
    deadline = time.monotonic() + 200
    if kill:
        # Paused, and every rank has certified the paused step (so the kill's timing is the test's).
        keys = [f"test/paused/{pause_rank}"] + [f"test/certified/{r}" for r in range(WORLD)]
        while not store.check(keys):
            assert all(p.poll() is None for p in procs), _logs(out)
            assert time.monotonic() < deadline
            time.sleep(0.05)  # polling the store the workers write
        procs[pause_rank].send_signal(signal.SIGKILL)  # the failure...
        for p in procs:  # ...and the restart of the whole worker group, as torchrun does
            p.send_signal(signal.SIGKILL)
            p.wait(30)
        return []
    for p in procs:
        code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert code == 0 or not ok, _logs(out)
    if not ok:
        return []
    return [json.loads((out / f"report-g{generation}-rank{r}.json").read_text()) for r in range(WORLD)]


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(out.glob("rank*.log")))


def _same(a: Path, b: Path) -> None:
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)

    def eq(x: object, y: object, path: str) -> None:
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f"{path} differs"
        elif isinstance(x, dict):
            assert isinstance(y, dict) and x.keys() == y.keys(), f"{path} keys differ"
            for k in x:
                eq(x[k], y[k], f"{path}.{k}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), path  # type: ignore[arg-type]
            for i, (u, v) in enumerate(zip(x, y, strict=True)):  # type: ignore[call-overload]
                eq(u, v, f"{path}[{i}]")
        else:
            assert x == y, f"{path}: {x!r} != {y!r}"

    eq(sa, sb, a.name)


@pytest.fixture
def shm_root() -> Path:
    root = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    path = root / f"lmr-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run, shared by every scenario of this module."""
    from tests.conftest import ProcessGroup

    tmp = tmp_path_factory.mktemp("baseline")
    group = ProcessGroup()
    try:
        _run(group, tmp, "run", tmp / "shm", 0, tmp / "disk")
    finally:
        group.stop_all()
    return tmp / "run"


def _scenario(
    processes,
    tmp: Path,
    shm: Path,
    baseline: Path,  # type: ignore[no-untyped-def]
    damage: Callable[[Path], None] | None = None,
    disk: Path | None = None,
    fsdp: bool = False,
) -> list[dict]:
    disk = disk or tmp / "disk"
    _run(processes, tmp, "g0", shm, 0, disk, pause_rank=1, kill=True, fsdp=fsdp)
    if damage is not None:
        damage(shm / "gemini-test")
    reports = _run(processes, tmp, "g1", shm, 1, disk, fsdp=fsdp)
    for r in range(WORLD):
        _same(baseline / f"final-rank{r}.pt", tmp / "g1" / f"final-rank{r}.pt")
    steps = {rep["recovered_step"] for rep in reports}
    assert len(steps) == 1 and PAUSE_AT - 1 <= steps.pop() <= PAUSE_AT
    return reports


def test_a_worker_sigkill_resumes_from_local_memory_bitwise(
    processes,
    tmp_path: Path,
    shm_root: Path,  # type: ignore[no-untyped-def]
    baseline: Path,
) -> None:
    reports = _scenario(processes, tmp_path, shm_root, baseline)
    for rep in reports:
        assert rep["decision"]["reason"].startswith("local"), rep["decision"]
        # The restored capture was recovery-verified before the kill and still is after it.
        assert rep["restored_certified"], rep
        assert rep["decision"]["checkpoint_source"] == "gemini" and rep["decision"]["available"]
        # A rank killed in the middle of a capture leaves that slot torn (its header invalidated):
        # skipped, never a copy failing its checksums, and no fault: nothing damaged it.
        assert all("empty" in r for r in rep["rejected_copies"]), rep
        assert not [f for f in rep["faults"] if f["kind"] == "checkpoint_corruption"], rep["faults"]

        assert rep["replicated"] > 0 and rep["replicas_received"] > 0
        assert rep["cluster_plan_step"] == STEPS and rep["cluster_plan_tiers"] == ["local"]
        assert rep["held_bytes"] > 0


def test_b_node_memory_wiped_restores_from_peer_replicas_bitwise(
    processes,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    shm_root: Path,
    baseline: Path,
) -> None:
    reports = _scenario(
        processes, tmp_path, shm_root, baseline, damage=lambda run: shutil.rmtree(run / "node-1")
    )
    for rep in reports:
        want = "local" if rep["rank"] < 2 else "peer"
        assert rep["decision"]["reason"].startswith(want), rep


def test_b_every_node_memory_lost_restores_from_the_durable_tier_bitwise(
    processes,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    shm_root: Path,
    baseline: Path,
) -> None:
    """Both nodes' shared memory gone (every local copy and every replica): the restart finds the
    step-4 files of the durable tier for every rank, restores them (their checksums verified on
    load) and the run ends bitwise equal; the decision names the durable tier."""
    disk = tmp_path / "disk"
    _run(processes, tmp_path, "g0", shm_root, 0, disk, pause_rank=1, kill=True)
    shutil.rmtree(shm_root / "gemini-test")
    reports = _run(processes, tmp_path, "g1", shm_root, 1, disk)
    for r in range(WORLD):
        _same(baseline / f"final-rank{r}.pt", tmp_path / "g1" / f"final-rank{r}.pt")
    for rep in reports:
        assert rep["recovered_step"] == 4 and rep["decision"]["reason"].startswith("disk:"), rep
        assert rep["decision"]["checkpoint_source"] == "durable", rep["decision"]
        assert rep["decision"]["checkpoint_id"].endswith(f"step-0000000004/rank-{rep['rank']:05d}.pt")


def _node_1_lost(processes, tmp_path: Path, shm_root: Path, env: dict[str, str]) -> list[dict]:  # type: ignore[no-untyped-def]
    """An uninterrupted run and one killed at PAUSE_AT whose node 1 lost its memory, both with
    `env`: the restart ends bitwise as the first, node 0 from its own memory and node 1 from its
    peers' replicas, at PAUSE_AT. Returns the restart's reports."""
    _run(processes, tmp_path, "run", shm_root / "base", 0, tmp_path / "base-disk", env=env)
    _run(processes, tmp_path, "g0", shm_root, 0, tmp_path / "disk", pause_rank=1, kill=True, env=env)
    shutil.rmtree(shm_root / "gemini-test" / "node-1")
    reports = _run(processes, tmp_path, "g1", shm_root, 1, tmp_path / "disk", env=env)
    for r in range(WORLD):
        _same(tmp_path / "run" / f"final-rank{r}.pt", tmp_path / "g1" / f"final-rank{r}.pt")
    for rep in reports:
        assert rep["recovered_step"] == PAUSE_AT, rep
        assert rep["decision"]["reason"].startswith("local" if rep["rank"] < 2 else "peer"), rep
    return reports


def test_two_optimizers_with_their_schedulers_resume_from_local_memory_and_replicas_bitwise(
    processes,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    shm_root: Path,
) -> None:
    """Muon for the matrices and AdamW for the biases, each with its own scheduler, passed as a
    list: every rank killed at step 6, node 1's memory lost. The restart restores both optimizers
    and both schedulers (node 0 from its own memory, node 1 from its peers' replicas) and the run
    ends bitwise equal to an uninterrupted one."""
    reports = _node_1_lost(processes, tmp_path, shm_root, {"TWO_OPTIMIZERS": "1"})
    # SCOUT compared both optimizers' state, agreed and certified the step (marked on own copies)
    assert reports[0]["restored_certified"] and reports[1]["restored_certified"], reports[:2]


def test_ddp_over_tensor_parallel_resumes_from_local_memory_and_replicas_bitwise(
    processes,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    shm_root: Path,
) -> None:
    """DDP(device_mesh=dp) over a model tensor-parallel within each node: torch takes the tensor-
    parallel parameters out of the model's registry at its first forward, and its state_dict() no
    longer has them. The captures hold them still (before, every restore refused the copy: the
    model's keys missing from the checkpoint), node 0 restores from its memory and node 1 from its
    peers' replicas, and the run ends bitwise equal to an uninterrupted one."""
    reports = _node_1_lost(processes, tmp_path, shm_root, {"TP": "1"})
    assert reports[0]["restored_certified"] and reports[1]["restored_certified"], reports[:2]


@pytest.fixture(scope="module")
def baseline_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import ProcessGroup

    tmp = tmp_path_factory.mktemp("baseline-fsdp")
    group = ProcessGroup()
    try:
        _run(group, tmp, "run", tmp / "shm", 0, tmp / "disk", fsdp=True)
    finally:
        group.stop_all()
    return tmp / "run"


def test_b_fsdp2_sharded_state_restores_from_peer_replicas_bitwise(
    processes,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    shm_root: Path,
    baseline_fsdp: Path,
) -> None:
    """FSDP2 over all four ranks: each rank's DTensor shards (parameters, AdamW state) are captured,
    replicated to the other node, and after node 1's memory is wiped its ranks restore their own
    shards from those replicas, bitwise."""
    reports = _scenario(
        processes,
        tmp_path,
        shm_root,
        baseline_fsdp,
        damage=lambda run: shutil.rmtree(run / "node-1"),
        fsdp=True,
    )
    for rep in reports:
        want = "local" if rep["rank"] < 2 else "peer"
        assert rep["decision"]["reason"].startswith(want), rep


@pytest.mark.parametrize(
    ("what", "at", "audit", "detail"),
    [
        ("output", 5, "1", "rank 1's forward outputs differ from the replay"),
        ("weight", 4, "0", "optimizer state changed after step 4 and before the next optimizer step"),
        ("moment", 4, "0", "optimizer state changed after step 4 and before the next optimizer step"),
    ],
    ids=["unit_output_audited", "weight_at_rest", "moment_at_rest"],
)
def test_b_fsdp2_restart_after_an_sdc_restores_the_step_before_it_bitwise(
    processes,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    shm_root: Path,
    baseline_fsdp: Path,
    what: str,
    at: int,
    audit: str,
    detail: str,
) -> None:
    """FSDP2 over all four ranks: no rank holds another's shards, so no fingerprints can agree.

    Rank 1's units compute wrong during step 5 (their outputs scaled): the peer that audits its
    step replays them and names it. Or a bit of rank 1's weight shard (or AdamW moment) flips after
    step 4: its peers gather the flipped weight all alike (no audit can tell), but rank 1's state
    changed between two optimizer steps while its peers' did not, and it is named at step 4 (audits
    off, the defaults). The
    job is killed with the corrupted captures the newest; restarted with no orchestrator naming a
    step, every rank restores the step before (no check up to it found anything, and every one
    came back) and ends bitwise equal to an uninterrupted run. Before, no step of a rank no replica
    holds was ever certified, so the restart after an audit's SDC started over from step 0, and a
    flip at rest went unseen (the run ended with the corruption)."""
    disk = tmp_path / "disk"
    flip = {
        "FLIP_RANK": "1",
        "FLIP_AT": str(at),
        "PAUSE_RANK": "-1",
        "FLIP_WHAT": what,
        "AUDIT_INTERVAL": audit,
    }
    _run(processes, tmp_path, "g0", shm_root, 0, disk, pause_rank=1, kill=True, fsdp=True, env=flip)
    log = (tmp_path / "g0" / "rank0.log").read_text()
    assert f"SCOUT verdict: sdc [1] at step {at}: " in log and detail in log, _logs(tmp_path / "g0")
    reports = _run(processes, tmp_path, "g1", shm_root, 1, disk, fsdp=True, env={"AUDIT_INTERVAL": audit})
    for r in range(WORLD):
        _same(baseline_fsdp / f"final-rank{r}.pt", tmp_path / "g1" / f"final-rank{r}.pt")
    for rep in reports:
        assert rep["recovered_step"] == at - 1, rep["decision"]
        assert rep["decision"]["recovery_mode"] == "recovery_verified", rep["decision"]
        assert rep["decision"]["failure_kind"] == "sdc", rep["decision"]
        assert rep["restored_certified"], rep
        assert not [f for f in rep["faults"] if f["kind"] == "sdc"], rep["faults"]


def test_c_damaged_copies_are_skipped_and_others_used_bitwise(
    processes,
    tmp_path: Path,
    shm_root: Path,  # type: ignore[no-untyped-def]
    baseline: Path,
) -> None:
    """In one run: rank 0's newest local copy has a flipped byte, rank 2's is truncated, rank 3's
    is gone. Each is detected and skipped (the first two reported), and every rank restores the
    same step from another copy (its older slot or its peer's replica), bitwise, not from disk."""

    def damage(run: Path) -> None:
        for rank, node, how in ((0, "node-0", "corrupt"), (2, "node-1", "truncate"), (3, "node-1", "delete")):
            slots = sorted((run / node).glob(f"own-r{rank}-s*"), key=lambda p: p.stat().st_mtime)
            newest = slots[-1]
            if how == "corrupt":
                with open(newest, "r+b") as f:
                    f.seek(4096 + 200)
                    byte = f.read(1)
                    f.seek(4096 + 200)
                    f.write(bytes([byte[0] ^ 0x10]))
            elif how == "truncate":
                os.truncate(newest, newest.stat().st_size // 2)
            else:
                newest.unlink()

    reports = {rep["rank"]: rep for rep in _scenario(processes, tmp_path, shm_root, baseline, damage=damage)}
    for r in (0, 2):
        assert reports[r]["rejected_copies"], f"rank {r}'s damaged copy was not reported"
        assert any(f["kind"] == "checkpoint_corruption" for f in reports[r]["faults"]), reports[r]
    # The flipped byte left the header intact: the report names whose copy of which step failed.
    found = [f for f in reports[0]["faults"] if f["kind"] == "checkpoint_corruption"]
    assert found[0]["owner"] == 0 and found[0]["steps"][0] in (PAUSE_AT - 1, PAUSE_AT), found
    for rep in reports.values():
        assert not rep["decision"]["reason"].startswith("disk"), rep["decision"]


def test_c_verify_integrity_finds_a_copy_damaged_at_rest_during_the_run(
    processes,
    tmp_path: Path,
    shm_root: Path,  # type: ignore[no-untyped-def]
    baseline: Path,
) -> None:
    """With `verify_integrity`, a byte that flips in rank 2's committed captures after step 5 is
    found while the job trains, not at a restart: the capture the next one keeps is verified again
    after that commit, reported (rank 2 as holder, its step named) and dropped; every rank verifies
    its held copies after each commit; training is not disturbed (the final state equals the
    baseline bitwise). (A replica is checked the same way; which one survives the next arrival is
    a race, so a test of it could not be sure to see it.)"""
    env = {"VERIFY_INTEGRITY": "1", "DAMAGE_RANK": "2", "DAMAGE_AT": "5"}
    runs = _run(processes, tmp_path, "run", shm_root, 0, tmp_path / "disk", env=env)
    reports = {r["rank"]: r for r in runs}
    for r in range(WORLD):
        _same(baseline / f"final-rank{r}.pt", tmp_path / "run" / f"final-rank{r}.pt")
        assert reports[r]["scrubbed"] > 0, reports[r]  # (fewer when a busy slot skips a capture)
    found = [f for f in reports[2]["faults"] if f["kind"] == "checkpoint_corruption"]
    assert len(found) == 1 and found[0]["failed_ranks"] == [2] and found[0]["owner"] == 2, found
    assert found[0]["steps"][0] in (4, 5) and "fails its checksum" in found[0]["detail"], found
    for r in (0, 1, 3):
        assert not [f for f in reports[r]["faults"] if f["kind"] == "checkpoint_corruption"], reports[r]


@pytest.mark.parametrize(
    ("mode", "what", "certified"),
    [("recovery_verified", "weight", 4), ("", "weight", 4), ("recovery_verified", "moment", 3)],
    ids=["asked", "noted_by_the_sdc", "a_moment_in_the_capture"],
)
def test_a_restart_after_sdc_skips_the_corrupted_captures_bitwise(
    processes,
    tmp_path: Path,
    shm_root: Path,  # type: ignore[no-untyped-def]
    baseline: Path,
    mode: str,
    what: str,
    certified: int,
) -> None:
    """Rank 1's weight flipped after step 4 (no error), SCOUT names it at step 5, and the job is
    killed with step 5's captures (rank 1's corrupted) the newest. Restarted with no orchestrator
    naming a step (plain torchrun), with `recovery_mode="recovery_verified"` or none (the SDC the
    killed generation found is noted on its node): every rank restores step 4, the newest certified
    capture, and ends bitwise equal to an uninterrupted run. Before, the newest step was restored
    whatever the mode, and the SDC came back.

    An AdamW moment flipped after step 4, with batches from the session's loader, is in step 4's
    capture while the parameters still agree: the optimizer state's fingerprint names it at step 4,
    and step 3 is restored. Before, step 4 was certified on its parameters, restored, and the
    corrupted moment parted rank 1's parameters again at step 5."""
    disk = tmp_path / "disk"
    loader = {"LOADER": "1"} if what == "moment" else {}
    flip = {"FLIP_RANK": "1", "FLIP_AT": "4", "PAUSE_RANK": "-1", "FLIP_WHAT": what, **loader}
    _run(processes, tmp_path, "g0", shm_root, 0, disk, pause_rank=1, kill=True, env=flip)
    named = "sdc [1] at step 4: 1 of 4 replicas disagree on optimizer state at step 4"
    assert (named in (tmp_path / "g0" / "rank0.log").read_text()) == (what == "moment"), _logs(
        tmp_path / "g0"
    )
    reports = _run(processes, tmp_path, "g1", shm_root, 1, disk, env={"RECOVERY_MODE": mode, **loader})
    for r in range(WORLD):
        _same(baseline / f"final-rank{r}.pt", tmp_path / "g1" / f"final-rank{r}.pt")
    for rep in reports:
        assert rep["recovered_step"] == certified, rep["decision"]
        assert rep["decision"]["recovery_mode"] == "recovery_verified", rep["decision"]
        # Without an orchestrator the kind is the one the killed generation noted with the SDC.
        assert rep["decision"]["failure_kind"] == "sdc", rep["decision"]
        assert rep["restored_certified"], rep
        assert not [f for f in rep["faults"] if f["kind"] == "sdc"], rep["faults"]


def test_b_node_lost_after_sdc_with_late_certificates_restores_a_certified_step_from_replicas(
    processes,
    tmp_path: Path,
    shm_root: Path,  # type: ignore[no-untyped-def]
    baseline: Path,
) -> None:
    """Evidence gossip held up to 1 s, longer than the 0.5 s a capture waits for a verdict, so
    certificates come late and at different times per rank; rank 1's weight flipped after step 4, named
    at step 5, then node 1's memory is lost. Replica holders keep what the owners keep: ranks 2 and
    3 find a certified step of theirs on node 0 that ranks 0 and 1 still hold locally, and every
    rank restores it, bitwise."""
    disk = tmp_path / "disk"
    late = {"FLIP_RANK": "1", "FLIP_AT": "4", "PAUSE_RANK": "-1", "PUBLISH_COALESCE_S": "1.0"}
    _run(
        processes,
        tmp_path,
        "g0",
        shm_root,
        0,
        disk,
        pause_rank=1,
        kill=True,
        env={**late, "HEARTBEAT_S": "1.0"},
    )
    shutil.rmtree(shm_root / "gemini-test" / "node-1")
    shutil.rmtree(disk)  # no disk copy to fall back on
    reports = _run(processes, tmp_path, "g1", shm_root, 1, disk, env={"RECOVERY_MODE": "recovery_verified"})
    for r in range(WORLD):
        _same(baseline / f"final-rank{r}.pt", tmp_path / "g1" / f"final-rank{r}.pt")
    steps = {rep["recovered_step"] for rep in reports}
    assert len(steps) == 1 and 1 <= steps.pop() <= 4, [rep["decision"] for rep in reports]
    for rep in reports:
        assert rep["restored_certified"], rep
        tier = "peer" if rep["rank"] >= 2 else "local"
        assert rep["decision"]["reason"].startswith(tier), rep["decision"]


def test_d_read_only_disk_keeps_training_and_reports(
    processes,
    tmp_path: Path,
    shm_root: Path,  # type: ignore[no-untyped-def]
    baseline: Path,
) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits: make the durable folder a file, so every write fails (ENOTDIR)
        disk = tmp_path / "disk-is-a-file"
        disk.write_text("not a directory")
    else:
        disk = tmp_path / "ro-disk"
        disk.mkdir()
        disk.chmod(stat.S_IRUSR | stat.S_IXUSR)
    reports = _scenario(processes, tmp_path, shm_root, baseline, disk=disk)
    for rep in reports:
        assert rep["disk_errors"] > 0 and rep["disk_writes"] == 0
        assert any(f["kind"] == "io_error" for f in rep["faults"])


def test_load_fallback_that_restores_different_steps_on_different_ranks_is_refused(
    processes,
    tmp_path: Path,
    shm_root: Path,  # type: ignore[no-untyped-def]
) -> None:
    """A restart finds no copy anywhere; the callers' own checkpoints restore step 4 on ranks 0 and
    1, step 6 on rank 2 and nothing on rank 3 (a file per rank, one written halfway). Before, each
    rank resumed at its own step. Now every rank refuses with an error that lists them."""
    _run(processes, tmp_path, "g1", shm_root, 1, tmp_path / "disk", env={"FALLBACK": "4,4,6,-1"}, ok=False)
    for r in range(WORLD):
        log = (tmp_path / "g1" / f"rank{r}.log").read_text()
        assert (
            f"rank {r}: load_fallback restored different steps on different ranks "
            "(ranks [0, 1] step 4; ranks [2] step 6; ranks [3] none)"
        ) in log, log[-3000:]
