"""The rendezvous state machine: pure transitions with literal values and `now`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_resiliency.core.rendezvous import state as rs

pytestmark = pytest.mark.timeout(60)


def _formed(nodes: list[str], min_nodes: int = 2) -> rs.RdzvState:
    s = rs.RdzvState.new("nonce", min_nodes, len(nodes), "pol")
    for n in nodes:
        s = rs.register(s, n, f"{n}.addr", 2, "pol")
    s = rs.elect(s, nodes[0], set(nodes))
    return rs.form(s, set(nodes))


def test_first_min_nodes_take_slots_the_rest_park_and_generation_zero_forms() -> None:
    s = rs.RdzvState.new("nonce", 2, 4, "pol")
    s = rs.register(s, "a", "ha", 2, "pol")
    assert rs.form(s, {"a"}).phase == rs.FORMING  # not every slot held yet
    for n in "bcd":
        s = rs.register(s, n, f"h{n}", 2, "pol")
    assert s.slots == ("a", "b") and s.standbys == ("c", "d")
    assert rs.role_of(s, "c") == "standby" and rs.role_of(s, "a") == "active"
    s = rs.form(rs.elect(s, "a", {"a", "b", "c", "d"}), {"a", "b", "c", "d"})
    assert s.phase == rs.RUNNING and s.generation == 0 and s.world_size() == 4
    assert s.first_global_rank(1) == 2


def test_a_relaunch_gives_each_node_the_slot_of_the_ranks_whose_copies_it_holds() -> None:
    """Generation 0 of a relaunched run: nodes that hold in-memory copies of ranks (held_rank) take
    those ranks' slots whatever their arrival; the rest fill the other slots in arrival order. A
    claim that does not fit (taken first by another, not a slot's first rank, out of range) is no
    claim. Nodes of different sizes keep arrival order; later generations keep their slots."""

    def formed(held: dict[str, int], size: dict[str, int] | None = None, min_nodes: int = 3) -> rs.RdzvState:
        s = rs.RdzvState.new("nonce", min_nodes, 4, "pol")
        for n, h in held.items():
            s = rs.register(s, n, f"{n}.addr", (size or {}).get(n, 2), "pol", h)
        s = rs.elect(s, next(iter(held)), set(held))
        return rs.form(s, set(held))

    assert formed({"a": 4, "b": 2, "c": 0}).slots == ("c", "b", "a")
    assert formed({"a": -1, "b": 0, "c": -1}).slots == ("b", "a", "c")
    assert formed({"a": 2, "b": 2, "c": 0}).slots == ("c", "a", "b")  # b's claim is a's: first come
    assert formed({"a": 3, "b": 6, "c": 2}).slots == ("a", "c", "b")  # rank 3: no slot's first
    # The fourth node parks as a standby whatever it holds; sizes that differ: arrival order.
    s = formed({"a": -1, "b": -1, "c": -1, "d": 0})
    assert s.slots == ("a", "b", "c") and s.standbys == ("d",)
    assert formed({"a": 2, "b": 0}, {"a": 2, "b": 1}, min_nodes=2).slots == ("a", "b")
    s = formed({"a": 4, "b": 2, "c": 0})
    s = rs.form(rs.arrive(rs.arrive(rs.arrive(s, "a", 0), "b", 0), "c", 0), {"a", "b", "c"})
    assert s.generation == 1 and s.slots == ("c", "b", "a")
    assert rs.decode(rs.encode(s)) == s and s.nodes["a"].held_rank == 4
    # A document without held ranks (an agent of the version before) reads as holding none.
    doc = rs.encode(s).replace('"a.addr",2,4]', '"a.addr",2]')
    assert rs.decode(doc).nodes["a"].held_rank == -1


def test_a_different_policy_is_refused_with_a_reason_code() -> None:
    s = rs.RdzvState.new("nonce", 1, 2, "pol-A")
    with pytest.raises(rs.RendezvousRefused) as info:
        rs.register(s, "x", "hx", 1, "pol-B")
    assert info.value.code == "policy_mismatch" and "same lm_resiliency_worker_config" in str(info.value)


def test_re_registration_after_an_agent_restart_keeps_arrival_and_slot() -> None:
    s = _formed(["a", "b", "c"])
    again = rs.register(s, "b", "hb2", 2, "pol")
    assert again.slots == s.slots and again.nodes["b"].arrival == s.nodes["b"].arrival
    assert again.nodes["b"].addr == "hb2"


def test_worker_exit_restarts_in_place_once_every_holder_arrived() -> None:
    s = _formed(["a", "b", "c"])
    s = rs.arrive(s, "b", 0)  # b's worker died: a restart begins
    assert s.phase == rs.RESTARTING and s.pending["culprits"] == ["b"]
    assert rs.form(s, {"a", "b", "c"}).phase == rs.RESTARTING  # a has not stopped its workers yet
    s = rs.arrive(s, "a", 0)
    s = rs.arrive(s, "a", 0)  # idempotent
    s = rs.form(s, {"a", "b", "c"}, {"checkpoint_step": 7})
    assert s.phase == rs.RUNNING and s.generation == 1 and s.slots == ("a", "b")
    assert s.plan["checkpoint_step"] == 7 and s.history[-1]["failure_kind"] == "process_failure"
    assert rs.arrive(s, "a", 0) == s  # a late report about generation 0 changes nothing


@pytest.mark.parametrize("order", ["exit-first", "words-first"])
def test_a_worker_that_said_why_it_died_names_the_reason_whichever_arrives_first(order: str) -> None:
    s = _formed(["a", "b", "c"])
    said = ("process_failure", "uncaught_exception", ["b"], False, "ValueError: loss is nan")
    if order == "exit-first":
        s = rs.request_restart(rs.arrive(s, "b", 0), 0, *said)
    else:
        s = rs.arrive(rs.request_restart(s, 0, *said), "b", 0)
    assert s.pending["reason"] == "uncaught_exception" and s.pending["error"] == "ValueError: loss is nan"
    assert s.pending["culprits"] == ["b"]
    # Another kind's report in the meantime only widens the culprits; the reason stays.
    s = rs.request_restart(s, 0, "hang", "never_entered_collective", ["a"])
    assert s.pending["reason"] == "uncaught_exception" and s.pending["culprits"] == ["a", "b"]


def test_a_desync_found_in_the_trails_names_its_culprit_instead_of_the_casualty() -> None:
    """c's worker was aborted by gloo (its exit named c); the trails show b entered another
    collective: the restart names b (quarantined, the standby takes its slot), and a late report of
    a worker that died of the broken collective names nobody more. Only a restart for workers' exits
    of that generation is renamed."""
    s = _formed(["a", "b", "c", "d"], min_nodes=3)
    s = rs.arrive(s, "c", 0)
    s = rs.name_desync(s, 0, "collective_sequence_minority", ["b"], quarantine=True)
    assert s.pending["failure_kind"] == "collective_desync" and s.pending["culprits"] == ["b"]
    assert s.pending["reason"] == "collective_sequence_minority" and s.excluded == {"b": "collective_desync"}
    assert rs.request_restart(s, 0, "process_failure", "uncaught_exception", ["a"]) == s
    s = rs.form(rs.arrive(rs.arrive(s, "a", 0), "b", 0), {"a", "b", "c", "d"})
    assert s.slots == ("a", "d", "c") and s.history[-1]["failure_kind"] == "collective_desync"
    # Not quarantined (no majority): restarted in place, both named.
    s = rs.name_desync(
        rs.arrive(_formed(["a", "b"]), "a", 0), 0, "collective_sequence_no_majority", ["a", "b"], False
    )
    assert s.pending["culprits"] == ["a", "b"] and s.excluded == {}
    # Another kind of failure, another generation, or no restart at all: unchanged.
    hang = rs.request_restart(_formed(["a", "b", "c"]), 0, "hang", "never_entered_collective", ["a"])
    assert rs.name_desync(hang, 0, "collective_sequence_minority", ["b"], True) == hang
    exited = rs.arrive(_formed(["a", "b", "c"]), "a", 0)
    assert rs.name_desync(exited, 1, "collective_sequence_minority", ["b"], True) == exited
    running = _formed(["a", "b", "c"])
    assert rs.name_desync(running, 0, "collective_sequence_minority", ["b"], True) == running


def test_lost_node_is_replaced_by_the_oldest_live_standby_in_its_slot() -> None:
    s = _formed(["a", "b", "c", "d"])
    s = rs.mark_dead(s, "a")
    assert s.phase == rs.RESTARTING and s.slots == (None, "b")
    assert s.pending["failure_kind"] == "node_lost"
    s = rs.arrive(s, "b", 0)
    s = rs.form(s, {"b", "c", "d"})
    assert s.slots == ("c", "b") and s.standbys == ("d",) and s.generation == 1
    assert s.history[-1]["admitted"] == [{"slot": 0, "node": "c"}]


def test_peers_exiting_first_do_not_hide_the_lost_node() -> None:
    s = _formed(["a", "b", "c"])
    s = rs.arrive(s, "a", 0)  # a's worker saw its peer die and exited first
    s = rs.mark_dead(s, "b")
    assert s.pending["failure_kind"] == "node_lost" and s.pending["culprits"] == ["b"]


def test_quarantined_culprit_is_excluded_and_replaced() -> None:
    s = _formed(["a", "b", "c"])
    s = rs.request_restart(s, 0, "sdc", "fingerprint_minority", ["b"], quarantine=True)
    assert s.excluded == {"b": "sdc"} and rs.role_of(s, "b") == "quarantined"
    s = rs.arrive(rs.arrive(s, "a", 0), "b", 0)
    s = rs.form(s, {"a", "b", "c"})
    assert s.slots == ("a", "c") and s.generation == 1
    assert rs.register(s, "b", "hb", 2, "pol").slots == s.slots  # coming back does not give it a slot


def test_the_standby_an_orchestrator_chose_takes_the_slot_before_older_ones() -> None:
    """`restart_destination` named standby d (c parked first): d takes b's slot, c stays parked.
    Without a destination, or one that is not a live standby, the oldest does."""
    s = _formed(["a", "b", "c", "d"])
    chosen = rs.request_restart(s, 0, "sdc", "fingerprint_minority", ["b"], True, "", "d")
    assert chosen.pending["destination"] == "d"
    formed = rs.form(rs.arrive(rs.arrive(chosen, "a", 0), "b", 0), {"a", "b", "c", "d"})
    assert formed.slots == ("a", "d") and formed.standbys == ("c",), formed
    assert formed.history[-1]["admitted"] == [{"slot": 1, "node": "d"}] and formed.pending == {}
    for dest in ("", "gone"):
        plain = rs.request_restart(s, 0, "sdc", "fingerprint_minority", ["b"], True, "", dest)
        assert rs.form(rs.arrive(rs.arrive(plain, "a", 0), "b", 0), {"a", "b", "c", "d"}).slots == ("a", "c")


def test_a_culprit_no_standby_can_replace_restarts_in_place_instead_of_waiting_for_ever() -> None:
    """The only standby replaced b after an SDC; then a is found corrupt too. Nobody can take a's
    slot: a keeps it and the job restarts in place (before, the slot waited for a standby that was
    not there and the job stopped for good). A lost node's slot still waits for one."""
    s = _formed(["a", "b", "c"])
    s = rs.request_restart(s, 0, "sdc", "fingerprint_minority", ["b"], quarantine=True)
    s = rs.form(rs.arrive(rs.arrive(s, "a", 0), "b", 0), {"a", "b", "c"})
    assert s.slots == ("a", "c") and s.history[-1]["admitted"] == [{"slot": 1, "node": "c"}]
    assert "kept" not in s.history[-1]
    s = rs.request_restart(s, 1, "sdc", "fingerprint_minority", ["a"], quarantine=True)
    assert rs.role_of(s, "a") == "quarantined"
    s = rs.form(s, {"a", "b", "c"})  # a kept before every holder arrived: its slot stays
    assert s.phase == rs.RESTARTING and s.slots == ("a", "c") and rs.role_of(s, "a") == "active"
    s = rs.form(rs.arrive(rs.arrive(s, "a", 1), "c", 1), {"a", "b", "c"}, {"checkpoint_step": 8})
    assert s.phase == rs.RUNNING and s.generation == 2 and s.slots == ("a", "c")
    assert s.history[-1]["kept"] == ["a"] and s.history[-1]["admitted"] == []
    assert s.excluded == {"b": "sdc"} and s.pending == {}
    # A standby that is there takes the slot as before; a dead node's slot waits.
    s = rs.register(s, "d", "hd", 2, "pol")
    s = rs.request_restart(s, 2, "sdc", "fingerprint_minority", ["a"], quarantine=True)
    s = rs.form(rs.arrive(rs.arrive(s, "a", 2), "c", 2), {"a", "c", "d"})
    assert s.slots == ("d", "c") and "kept" not in s.history[-1]
    s = rs.mark_dead(s, "c")
    s = rs.form(rs.arrive(s, "d", 3), {"d"})
    assert s.phase == rs.RESTARTING and s.slots == ("d", None)


def _fails(s: rs.RdzvState, node: str, error: str, live: set[str], step: int | None = None) -> rs.RdzvState:
    """`node`'s worker dies of `error` in the current generation; every holder arrives; the next forms
    (from `step` when given)."""
    g = s.generation
    s = rs.arrive(
        rs.request_restart(s, g, "process_failure", "uncaught_exception", [node], False, error), node, g
    )
    for n in s.slots:
        if n is not None:
            s = rs.arrive(s, n, g)
    return rs.form(s, live, None if step is None else {"checkpoint_step": step})


def test_a_node_that_fails_the_same_way_twice_in_a_row_is_replaced_by_a_standby() -> None:
    """b's data path is gone: its worker dies of the same error in generation 0 and again in 1. A
    third restart in place would fail again (and use up torchrun's restarts): b is quarantined
    and the standby takes its slot."""
    live = {"a", "b", "c"}
    s = _formed(["a", "b", "c"])
    gone = "FileNotFoundError: [Errno 2] No such file or directory: '/data/shard-{}'"
    s = _fails(s, "b", gone.format(2), live)
    assert s.generation == 1 and s.slots == ("a", "b") and not s.excluded  # the first: in place
    assert rs.repeat_offender(s) is None
    s = _fails(s, "b", gone.format(3), live)  # (another of its workers' files this time)
    assert s.generation == 2 and s.slots == ("a", "c") and s.excluded == {"b": "repeated_process_failure"}
    assert s.history[-1]["repeated"] and s.history[-1]["admitted"] == [{"slot": 1, "node": "c"}]
    assert rs.role_of(s, "b") == "quarantined"


def test_a_peer_whose_workers_exit_first_while_the_culprit_node_dies_is_no_repeat_offender() -> None:
    """b's worker is SIGKILLed in generation 0 (a restart in place). Early in generation 1 a's node
    dies: b's workers exit first (their collectives broke), b's agent arrives, and the same failure
    as before names b again while a's heartbeats are still being waited out. b is not quarantined
    then; a's loss names a, and the standby takes a's slot. Before, b was quarantined at once, the
    standby went to b's slot, and a's slot waited for a node that never came back."""
    live = {"a", "b", "c"}
    s = _formed(["a", "b", "c"])
    s = rs.form(
        rs.arrive(
            rs.arrive(rs.request_restart(s, 0, "process_failure", "worker_exit", ["b"]), "b", 0), "a", 0
        ),
        live,
    )
    assert s.generation == 1 and s.slots == ("a", "b")
    s = rs.arrive(rs.request_restart(s, 1, "process_failure", "worker_exit", ["b"]), "b", 1)
    assert rs.repeat_offender(s) == "b"  # the same failure of the same node, on its face
    s = rs.form(s, live)
    assert s.phase == rs.RESTARTING and not s.excluded and s.slots == ("a", "b")
    s = rs.form(rs.mark_dead(s, "a"), {"b", "c"})
    assert s.phase == rs.RUNNING and s.generation == 2 and s.slots == ("c", "b") and not s.excluded
    assert s.history[-1]["failure_kind"] == "node_lost" and s.history[-1]["culprits"] == ["a"]


def test_other_failures_in_a_row_and_no_standby_restart_in_place() -> None:
    live = {"a", "b", "c"}
    for second in (("b", "RuntimeError: loss is nan"), ("a", "OSError: x")):
        s = _fails(_formed(["a", "b", "c"]), "b", "OSError: x", live)
        s = _fails(s, *second, live)  # another error, or another node
        assert s.generation == 2 and s.slots == ("a", "b") and not s.excluded, second
    s = _fails(_fails(_formed(["a", "b"]), "b", "OSError: x", {"a", "b"}), "b", "OSError: x", {"a", "b"})
    assert s.generation == 2 and s.slots == ("a", "b") and not s.excluded  # nobody to take its slot
    # Not in a row: generation 1 ended another way (a's node was lost) between b's two failures.
    s = _fails(_formed(["a", "b", "c", "d"]), "b", "OSError: x", {"a", "b", "c", "d"})
    s = rs.form(rs.arrive(rs.mark_dead(s, "a"), "b", 1), {"b", "c", "d"})
    s = _fails(s, "b", "OSError: x", {"b", "c", "d"})
    assert s.generation == 3 and "b" in s.slots and set(s.excluded) == set(), s


def _restarted(s: rs.RdzvState, kind: str, reason: str, node: str, step: int) -> rs.RdzvState:
    """A verdict on `node` stops the current generation; every holder arrives; the next forms from `step`."""
    g = s.generation
    s = rs.request_restart(s, g, kind, reason, [node])
    for n in s.slots:
        if n is not None:
            s = rs.arrive(s, n, g)
    return rs.form(s, set(s.nodes), {"checkpoint_step": step})


def test_the_same_failure_restarted_from_the_same_step_again_and_again_closes_the_run_as_failed() -> None:
    """b's loop ends early at step 8 in every generation (its data): its peers wait, SCOUT names it,
    the leader restarts from step 8, and the same happens again. After `LOOP_LIMIT` such restarts
    the next one is not published: the run is closed with the reason, and every agent fails
    (before: a new generation every few seconds, for ever, with torchrun's restarts untouched)."""
    s = _formed(["a", "b"])
    for _ in range(rs.LOOP_LIMIT):
        s = _restarted(s, "hang", "left_while_peers_wait", "b", 8)
        assert s.phase == rs.RUNNING
    assert s.generation == rs.LOOP_LIMIT and s.history[-1]["checkpoint_step"] == 8
    gave_up = _restarted(s, "hang", "left_while_peers_wait", "b", 8)
    assert gave_up.phase == rs.CLOSED and gave_up.generation == rs.LOOP_LIMIT
    assert (
        "same failure (hang: left_while_peers_wait, nodes ['b']) from the same step (8)"
        in (gave_up.pending["gave_up"])
    )
    assert rs.decode(rs.encode(gave_up)) == gave_up
    # Progress between (a later step each time), another failure, or another node: restarted.
    for step, kind, node in ((9, "hang", "b"), (8, "data_stall", "b"), (8, "hang", "a")):
        other = _restarted(s, kind, "left_while_peers_wait", node, step)
        assert other.phase == rs.RUNNING and other.generation == rs.LOOP_LIMIT + 1, (step, kind, node)


def test_worker_kills_restarted_from_the_same_step_are_budgeted_by_torchrun_not_the_loop_limit() -> None:
    """A chaos test SIGKILLs b's workers again and again while they restart, before any step runs:
    each generation restarts from step 5 for the same failure. Each such restart costs b's agent
    one of torchrun's `--max-restarts` (the user's budget for them), so the leader keeps publishing
    (before: after three the run was closed as 'a restart would repeat it' with restarts left).
    An exception that says the same thing from the same step each time still closes the run."""
    s = _formed(["a", "b"])
    for _ in range(rs.LOOP_LIMIT + 2):
        s = _restarted(s, "process_failure", "worker_exit", "b", 5)
        assert s.phase == rs.RUNNING
    assert s.generation == rs.LOOP_LIMIT + 2
    # The same exception from the same step, again and again, is a loop (a bad batch at step 6).
    s = _formed(["a", "b"])
    for _ in range(rs.LOOP_LIMIT):
        s = _fails(s, "b", "FloatingPointError: loss is nan", {"a", "b"}, step=5)
        assert s.phase == rs.RUNNING
    assert _fails(s, "b", "FloatingPointError: loss is nan", {"a", "b"}, step=5).phase == rs.CLOSED
    assert _fails(s, "b", "OSError: disk", {"a", "b"}, step=5).phase == rs.RUNNING  # another error


def test_a_node_that_leaves_for_good_is_replaced_at_once_or_the_run_gives_up() -> None:
    """b's agent has no restarts left (torchrun's `--max-restarts`) and exits: a parked standby takes
    its slot at once (no heartbeat timeout to wait out); with none, the run gives up with the reason
    so that every agent fails now (before: a waited for b's slot to be filled, for ever)."""
    why = "its workers failed and torchrun's --max-restarts are used up"
    s = rs.leave(_formed(["a", "b", "c"]), "b", "restarts_exhausted", why)
    assert s.phase == rs.RESTARTING and s.slots == ("a", None)
    assert s.pending["failure_kind"] == "process_failure" and s.pending["reason"] == "restarts_exhausted"
    assert s.pending["culprits"] == ["b"]
    assert "b" in s.nodes  # the leader's plan maps generation 0's ranks to their nodes
    s = rs.form(rs.arrive(s, "a", 0), {"a", "c"})
    assert s.phase == rs.RUNNING and s.generation == 1 and s.slots == ("a", "c")
    assert s.history[-1]["admitted"] == [{"slot": 1, "node": "c"}] and s.history[-1]["culprits"] == ["b"]

    # a's workers broke first (their collectives lost b's) and a arrived: b is still the cause.
    s = rs.arrive(_formed(["a", "b"]), "a", 0)
    assert s.pending["culprits"] == ["a"]
    gave_up = rs.leave(s, "b", "restarts_exhausted", why)
    assert gave_up.phase == rs.CLOSED and gave_up.pending["culprits"] == ["b"]
    assert gave_up.pending["reason"] == "restarts_exhausted"
    assert gave_up.pending["gave_up"] == f"node b left the run ({why}) and no standby can take its slot 1"
    assert rs.decode(rs.encode(gave_up)) == gave_up
    assert rs.leave(gave_up, "a", "restarts_exhausted") == gave_up  # closed: nothing changes

    # Still forming: the slot is freed for a node that registers later; the run goes on forming.
    forming = rs.register(rs.RdzvState.new("nonce", 2, 2, "pol"), "a", "ha", 2, "pol")
    forming = rs.leave(forming, "a", "agent_failed")
    assert forming.phase == rs.FORMING and forming.slots == (None, None)


def test_without_a_standby_a_lost_slot_waits() -> None:
    s = _formed(["a", "b"])
    assert rs.unfillable_slots(s) == []
    s = rs.mark_dead(s, "b")
    s = rs.form(rs.arrive(s, "a", 0), {"a"})
    assert s.phase == rs.RESTARTING and s.slots == ("a", None)
    assert rs.unfillable_slots(s) == [1]  # the leader gives up after the join timeout
    closed = rs.give_up(s, "slots [1] had no node")
    assert closed.phase == rs.CLOSED and closed.pending["gave_up"] == "slots [1] had no node"
    assert rs.give_up(closed, "again") == closed
    s = rs.register(s, "b", "hb", 2, "pol")  # the node's agent came back (same machine id)
    assert s.standbys == ("b",)
    s = rs.form(s, {"a", "b"})
    assert s.phase == rs.RUNNING and s.slots == ("a", "b")


def test_election_oldest_live_node_takes_over_with_a_new_term() -> None:
    s = _formed(["a", "b", "c"])
    assert s.leader == "a" and s.term == 1
    assert rs.elect(s, "b", {"a", "b", "c"}) == s  # a live leader stays
    assert rs.elect(s, "c", {"b", "c"}) == s  # b is older than c: c does not take over
    s2 = rs.elect(s, "b", {"b", "c"})
    assert s2.leader == "b" and s2.term == 2


def test_liveness_uses_counters_on_the_observers_clock() -> None:
    live = rs.Liveness(timeout_s=3.0)
    live.observe("a", 5, now=100.0)
    live.observe("b", 9, now=100.0)
    live.observe("a", 6, now=102.5)
    live.observe("b", 9, now=102.5)  # stuck counter
    assert live.live(102.9) == {"a", "b"}  # b's counter last moved at 100.0
    assert live.dead(103.1) == {"b"} and live.live(103.1) == {"a"}
    live.observe("b", 10, now=104.0)  # it moves again: live again
    assert live.live(104.0) == {"a", "b"}


def test_encode_decode_round_trip_and_malformed_documents() -> None:
    s = rs.mark_dead(_formed(["a", "b", "c"]), "a")
    assert rs.decode(rs.encode(s)) == s
    with pytest.raises(ValueError, match="malformed"):
        rs.decode(b'{"schema": 1, "phase": "running"}')
    with pytest.raises(ValueError, match="schema"):
        rs.decode(b'{"schema": 9}')
    with pytest.raises(ValueError):
        rs.decode(b"not json")


def test_closed_run_ignores_further_changes() -> None:
    s = rs.close(_formed(["a", "b"]))
    assert rs.mark_dead(s, "a") == s and rs.arrive(s, "a", 0) == s
    assert rs.request_restart(s, 0, "sdc", "x") == s and rs.form(s, {"a", "b"}) == s


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["kill", "arrive", "register", "form"]), st.integers(0, 4)), max_size=40
    )
)
def test_any_event_sequence_keeps_slots_unique_and_trusted(events: list[tuple[str, int]]) -> None:
    names = [f"n{i}" for i in range(5)]
    s = _formed(names[:3])
    alive = set(names[:3])
    for op, i in events:
        n = names[i]
        if op == "kill":
            s, alive = rs.mark_dead(s, n), alive - {n}
        elif op == "arrive":
            s = rs.arrive(s, n, s.generation)
        elif op == "register":
            s, alive = rs.register(s, n, "h", 2, "pol"), alive | {n}
        else:
            s = rs.form(s, alive)
        held = [x for x in s.slots if x is not None]
        assert len(held) == len(set(held))
        assert not set(held) & set(s.standbys)
        assert not set(held) & set(s.excluded)
        if s.phase == rs.RUNNING:
            assert None not in s.slots


def test_a_run_no_restart_can_follow_ends_failing_with_why_and_stays_ended() -> None:
    """A node's workers ended their scripts (its agent waits in torch's exit barrier) and another
    node's failed later: the run closes with why, kept for everyone (and the monitor), and a
    second close does not overwrite it."""
    s = rs.request_restart(_formed(["a", "b"]), 0, "process_failure", "worker_exit", ["b"])
    ended = rs.end_failing(s, "node b's workers failed after 1 node(s) had ended their scripts")
    assert ended.phase == rs.CLOSED and "had ended their scripts" in ended.pending["ended_failing"]
    assert "gave_up" not in ended.pending  # (healthy agents are not asked to restart)
    assert rs.decode(rs.encode(ended)) == ended
    assert rs.end_failing(ended, "again") == ended and rs.give_up(ended, "again") == ended
