"""The rendezvous handler in one process: a real TCPStore, threads as agents."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousError

from lm_resiliency.adapters import torchrun as tr
from lm_resiliency.core.rendezvous import state as rs

pytestmark = pytest.mark.timeout(90)


def _params(port: int, tmp: Path, name: str, **conf: Any) -> RendezvousParameters:
    base = {
        "lm_resiliency_restart_context_path": str(tmp / f"ctx-{name}.json"),
        "lm_resiliency_poll_interval_ms": "50",
        # Long enough that a thread agent starved of the CPU on a loaded CI host is not taken for
        # a lost node (it was, at 1.5 s, in a test about something else); tests that lose a node
        # by its heartbeat pass _QUICK_LOSS.
        "lm_resiliency_heartbeat_timeout_ms": "8000",
        "lm_resiliency_join_timeout_ms": "20000",
        "timeout": 900,
        **conf,
    }
    return RendezvousParameters(
        "lm_resiliency", f"127.0.0.1:{port}", "unit-run", 2, 3, local_addr="127.0.0.1", **base
    )


_QUICK_LOSS = {"lm_resiliency_heartbeat_timeout_ms": "1500"}


@pytest.fixture
def store() -> Any:
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield s


def _start_in_order(store: Any, threads: dict[str, threading.Thread]) -> None:
    """Start agents one after the other, each once the previous one registered (arrival order)."""
    control = tr._Control(store, "unit-run")
    for n, t in threads.items():
        t.start()
        for _ in range(400):
            got = control.read() if store.check([control.key("state")]) else None
            if got is not None and n in got[1].nodes:
                break
            threading.Event().wait(0.02)


class _Agents:
    """Agents a, b, c as threads, registered in that order: a and b take the slots, c parks."""

    def __init__(self, store: Any, tmp: Path, names: str = "abc", **conf: Any) -> None:
        self.handlers = {
            n: tr.LmResiliencyRendezvousHandler(_params(store.port, tmp, n, **conf), node_id=n) for n in names
        }
        self.infos: dict[str, Any] = {}
        self.exits: dict[str, Any] = {}
        self.threads = {n: threading.Thread(target=self.run, args=(n,)) for n in names}
        _start_in_order(store, self.threads)
        for n in "ab":
            self.threads[n].join(30)

    def run(self, n: str) -> None:
        try:
            self.infos[n] = self.handlers[n].next_rendezvous()
        except SystemExit as exc:
            self.exits[n] = exc.code
        except RendezvousError as exc:
            self.exits[n] = exc

    def again(self, n: str) -> threading.Thread:
        """n's agent re-enters the rendezvous (its workers stopped)."""
        t = threading.Thread(target=self.run, args=(n,))
        t.start()
        return t

    def shutdown(self) -> None:
        for h in self.handlers.values():
            h.shutdown()


@pytest.fixture
def agents(store: Any, tmp_path: Path) -> Any:
    """Three thread agents; their pulse threads are stopped even when the test fails."""
    group = _Agents(store, tmp_path)
    yield group
    group.shutdown()


@pytest.fixture(autouse=True)
def _own_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    # next_rendezvous exports the worker environment into os.environ: keep it inside this test.
    monkeypatch.setattr(os, "environ", dict(os.environ))


def test_entry_point_is_registered_and_returns_a_creator() -> None:
    from torch.distributed.elastic.rendezvous.registry import handler_registry

    assert "lm_resiliency" in handler_registry._registry
    creator = tr.rendezvous_handler_creator()
    with pytest.raises(ValueError, match="lm_resiliency_restart_context_path is required"):
        creator(RendezvousParameters("lm_resiliency", "127.0.0.1:1", "r", 1, 1))  # reaches create_handler


def test_importing_the_backend_first_loads_its_entry_point_without_a_warning() -> None:
    """Torch's rendezvous package loads every torchrun.handlers entry point when first imported:
    from our module, half-initialized, it logged a traceback (a `RunManager`, `lm-resiliency
    monitor`) and left the backend unregistered in that process."""
    import subprocess
    import sys

    probe = (
        "import lm_resiliency.adapters.torchrun\n"
        "from torch.distributed.elastic.rendezvous.registry import handler_registry\n"
        "print('lm_resiliency' in handler_registry._registry)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    assert "Exception while registering" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"lm_resiliency_restart_context_path": "/tmp/x.json", "bogus_key": "1"}, "unknown key 'bogus_key'"),
        ({}, "lm_resiliency_restart_context_path is required"),
        (
            {"lm_resiliency_restart_context_path": "/x", "lm_resiliency_poll_interval_ms": "fast"},
            "lm_resiliency_poll_interval_ms='fast': expected an integer",
        ),
        (
            {"lm_resiliency_restart_context_path": "/x", "lm_resiliency_heartbeat_timeout_ms": "0"},
            "must be > 0",
        ),
        ({"lm_resiliency_restart_context_path": "/x", "store_type": "etcd"}, "store_type='etcd'"),
        ({"lm_resiliency_restart_context_path": "/x", "is_host": "maybe"}, "is_host='maybe'"),
    ],
)
def test_rdzv_conf_is_validated_and_errors_name_the_key(conf: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tr.parse_conf(conf)


def test_bad_policy_file_fails_with_its_key(tmp_path: Path, store: Any) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text("schema_version = 1\ninterval = 'often'\n")
    with pytest.raises(Exception, match="interval"):
        tr.LmResiliencyRendezvousHandler(
            _params(store.port, tmp_path, "a", lm_resiliency_worker_config=str(bad)), node_id="a"
        )


def test_agents_as_threads_form_restart_and_close(tmp_path: Path, store: Any, agents: Any) -> None:
    handlers, infos, exits, threads = agents.handlers, agents.infos, agents.exits, agents.threads
    assert sorted(infos) == ["a", "b"]  # c registered last: it is the parked standby
    assert {infos[n].rank for n in "ab"} == {0, 1} and infos["a"].world_size == 2
    assert infos["a"].bootstrap_store_info.master_port == infos["b"].bootstrap_store_info.master_port
    assert threads["c"].is_alive()
    assert not (tmp_path / "ctx-a.json").exists()  # no context in generation 0
    assert os.environ["LM_RESILIENCY_GENERATION"] == "0"

    # a's workers fail: a re-enters; b is told to restart through num_nodes_waiting(), then re-enters.
    ta = agents.again("a")
    handlers["b"]._pulse.state = None
    for _ in range(200):
        if handlers["b"].num_nodes_waiting() == 1:
            break
        threading.Event().wait(0.05)
    assert handlers["b"].num_nodes_waiting() == 1
    infos["b"] = handlers["b"].next_rendezvous()
    ta.join(30)
    assert infos["a"].store is not None and handlers["a"]._generation == 1
    ctx = (tmp_path / "ctx-a.json").read_text()
    assert '"generation": 1' in ctx and '"reason_code": "worker_exit"' in ctx
    assert oct((tmp_path / "ctx-a.json").stat().st_mode & 0o777) == "0o600"
    assert handlers["b"].num_nodes_waiting() == 0

    # Success: both pass torch's exit barrier, shutdown closes the run, the standby exits 0.
    for n in "ab":
        infos[n].store.add(tr._TERMINAL_KEY, 1)
    for n in "ab":
        assert handlers[n].shutdown()
    threads["c"].join(30)
    assert exits == {"c": 0}
    assert handlers["a"].is_closed()
    handlers["c"].shutdown()


def test_a_different_policy_is_refused_at_registration(tmp_path: Path, store: Any) -> None:
    p1, p2 = tmp_path / "p1.toml", tmp_path / "p2.toml"
    p1.write_text("schema_version = 1\n")
    p2.write_text("schema_version = 1\n[recovery]\nreplace_node_on = ['sdc']\n")
    a = tr.LmResiliencyRendezvousHandler(
        _params(store.port, tmp_path, "a", lm_resiliency_worker_config=str(p1)), node_id="a"
    )
    b = tr.LmResiliencyRendezvousHandler(
        _params(store.port, tmp_path, "b", lm_resiliency_worker_config=str(p2)), node_id="b"
    )
    a._connect()  # a creates the run with its policy
    with pytest.raises(RendezvousError, match="policy_mismatch"):
        b.next_rendezvous()
    a.shutdown()
    b.shutdown()


def test_lost_leader_is_replaced_by_the_next_oldest_node(tmp_path: Path, store: Any) -> None:
    agents = _Agents(store, tmp_path, **_QUICK_LOSS)
    try:
        handlers, infos, threads = agents.handlers, agents.infos, list(agents.threads.values())
        control = tr._Control(store, "unit-run")
        leader = control.read()[1].leader  # type: ignore[index]
        assert leader == "a"
        handlers["a"]._pulse.stop()  # a's agent "dies": its heartbeat stops
        for _ in range(200):  # b takes the lead, and tells its agent to restart its workers
            if handlers["b"].num_nodes_waiting() == 1:
                break
            threading.Event().wait(0.05)
        s = control.read()[1]  # type: ignore[index]
        assert s.leader == "b" and s.term == 2 and s.phase == rs.RESTARTING
        info_b = handlers["b"].next_rendezvous()  # b's agent re-enters; the standby fills a's slot
        threads[2].join(30)
        s = control.read()[1]  # type: ignore[index]
        assert s.generation == 1 and s.slots == ("c", "b"), s
        assert s.history[-1]["failure_kind"] == "node_lost" and s.history[-1]["culprits"] == ["a"]
        assert infos["c"].rank == 0 and info_b.rank == 1  # the standby took the lost node's slot
        control.update(rs.close)
    finally:
        agents.shutdown()


def _shutdown_failing(handler: Any) -> None:
    """torchrun's launch calls shutdown() from a `finally` while the agent's failure is in flight."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    try:
        try:
            raise ChildFailedError("train.py", {0: ProcessFailure(0, 1234, 1, "/nonexistent/error.json")})
        finally:
            handler.shutdown()
    except ChildFailedError:
        pass


def test_a_node_whose_restarts_are_used_up_is_replaced_then_the_run_gives_up(
    tmp_path: Path, store: Any, agents: Any
) -> None:
    """b's agent exits with torchrun's restarts used up: the standby takes b's slot at once, with no
    heartbeat timeout to wait out. When c's are used up too, nobody can take its slot: the run gives
    up, a is told to stop its workers, and its next rendezvous fails with the reason (before: a
    waited for the slot to be filled, for ever)."""
    handlers, threads = agents.handlers, agents.threads
    control = tr._Control(store, "unit-run")
    _shutdown_failing(handlers["b"])
    s = control.read()[1]  # type: ignore[index]
    assert s.phase == rs.RESTARTING and s.slots == ("a", None) and s.pending["culprits"] == ["b"]
    assert s.pending["reason"] == "restarts_exhausted"
    info_a = handlers["a"].next_rendezvous()  # a re-enters; the standby fills b's slot
    threads["c"].join(30)
    s = control.read()[1]  # type: ignore[index]
    assert s.generation == 1 and s.slots == ("a", "c") and info_a.rank == 0 and agents.infos["c"].rank == 1
    _shutdown_failing(handlers["c"])
    assert control.read()[1].phase == rs.CLOSED  # type: ignore[index]
    for _ in range(200):  # a's pulse sees the closed run
        if handlers["a"].num_nodes_waiting() == 1:
            break
        threading.Event().wait(0.05)
    assert handlers["a"].num_nodes_waiting() == 1
    with pytest.raises(
        RendezvousError, match=r"gave up: node c left the run \(its workers failed and torchrun"
    ):
        handlers["a"].next_rendezvous()


def test_a_restart_waiting_for_a_lost_node_with_no_standby_gives_up_after_the_join_timeout(
    tmp_path: Path, store: Any
) -> None:
    """No standby, and b's node is lost: the restart waits for b's slot to be filled (b's agent may
    come back on its machine) for the join timeout, then the run gives up and a's next rendezvous
    fails with the reason (before: a waited for ever)."""
    group = _Agents(store, tmp_path, names="ab", lm_resiliency_join_timeout_ms="3000", **_QUICK_LOSS)
    try:
        handlers = group.handlers
        control = tr._Control(store, "unit-run")
        handlers["b"]._pulse.stop()
        for _ in range(400):
            if control.read()[1].phase == rs.CLOSED:  # type: ignore[index]
                break
            threading.Event().wait(0.05)
        assert handlers["a"].num_nodes_waiting() == 1
        with pytest.raises(RendezvousError, match=r"gave up: slots \[1\] had no node for 3 s"):
            handlers["a"].next_rendezvous()
    finally:
        group.shutdown()


def test_a_second_live_agent_with_a_node_id_in_use_is_refused_and_the_holder_is_told(
    tmp_path: Path, store: Any, agents: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Hosts cloned from one image share /etc/machine-id. Before, a second agent with b's id
    registered as b, and the run waited for its missing node without a word. Now it is refused with
    the fix, b's log says so, and the run's state is b's as before."""
    control = tr._Control(store, "unit-run")
    before = control.read()[1]  # type: ignore[index]
    clone = tr.LmResiliencyRendezvousHandler(_params(store.port, tmp_path, "clone"), node_id="b")
    with pytest.raises(
        RendezvousError,
        match=r"\[duplicate_node_id\] node id 'b' in run unit-run: a live agent holds it \(host .*, "
        r"pid \d+, address 127.0.0.1\)\. .*/etc/machine-id.*LM_RESILIENCY_MACHINE_ID_PATH",
    ):
        clone.next_rendezvous()
    assert control.read()[1] == before  # type: ignore[index]
    assert json.loads(store.get(control.key("owner/b"))) == json.loads(agents.handlers["b"].claim)
    for _ in range(200):
        if any("asked for it and was refused" in r.getMessage() for r in caplog.records):
            break
        threading.Event().wait(0.05)
    told = [r.getMessage() for r in caplog.records if "asked for it and was refused" in r.getMessage()]
    assert len(told) == 1 and f"pid {os.getpid()}" in told[0] and told[0].startswith("node id 'b'")
    clone.shutdown()
    # b's agent is restarted later: the refusal its predecessor logged is not logged again.
    agents.handlers["b"]._pulse.stop()
    again = tr.LmResiliencyRendezvousHandler(_params(store.port, tmp_path, "b2"), node_id="b")
    again._claim_node_id(again._connect())
    assert again.refused_seen == clone.claim
    control.update(rs.close)
    agents.threads["c"].join(30)


def test_an_agent_restarted_on_its_node_takes_over_the_id_from_its_dead_or_closed_predecessor(
    tmp_path: Path, store: Any, agents: Any
) -> None:
    """b's agent dies (its heartbeat stops): the agent that replaces it on b's machine claims b's
    id. A clean exit releases the id: the next agent claims it at once."""
    control = tr._Control(store, "unit-run")
    key = control.key("owner/b")
    agents.handlers["b"]._pulse.stop()
    again = tr.LmResiliencyRendezvousHandler(_params(store.port, tmp_path, "b2"), node_id="b")
    again._claim_node_id(again._connect())
    assert store.get(key).decode() == again.claim != agents.handlers["b"].claim
    agents.handlers["a"].shutdown()
    assert store.get(control.key("owner/a")) == b""
    fresh = tr.LmResiliencyRendezvousHandler(_params(store.port, tmp_path, "a2"), node_id="a")
    fresh._claim_node_id(fresh._connect())
    assert store.get(control.key("owner/a")).decode() == fresh.claim
    control.update(rs.close)
    agents.threads["c"].join(30)


def test_manager_reads_decisions_and_publishes_a_replacement(tmp_path: Path, store: Any, agents: Any) -> None:
    from lm_resiliency.manager import RunManager

    handlers, by_name = agents.handlers, agents.threads
    m = RunManager(f"127.0.0.1:{store.port}", "unit-run")
    assert m.state()["generation"] == 0 and m.decisions()[-1]["slots"] == ["a", "b"]
    with pytest.raises(ValueError, match="unknown nodes"):
        m.publish_plan("replace", culprits=["zz"])
    with pytest.raises(ValueError, match="action"):
        m.publish_plan("reboot")
    out = m.publish_plan("replace", culprits=["b"], failure_kind="hardware", reason="ecc")
    assert out["phase"] == rs.RESTARTING and out["excluded"] == {"b": "hardware"}
    assert m.incidents()[-1]["failure_kind"] == "hardware"
    for _ in range(200):  # both agents are told to restart their workers
        if handlers["a"].num_nodes_waiting() == 1 and handlers["b"].num_nodes_waiting() == 1:
            break
        threading.Event().wait(0.05)
    ta = agents.again("a")
    with pytest.raises(SystemExit):  # b is quarantined: it parks until the run closes
        tb_control = tr._Control(store, "unit-run")
        threading.Timer(2.0, lambda: tb_control.update(rs.close)).start()
        handlers["b"].next_rendezvous()
    ta.join(30)
    by_name["c"].join(30)
    assert m.decisions()[-1]["slots"] == ["a", "c"] and m.decisions()[-1]["failure_kind"] == "hardware"
    for h in handlers.values():
        h.shutdown()


def _restarting(group: _Agents, store: Any) -> rs.RdzvState:
    """The run's state once agent a was told to restart its workers (a verdict was acted on)."""
    for _ in range(200):
        if group.handlers["a"].num_nodes_waiting() == 1:
            break
        threading.Event().wait(0.05)
    s = tr._Control(store, "unit-run").read()[1]  # type: ignore[index]
    assert s.phase == rs.RESTARTING, s
    return s  # type: ignore[no-any-return]


@pytest.mark.parametrize("policy", ["replace", "default", "report"])
def test_a_slow_node_is_replaced_or_restarted_as_the_policy_says(
    tmp_path: Path, store: Any, policy: str
) -> None:
    """A confirmed straggler (the job still trains) replaces its node where `replace_node_on` lists
    its kind and a standby is parked. By default (`restart_in_place_on`, FAILURES.md's action for a
    `delay`) it restarts the group in place, nobody quarantined: before, it was only reported and
    the campaign's delay ended in no action. With neither, it is only reported: the data-loader
    stall posted after it, which its peers wait on (the job stopped), is what restarts the job."""
    from lm_resiliency.runtime.control import ControlChannel

    text = {
        "replace": "replace_node_on = ['sdc', 'straggler']\n",
        "default": "replace_node_on = ['sdc']\n",
        "report": "replace_node_on = ['sdc']\nrestart_in_place_on = []\n",
    }[policy]
    path = tmp_path / "policy.toml"
    path.write_text(f"schema_version = 1\n[recovery]\n{text}")
    group = _Agents(store, tmp_path, lm_resiliency_worker_config=str(path))
    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    try:
        slow = {"kind": "straggler", "straggler_type": "compute", "failed_ranks": [1], "confidence": 1.0}
        ch.post_verdict(0, slow)
        stopped = {"kind": "data_stall", "reason": "dataloader_stalled_peers_wait", "failed_ranks": [0]}
        ch.post_verdict(0, stopped)
        assert ch.flush(10)
        s = _restarting(group, store)
        if policy == "replace":
            assert s.pending["failure_kind"] == "straggler" and s.pending["culprits"] == ["b"], s.pending
            assert s.excluded == {"b": "straggler"}
        elif policy == "default":
            assert s.pending["failure_kind"] == "straggler" and s.pending["culprits"] == ["b"], s.pending
            assert s.excluded == {} and not s.pending["quarantine"]
        else:
            assert s.pending["failure_kind"] == "data_stall" and s.pending["culprits"] == ["a"], s.pending
            assert s.excluded == {}
    finally:
        ch.close()
        tr._Control(store, "unit-run").update(rs.close)
        group.threads["c"].join(30)  # the parked standby leaves when the run closes
        group.shutdown()
    assert group.exits == {"c": 0}


@pytest.mark.parametrize("slow", ["straggler", "stall its peers wait on"])
def test_a_node_slow_again_after_its_restart_in_place_is_replaced_by_a_parked_standby(
    tmp_path: Path, store: Any, agents: Any, slow: str
) -> None:
    """The default policy restarts in place for a straggler (once) and for a data-loader stall its
    peers wait on (a failure). When the same node is named again in a later generation (the node
    is slow, not its process) and a standby is parked, the standby takes its slot and the node is
    quarantined. Before, a second straggler verdict was only reported: the run went on at the slow
    node's pace with the standby idle (outsider 56, a node whose rank took 150 ms more per step,
    named at steps 13 and 16); and a node whose loader stalled for 14 s in every generation was
    restarted in place 30 times in 40 steps (388 s; now 39 s)."""
    from lm_resiliency.runtime.control import ControlChannel

    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    control = tr._Control(store, "unit-run")
    handlers = agents.handlers
    kind = "straggler" if slow == "straggler" else "data_stall"
    verdict = (
        {"kind": kind, "straggler_type": "compute", "failed_ranks": [1], "confidence": 1.0}
        if slow == "straggler"
        else {"kind": kind, "reason": "dataloader_stalled_peers_wait", "failed_ranks": [1]}
    )
    try:
        ch.post_verdict(0, verdict)
        assert ch.flush(10)
        s = _restarting(agents, store)
        assert s.pending["culprits"] == ["b"] and s.excluded == {} and not s.pending["quarantine"]
        ta, tb = agents.again("a"), agents.again("b")
        ta.join(30)
        tb.join(30)
        s = control.read()[1]  # type: ignore[index]
        assert s.generation == 1 and s.slots == ("a", "b") and s.standbys == ("c",), s
        # Another node slow once: its own restart in place, nobody quarantined.
        ch.post_verdict(1, {**verdict, "failed_ranks": [0]})
        assert ch.flush(10)
        s = _restarting(agents, store)
        assert s.pending["culprits"] == ["a"] and s.excluded == {}, s.pending
        ta, tb = agents.again("a"), agents.again("b")
        ta.join(30)
        tb.join(30)
        ch.post_verdict(2, verdict)  # b slow again
        assert ch.flush(10)
        for _ in range(200):
            s = control.read()[1]  # type: ignore[index]
            if s.phase == rs.RESTARTING:
                break
            threading.Event().wait(0.05)
        assert s.pending["failure_kind"] == kind and s.pending["culprits"] == ["b"], s.pending
        assert s.excluded == {"b": kind}, s
        ta = agents.again("a")
        with pytest.raises(SystemExit):  # b is quarantined: it parks until the run closes
            threading.Timer(2.0, lambda: tr._Control(store, "unit-run").update(rs.close)).start()
            handlers["b"].next_rendezvous()
        ta.join(30)
        agents.threads["c"].join(30)
        assert agents.infos["c"] is not None  # c took b's slot
    finally:
        ch.close()
        control.update(rs.close)


@pytest.mark.parametrize("named", [[1], [0, 1]])
def test_an_sdc_named_on_every_node_restarts_them_in_place(store: Any, agents: Any, named: list[int]) -> None:
    """An SDC naming one node's rank replaces that node by the parked standby. One naming a rank
    of every node (two replicas each alone in its value: `params_fingerprint_lone`) keeps them in
    their slots: each node holds the others' replicas, and new nodes in every slot would have
    found no copy in memory (outsider 57: both nodes replaced, the run restarted from step 0)."""
    from lm_resiliency.runtime.control import ControlChannel

    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    control = tr._Control(store, "unit-run")
    verdict = {"kind": "sdc", "reason": "params_fingerprint_lone", "failed_ranks": named, "confidence": 1.0}
    try:
        ch.post_verdict(0, verdict)
        assert ch.flush(10)
        s = _restarting(agents, store)
        if named == [1]:
            assert s.pending["culprits"] == ["b"] and s.pending["quarantine"] and s.excluded == {"b": "sdc"}
        else:
            assert s.pending["culprits"] == ["a", "b"] and not s.pending["quarantine"] and s.excluded == {}
            assert s.pending["failure_kind"] == "sdc", s.pending  # (the plan restores a certified step)
    finally:
        ch.close()
        control.update(rs.close)


def test_workers_post_what_the_job_trains_through_only_where_the_policy_acts_on_it() -> None:
    from lm_resiliency.api import _actionable
    from lm_resiliency.config import DEFAULT_RESTART_IN_PLACE_ON, ConfigError, RecoveryPolicyConfig

    slow = {"kind": "straggler", "failed_ranks": [1], "straggler_type": "compute"}
    assert not _actionable(slow)  # reported to the script's callbacks, not to the leader
    assert _actionable(slow, frozenset({"straggler"}))
    assert not _actionable({"kind": "data_stall", "failed_ranks": [1]}, frozenset({"straggler"}))
    assert _actionable({"kind": "sdc", "failed_ranks": [1]})
    # Ranks left waiting in mismatched collectives: before, no action, and the job waited for the
    # process group's timeout.
    assert _actionable({"kind": "collective_desync", "failed_ranks": [1]})
    # By default a slow rank, a damaged checkpoint copy, a failing disk and a chunk corrupted in
    # flight restart in place (FAILURES.md); a slow checkpoint write is only reported.
    default = frozenset(RecoveryPolicyConfig().restart_in_place_on)
    assert default == frozenset(DEFAULT_RESTART_IN_PLACE_ON)
    for kind in ("straggler", "data_stall", "checkpoint_corruption", "io_error", "payload_corruption"):
        assert _actionable({"kind": kind, "failed_ranks": [1]}, default), kind
    assert not _actionable({"kind": "checkpoint_stall", "failed_ranks": [1]}, default)
    with pytest.raises(ConfigError, match=r"restart_in_place_on.*'hang'"):
        RecoveryPolicyConfig(restart_in_place_on=("hang",))


def test_a_kind_the_job_trains_through_restarts_in_place_once_per_culprit() -> None:
    """A second straggler verdict on the node a restart was already made for is only reported (a
    restart in place did not make it faster, another will not); another node, or another kind on
    the same node, restarts, up to RESTART_IN_PLACE_MAX restarts for a kind."""
    node = {n: rs.NodeInfo(n, i, "127.0.0.1", 2) for i, n in enumerate("ab")}
    s = rs.RdzvState("nonce", 2, 2, generation=1, phase=rs.RUNNING, slots=("a", "b"), nodes=node, leader="a")
    s = dataclasses.replace(
        s,
        history=(
            {"generation": 1, "failure_kind": "straggler", "reason": "compute_straggler", "culprits": ["b"]},
        ),
    )
    assert rs.restarted_for(s, "straggler", {"b"})
    assert not rs.restarted_for(s, "straggler", {"a"})
    assert not rs.restarted_for(s, "straggler", {"a", "b"})
    assert not rs.restarted_for(s, "io_error", {"b"})
    # A folder every node shares turned read-only: each node reports it, in turn. Three restarts
    # in place for a kind at most, whoever reports it next.
    entry = {"failure_kind": "io_error", "reason": "durable_probe_failed"}
    storm = dataclasses.replace(s, history=tuple({**entry, "culprits": [n]} for n in "abc"))
    assert rs.restarted_for(storm, "io_error", {"d"}) and not rs.restarted_for(storm, "straggler", {"d"})


def test_a_slow_node_without_a_standby_keeps_training() -> None:
    """Replacing a slow node needs a parked standby for its slot: a restart in place would not make
    it faster, so without one the verdict changes nothing (a failure kind still restarts)."""
    node = {n: rs.NodeInfo(n, i, "127.0.0.1", 2) for i, n in enumerate("abc")}
    s = rs.RdzvState("nonce", 2, 3, generation=0, phase=rs.RUNNING, slots=("a", "b"), nodes=node, leader="a")
    args = (0, "straggler", "compute_straggler", {"b"}, True, "")
    assert rs.replace_with_standbys(s, *args) == s
    parked = dataclasses.replace(s, standbys=("c",))
    out = rs.replace_with_standbys(parked, *args)
    assert out.phase == rs.RESTARTING and out.excluded == {"b": "straggler"}


def test_control_channel_sends_off_the_callers_thread_and_never_blocks_them(store: Any) -> None:
    import json
    import time

    from lm_resiliency.runtime.control import ControlChannel

    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    for step in range(5):  # only the newest inventory matters
        ch.publish_inventory(3, {"local": [step]})
    ch.post_verdict(2, {"kind": "sdc", "failed_ranks": [1]})
    ch.post_verdict(2, {"kind": "hang", "failed_ranks": [0]})
    assert ch.flush(10)
    assert json.loads(store.get("lmr/unit-run/inv/3")) == {"local": [4]}
    assert store.add("lmr/unit-run/verdicts/g2/n", 0) == 2
    kinds = {json.loads(store.get(f"lmr/unit-run/verdicts/g2/{i}"))["kind"] for i in range(2)}
    assert kinds == {"sdc", "hang"}
    ch.close()
    with pytest.raises(ValueError, match="LM_RESILIENCY_CONTROL_STORE"):
        ControlChannel("127.0.0.1:1", "unit-run")
    # Nothing listens here: handing values over still returns at once, and close() does not hang.
    dead = ControlChannel("tcp://127.0.0.1:1", "unit-run", timeout_s=1.0)
    t0 = time.monotonic()
    dead.publish_inventory(0, {"local": [1]})
    dead.post_verdict(0, {"kind": "sdc"})
    assert time.monotonic() - t0 < 0.1
    dead.close()


def test_a_beating_rank_is_heard_through_the_store_until_its_line_is_muted(store: Any) -> None:
    """A rank that beats bumps its counter in the store every BEAT_S; a peer reads it (`alive`), 0
    for one that never beat. Muted (a campaign's partition cuts this line too), it sends nothing:
    no beats, and a verdict handed over waits (flush times out) until the mute ends."""
    from lm_resiliency.runtime.control import BEAT_S, ControlChannel

    at = f"tcp://127.0.0.1:{store.port}"
    beating, reader = ControlChannel(at, "unit-run"), ControlChannel(at, "unit-run")
    try:
        assert reader.alive([3, 5]) == {3: 0, 5: 0}
        beating.beat(3)
        deadline = time.monotonic() + 30
        while reader.alive([3])[3] < 2:
            assert time.monotonic() < deadline, "no beats in the store"
            threading.Event().wait(0.05)
        beating.mute(60.0)
        before = reader.alive([3])[3]
        beating.post_verdict(0, {"kind": "sdc", "failed_ranks": [1]})
        assert not beating.flush(timeout=2.5 * BEAT_S)
        assert reader.alive([3])[3] <= before + 1  # (a beat already on its way when muted)
        assert store.add("lmr/unit-run/verdicts/g0/n", 0) == 0
        beating.mute(0.0)
        assert beating.flush(10) and store.add("lmr/unit-run/verdicts/g0/n", 0) == 1
    finally:
        beating.close()
        reader.close()
    nobody = ControlChannel("tcp://127.0.0.1:1", "unit-run", timeout_s=1.0)
    try:
        assert nobody.alive([0]) == {}
    finally:
        nobody.close()  # (its thread would outlive the test)


def test_control_channel_flush_waits_for_the_send_not_only_for_the_hand_over() -> None:
    """A worker drains its checkpoints and dies right after (a fault, a preemption): the newest
    inventory must be in the store by then, or the leader restarts the group a step further back."""
    import socket

    from lm_resiliency.runtime.control import ControlChannel

    mute = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    ch = ControlChannel(f"tcp://127.0.0.1:{mute.getsockname()[1]}", "unit-run", timeout_s=5.0)
    try:
        ch.publish_inventory(0, {"local": [4]})
        assert not ch.flush(1.0)  # the thread took it long ago, and is still sending it
    finally:
        mute.close()  # the connection is reset: the send fails, and nothing is left to wait for
    assert ch.flush(30.0)
    ch.close()


def test_only_verdicts_sure_of_their_culprit_quarantine_a_node() -> None:
    from lm_resiliency.adapters.torchrun import _quarantines

    replace_on = ("sdc", "hardware")
    assert _quarantines({"kind": "sdc", "failed_ranks": [1], "confidence": 1.0}, replace_on)
    assert _quarantines({"kind": "sdc", "failed_ranks": [1]}, replace_on)  # no confidence given
    # Two replicas that replay could not settle: roll back, keep both nodes.
    assert not _quarantines({"kind": "sdc", "failed_ranks": [0, 1], "confidence": 0.5}, replace_on)
    assert not _quarantines({"kind": "hang", "failed_ranks": [0], "confidence": 1.0}, replace_on)
    # A node cut off is replaced; ranks cut off while their node mates are heard only restart.
    cut_on = ("network_partition",)
    assert _quarantines({"kind": "network_partition", "failed_ranks": [2, 3], "scope": "node"}, cut_on)
    assert not _quarantines({"kind": "network_partition", "failed_ranks": [2], "scope": "rank"}, cut_on)
    # A rank that issued another collective than its replicas is replaced by default; a desync of
    # two replicas (or as many on each side) names them all, sure of none: a restart in place.
    default = tr.DEFAULT_REPLACE_ON
    assert _quarantines({"kind": "collective_desync", "failed_ranks": [2], "confidence": 1.0}, default)
    assert not _quarantines({"kind": "collective_desync", "failed_ranks": [0, 1], "confidence": 0.5}, default)


def test_the_leader_restores_only_a_step_every_replica_group_certified() -> None:
    """Two replica groups (DDP over {0, 2} and {1, 3}, as tensor parallelism makes them): an SDC on
    rank 3 at step 9, named after a replay while the job went on. Its group certified up to 8; the
    healthy group certified its later steps. Every rank holds step 13, certified by the healthy
    group only: taking any rank's certificate for the job's restored rank 3's corrupted copy."""
    node = {n: rs.NodeInfo(n, i, "127.0.0.1", 2) for i, n in enumerate("ab")}
    old = rs.RdzvState(
        "nonce",
        2,
        3,
        generation=0,
        slots=("a", "b"),
        nodes=node,
        pending={"failure_kind": "sdc", "culprits": ["b"]},
    )
    groups = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}

    class Store:
        def __init__(self, certified: dict[int, list[int]]) -> None:
            self.certified = certified

        def json_get(self, key: str) -> Any:
            r = int(key.rsplit("/", 1)[1])
            local = [8, 13] if r % 2 else [13, 14]
            return {
                "local": local,
                "replicas": {},
                "disk": [],
                "certified": self.certified[r],
                "scout": True,
                "group": groups[r],
                "topology": "t",
            }

    plan = tr._Pulse._plan(None, Store({0: [13, 14], 2: [13, 14], 1: [8], 3: [8]}), old, old)  # type: ignore[arg-type]
    assert plan["recovery_mode"] == "recovery_verified" and plan["checkpoint_step"] == -1, plan
    plan = tr._Pulse._plan(None, Store({0: [13, 14], 2: [13], 1: [8, 13], 3: [8]}), old, old)  # type: ignore[arg-type]
    assert plan["checkpoint_step"] == 13, plan


@pytest.mark.parametrize("first", ["kill", "sdc"])
def test_an_sdc_named_while_a_killed_rank_is_handled_restores_a_certified_step(first: str) -> None:
    """Rank 1 (node b) is killed; rank 2 (node c) is named SDC at step 13 a moment before or after
    (both reports reach the leader within one restart). The plan restores a step its groups
    certified (12), not the newest every rank holds (14, holding the corruption), whichever
    report came first; only the SDC's node is quarantined and both kinds are in the plan. Before,
    the kill's report first left the restart at `latest`: the corrupted step 14 was restored."""
    s = rs.RdzvState.new("nonce", 3, 4, "pol")
    for n in "abcd":
        s = rs.register(s, n, f"{n}.addr", 1, "pol")
    s = rs.form(rs.elect(s, "a", set("abcd")), set("abcd"))
    reports = {
        "kill": ("process_failure", "worker_exit", ["b"], False),
        "sdc": ("sdc", "fingerprint_minority", ["c"], True),
    }
    order = [first, *(k for k in reports if k != first)]
    for k in order:
        kind, reason, culprits, quarantine = reports[k]
        s = rs.request_restart(s, 0, kind, reason, culprits, quarantine)
    assert s.pending["failure_kind"] == reports[first][0] and s.pending["culprits"] == ["b", "c"]
    assert rs.also_kinds(s.pending) == [reports[k][0] for k in order]
    assert s.excluded == {"c": "sdc"}

    class Store:
        def json_get(self, key: str) -> Any:
            return {
                "local": [12, 13, 14],
                "replicas": {},
                "disk": [],
                "certified": [11, 12],
                "scout": True,
                "group": [0, 1, 2],
                "topology": "t",
            }

    plan = tr._Pulse._plan(None, Store(), s, s)  # type: ignore[arg-type]
    assert plan["recovery_mode"] == "recovery_verified" and plan["checkpoint_step"] == 12, plan
    assert plan["failure_kinds"] == [reports[k][0] for k in order], plan
    # One kind alone, as before: a kill restores the newest step.
    alone = dataclasses.replace(s, pending={"failure_kind": "process_failure", "culprits": ["b"]})
    plan = tr._Pulse._plan(None, Store(), alone, alone)  # type: ignore[arg-type]
    assert plan["recovery_mode"] == "latest" and plan["checkpoint_step"] == 14, plan


@pytest.mark.parametrize(("stores", "step"), [(("s1", "s1"), 50), (("s1", "s2"), -1), (("", ""), -1)])
def test_a_rank_on_a_new_node_restores_from_a_durable_folder_every_node_shares(
    stores: tuple[str, str], step: int
) -> None:
    """Node b (rank 1) is replaced by standby c after an SDC. The ranks' memory
    copies hold no step in common (their certificates parted while rank 0's messages were
    dropped); every rank wrote step 50 to disk. When both nodes' folders carry the same id
    (shared storage), rank 1's copy there is found from its new node: the restart restores 50.
    Node-local disks (different ids, or none written) leave it out, as before: no step."""
    node = {n: rs.NodeInfo(n, i, "127.0.0.1", 1) for i, n in enumerate("abc")}
    old = rs.RdzvState(
        "nonce", 2, 3, generation=0, slots=("a", "b"), nodes=node, pending={"failure_kind": "sdc"}
    )
    new = dataclasses.replace(old, slots=("a", "c"))

    class Store:
        def json_get(self, key: str) -> Any:
            r = int(key.rsplit("/", 1)[1])
            return {
                "local": [60, 61] if r == 0 else [15, 61],
                "replicas": {},
                "disk": [50],
                "disk_store": stores[r],
                "certified": [50, 60] if r == 0 else [15],
                "scout": True,
                "group": [0, 1],
                "topology": "t",
            }

    plan = tr._Pulse._plan(None, Store(), old, new)  # type: ignore[arg-type]
    assert plan["checkpoint_step"] == step, plan
    if step >= 0:
        assert plan["checkpoint_source"] == "durable" and plan["sources"] == ["disk"], plan


def _trail_run() -> tuple[rs.RdzvState, dict[str, Any], dict[str, Any]]:
    """3 active nodes a, b, c (ranks 0-2) and a standby d, generation 0 running; a trail of rank
    states, and one that entered another collective at the second state."""
    from lm_resiliency.runtime.trail import group_digest

    s = rs.RdzvState.new("nonce", 3, 4, "pol")
    for n in "abcd":
        s = rs.register(s, n, f"{n}.addr", 1, "pol")
    s = rs.form(rs.elect(s, "a", set("abcd")), set("abcd"))
    group = group_digest([0, 1, 2]).hex()
    ok = {"group": group, "states": [[15, "aa" * 8], [16, "bb" * 8]]}
    odd = {"group": group, "states": [[15, "aa" * 8], [16, "cc" * 8]]}
    return s, ok, odd


class _TrailControl:
    """The control store as the leader's pulse uses it: generation 0's published trails by rank."""

    def __init__(self, docs: dict[int, Any], state: rs.RdzvState) -> None:
        self.docs, self.state = docs, state

    def json_get(self, key: str) -> Any:
        assert key.startswith("trail/g0/"), key
        return self.docs.get(int(key.rsplit("/", 1)[1]))

    def update(self, fn: Any) -> rs.RdzvState:
        self.state = fn(self.state)
        return self.state


def test_the_leader_names_the_rank_whose_trail_shows_another_collective() -> None:
    """Generation 0 restarted for its workers' exits (node c's worker was aborted first); every node
    is back with its workers' trails published. Rank 1 (node b) entered another collective: the
    restart becomes b's collective desync, b quarantined. A malformed or missing trail is left out
    (two replicas left that differ: both named, nobody quarantined); a restart for anything else,
    or one already judged, is not looked at."""
    from types import SimpleNamespace

    s, ok, odd = _trail_run()
    exited = rs.arrive(rs.arrive(rs.arrive(s, "c", 0), "a", 0), "b", 0)

    def judge(docs: dict[int, Any], state: rs.RdzvState = exited, judged: int = -1) -> rs.RdzvState:
        h = SimpleNamespace(run_id="r", node_id="a", replace_on=tr.DEFAULT_REPLACE_ON)
        pulse = SimpleNamespace(h=h, _trails_judged=judged)
        pulse._trails_due = lambda s: tr._Pulse._trails_due(pulse, s)  # type: ignore[arg-type]
        return tr._Pulse._judge_trails(pulse, _TrailControl(docs, state), state)  # type: ignore[arg-type]

    got = judge({0: ok, 1: odd, 2: ok})
    assert got.pending["failure_kind"] == "collective_desync" and got.pending["culprits"] == ["b"]
    assert got.pending["reason"] == "collective_sequence_minority" and got.excluded == {
        "b": "collective_desync"
    }
    for bad in (
        None,
        [1, 2],
        {"group": 5, "states": []},
        {"group": ok["group"], "states": [[1]]},
        {"states": "zz"},
    ):
        got = judge({0: ok, 1: bad, 2: odd})
        assert got.pending["failure_kind"] == "collective_desync" and got.pending["culprits"] == ["a", "c"]
        assert got.pending["reason"] == "collective_sequence_no_majority" and got.excluded == {}
    assert judge({0: ok, 1: ok, 2: ok}) == exited  # the same collectives: the exit stands
    assert judge({0: ok, 1: odd, 2: ok}, judged=0) == exited
    hang = rs.request_restart(s, 0, "hang", "never_entered_collective", ["c"])
    hang = rs.arrive(rs.arrive(rs.arrive(hang, "c", 0), "a", 0), "b", 0)
    assert judge({0: ok, 1: odd, 2: ok}, hang) == hang
    waiting = rs.arrive(s, "c", 0)  # a and b still stop their workers: their trails are not final
    assert judge({0: ok, 1: odd, 2: ok}, waiting) == waiting


def test_a_node_arriving_between_the_leaders_read_and_update_still_has_the_trails_judged() -> None:
    """The leader's tick reads the state (b's agent not back yet: no trails to judge), then b
    arrives, then the tick's update would publish generation 1: a process failure of the rank gloo
    aborted, restarted in place. It waits a tick instead; the next one judges the trails and names
    b. Before, the culprit of a mismatched collective went unnamed (CI, 1 run in several)."""
    from types import SimpleNamespace

    s, ok, odd = _trail_run()
    read = rs.arrive(rs.arrive(s, "c", 0), "a", 0)
    control = _TrailControl({0: ok, 1: odd, 2: ok}, rs.arrive(read, "b", 0))  # b came after the read

    h = SimpleNamespace(run_id="r", node_id="a", replace_on=tr.DEFAULT_REPLACE_ON, heartbeat_timeout_s=5.0)
    pulse = SimpleNamespace(
        h=h,
        _trails_judged=-1,
        _liveness=SimpleNamespace(dead=lambda now: set()),
        _apply_verdicts=lambda control, s: s,
        _plan=lambda control, cur, formed: {"checkpoint_step": 9},
        _wait_for_lost_nodes=lambda control, s, now: s,
    )
    pulse._judge_trails = lambda control, s: tr._Pulse._judge_trails(pulse, control, s)  # type: ignore[arg-type]
    pulse._trails_due = lambda s: tr._Pulse._trails_due(pulse, s)  # type: ignore[arg-type]
    got = tr._Pulse._lead(pulse, control, read, 0.0)  # type: ignore[arg-type]
    assert got.phase == rs.RESTARTING and got.generation == 0, got.history
    got = tr._Pulse._lead(pulse, control, control.state, 0.5)  # type: ignore[arg-type]
    assert got.phase == rs.RUNNING and got.generation == 1, got
    entry = got.history[-1]
    assert entry["failure_kind"] == "collective_desync" and entry["culprits"] == ["b"], entry
    assert entry["admitted"] == [{"slot": 1, "node": "d"}], entry


def test_a_worker_reads_whether_the_leader_is_restarting_its_generation(store: Any) -> None:
    """A rank that sees peers go with "terminated" while its own group carries on asks the store:
    under a restart the leader began (another replica group's SDC, which this rank never heard of),
    they were stopped by it and are not reported as failed processes."""
    import dataclasses

    from lm_resiliency.runtime.control import ControlChannel

    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    control = tr._Control(store, "unit-run")
    try:
        assert ch.restart_culprits(2) is None  # no rendezvous state at all
        running = dataclasses.replace(rs.RdzvState.new("nonce", 1, 2), generation=2, phase=rs.RUNNING)
        control.init(running)
        assert ch.restart_culprits(2) is None
        why = {"failure_kind": "process_failure", "culprits": ["node-b"]}
        control.update(lambda s: dataclasses.replace(s, phase=rs.RESTARTING, pending=why))
        assert ch.restart_culprits(2) == {"node-b"} and ch.restart_culprits(3) is None
        # On a verdict, the culprits' workers were stopped by the restart too: none went by itself.
        why = {"failure_kind": "hang", "culprits": ["node-b"]}
        control.update(lambda s: dataclasses.replace(s, pending=why))
        assert ch.restart_culprits(2) == set()
        control.update(lambda s: dataclasses.replace(s, pending={**why, "also": ["process_failure"]}))
        assert ch.restart_culprits(2) == {"node-b"}
        published = {"generation": 3, "failure_kind": "process_failure", "culprits": ["node-b"]}
        control.update(lambda s: dataclasses.replace(s, generation=3, phase=rs.RUNNING, history=(published,)))
        assert ch.restart_culprits(2) == {"node-b"}  # a worker of generation 2 still going
        assert ch.restart_culprits(3) is None
        published = {"generation": 3, "failure_kind": "sdc", "culprits": ["node-b"]}
        control.update(lambda s: dataclasses.replace(s, history=(published,)))
        assert ch.restart_culprits(2) == set()
    finally:
        ch.close()
    dead = ControlChannel("tcp://127.0.0.1:1", "unit-run")
    assert dead.restart_culprits(0) is None  # nothing listens: not known to restart
    dead.close()


@pytest.mark.parametrize(
    ("names", "scope", "confidence", "excluded"),
    [
        ("abc", "node", 1.0, {"b": "network_partition"}),  # a node cut off, a standby parked: replaced
        ("ab", "node", 1.0, {}),  # no standby: restarted in place (a link that flapped may work again)
        ("abc", "rank", 1.0, {}),  # a rank's messages dropped while its node mate is heard: restarted
        ("abc", "node", 0.5, {}),  # a reporter that may be the one cut off: restarted, nobody out
    ],
)
def test_a_node_cut_off_is_replaced_only_when_sure_and_a_standby_can_take_its_slot(
    tmp_path: Path, store: Any, names: str, scope: str, confidence: float, excluded: dict[str, str]
) -> None:
    from lm_resiliency.config import RecoveryPolicyConfig
    from lm_resiliency.runtime.control import ControlChannel

    # No worker policy: the backend's default is the policy's.
    assert RecoveryPolicyConfig().replace_node_on == tr.DEFAULT_REPLACE_ON
    group = _Agents(store, tmp_path, names)
    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    control = tr._Control(store, "unit-run")
    for _ in range(400):  # c parked (its registration may lag a and b's under load)
        if "c" not in names or "c" in control.read()[1].standbys:  # type: ignore[index]
            break
        threading.Event().wait(0.02)
    try:
        cut = {"kind": "network_partition", "scope": scope, "failed_ranks": [1], "confidence": confidence}
        ch.post_verdict(0, {**cut, "reason": "node_unreachable"})
        assert ch.flush(10)
        s = _restarting(group, store)
        assert s.pending["failure_kind"] == "network_partition" and s.pending["culprits"] == ["b"], s.pending
        assert s.excluded == excluded
    finally:
        ch.close()
        tr._Control(store, "unit-run").update(rs.close)
        if "c" in names:
            group.threads["c"].join(30)  # the parked standby leaves when the run closes
        group.shutdown()


def test_monitor_shows_the_runs_nodes_copies_incidents_and_generations(
    tmp_path: Path, store: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lm-resiliency monitor` reads a live run's control store: roles and agent liveness, each
    rank's copies from the inventories its workers posted, the verdicts posted in this generation,
    the generations published; it stops by itself when the run closes."""
    from lm_resiliency.cli.main import main
    from lm_resiliency.runtime.control import ControlChannel

    monkeypatch.setitem(os.environ, "LOCAL_WORLD_SIZE", "2")
    group = _Agents(store, tmp_path)
    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    endpoint = f"127.0.0.1:{store.port}"
    try:
        inv = {"local": [3, 4], "replicas": {"2": [4]}, "disk": [2], "certified": [3], "generation": 0}
        for r, doc in (  # (a channel sends a rank's newest inventory only: one at a time)
            (0, inv),
            (2, {**inv, "local": [4, 5], "replicas": {"0": [3, 4]}, "disk": []}),
            (3, {"local": "garbage", "replicas": [1]}),  # malformed: shown empty
        ):
            ch.publish_inventory(r, doc)
            assert ch.flush(10)
        # (a slow checkpoint write: only reported, the run stays as it is)
        ch.post_verdict(0, {"kind": "checkpoint_stall", "failed_ranks": [3], "reason": "slow_write"})
        assert ch.flush(10)
        assert (
            main(["monitor", endpoint, "--run-id", "unit-run", "--once", "--json", "--interval", "0.3"]) == 0
        )
        snap = json.loads(capsys.readouterr().out)
        assert (snap["phase"], snap["generation"], snap["leader"], snap["world_size"]) == (
            "running",
            0,
            "a",
            4,
        )
        roles = {n["node"]: (n["role"], n["ranks"], n["live"]) for n in snap["nodes"]}
        assert roles == {
            "a": ("slot 0", [0, 1], True),
            "b": ("slot 1", [2, 3], True),
            "c": ("standby", [], True),
        }
        ranks = {r["rank"]: r for r in snap["ranks"]}
        assert ranks[0]["local"] == [3, 4] and ranks[0]["replicated"] == [3, 4] and ranks[0]["disk"] == [2]
        assert ranks[0]["newest"] == 4 and ranks[0]["certified"] == [3] and ranks[0]["node"] == "a"
        assert ranks[2]["newest"] == 5 and ranks[2]["replicated"] == [4] and ranks[2]["node"] == "b"
        assert ranks[1] == {"rank": 1, "node": "a", "inventory": False}
        assert ranks[3]["inventory"] and ranks[3]["local"] == [] and ranks[3]["newest"] == -1
        assert [(v["kind"], v["failed_ranks"]) for v in snap["incidents"]] == [("checkpoint_stall", [3])]
        assert [(d["generation"], d["reason"], d["slots"]) for d in snap["decisions"]] == [
            (0, "startup", ["a", "b"])
        ]

        # c's agent stops heart-beating: the next view shows it silent (or gone, once the leader
        # judged it dead); the text view lays out the same facts.
        group.handlers["c"].shutdown()
        assert main(["monitor", endpoint, "--run-id", "unit-run", "--once", "--interval", "2.0"]) == 0
        text = capsys.readouterr().out
        assert "phase running  generation 0  leader a (term" in text
        c_line = [ln for ln in text.splitlines() if ln.startswith("c ")]
        assert not c_line or " SILENT " in c_line[0], text
        assert [ln.split()[:3] for ln in text.splitlines() if ln.startswith("a ")] == [["a", "slot", "0*"]]
        assert "checkpoint_stall   ranks 3" in text and "g0: none (startup)" in text
    finally:
        ch.close()
        tr._Control(store, "unit-run").update(rs.close)
        group.threads["c"].join(30)
        group.shutdown()
    # A closed run: the watch ends by itself, exit 0.
    assert main(["monitor", endpoint, "--run-id", "unit-run", "--interval", "0.1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["phase"] == "closed"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--run-id", "no-such-run"], "no rendezvous state for run 'no-such-run'"),
        (["--run-id", "r", "--interval", "0"], "--interval and --timeout must be > 0"),
        (["--run-id", "r", "--store-type", "file"], "no control store file at "),
    ],
)
def test_monitor_says_what_it_cannot_find(
    tmp_path: Path, store: Any, args: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lm_resiliency.cli.main import main

    endpoint = str(tmp_path / "filestore") if "file" in args else f"127.0.0.1:{store.port}"
    assert main(["monitor", endpoint, *args]) == 2
    assert match in capsys.readouterr().err


def test_monitor_names_an_endpoint_it_cannot_reach(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from lm_resiliency.cli.main import main

    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert main(["monitor", f"127.0.0.1:{port}", "--run-id", "r", "--timeout", "1"]) == 2
    assert f"cannot reach the control store at 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["monitor", "no-port", "--run-id", "r"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("close", "said"),
    [(rs.give_up, "gave up: "), (rs.end_failing, "ended failing: ")],
    ids=["gave-up", "ended-failing"],
)
def test_monitor_exits_1_on_a_run_that_gave_up(
    store: Any, capsys: pytest.CaptureFixture[str], close: Any, said: str
) -> None:
    """A run that gave up, or ended failing (a node failed after others had ended their scripts)."""
    from lm_resiliency.cli.main import main

    control = tr._Control(store, "given-up")
    control.init(rs.RdzvState.new("n0", 1, 2))
    control.update(lambda s: close(s, "slots [0] had no node"))
    assert (
        main(["monitor", f"127.0.0.1:{store.port}", "--run-id", "given-up", "--once", "--interval", "0.1"])
        == 1
    )
    out = capsys.readouterr().out
    assert "phase closed" in out and f"{said}slots [0] had no node" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_agents_waiting_on_a_store_that_vanished_say_so_and_the_standby_exits_cleanly(
    tmp_path: Path, processes: Any
) -> None:
    """The control store's host exits a few seconds after the run closes. A standby that was not
    answering then (SIGSTOPped, or swapped out) wakes to a store that is gone: before, it died with
    a DistNetworkError traceback and rc 1 after a run that ended well. A standby has no workers
    whose outcome it must report: it says the store is gone and exits 0. An agent that had workers
    in the run cannot tell how it ended: it fails, saying so."""
    port = _free_port()
    host = processes.start(
        ["-m", "lm_resiliency.runtime.store_host", "127.0.0.1", str(port), "unit-run"],
        {},
        tmp_path / "host.log",
    )
    deadline = time.monotonic() + 30
    while not tr._port_open("127.0.0.1", port):
        assert time.monotonic() < deadline and host.poll() is None, (tmp_path / "host.log").read_text()
        threading.Event().wait(0.05)
    client = TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    group = _Agents(client, tmp_path)
    try:
        assert sorted(group.infos) == ["a", "b"] and group.threads["c"].is_alive()
        ta = group.again("a")  # a's workers failed: its agent waits for the next generation
        for _ in range(200):
            if tr._Control(client, "unit-run").read()[1].phase == rs.RESTARTING:  # type: ignore[index]
                break
            threading.Event().wait(0.05)
        os.killpg(host.pid, signal.SIGKILL)
        host.wait(timeout=30)
        group.threads["c"].join(30)
        ta.join(30)
        assert not group.threads["c"].is_alive() and not ta.is_alive()
        assert group.exits["c"] == 0, group.exits
        err = group.exits["a"]
        assert isinstance(err, RendezvousError), group.exits
        assert f"control store at 127.0.0.1:{port} is gone" in str(err)
        assert "cannot tell how run unit-run ended" in str(err)
    finally:
        group.shutdown()


def test_an_sdc_posted_while_a_kills_restart_forms_is_applied_and_a_hang_is_not(store: Any) -> None:
    """Rank 1 (node b) was killed and its agent asked for a restart first; the SDC its replicas
    agreed on rank 0 (node a) a moment before reaches the leader's next tick. It is applied: node a
    quarantined, the SDC among the restart's kinds (a certified step). A hang posted then (peers
    stopped by the restart) is not. Before, every verdict but a worker's own exception was dropped
    while the restart formed: an outsider's flipped device kept its slot."""
    from types import SimpleNamespace

    from lm_resiliency.runtime.control import ControlChannel

    s = rs.RdzvState.new("nonce", 2, 4, "pol")
    for n in "abcd":
        s = rs.register(s, n, f"{n}.addr", 1, "pol")
    s = rs.form(rs.elect(s, "a", set("abcd")), set("abcd"))
    assert s.slots == ("a", "b") and s.standbys == ("c", "d")
    s = rs.request_restart(s, 0, "process_failure", "worker_exit", ["b"])
    control = tr._Control(store, "unit-run")
    control.init(s)
    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    ch.post_verdict(0, {"kind": "hang", "failed_ranks": [0], "reason": "never_entered_collective"})
    ch.post_verdict(0, {"kind": "sdc", "failed_ranks": [0], "reason": "grads_fingerprint_minority"})
    assert ch.flush(10)
    ch.close()
    h = SimpleNamespace(
        run_id="unit-run",
        node_id="a",
        replace_on=tr.DEFAULT_REPLACE_ON,
        restart_on=(),
        heartbeat_timeout_s=5.0,
    )
    pulse = SimpleNamespace(h=h, _verdicts_read=(-1, 0), _kept=set(), _destination=lambda s, v, c, q: (q, ""))
    got = tr._Pulse._apply_verdicts(pulse, control, s)  # type: ignore[arg-type]
    assert got.phase == rs.RESTARTING and got.pending["failure_kind"] == "process_failure", got.pending
    assert rs.also_kinds(got.pending) == ["process_failure", "sdc"] and got.pending["culprits"] == ["a", "b"]
    assert got.excluded == {"a": "sdc"}


def test_a_closed_session_waits_until_every_rank_of_its_generation_closed_too(store: Any) -> None:
    """ControlChannel.finish: each rank counts itself closed in its generation and waits for the
    others (or its bound, or `stop`), so a worker whose peer fails later is still there for the
    restart to stop."""
    from lm_resiliency.runtime.control import ControlChannel, finished_key

    chans = [ControlChannel(f"tcp://127.0.0.1:{store.port}", "finish-run") for _ in range(3)]
    got: dict[int, int] = {}
    waiting = [
        threading.Thread(target=lambda r=r: got.__setitem__(r, chans[r].finish(0, 3, 60.0)), daemon=True)
        for r in (0, 1)
    ]
    try:
        for t in waiting:
            t.start()
        reader = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        deadline = time.monotonic() + 30
        while reader.add("lmr/finish-run/" + finished_key(0), 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # polling the store's count
        assert all(t.is_alive() for t in waiting) and got == {}  # rank 2 has not closed yet
        assert chans[2].finish(0, 3, 60.0) == 3
        for t in waiting:
            t.join(30)
        assert got == {0: 3, 1: 3}
        # Another generation counts apart; the bound and `stop` end a wait short of the world.
        t0 = time.monotonic()
        assert chans[0].finish(1, 2, 0.3) == 1 and time.monotonic() - t0 < 10
        assert chans[1].finish(2, 2, 60.0, stop=lambda: True) == 1
    finally:
        for ch in chans:
            ch.close()


def test_a_closed_session_ends_at_once_where_the_store_cannot_be_reached() -> None:
    from lm_resiliency.runtime.control import ControlChannel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    ch = ControlChannel(f"tcp://127.0.0.1:{port}", "finish-run", timeout_s=1.0)
    try:
        assert ch.finish(0, 2, 60.0) == -1
    finally:
        ch.close()


def test_a_workers_exit_that_no_report_named_is_planned_to_be_reported(store: Any) -> None:
    """The exits the agents saw go into the plan, `reported` where a report of the job named the
    rank a failed process (a casualty's report of a kill mid-step, the rank's own of its exception;
    `ControlChannel.name_failed`). A kill after the others left their loops was seen by nobody."""
    from lm_resiliency.runtime.control import ControlChannel

    control = tr._Control(store, "unit-run")
    node = {n: rs.NodeInfo(n, i, "127.0.0.1", 2) for i, n in enumerate("ab")}
    old = rs.RdzvState("nonce", 2, 3, generation=4, slots=("a", "b"), nodes=node)
    assert tr._worker_exits(control, old, {"b"}) == []
    kill = {"rank": 3, "local_rank": 1, "exitcode": -9, "pid": 7, "at": 2.0, "node": "b"}
    store.set(control.key("exits/g4/b"), json.dumps(kill))
    store.set(control.key("exits/g4/a"), json.dumps({"rank": "x"}))  # malformed: left out
    store.set(control.key("exits/g3/a"), json.dumps({**kill, "rank": 0}))  # another generation's
    assert tr._worker_exits(control, old, {"b"}) == [{**kill, "reported": False, "culprit": True}]
    assert tr._worker_exits(control, old, {"a"}) == [{**kill, "reported": False, "culprit": False}]
    channel = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    try:
        channel.name_failed(3, [3])  # another generation's report
        channel.name_failed(4, [2])  # another rank
        assert channel.flush(timeout=10)
        assert tr._worker_exits(control, old, {"b"})[0]["reported"] is False
        channel.name_failed(4, [2, 3])
        assert channel.flush(timeout=10)
        assert tr._worker_exits(control, old, {"b"}) == [{**kill, "reported": True, "culprit": True}]
    finally:
        channel.close()


@pytest.mark.parametrize(
    ("exit_", "reports"),
    [
        ({"rank": 1, "exitcode": -9, "reported": False, "culprit": True}, True),
        ({"rank": 1, "exitcode": 1, "reported": False, "culprit": True}, True),  # after its close
        ({"rank": 1, "exitcode": -9, "reported": True, "culprit": True}, False),  # named already
        ({"rank": 1, "exitcode": -15, "reported": False, "culprit": False}, True),  # its own SIGTERM
        ({"rank": 1, "exitcode": 1, "reported": False, "culprit": False}, False),  # a casualty
        ({"rank": 1, "exitcode": -6, "reported": False, "culprit": False}, False),  # gloo's abort
        ({"rank": "1", "exitcode": -9, "reported": False, "culprit": True}, False),  # malformed
        ({"rank": 1, "exitcode": -9}, False),  # (no flags: an older leader's plan)
    ],
)
def test_a_restart_reports_the_exits_no_report_named_that_were_no_casualties(
    exit_: dict[str, Any], reports: bool
) -> None:
    from lm_resiliency.api import unwatched_exit

    assert unwatched_exit(exit_) is reports


def test_a_culprit_nodes_ranks_its_agent_stopped_are_no_culprits(store: Any) -> None:
    """A worker that saw peers go asks which the restart stopped: those of nodes it is not for, and
    of the culprit's node every rank but the one its agent saw end first (`first_exits`)."""
    from lm_resiliency.api import stopped_by_restart
    from lm_resiliency.runtime.control import ControlChannel, exits_key

    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    channel = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    try:
        assert channel.first_exits(5, {"a"}) == {}  # its agent has not said (yet)
        assert stopped_by_restart([0, 1, 2], nodes.get, {"a"}, {}) == {2}
        control = tr._Control(store, "unit-run")
        store.set(control.key(exits_key(5, "a")), json.dumps({"rank": 0, "exitcode": -15}))
        store.set(control.key(exits_key(5, "b")), "not json")
        first = channel.first_exits(5, {"a", "b", "c"})
        assert first == {"a": 0}
        assert stopped_by_restart([0, 1, 2], nodes.get, {"a"}, first) == {1, 2}
        assert stopped_by_restart([0, 1, 2, 3], nodes.get, {"a", "b"}, first) == {1}
    finally:
        channel.close()


def test_the_store_host_serves_a_closed_run_until_every_node_still_in_it_has_left(store: Any) -> None:
    """Once the run closed, the store host goes as soon as each node still in it (a slot's, a
    standby's, a quarantined one's) has let go of its node id, as its agent does last when it exits;
    a node that never does (its agent killed) holds it `grace_s` at most. Before, it always served
    5 s more: 5 s at the end of every job, and of each torchrun test of the suite."""
    from lm_resiliency.runtime.store_host import _until_every_node_left

    prefix = "lmr/unit-run/"
    doc = {"slots": ["a", None, "b"], "standbys": ["c"], "excluded": {"q": "sdc"}, "nodes": {"gone": []}}
    for n in "abcq":
        store.set(f"{prefix}owner/{n}", "claim")
    waiting = threading.Thread(target=_until_every_node_left, args=(store, prefix, doc, 120.0))
    waiting.start()
    for n in "abc":
        store.set(f"{prefix}owner/{n}", "")
    waiting.join(1.0)
    assert waiting.is_alive()  # q still holds its id
    store.delete_key(f"{prefix}owner/q")  # (as a node that never registered: no claim at all)
    waiting.join(60.0)
    assert not waiting.is_alive()
    store.set(f"{prefix}owner/b", "claim")  # an agent killed before it let go: the grace ends the wait
    t0 = time.monotonic()
    _until_every_node_left(store, prefix, doc, 0.5)
    assert time.monotonic() - t0 >= 0.5


def test_the_step_counts_the_ranks_end_at_are_published_and_read_back(store: Any) -> None:
    """`publish_final` / `finals` (Session._settle compares them): nothing to read when every rank
    ended at one count; where one differs, each rank's count, read once all are there or when the
    wait ends; a count that is not an integer is left out; the final-state digests beside them, a
    malformed one left out."""
    from lm_resiliency.runtime.control import ControlChannel

    ch = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    try:
        assert ch.publish_final(2, 0, 24) and ch.publish_final(2, 1, 24)
        assert ch.finals(2, 2, timeout_s=30.0) == {}  # (agreed)
        assert ch.publish_final(3, 0, 24) and ch.publish_final(3, 1, 25)
        t0 = time.monotonic()
        assert ch.finals(3, 2, timeout_s=30.0) == {0: 24, 1: 25}
        assert time.monotonic() - t0 < 10.0  # (all there: no wait for the deadline)
        store.set("lmr/unit-run/final/g3/r2", "not a step")
        store.add("lmr/unit-run/final/g3/n", 1)
        assert ch.finals(3, 4, timeout_s=0.3) == {0: 24, 1: 25}  # (rank 3: never published)
        assert ch.finals(4, 2, timeout_s=0.1) == {}  # another generation's: none
        assert ch.publish_final(5, 0, 7) and ch.publish_final(5, 2, 8)
        assert ch.finals(5, 3, timeout_s=30.0, stop=lambda: True) == {0: 7, 2: 8}
        # The final-state digests, published with the counts (none where a rank gave none).
        assert ch.publish_final(6, 0, 9, b"\x01\x02") and ch.publish_final(6, 1, 9, b"\x01\x03")
        assert ch.publish_final(6, 2, 9)
        store.set("lmr/unit-run/final/g6/d3", "zz")
        assert ch.finals(6, 4, timeout_s=0.3) == {}
        assert ch.final_digests(6, [0, 1, 2, 3]) == {0: b"\x01\x02", 1: b"\x01\x03"}
        assert ch.final_digests(7, [0, 1]) == {}
    finally:
        ch.close()
