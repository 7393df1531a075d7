"""Real torchrun with `--rdzv-backend=lm_resiliency` on localhost: synthetic nodes (one agent each,
its own machine-id file), 2 active + 1 standby, one gloo worker per node.

Every run must end with every agent exiting 0 (the standby too) and no process of the run left
behind (workers, the detached control-store host); faulted runs must end bitwise equal to an
uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, ProcessGroup

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = "tests/integration/workers/rdzv_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _procs_tagged(tag: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if tag.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


class Job:
    def __init__(
        self,
        group: ProcessGroup,
        tmp: Path,
        name: str,
        nodes: int = 3,
        nnodes: str = "2:3",
        worker: str = WORKER,
        nproc: int = 1,
    ) -> None:
        self.group, self.tmp, self.name = group, tmp / name, name
        self.tmp.mkdir(parents=True)
        self.nodes, self.nnodes = nodes, nnodes
        self.run_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.port = _free_port()
        self.out = self.tmp / "final.pt"
        self.worker = worker
        self.nproc = nproc
        self.procs: list = []

    def start(
        self,
        env: dict[str, str] | None = None,
        policies: list[str | None] | None = None,
        only: list[int] | None = None,
    ) -> None:
        for n in range(self.nodes) if only is None else only:
            mid = self.tmp / f"machine-id-{n}"
            mid.write_text(f"{self.name}-node-{n}\n")
            conf = [
                f"lm_resiliency_restart_context_path={self.tmp / f'context-{n}.json'}",
                "lm_resiliency_poll_interval_ms=100",
                "lm_resiliency_heartbeat_timeout_ms=3000",
                "lm_resiliency_join_timeout_ms=60000",
            ]
            if policies and policies[n]:
                conf.append(f"lm_resiliency_worker_config={policies[n]}")
            full = {
                "LM_RESILIENCY_MACHINE_ID_PATH": str(mid),
                "LM_RESILIENCY_SHM_DIR": str(self.tmp / "shm"),
                "OUT": str(self.out),
                **(env or {}),
            }
            args = [
                "-m",
                "torch.distributed.run",
                f"--nnodes={self.nnodes}",
                f"--nproc-per-node={self.nproc}",
                "--rdzv-backend=lm_resiliency",
                f"--rdzv-endpoint=127.0.0.1:{self.port}",
                f"--rdzv-id={self.run_id}",
                "--local-addr=127.0.0.1",
                "--rdzv-conf=" + ",".join(conf),
                "--max-restarts=30",
                "--monitor-interval=0.1",
                str(ROOT / self.worker),
                self.run_id,  # tags the workers' command lines
            ]
            # In the job's directory: durable checkpoints (default ./checkpoints) land there, not in
            # the checkout.
            self.procs.append(self.group.start(args, full, self.tmp / f"agent-{n}.log", cwd=self.tmp))

    def log(self, n: int) -> str:
        return (self.tmp / f"agent-{n}.log").read_text(errors="replace")

    def text(self) -> str:
        """Every agent's whole log: what a test searches (a tail could drop the line it looks for
        behind a worker's long traceback)."""
        return "\n".join(self.log(n) for n in range(self.nodes))

    def logs(self) -> str:
        """The end of every agent's log, for an assertion's message."""
        return "\n".join(f"===== agent {n}\n{self.log(n)[-6000:]}" for n in range(self.nodes))

    def wait(self, timeout: float = 240.0, killed: tuple[int, ...] = ()) -> None:
        deadline = time.monotonic() + timeout
        for n, p in enumerate(self.procs):
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if n in killed:
                assert rc == -signal.SIGKILL, self.logs()
            else:
                assert rc == 0, f"agent {n} exited {rc}\n{self.logs()}"
                # The run is over: no agent that saw it close leaves its node's copies in memory.
                left = self.tmp / "shm" / self.run_id / f"{self.name}-node-{n}"
                assert not left.exists(), (sorted(p.name for p in left.iterdir()), self.logs())
                assert not left.with_name(f"{left.name}.trail").exists(), self.logs()  # its workers' trails
        # Nothing of the run is left: workers die with their agents, the store host after closing.
        until = time.monotonic() + 20.0
        while _procs_tagged(self.run_id) and time.monotonic() < until:
            time.sleep(0.2)
        left = _procs_tagged(self.run_id)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left behind: {left}\n{self.logs()}"

    def generations(self) -> dict[int, dict]:
        out = {}
        for f in self.tmp.glob("final.pt.gen*.json"):
            doc = json.loads(f.read_text())
            out[doc["generation"]] = doc
        return out

    def final(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _restarted_once(job: Job, env: dict[str, str]) -> tuple[dict[int, dict], dict]:
    """Run `job` with the fault `env`; it must end after one restart: (generations, the restart's
    context)."""
    job.start(env)
    job.wait()
    gens = job.generations()
    assert sorted(gens) == [0, 1], job.logs()
    return gens, json.loads(Path(gens[1]["context"]).read_text())


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    group = ProcessGroup()
    try:
        job = Job(group, tmp_path_factory.mktemp("rdzv"), "baseline")
        job.start()
        job.wait()
        gens = job.generations()
        assert list(gens) == [0], job.logs()
        assert "parked as standby" in job.log(2) or "parked as standby" in job.text()
        return job.final()
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def plain_baseline(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], dict[str, torch.Tensor]]]:
    """The uninterrupted runs of `plain_ddp.py` on 2 nodes (policy: a capture every step), one per
    `WRAP`, each run once for the module (first: two jobs starting at once crowd this 2-core host)."""
    group, runs = ProcessGroup(), {}

    def get(setting: str) -> dict[str, torch.Tensor]:
        """`setting`: "ddp", "fsdp2" or "fsdp2-compiled"."""
        if setting not in runs:
            wrap, _, compiled = setting.partition("-")
            tmp = tmp_path_factory.mktemp(f"plain-{setting}")
            policy = tmp / "policy.toml"
            policy.write_text("schema_version = 1\ninterval = 1\n")
            base = Job(
                group, tmp, f"plain-{setting}-base", nodes=2, worker="tests/integration/workers/plain_ddp.py"
            )
            base.start({"WRAP": wrap, "COMPILE": "1" if compiled else ""}, policies=[str(policy)] * 2)
            base.wait()
            runs[setting] = base.final()
        return runs[setting]

    try:
        yield get
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def three_baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """An uninterrupted run of 3 active nodes (the replicas of the tests that need a majority)."""
    group = ProcessGroup()
    try:
        base = Job(group, tmp_path_factory.mktemp("rdzv-three"), "three-base", nodes=3, nnodes="3:3")
        base.start()
        base.wait()
        return base.final()
    finally:
        group.stop_all()


def test_node_sigkill_admits_the_standby_which_restores_from_a_peer(processes, tmp_path, baseline) -> None:  # type: ignore[no-untyped-def]
    job = Job(processes, tmp_path, "node")
    job.start({"FAULT": "node", "FAULT_RANK": "1", "FAULT_STEP": "10"})
    # The node whose worker holds rank 1 is killed: it is the agent that exits first.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and all(p.poll() is None for p in job.procs):
        time.sleep(0.2)
    lost = next(n for n, p in enumerate(job.procs) if p.poll() is not None)
    job.wait(killed=(lost,))
    gens = job.generations()
    assert sorted(gens) == [0, 1], job.logs()
    ctx = json.loads(Path(gens[1]["context"]).read_text())
    assert ctx["failure_kind"] == "node_lost" and ctx["checkpoint_step"] == 10
    assert ctx["culprits"] == [f"node-node-{lost}"] and len(ctx["admitted"]) == 1
    assert "peer" in " ".join(job.text().split("plan_reason")[1:2]) or "local+peer" in job.text()
    assert _equal(job.final(), baseline)


def test_a_killed_job_launched_again_resumes_from_the_memory_of_its_machines(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Every node of a job (run id named: a relaunch may resume it) dies at step 10, its agent
    SIGKILLed (nothing flushed, no durable copy), and the job is launched again on the same
    machines, its nodes joining in the other order. Each takes the slot of the ranks whose copies it
    holds, and the job resumes from step 10 in shared memory, bitwise. Before, slots went by
    arrival: each node ran the other's rank, found no copy of it, and the job started from step 0."""
    job = Job(processes, tmp_path, "relaunch", nodes=2, nnodes="2:2")
    # Fresh worker interpreters (not forks of the suite's zygote): their own parent-death signal
    # ends them with their killed agents, as in a user's job.
    named = {"LM_RESILIENCY_RUN_ID": job.run_id, "LM_RESILIENCY_TEST_FRESH": "1"}

    def start_in_order(env: dict[str, str], order: list[int]) -> None:
        job.procs, job.port = [], _free_port()
        for n in order:  # each registered before the next starts: slots by arrival would follow
            job.start(env, only=[n])
            deadline = time.monotonic() + 60
            while "registered with run" not in job.log(n) and time.monotonic() < deadline:
                time.sleep(0.1)

    start_in_order({"FAULT": "job", "FAULT_STEP": "10", **named}, [0, 1])
    for proc in job.procs:
        assert proc.wait(timeout=120) == -signal.SIGKILL, job.logs()
    for pid in _procs_tagged(job.run_id):  # the store host (it would wait 120 s for the agents)
        os.kill(pid, signal.SIGKILL)
    assert job.generations()[0]["start"] == 0
    start_in_order(named, [1, 0])
    job.wait()
    logs = job.text()
    assert "node relaunch-node-1 holds in-memory checkpoints of run" in logs, job.logs()
    assert "'relaunch-node-0', 'relaunch-node-1'" in logs, job.logs()  # (slots: as the copies lie)
    gens = job.generations()
    assert sorted(gens) == [0] and gens[0]["start"] == 10, (gens, job.logs())
    assert gens[0]["decision"]["reason"].startswith("local:"), gens
    assert _equal(job.final(), baseline)


def test_leader_agent_killed_new_leader_elected_and_run_completes(processes, tmp_path, baseline) -> None:  # type: ignore[no-untyped-def]
    job = Job(processes, tmp_path, "leader")
    job.start({"FAULT": "leader", "FAULT_STEP": "10"})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and all(p.poll() is None for p in job.procs):
        time.sleep(0.2)
    lost = next(n for n, p in enumerate(job.procs) if p.poll() is not None)
    job.wait(killed=(lost,))
    assert "leads run" in job.log(lost) and "(term 2)" in job.text(), job.logs()
    assert sorted(job.generations()) == [0, 1]
    assert _equal(job.final(), baseline)


def test_ten_consecutive_worker_kills_all_recover_without_extra_generations(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """A worker SIGKILLed two steps into each of ten generations in a row (rank g % 2 in generation
    g, after its capture): each restart is in place, from the killed step in local memory, with a
    restart context that says so; exactly eleven generations, and the result is bitwise."""
    job = Job(processes, tmp_path, "repeat")
    job.start({"FAULT": "repeat", "FAULT_REPEAT": "10"})
    job.wait(timeout=280)
    gens = job.generations()
    assert sorted(gens) == list(range(11)), job.logs()
    assert [gens[g]["start"] for g in range(11)] == [0, *range(2, 21, 2)], gens
    assert [gens[g]["env_step"] for g in range(11)] == [0, *range(2, 21, 2)], gens
    assert all(gens[g]["decision"]["reason"].startswith("local:") for g in range(1, 11)), gens
    ctx_path = Path(gens[10]["context"])  # (each generation's replaces the one before)
    ctx = json.loads(ctx_path.read_text())
    assert ctx_path.stat().st_mode & 0o777 == 0o600
    assert ctx["generation"] == 10 and ctx["checkpoint_step"] == 20 and ctx["checkpoint_source"] == "gemini"
    assert ctx["reason_code"] == "worker_exit" and ctx["admitted"] == []
    # The session's decision names the copy it restored as the restart context does.
    assert ctx["checkpoint_id"] == gens[10]["decision"]["checkpoint_id"] == "gemini-step-20"
    assert gens[10]["decision"]["failure_kind"] == ctx["failure_kind"] == "process_failure", gens[10]
    assert gens[10]["decision"]["recovery_mode"] == "latest", gens[10]
    assert ctx["expected_world_size"] == 2 and ctx["logical_node_slot"] in (0, 1)
    assert _equal(job.final(), baseline)


def test_a_node_with_a_different_policy_is_refused(processes, tmp_path) -> None:  # type: ignore[no-untyped-def]
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("schema_version = 1\ninterval = 1\n")
    b.write_text("schema_version = 1\ninterval = 2\n")
    job = Job(processes, tmp_path, "policy", nodes=2, nnodes="1:2")
    job.start({"STEPS": "4"}, policies=[str(a), str(b)], only=[0])
    deadline = time.monotonic() + 120  # the run's policy is the first node's: let it register first
    while "registered with run" not in job.log(0) and time.monotonic() < deadline:
        time.sleep(0.1)
    job.start({"STEPS": "4"}, policies=[str(a), str(b)], only=[1])
    assert job.procs[1].wait(timeout=120) != 0
    assert "policy_mismatch" in job.log(1) and "same lm_resiliency_worker_config" in job.log(1), job.log(1)
    assert job.procs[0].wait(timeout=200) == 0, job.logs()


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2", "fsdp2-compiled"])
def test_an_unmodified_script_is_instrumented_from_the_policy_alone(
    processes, tmp_path, plain_baseline, wrap: str
) -> None:  # type: ignore[no-untyped-def]
    """DDP, or FSDP2 (`fully_shard`); its SequentialLR, which it never names to us, is restored too.
    FSDP2 compiled whole (`torch.compile(model)`): before, the first-forward hook ran inside the
    compiled region, where the sharded root was no longer the outermost module called: the job was
    never instrumented (and one generation died in dynamo's tracing of our hook)."""
    wrap, _, compiled = wrap.partition("-")
    policy = tmp_path / "policy.toml"
    policy.write_text("schema_version = 1\ninterval = 1\n[checkpoint]\ndisk_flush_interval = 1000\n")
    script = "tests/integration/workers/plain_ddp.py"
    env = {"WRAP": wrap, "COMPILE": "1" if compiled else ""}
    if wrap == "ddp":  # fresh worker interpreters: instrumented when the script imports torch
        env["LM_RESILIENCY_TEST_FRESH"] = "1"
    job = Job(processes, tmp_path, "plain", worker=script)
    job.start({"FAULT": "raise", **env}, policies=[str(policy)] * 3)
    job.wait()
    gens = job.generations()
    assert sorted(gens) == [0, 1] and gens[1]["instrumented"], job.logs()
    assert 0 < gens[1]["start"] <= 10, gens
    assert "instrumented automatically" in job.text() and "Dynamo does not know" not in job.text()
    # The worker said why it died (its uncaught exception), and the restart context carries it.
    ctx = json.loads(Path(gens[1]["context"]).read_text())
    assert ctx["failure_kind"] == "process_failure" and ctx["reason_code"] == "uncaught_exception", ctx
    assert ctx["error"] == "RuntimeError: injected: the loss diverged at step 10", ctx
    assert _equal(job.final(), plain_baseline(wrap + ("-compiled" if compiled else ""))), job.logs()


@pytest.mark.parametrize("wrap", ["ddp", "ddp-early", "fsdp2"])
def test_an_unmodified_script_restarted_after_its_last_step_is_restored_when_it_reads_its_state(
    processes, tmp_path, plain_baseline, wrap
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 raises after the last step (24), its capture taken: the restart resumes at step 24,
    and the loop has no step left, so no forward comes to open the session that would restore it.
    Its `state_dict()` after the loop restores step 24 from this node's memory first: the final
    state is the uninterrupted run's, bitwise. Before, each worker saved the fresh model's state
    and said NOT RESTORED at exit (outsider 57, zero-import, an exception in the last step; outsider
    58, a hang after the loop). The same for FSDP2, whose shards each rank restores, with a script
    that reads its parameters as they are, not its `state_dict()` (before, an outsider HSDP job
    saved the fresh model's shards). ddp-early: the script counts its parameters before it makes
    its scheduler, so the step is restored before the scheduler exists, whose constructor then
    sets the learning rate to the schedule's start: the scheduler takes the step's schedule at
    the next read (before, the final learning rate and schedule were the start's)."""
    wrap, _, early = wrap.partition("-")
    policy = tmp_path / "policy.toml"
    policy.write_text("schema_version = 1\ninterval = 1\n")
    script = "tests/integration/workers/plain_ddp.py"
    job = Job(processes, tmp_path, "plain-end", nodes=2, nnodes="2:2", worker=script)
    read = "params" if wrap == "fsdp2" else early
    job.start({"FAULT": "raise", "FAULT_STEP": "24", "WRAP": wrap, "READ": read}, policies=[str(policy)] * 2)
    job.wait()
    gens = job.generations()
    assert sorted(gens) == [0, 1] and gens[1]["start"] == 24, job.logs()
    assert job.text().count("restored step 24 (rank") == 2, job.logs()
    assert job.text().count("restored step 24's learning-rate schedule into it") == (2 if early else 0)
    assert "NOT RESTORED" not in job.text(), job.logs()
    assert _equal(job.final(), plain_baseline(wrap)), job.logs()


def test_an_unmodified_script_whose_rank_is_terminated_after_its_last_step_is_named(
    processes, tmp_path, plain_baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 of an unmodified DDP script is SIGTERMed after its last step (24). The restart resumes
    at 24 with no step left, so no forward opens the session that reports the ranks of the
    generation before that ended unseen. Before, no report named rank 1 (outsider fuzz, zero-import,
    a SIGTERM in the last step); now rank 0 of the restart reports it at its exit
    (`exited_unwatched`), where no report of the generation before named it already. Bitwise."""
    policy = tmp_path / "policy.toml"
    policy.write_text("schema_version = 1\ninterval = 1\n")
    script = "tests/integration/workers/plain_ddp.py"
    job = Job(processes, tmp_path, "term-end", nodes=2, nnodes="2:2", worker=script)
    reports = tmp_path / "reports"
    env = {"FAULT": "term", "FAULT_STEP": "24", "WRAP": "ddp", "LM_RESILIENCY_REPORT_DIR": str(reports)}
    job.start(env, policies=[str(policy)] * 2)
    job.wait()
    gens = job.generations()
    assert sorted(gens) == [0, 1] and gens[1]["start"] == 24, job.logs()
    named = [
        (r["generation"], r["reason"])
        for f in sorted(reports.glob("*.jsonl"))
        for r in map(json.loads, f.read_text().splitlines())
        if r["kind"] == "process_failure" and r["failed_ranks"] == [1]
    ]
    assert named, job.logs()
    assert _equal(job.final(), plain_baseline("ddp")), job.logs()


def test_a_rank_that_steps_its_optimizer_once_more_in_the_last_step_is_named_and_undone(
    processes, tmp_path, plain_baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 of an unmodified DDP script steps its optimizer twice in its last step (24): no
    collective pairs the second step with its peer, and no step after it compares them. The ranks
    publish the step counts they ended at; they differ (24 and 25), so both vote `stale_state`
    (two replicas: no majority names one), and the leader restarts the run from the newest
    certified step, 24, before the workers end. Before, rank 0's extra update stayed in its final
    weights and the run ended with exit code 0 (outsider fuzz: a duplicated step at the last one)."""
    policy = tmp_path / "policy.toml"
    policy.write_text("schema_version = 1\ninterval = 1\n")
    script = "tests/integration/workers/plain_ddp.py"
    job = Job(processes, tmp_path, "twice", nodes=2, nnodes="2:2", worker=script)
    reports = tmp_path / "reports"
    env = {"FAULT": "twice", "FAULT_RANK": "0", "FAULT_STEP": "24", "WRAP": "ddp"}
    job.start({**env, "LM_RESILIENCY_REPORT_DIR": str(reports)}, policies=[str(policy)] * 2)
    job.wait()
    gens = job.generations()
    assert sorted(gens) == [0, 1] and gens[1]["start"] == 24, job.logs()
    ctx = json.loads(Path(gens[1]["context"]).read_text())
    assert ctx["failure_kind"] == "stale_state", ctx
    assert ctx["reason_code"] == "final_steps_differ_no_majority", ctx
    named = {
        tuple(r["failed_ranks"])
        for f in sorted(reports.glob("*.jsonl"))
        for r in map(json.loads, f.read_text().splitlines())
        if r["kind"] == "stale_state"
    }
    assert named == {(0, 1)}, job.logs()
    assert _equal(job.final(), plain_baseline("ddp")), job.logs()


def test_an_unmodified_script_whose_node_is_lost_after_its_last_step_restores_from_a_peer_node(
    processes, tmp_path, plain_baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 0's node of an unmodified DDP script dies after the last step (24), once its capture is
    replicated: the standby takes its slot and the restart resumes at 24 with no step left, so no
    forward opens a session anywhere. Rank 0, on the new node, holds no copy of step 24: when the
    script reads its state, the replica rank 1's node holds comes through that node's agent
    (`gemini/node_copies`). Before, it saved the fresh model's state and said NOT RESTORED.

    The job names its checkpoints' run id (`LM_RESILIENCY_RUN_ID`), which is not its --rdzv-id:
    before, its workers published their inventories under that id in the control store, where the
    agents never looked, and the restart was planned from no step (-1)."""
    policy = tmp_path / "policy.toml"
    policy.write_text("schema_version = 1\ninterval = 1\n")
    script = "tests/integration/workers/plain_ddp.py"
    job = Job(processes, tmp_path, "node-end", worker=script)
    named = {"LM_RESILIENCY_RUN_ID": f"checkpoints-of-{job.run_id}"}
    job.start(
        {"FAULT": "node", "FAULT_RANK": "0", "FAULT_STEP": "24", "WRAP": "ddp", **named}, [str(policy)] * 3
    )
    for p in job.procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=240)
    lost = [n for n, p in enumerate(job.procs) if p.poll() == -signal.SIGKILL]
    assert len(lost) == 1, job.logs()
    job.wait(killed=(lost[0],))
    gens = job.generations()
    assert sorted(gens) == [0, 1] and gens[1]["start"] == 24, job.logs()
    ctx = json.loads(Path(gens[1]["context"]).read_text())
    assert ctx["failure_kind"] == "node_lost" and ctx["culprits"] == [f"node-end-node-{lost[0]}"], ctx
    assert "restored step 24 (rank 0, from another node's memory)" in job.text(), job.logs()
    assert "NOT RESTORED" not in job.text(), job.logs()
    assert _equal(job.final(), plain_baseline("ddp")), job.logs()
    memory = job.tmp / "shm" / named["LM_RESILIENCY_RUN_ID"]  # (under the id it names: reclaimed at the end)
    gone = f"node-end-node-{lost[0]}"  # (the lost node's: nobody is left there to reclaim them)
    assert sorted(p.name for p in memory.iterdir()) == [gone, f"{gone}.trail"], job.logs()


def _three_replicas_restarted_once(
    group: ProcessGroup, tmp: Path, fault: str, rank: str, step: str = "10"
) -> tuple[Job, dict[int, dict], dict]:
    """`fault` at `step` (of 24) on `rank` of 3 active nodes + 1 standby (`three_baseline` is its
    uninterrupted run); the run must end after one restart: (the job, generations, the restart's
    context)."""
    job = Job(group, tmp, fault, nodes=4, nnodes="3:4")
    job.start({"FAULT": fault, "FAULT_RANK": rank, "FAULT_STEP": step})
    job.wait()
    gens = job.generations()
    assert sorted(gens) == [0, 1], job.logs()
    return job, gens, json.loads(Path(gens[1]["context"]).read_text())


def test_sdc_named_by_scout_replaces_the_node_and_resumes_from_a_verified_step(
    processes, tmp_path, three_baseline
) -> None:  # type: ignore[no-untyped-def]
    """Three replicas are needed to out-vote one corrupted copy: 3 active nodes + 1 standby. The
    gradient flips in the last step (24): the workers' sessions close only once it is judged,
    and wait for the leader's restart, which does the last step again from step 23. Before, the
    verdict came as the workers ended, and the restart began again from step 0 (their copies
    reclaimed: checkpoint source none)."""
    job, gens, ctx = _three_replicas_restarted_once(processes, tmp_path, "sdc", "1", step="24")
    assert ctx["failure_kind"] == "sdc" and ctx["recovery_mode"] == "recovery_verified", ctx
    assert len(ctx["culprits"]) == 1 and len(ctx["admitted"]) == 1, ctx
    assert 0 < ctx["checkpoint_step"] < 24 and gens[1]["start"] == ctx["checkpoint_step"], (ctx, gens)
    # Each resumed worker's decision says what the plan recovered from, and at which trust level.
    decision = gens[1]["decision"]
    assert decision["failure_kind"] == "sdc" and decision["recovery_mode"] == "recovery_verified", decision
    assert decision["checkpoint_step"] == ctx["checkpoint_step"], decision
    assert _equal(job.final(), three_baseline), job.logs()


def test_a_mismatched_collective_that_kills_a_peer_names_the_rank_that_issued_it(
    processes, tmp_path, three_baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 2's script all-reduces a tensor of its own where its replicas all-reduce their gradients.
    Gloo aborts on the sizes in milliseconds, in a peer's process (SIGABRT), and the others die of
    the broken collective before SCOUT compares their hash chains. The agents publish each worker's
    last collective states (its trail) as they restart, and the leader finds rank 2 the minority:
    a collective desync, its node replaced by the standby, the job ends bitwise. Before, the exit
    named the process gloo aborted: a process failure of an innocent rank, restarted in place."""
    job, _, ctx = _three_replicas_restarted_once(processes, tmp_path, "mismatch", "2")
    logs = job.text()
    slots = json.loads(re.search(r"generation 0 published \(slots (\[.*?\])", logs)[1].replace("'", '"'))
    assert ctx["failure_kind"] == "collective_desync", (ctx, job.logs())
    assert ctx["reason_code"] == "collective_sequence_minority" and ctx["culprits"] == [slots[2]], (
        ctx,
        slots,
    )
    assert [a["slot"] for a in ctx["admitted"]] == [2], ctx
    assert _equal(job.final(), three_baseline), job.logs()


@pytest.mark.parametrize("destination", ["", "culprit", "slow"])
def test_optimizer_state_corrupted_before_the_schedulers_step_is_never_recovered(
    processes, tmp_path, baseline, destination: str
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 flips a bit of an Adam moment between its optimizer step 10 and the scheduler's, where
    the capture of step 10 is taken (the loop reads no instrumented loader). The state is judged as
    captured: two replicas disagree on optimizer state at step 10 and replay names rank 1 (or the
    check at rest of the window after its optimizer step does, whichever comes first: two replicas
    are checked at rest too). Its node is replaced and the job resumes from step 9, bitwise. Before,
    the fingerprints were taken at the
    optimizer's step: step 10 was certified with the flip in its capture, every restart resumed it,
    and the run gave up.

    With an orchestrator's `restart_destination` hook that answers the culprit's own node, the
    same restart is in place: no standby admitted (before, the hook was never called). With one
    that does not answer (an orchestrator's API call that hangs), the report goes to the leader
    after 1 s (`RuntimeConfig.restart_destination_wait_s`) without an answer and the policy
    decides: before, the restart waited for the hook, and the corrupted replica trained on
    (outsider 57)."""
    job = Job(processes, tmp_path, "optstate")
    env = {"FAULT": "optstate", "FAULT_RANK": "1", "FAULT_STEP": "10", "LOADER": "plain"}
    gens, ctx = _restarted_once(job, {**env, "DESTINATION": destination, "DESTINATION_WAIT_S": "1"})
    assert ctx["failure_kind"] == "sdc", ctx
    assert ctx["reason_code"] in ("optim_replay_mismatch", "state_changed_at_rest"), ctx
    assert len(ctx["culprits"]) == 1 and ctx["failure_kinds"] == ["sdc"], ctx
    assert ctx["recovery_mode"] == "recovery_verified", ctx
    assert len(ctx["admitted"]) == (0 if destination == "culprit" else 1), ctx
    if destination == "slow":
        assert "restart_destination did not answer within 1.0 s" in job.text(), job.logs()
    if destination == "culprit":
        (culprit,) = ctx["culprits"]
        assert f"restart_destination asked about sdc: {culprit}" in job.text(), job.logs()
    assert ctx["checkpoint_step"] == 9 and gens[1]["start"] == 9, (ctx, gens)
    assert _equal(job.final(), baseline)


def test_a_data_loader_stuck_while_its_peers_wait_is_a_data_stall_the_leader_restarts(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1's loader blocks for good at step 10 (threshold 1 s) while rank 0 waits in the
    all-reduce (hang threshold 2 s): named a data stall, not a hang, and the leader restarts in
    place from the capture before it: for the stall its peers wait on, or already for the loader's
    own report of its stall (`restart_in_place_on` lists data_stall by default)."""
    job = Job(processes, tmp_path, "loader")
    gens, ctx = _restarted_once(
        job, {"FAULT": "loader", "FAULT_RANK": "1", "FAULT_STEP": "10", "HANG_S": "2", "LOADER_S": "1"}
    )
    assert ctx["failure_kind"] == "data_stall", ctx
    assert ctx["reason_code"] in ("dataloader_stalled", "dataloader_stalled_peers_wait"), ctx
    assert len(ctx["culprits"]) == 1 and ctx["admitted"] == [], ctx
    assert ctx["checkpoint_step"] == 9 and gens[1]["start"] == 9, (ctx, gens)
    assert _equal(job.final(), baseline)


@pytest.mark.parametrize(
    ("fault", "kind", "reason"), [("stale", "stale_state", "grads_reused"), ("drop", "sdc", "grads_dropped")]
)
def test_stale_or_dropped_state_named_by_scout_restarts_in_place_from_a_verified_step(
    processes, tmp_path, baseline, fault: str, kind: str, reason: str
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 steps with step 9's gradients at step 10 (stale), or with its gradients zeroed (a
    bucket dropped). Two replicas cannot outvote each other, but rank 1 holds exactly what both
    held one step before, or zeros where its replica holds values: the software's doing, not a
    faulty device. No standby is taken (before, a drop quarantined rank 1's node); the job
    resumes from the newest verified step, before the fault, bitwise."""
    job = Job(processes, tmp_path, fault)
    gens, ctx = _restarted_once(job, {"FAULT": fault, "FAULT_RANK": "1", "FAULT_STEP": "10"})
    assert ctx["failure_kind"] == kind and ctx["reason_code"] == reason, ctx
    assert ctx["recovery_mode"] == "recovery_verified" and ctx["admitted"] == [], ctx
    assert len(ctx["culprits"]) == 1, ctx
    assert 0 < ctx["checkpoint_step"] < 10 and gens[1]["start"] == ctx["checkpoint_step"], (ctx, gens)
    assert _equal(job.final(), baseline)


def test_a_script_that_exits_mid_run_is_named_as_soon_as_its_peers_wait_for_it(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1's script exits with status 3 after step 10 (`sys.exit`). Its session closes at the
    interpreter's exit and waits there for the rest of its generation, which wait for it in step
    11's all-reduce: torchrun sees no exit. A closed session never enters a collective again, so
    once its peers have waited a moment (`LEFT_WAIT_S`, not the hang threshold, 120 s here) it is
    named and the run restarts from step 10, bitwise. Before, only at the threshold (outsider fuzz:
    30 s late, where torchrun alone would have restarted at once)."""
    job = Job(processes, tmp_path, "exit")
    reports = tmp_path / "reports"
    env = {"FAULT": "exit", "FAULT_RANK": "1", "FAULT_STEP": "10", "HANG_S": "120"}
    gens, ctx = _restarted_once(job, {**env, "LM_RESILIENCY_REPORT_DIR": str(reports)})
    assert ctx["failure_kind"] == "hang" and ctx["reason_code"] == "left_while_peers_wait", ctx
    assert ctx["checkpoint_step"] == 10 and gens[1]["start"] == 10, (ctx, gens)
    named = [
        r["detection_latency_s"]
        for f in sorted(reports.glob("*.jsonl"))
        for r in map(json.loads, f.read_text().splitlines())
        if r["kind"] == "hang" and r["failed_ranks"] == [1]
    ]
    assert named and max(named) < 120, (named, job.logs())
    assert _equal(job.final(), baseline)


def test_a_script_that_exits_after_its_last_step_while_the_others_wait_in_a_barrier_is_named(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1's script exits (status 3) after the last step (24), its capture in place, while the
    other enters `dist.barrier()` and waits for it there (between steps: never counted as a wait).
    Rank 0 is idle and quiet as a rank hung after its loop is, but it entered one collective more
    than rank 1 had at its close (its last progress, sent before its goodbye): rank 1 is named
    (`left_while_peers_wait`), not rank 0 (before: rank 0 was named hung after its loop, outsider
    fuzz). The restart resumes at 24, bitwise."""
    job = Job(processes, tmp_path, "exitlast")
    reports = tmp_path / "reports"
    env = {"FAULT": "exit", "FAULT_RANK": "1", "FAULT_STEP": "24", "HANG_S": "2", "BARRIER": "1"}
    gens, ctx = _restarted_once(job, {**env, "LM_RESILIENCY_REPORT_DIR": str(reports)})
    assert ctx["failure_kind"] == "hang" and ctx["reason_code"] == "left_while_peers_wait", ctx
    assert ctx["checkpoint_step"] == 24 and gens[1]["start"] == 24, (ctx, gens)
    hangs = {
        tuple(r["failed_ranks"])
        for f in sorted(reports.glob("*.jsonl"))
        for r in map(json.loads, f.read_text().splitlines())
        if r["kind"] == "hang"
    }
    assert hangs == {(1,)}, (hangs, job.logs())
    assert _equal(job.final(), baseline)


def test_a_hang_named_by_scout_is_recovered_and_the_run_completes_bitwise(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 never enters step 10's all-reduce: SCOUT names it (threshold 2 s), the leader acts on the
    verdict: the stuck worker group is stopped (SIGTERM reaches workers waiting in gloo) and restarts
    in place (a hang is not in `replace_node_on`), resuming from the capture before the hang."""
    job = Job(processes, tmp_path, "hang")
    gens, ctx = _restarted_once(job, {"FAULT": "hang", "FAULT_RANK": "1", "FAULT_STEP": "10", "HANG_S": "2"})
    assert ctx["failure_kind"] == "hang" and ctx["reason_code"] == "never_entered_collective", ctx
    assert len(ctx["culprits"]) == 1 and ctx["admitted"] == [], ctx
    assert ctx["checkpoint_step"] == 9 and gens[1]["start"] == 9, (ctx, gens)
    assert _equal(job.final(), baseline)


def test_ddp_over_tensor_parallel_names_its_hang_and_its_sdc_and_resumes_bitwise(processes, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Tensor parallel within each node (2 ranks), DDP(device_mesh=dp) across two, a standby: a
    campaign hangs rank 3 at step 6 and flips a gradient of rank 1 after reduction at step 12.
    Replicas {0, 2} wait for rank 3 (rank 2's tensor-parallel peer) with no culprit among them;
    {1, 3} name it. The leader restarts for a hang of rank 3 alone (before: on "[0, 2] every rank
    stuck", and the others reported rank 3's node's ranks as failed processes), then replaces
    rank 1's node, and every rank's shards end bitwise as an uninterrupted run's (before: torch
    takes the tensor-parallel parameters out of the model's registry at its first forward, so
    every capture lacked them and each restore refused it; the campaign found no gradient of
    theirs to flip)."""
    campaign = tmp_path / "campaign.json"
    faults = [
        ("01-hang", 6, "hang", "process", 3, {}),
        ("02-flip", 12, "tensor_corruption", "gradient", 1, {"operation": "single_bitflip"}),
    ]
    incidents = [
        {
            "incident_id": name,
            "trigger": {"at": [at]},
            "faults": [
                {
                    "fault_id": name[3:],
                    "type": kind,
                    "target": {
                        "surface": surface,
                        "rank": rank,
                        **({"module_path": "0.weight"} if rank == 1 else {}),
                    },
                    "parameters": params,
                }
            ],
        }
        for name, at, kind, surface, rank, params in faults
    ]
    campaign.write_text(json.dumps({"schema_version": 1, "name": "tp", "seed": 1, "incidents": incidents}))
    env = {"TP": "1", "STEPS": "18", "HANG_S": "3"}
    base = Job(processes, tmp_path, "tp-base", nodes=2, nnodes="2:2", nproc=2)
    base.start(env)
    base.wait()
    job = Job(processes, tmp_path, "tp", nproc=2)
    job.start(
        {
            **env,
            "LM_RESILIENCY_FAULT_CAMPAIGN": str(campaign),
            "LM_RESILIENCY_FAULT_GROUND_TRUTH": str(tmp_path / "gt"),
        }
    )
    job.wait()
    gens = job.generations()
    assert sorted(gens) == [0, 1, 2], job.logs()
    assert gens[1]["decision"]["failure_kind"] == "hang", gens
    assert gens[2]["decision"]["failure_kind"] == "sdc", gens
    hung = re.findall(r"verdict hang on ranks \[([0-9, ]+)\] -> \['([^']+)'\]", job.logs())
    flipped = re.findall(r"verdict sdc on ranks \[1\] -> \['([^']+)'\]", job.logs())
    contexts = [json.loads(p.read_text()) for p in job.tmp.glob("context-*.json")]
    last = {c["first_global_rank"]: c["node_id"] for c in contexts if c["generation"] == 2}
    assert {h for h, _ in hung} == {"3"} and {n for _, n in hung} == {last[2]}, (hung, contexts)
    assert flipped and flipped[0] not in last.values(), (flipped, contexts)  # replaced by the standby
    assert "every rank waits in collective" not in job.text() and "said it was terminated" not in job.text()
    for r in range(4):
        got, want = torch.load(f"{job.out}.rank{r}"), torch.load(f"{base.out}.rank{r}")
        assert len(want) == 4 and _equal(got, want), f"rank {r} ended off the uninterrupted run"


PIPELINE = "tests/integration/workers/pipeline_train.py"


@pytest.fixture(scope="module")
def pipeline_baseline(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    """Each rank's parameters after an uninterrupted run of the pipeline job (12 steps; with or
    without `group=`, the same numbers)."""
    group = ProcessGroup()
    try:
        base = Job(
            group,
            tmp_path_factory.mktemp("rdzv-pp"),
            "pp-base",
            nodes=2,
            nnodes="2:2",
            worker=PIPELINE,
            nproc=2,
        )
        base.start({"STEPS": "12"})
        base.wait()
        return [torch.load(f"{base.out}.rank{r}") for r in range(4)]
    finally:
        group.stop_all()


@pytest.mark.parametrize("group", ["dp", "none"])
def test_a_hung_pipeline_stage_is_named_not_the_stage_that_waits_for_it(
    processes, tmp_path, pipeline_baseline, group: str
) -> None:  # type: ignore[no-untyped-def]
    """Two pipeline stages per node (torch.distributed.pipelining), data parallel across two nodes
    by the script's own all-reduce: a campaign hangs rank 3 (stage 1) at step 6. Rank 2 (stage 0)
    waits for rank 3's gradients in the schedule's point-to-point wait, which SCOUT sees as waiting
    in a collective: only rank 3 is named (before, rank 2 was named too, idle to its replica 0
    waiting in the all-reduce), and the run resumes bitwise.

    With no `group=` (as zero-import instruments a stage) no rank knows a peer: the hang is judged
    across the job (before, nobody compared rank 3's progress with anyone's, and the job waited for
    gloo's 30-minute timeout)."""
    campaign = tmp_path / "campaign.json"
    hang = {"fault_id": "h", "type": "hang", "target": {"surface": "process", "rank": 3}}
    incident = {"incident_id": "01-hang", "trigger": {"at": [6]}, "faults": [hang]}
    campaign.write_text(json.dumps({"schema_version": 1, "name": "pp", "seed": 1, "incidents": [incident]}))
    env = {"STEPS": "12", "HANG_S": "3", **({"NO_GROUP": "1"} if group == "none" else {})}
    job = Job(processes, tmp_path, "pp", nodes=2, nnodes="2:2", worker=PIPELINE, nproc=2)
    job.start(
        {
            **env,
            "LM_RESILIENCY_FAULT_CAMPAIGN": str(campaign),
            "LM_RESILIENCY_FAULT_GROUND_TRUTH": str(tmp_path / "gt"),
        }
    )
    job.wait()
    gens = job.generations()
    assert sorted(gens) == [0, 1] and gens[1]["decision"]["failure_kind"] == "hang", job.logs()
    named = set(re.findall(r"SCOUT verdict: hang (\[[0-9, ]+\])", job.logs()))
    assert named == {"[3]"}, (named, job.logs())
    for r, want in enumerate(pipeline_baseline):
        got = torch.load(f"{job.out}.rank{r}")
        assert want and _equal(got, want), f"rank {r} ended off the uninterrupted run"


def test_a_stopped_worker_is_continued_to_take_the_restarts_sigterm(processes, tmp_path, baseline) -> None:  # type: ignore[no-untyped-def]
    """Rank 1's worker is SIGSTOPped after step 10 (its capture drained). SCOUT names it (it went
    silent while its peer waits); before torchrun's SIGTERM its agent continues it, so it exits on
    the SIGTERM like its peers instead of being SIGKILLed after torchrun's 30 s shutdown timeout.
    The restart is in place, from the newest step both hold, bitwise."""
    job = Job(processes, tmp_path, "stop")
    gens, ctx = _restarted_once(job, {"FAULT": "stop", "FAULT_RANK": "1", "FAULT_STEP": "10", "HANG_S": "2"})
    logs = job.text()
    assert ctx["failure_kind"] in ("hang", "process_failure") and len(ctx["culprits"]) == 1, ctx
    # Continued, it may take one more step with its peer before both take the SIGTERM.
    assert ctx["admitted"] == [] and ctx["checkpoint_step"] in (10, 11), ctx
    assert gens[1]["start"] == ctx["checkpoint_step"], (ctx, gens)
    assert "was stopped (SIGSTOP/SIGTSTP); continued it" in logs, job.logs()
    assert "forcefully exiting via 9" not in logs, job.logs()
    assert _equal(job.final(), baseline)


def test_a_stopped_worker_whose_node_mate_dies_takes_torchruns_sigterm(processes, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two ranks per node: rank 1 stops itself (SIGSTOP) after step 10, then its node-mate rank 0
    dies. torchrun sees rank 0's exit and stops the node's workers at once, before the leader
    decides anything: the stopped rank 1 would take that SIGTERM only as the SIGKILL that follows
    torchrun's 30 s shutdown timeout. The agent continues a stopped worker once a sibling has
    ended, so it exits on the SIGTERM and the restart waits for nothing."""
    job = Job(processes, tmp_path, "stopmate", nodes=2, nnodes="2:2", nproc=2)
    gens, ctx = _restarted_once(job, {"FAULT": "stopmate", "FAULT_RANK": "1", "FAULT_STEP": "10"})
    logs = job.text()
    assert "was stopped (SIGSTOP/SIGTSTP); continued it" in logs, job.logs()
    assert "forcefully exiting via 9" not in logs, job.logs()
    assert gens[1]["start"] == ctx["checkpoint_step"] >= 10, (ctx, gens)


@pytest.mark.parametrize("fault", ["late", "killlast"])
def test_a_rank_that_fails_after_the_others_closed_their_sessions_is_restarted_bitwise_and_named(
    processes, tmp_path, baseline, fault: str
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 raises after its loop (late), or is killed there (killlast), once rank 0's worker
    has ended (or waits at its close). A worker that ended at once left its agent in torch's exit
    barrier, where the restart never reached it, and the run waited for that node for good. Closed
    sessions wait for every rank of their generation, so the restart stops them, and the next
    generation ends the script again from the last step's capture, bitwise.

    Rank 1 is named once in the fault reports: the exception by rank 1 itself. The kill was seen by
    no peer (their sessions were closed) and was in no report before; rank 0 of the restart now
    reports it from what rank 1's agent saw (`worker_exits` in the restart context)."""
    job = Job(processes, tmp_path, fault)
    reports = tmp_path / "reports"
    gens, ctx = _restarted_once(
        job, {"FAULT": fault, "FAULT_RANK": "1", "LM_RESILIENCY_REPORT_DIR": str(reports)}
    )
    assert ctx["failure_kind"] == "process_failure" and ctx["checkpoint_step"] == 24, ctx
    exits = [(e["rank"], e["exitcode"], e["reported"], e["culprit"]) for e in ctx["worker_exits"]]
    if fault == "late":  # (its report may start the restart before its agent sees the exit)
        assert exits in ([], [(1, 1, True, True)]), ctx
    else:
        assert exits == [(1, -signal.SIGKILL, False, True)], ctx
    assert gens[1]["start"] == 24, gens
    assert _equal(job.final(), baseline)
    named = [
        (f.name, r["reason"])
        for f in sorted(reports.glob("*.jsonl"))
        for r in map(json.loads, f.read_text().splitlines())
        if r["kind"] == "process_failure" and r["failed_ranks"] == [1]
    ]
    want = "uncaught_exception" if fault == "late" else "exited_unwatched"
    assert named == [(f"reports-rank{0 if fault == 'killlast' else 1}.jsonl", want)], (named, job.logs())


def test_a_rank_that_fails_after_the_others_ended_ends_the_run_failing_and_lets_them_exit(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 raises after its loop once rank 0's worker has ended: rank 0's closed session waited
    1 s (`RuntimeConfig.finish_wait_s`) and ended, and its agent waits in torch's exit barrier,
    which no restart reaches. Before, the restart waited for that node for good. Now rank 1's
    agent closes the run failing, saying why, and counts itself in the exit barrier: rank 0's node
    exits 0 with what its script saved (the uninterrupted run's state), rank 1's fails, the
    standby exits 0, and no second generation starts."""
    job = Job(processes, tmp_path, "afterend")
    job.start({"FAULT": "afterend", "FAULT_RANK": "1", "FINISH_S": "1"})
    deadline = time.monotonic() + 240
    rcs = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in job.procs]
    failed = [n for n, rc in enumerate(rcs) if rc != 0]
    assert len(failed) == 1 and rcs[failed[0]] == 1, (rcs, job.logs())
    assert "had ended their scripts" in job.log(failed[0]), job.logs()
    assert list(job.generations()) == [0], job.logs()
    assert _equal(job.final(), baseline)


def test_a_rank_that_hangs_after_its_loop_is_named_once_the_others_closed_and_restarted(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 hangs after its loop (an event never set). Nobody waits for it in a collective, and
    before, the job never ended. Once every other rank has closed its session, its own SCOUT names
    it (no progress and no CPU outside the library for the stall threshold), the run restarts, and
    the next generation ends the script from the last step's capture, bitwise."""
    job = Job(processes, tmp_path, "hanglast")
    gens, ctx = _restarted_once(job, {"FAULT": "hanglast", "FAULT_RANK": "1", "HANG_S": "2"})
    assert ctx["failure_kind"] == "hang" and ctx["checkpoint_step"] == 24, ctx
    assert "idle_after_peers_closed" in job.text(), job.logs()
    assert gens[1]["start"] == 24, gens
    assert _equal(job.final(), baseline)


def test_two_ranks_that_hang_after_their_loops_are_named_together_once_the_rest_closed(
    processes, tmp_path, three_baseline
) -> None:  # type: ignore[no-untyped-def]
    """Three ranks; ranks 1 and 2 hang after the loop. Neither ever sees every other rank closed:
    before, nobody was named and the job never ended (outsider fuzz: FSDP2, ranks 0 and 3 hung
    after the last step). Each, quiet itself, names both once rank 0 closed and the other is idle
    after the same step; the run restarts from the last step, bitwise."""
    job = Job(processes, tmp_path, "hang2", nodes=3, nnodes="3:3")
    gens, ctx = _restarted_once(
        job, {"FAULT": "hanglast", "FAULT_RANK": "1", "ALSO_RANKS": "2", "HANG_S": "2"}
    )
    assert ctx["failure_kind"] == "hang" and ctx["checkpoint_step"] == 24, ctx
    assert "idle_after_peers_closed" in job.text() and "every rank but [1, 2] closed" in job.text(), (
        job.logs()
    )
    assert gens[1]["start"] == 24, gens
    assert _equal(job.final(), three_baseline)


def test_a_rank_that_hangs_after_its_loop_while_the_others_wait_in_a_barrier_is_named(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 hangs after its loop; the others enter `dist.barrier()` and wait for it there. A
    collective between steps is never counted as a wait (rank 0 saving while the others wait is
    no hang), and nobody closed: before, nobody was named, and the job waited for the process
    group's timeout (outsider fuzz). Now its peers, having entered a collective it never entered
    and waited the threshold, and it, idle with its process quiet as long, name it; the run
    restarts and the next generation ends from the last step's capture, bitwise."""
    job = Job(processes, tmp_path, "hangbarrier")
    gens, ctx = _restarted_once(job, {"FAULT": "hanglast", "FAULT_RANK": "1", "HANG_S": "2", "BARRIER": "1"})
    assert ctx["failure_kind"] == "hang" and ctx["checkpoint_step"] == 24, ctx
    assert "idle_while_peers_wait" in job.text(), job.logs()
    assert gens[1]["start"] == 24, gens
    assert _equal(job.final(), baseline)


@pytest.mark.parametrize("fault", ["busylast", "sleeplast", "busylast-barrier", "sleeplast-barrier"])
def test_a_rank_at_work_after_its_loop_is_not_named_while_the_others_wait(
    processes, tmp_path, baseline, fault
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1's main thread waits 3x the stall threshold after its loop for a thread of its own
    that computes (a save, an upload, an evaluation of its own): its process uses CPU, so it is
    not the hang above. Or it sleeps as long (`time.sleep`, a wait it chose: before, it was named
    and restarted). The others close their sessions, or (`-barrier`) wait for it in a barrier.
    The run ends in its first generation."""
    fault, _, barrier = fault.partition("-")
    job = Job(processes, tmp_path, fault)
    env = {"FAULT": fault, "FAULT_RANK": "1", "HANG_S": "2", "BUSY_S": "6", "BARRIER": "1" if barrier else ""}
    job.start(env)
    job.wait()
    assert list(job.generations()) == [0], job.logs()
    assert "idle_after_peers_closed" not in job.text() and "idle_while_peers_wait" not in job.text(), (
        job.logs()
    )
    assert _equal(job.final(), baseline)


def test_a_worker_stopped_after_its_last_step_is_continued_to_end_with_the_job(
    processes, tmp_path, baseline
) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 (alone on its node) stops itself (SIGSTOP) after the last step. Nobody waits for it
    in a collective and no node-mate of its ends: before, it stayed stopped, and the job never
    ended. Once a rank of its generation closed its session, its agent continues it, and it ends
    its script with the others, in the first generation."""
    job = Job(processes, tmp_path, "stoplast")
    job.start({"FAULT": "stop", "FAULT_RANK": "1", "FAULT_STEP": "24"})
    job.wait()
    assert list(job.generations()) == [0], job.logs()
    assert "was stopped (SIGSTOP/SIGTSTP); continued it" in job.text(), job.logs()
    assert _equal(job.final(), baseline)


@pytest.fixture(scope="module")
def augmented_baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """An uninterrupted run of the loop that draws noise before each forward, its scheduler
    stepping after every second step only."""
    group = ProcessGroup()
    try:
        job = Job(group, tmp_path_factory.mktemp("rdzv-aug"), "augbase")
        job.start({"AUG": "1", "SCHED_EVERY": "2", "LOADER": "plain"})
        job.wait()
        return job.final()
    finally:
        group.stop_all()


@pytest.mark.parametrize("loader", ["plain", "instrumented"])
def test_a_step_the_scheduler_skips_is_captured_as_it_ended(
    processes, tmp_path, augmented_baseline, loader: str
) -> None:  # type: ignore[no-untyped-def]
    """The scheduler steps after even steps only, and the loop draws augmentation noise before
    each forward. The capture of step 11 waits for a scheduler step that does not come; it was
    taken at step 12's forward, after the loop had drawn step 12's noise, so a restart from it
    drew other noise and ended elsewhere. Now it keeps the random numbers of step 11's end (the
    optimizer's step; with an instrumented loader, step 12's fetch). Rank 1 dies in step 12: the
    job resumes from step 11, bitwise."""
    job = Job(processes, tmp_path, f"skip-{loader}")
    env = {"AUG": "1", "SCHED_EVERY": "2", "LOADER": loader, "FAULT": "midstep", "FAULT_STEP": "12"}
    gens, ctx = _restarted_once(job, env)
    assert ctx["checkpoint_step"] == 11 and gens[1]["start"] == 11, (ctx, gens)
    assert _equal(job.final(), augmented_baseline)
