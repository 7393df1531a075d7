"""The torchrun rendezvous as a pure state machine.

One JSON document in the control store holds the whole rendezvous; every change is a pure function
of the current state (and, for liveness, of counters and a literal `now`), applied by compare-and-set.
Because the leader's identity and term live inside the document, a deposed leader's write fails:
compare-and-set is the fence.

Life of a run:
- `forming`: nodes register; the first `min_nodes` (by arrival) take the logical slots, later ones
  park as standbys (arrival order). When every slot is held, the leader publishes generation 0.
- `running`: generation g trains. A worker failure, a lost node or an agreed verdict moves it to
- `restarting`: every slot holder must arrive (its agent stopped its workers and re-entered the
  rendezvous) or be declared dead. Dead or quarantined slots are filled by the oldest live standby;
  previous holders keep their slots (stable ranks). Then generation g+1 is published.
- `closed`: the job succeeded; parked and quarantined nodes exit 0. Or it gave up (`pending["gave_up"]`
  says why): the same failure restarted from the same step `LOOP_LIMIT` times in a row, a slot
  holder left for good (`leave`) with no standby to take its slot, or a lost node's slot stayed
  unfilled (`unfillable_slots`) for the join timeout; every agent then fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "CLOSED",
    "FORMING",
    "PHASES",
    "RESTARTING",
    "RUNNING",
    "Liveness",
    "NodeInfo",
    "RdzvState",
    "RendezvousRefused",
    "arrive",
    "close",
    "decode",
    "elect",
    "encode",
    "form",
    "give_up",
    "leave",
    "mark_dead",
    "name_desync",
    "register",
    "repeat_offender",
    "request_restart",
    "role_of",
    "unfillable_slots",
]

FORMING, RUNNING, RESTARTING, CLOSED = "forming", "running", "restarting", "closed"
PHASES = (FORMING, RUNNING, RESTARTING, CLOSED)
SCHEMA = 1


class RendezvousRefused(Exception):
    """A node may not take part (its policy differs from the run's); `.code` is a stable reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    arrival: int  # registration order: the oldest standby is admitted first; the oldest node leads
    addr: str
    local_world_size: int
    # The first rank whose in-memory checkpoints of this run the node holds (a relaunch of the run
    # on the same machines): generation 0 gives it the slot of those ranks (see _as_held). -1: none.
    held_rank: int = -1


@dataclass(frozen=True)
class RdzvState:
    nonce: str  # the run's identity in the store: a leftover store of another run is never used
    min_nodes: int
    max_nodes: int
    policy_digest: str = ""
    term: int = 0
    leader: str | None = None
    generation: int = -1  # -1 until the first generation is published
    phase: str = FORMING
    slots: tuple[str | None, ...] = ()
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    standbys: tuple[str, ...] = ()
    excluded: Mapping[str, str] = field(default_factory=dict)  # node -> reason (quarantine)
    arrived: tuple[str, ...] = ()  # slot holders back in the rendezvous since the restart began
    pending: Mapping[str, Any] = field(default_factory=dict)  # why the current restart happens
    plan: Mapping[str, Any] = field(default_factory=dict)  # what the published generation restores
    next_arrival: int = 0
    history: tuple[Mapping[str, Any], ...] = ()  # one entry per published generation

    @staticmethod
    def new(nonce: str, min_nodes: int, max_nodes: int, policy_digest: str = "") -> RdzvState:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}:{max_nodes}")
        return RdzvState(nonce, min_nodes, max_nodes, policy_digest, slots=(None,) * min_nodes)

    def slot_of(self, node: str) -> int | None:
        for i, n in enumerate(self.slots):
            if n == node:
                return i
        return None

    def first_global_rank(self, slot: int) -> int:
        return sum(self.nodes[n].local_world_size for n in self.slots[:slot] if n is not None)

    def world_size(self) -> int:
        return sum(self.nodes[n].local_world_size for n in self.slots if n is not None)


def role_of(s: RdzvState, node: str) -> str:
    """`active` (holds a slot), `standby`, `quarantined`, or `unknown`."""
    if node in s.excluded:
        return "quarantined"
    if s.slot_of(node) is not None:
        return "active"
    if node in s.standbys:
        return "standby"
    return "unknown"


def register(
    s: RdzvState, node: str, addr: str, local_world_size: int, policy_digest: str = "", held_rank: int = -1
) -> RdzvState:
    """A node's agent joins (or re-joins after its own restart: same node id, same arrival).
    `held_rank`: the first rank whose in-memory checkpoints of this run the node holds, or -1."""
    if s.policy_digest and policy_digest != s.policy_digest:
        raise RendezvousRefused(
            "policy_mismatch",
            f"node {node} runs worker policy {policy_digest[:12] or '<none>'} but the run uses "
            f"{s.policy_digest[:12]}: every node must run the same lm_resiliency_worker_config",
        )
    if s.phase == CLOSED:
        return s
    nodes = dict(s.nodes)
    known = nodes.get(node)
    arrival = known.arrival if known is not None else s.next_arrival
    nodes[node] = NodeInfo(node, arrival, addr, local_world_size, held_rank)
    out = replace(s, nodes=nodes, next_arrival=max(s.next_arrival, arrival + 1))
    if node in s.excluded or s.slot_of(node) is not None or node in s.standbys:
        return out
    if s.phase == FORMING and None in s.slots:
        slots = list(s.slots)
        slots[slots.index(None)] = node
        return replace(out, slots=tuple(slots))
    return replace(out, standbys=(*s.standbys, node))


def elect(s: RdzvState, me: str, live: Set[str]) -> RdzvState:
    """`me` takes the lead when there is no live leader and `me` is the oldest live, trusted node."""
    if s.leader is not None and s.leader in live:
        return s
    candidates = [n for n in live if n in s.nodes and n not in s.excluded]
    if not candidates or min(candidates, key=lambda n: s.nodes[n].arrival) != me:
        return s
    return replace(s, leader=me, term=s.term + 1)


def request_restart(
    s: RdzvState,
    generation: int,
    failure_kind: str,
    reason: str,
    culprits: Iterable[str] = (),
    quarantine: bool = False,
    error: str = "",
    destination: str = "",
) -> RdzvState:
    """Generation `generation` failed. Requests about an older generation are already handled.

    `error`: the failing worker's own words (its uncaught exception), when it said them.
    `destination`: a parked standby the culprits' work should go to (an orchestrator's choice,
    `OrchestrationHooks.restart_destination`): admitted before older standbys."""
    if s.phase == CLOSED or generation != s.generation:
        return s
    culprits = tuple(sorted(set(culprits)))
    excluded = dict(s.excluded)
    if quarantine:
        for c in culprits:
            excluded.setdefault(c, failure_kind)
    if s.phase == RESTARTING:  # a second report of the same failure: only widen it
        if failure_kind == "process_failure" and s.pending.get("failure_kind") == "collective_desync":
            return s  # a worker that died of the mismatched collective: its consequence, not a culprit
        pending = dict(s.pending)
        pending["culprits"] = sorted(set(pending.get("culprits", ())) | set(culprits))
        pending["quarantine"] = bool(pending.get("quarantine")) or quarantine
        if failure_kind != pending.get("failure_kind"):
            # Another failure of the same generation (an SDC named while a killed rank's exit was
            # being handled): the plan restores as the most demanding of them asks (see also_kinds).
            pending["also"] = sorted({*pending.get("also", ()), failure_kind})
        if pending.get("reason") == "worker_exit" and failure_kind == pending.get("failure_kind"):
            pending["reason"] = reason  # the worker said why it exited: more than the exit itself
            if error:
                pending["error"] = error
        return replace(s, pending=pending, excluded=excluded)
    if s.phase != RUNNING:
        return s
    pending = {
        "failure_kind": failure_kind,
        "reason": reason,
        "culprits": list(culprits),
        "quarantine": quarantine,
        "from_generation": generation,
    }
    if error:
        pending["error"] = error
    if destination:
        pending["destination"] = destination
    return replace(s, phase=RESTARTING, arrived=(), pending=pending, excluded=excluded)


def also_kinds(pending: Mapping[str, Any]) -> list[str]:
    """Every failure kind a restart's pending request was made for: the first one's, then those
    reported of the same generation while it was being handled."""
    first = str(pending.get("failure_kind", "none"))
    return [first, *(str(k) for k in pending.get("also", ()) if k != first)]


def replace_with_standbys(
    s: RdzvState,
    generation: int,
    failure_kind: str,
    reason: str,
    culprits: Iterable[str] = (),
    quarantine: bool = True,
    error: str = "",
    destination: str = "",
) -> RdzvState:
    """A verdict on a job that still trains (a straggler, a stall nobody waits on): its culprits'
    nodes are quarantined and replaced only while parked standbys can take every one of their
    slots; otherwise nothing changes and the job keeps training (a restart in place would not make
    a node faster)."""
    if len(s.standbys) < len(set(culprits)):
        return s
    return request_restart(s, generation, failure_kind, reason, culprits, quarantine, error, destination)


def name_desync(
    s: RdzvState, generation: int, reason: str, culprits: Iterable[str], quarantine: bool
) -> RdzvState:
    """The restart of `generation` for its workers' exits names its cause: the collective trails
    showed the culprits' ranks entered another collective than their replicas (gloo aborts on a
    mismatch of sizes, often in another rank's process). Their nodes replace the ones whose
    workers merely died of it; quarantined when `quarantine`."""
    p = s.pending
    if s.phase != RESTARTING or p.get("from_generation") != generation:
        return s
    if p.get("failure_kind") != "process_failure":
        return s
    culprits = sorted(set(culprits))
    excluded = dict(s.excluded)
    if quarantine:
        for c in culprits:
            excluded.setdefault(c, "collective_desync")
    pending = {
        **p,
        "failure_kind": "collective_desync",
        "reason": reason,
        "culprits": culprits,
        "quarantine": quarantine,
    }
    return replace(s, pending=pending, excluded=excluded)


def arrive(s: RdzvState, node: str, generation: int) -> RdzvState:
    """A slot holder's agent re-entered the rendezvous after its workers of `generation` stopped."""
    if generation != s.generation:
        return s
    if s.phase == RUNNING:  # the first to notice: its own workers failed
        s = request_restart(s, generation, "process_failure", "worker_exit", (node,))
    if s.phase != RESTARTING or node in s.arrived:
        return s
    return replace(s, arrived=(*s.arrived, node))


def mark_dead(s: RdzvState, node: str) -> RdzvState:
    """The node's heartbeats stopped: a standby leaves the list, a slot holder's slot is freed."""
    if s.phase == CLOSED:
        return s
    if node in s.standbys:
        return replace(s, standbys=tuple(n for n in s.standbys if n != node))
    slot = s.slot_of(node)
    if slot is None:
        return s
    if s.phase == RUNNING:
        s = request_restart(s, s.generation, "node_lost", "heartbeat_lost", (node,))
    elif s.pending.get("failure_kind") == "process_failure":
        # Peers' workers exited first (their collectives broke), but the root cause is this node.
        s = replace(
            s,
            pending={
                **s.pending,
                "failure_kind": "node_lost",
                "reason": "heartbeat_lost",
                "culprits": [node],
            },
        )
    return _free_slot(s, node, slot)


def _free_slot(s: RdzvState, node: str, slot: int) -> RdzvState:
    """`node` no longer holds `slot` (its NodeInfo stays: the next plan maps the last generation's
    ranks to their nodes)."""
    slots = list(s.slots)
    slots[slot] = None
    return replace(s, slots=tuple(slots), arrived=tuple(n for n in s.arrived if n != node))


def leave(s: RdzvState, node: str, reason: str, detail: str = "") -> RdzvState:
    """The node's agent exits for good while the run goes on: torchrun has no restarts left for its
    workers (`--max-restarts`), or the agent itself failed. Its slot is freed at once, without
    waiting out its heartbeats, and a parked standby takes it. With no standby to take it the next
    generation cannot form: the run is closed as given up with the reason, and every agent fails
    now (before, the others waited for the node for ever). While the run still forms, the slot is
    only freed: a node that registers later takes it. `reason` is the stable code
    (`restarts_exhausted`, `agent_failed`), `detail` what an operator reads."""
    if s.phase == CLOSED:
        return s
    slot = s.slot_of(node)
    if slot is None or s.phase == FORMING:
        return mark_dead(s, node)
    if s.phase == RUNNING:
        s = request_restart(s, s.generation, "process_failure", reason, (node,))
    elif s.pending.get("failure_kind") == "process_failure":
        # Peers' workers exited first (their collectives broke), but the root cause is this node.
        s = replace(s, pending={**s.pending, "reason": reason, "culprits": [node]})
    s = _free_slot(s, node, slot)
    if not unfillable_slots(s):
        return s
    return give_up(
        s, f"node {node} left the run ({detail or reason}) and no standby can take its slot {slot}"
    )


def form(s: RdzvState, live: Set[str], plan: Mapping[str, Any] | None = None) -> RdzvState:
    """The leader publishes the next generation once every slot is held by a ready node.

    Quarantined holders lose their slot; holes are filled by the oldest live standbys. A holder is
    ready when it arrived (restarting) or registered (forming). Returns `s` unchanged when not ready.
    """
    if s.phase not in (FORMING, RESTARTING):
        return s
    again = repeat_offender(s)
    # Judged once every slot holder is back: one that is not may be dying, the root cause of the
    # exits (its peers' collectives broke first); its loss then names it (mark_dead). Before, the
    # peer whose workers exited first was quarantined as a repeat offender while the dying node's
    # heartbeats were still being waited out, and two slots needed the one standby.
    back = all(n in s.arrived for n in s.slots if n is not None)
    if again is not None and back and any(n in live and n not in s.excluded for n in s.standbys):
        # A node that failed the same way at the start of the generation that replaced it: a
        # fault of the node (a dead disk, its data path gone), which a restart in place repeats.
        s = replace(
            s,
            excluded={**s.excluded, again: f"repeated_{s.pending.get('failure_kind')}"},
            pending={**s.pending, "quarantine": True, "repeated": True},
        )
    s = _keep_without_standby(s, live)
    slots = list(s.slots)
    for i, n in enumerate(slots):
        if n is not None and (n in s.excluded or n not in live):
            slots[i] = None
    cleared = replace(s, slots=tuple(slots))  # what is kept when not ready: holes, never admissions
    standbys = [n for n in s.standbys if n in live and n not in s.excluded]
    # The oldest first, after the one an orchestrator chose (`request_restart`'s destination).
    standbys.sort(key=lambda n: (n != s.pending.get("destination"), s.nodes[n].arrival))
    admitted: list[tuple[int, str]] = []
    for i, n in enumerate(slots):
        if n is None and standbys:
            slots[i] = standbys.pop(0)
            admitted.append((i, slots[i]))  # type: ignore[arg-type]
    if None in slots:
        return cleared
    if s.phase == FORMING:
        slots = _as_held(s, slots)
    if s.phase == RESTARTING:
        newcomers = {n for _, n in admitted}
        if any(n not in s.arrived and n not in newcomers for n in slots):
            return cleared
    generation = s.generation + 1
    entry = {
        "generation": generation,
        "slots": list(slots),
        "admitted": [{"slot": i, "node": n} for i, n in admitted],
        "failure_kind": s.pending.get("failure_kind", "none"),
        "reason": s.pending.get("reason", "startup"),
        "culprits": list(s.pending.get("culprits", ())),
        "error_type": _error_type(s.pending),
    }
    if plan is not None:
        entry["checkpoint_step"] = int(plan.get("checkpoint_step", -1))
        looping = _looping(s.history, entry)
        if looping:
            return give_up(s, looping)
    if s.pending.get("also"):
        entry["also"] = list(s.pending["also"])
    if s.pending.get("repeated"):
        entry["repeated"] = True
    if s.pending.get("kept"):
        entry["kept"] = list(s.pending["kept"])
    return replace(
        s,
        generation=generation,
        phase=RUNNING,
        slots=tuple(slots),
        standbys=tuple(n for n in s.standbys if n not in slots),
        arrived=(),
        pending={},
        plan=dict(plan or {}),
        history=(*s.history, entry)[-64:],
    )


def _as_held(s: RdzvState, slots: list[str | None]) -> list[str | None]:
    """The slots of generation 0 (`slots`: in arrival order), with each node that holds in-memory
    checkpoints of this run (a relaunch on the same machines: `held_rank`) in the slot of the ranks
    it held, so that those copies are its ranks' own again; the others fill the rest in arrival
    order. Arrival order alone gave a relaunch's ranks other nodes than they trained on: each node's
    copies were of ranks it no longer runs, and the job started afresh with its state in memory.
    Only where every node runs as many ranks (else a slot's first rank depends on the others)."""
    nodes = [n for n in slots if n is not None]
    sizes = {s.nodes[n].local_world_size for n in nodes}
    if len(nodes) != len(slots) or len(sizes) != 1 or all(s.nodes[n].held_rank < 0 for n in nodes):
        return slots
    size = sizes.pop()
    placed: list[str | None] = [None] * len(slots)
    rest = []
    for n in nodes:
        held = s.nodes[n].held_rank
        i = held // size if held >= 0 and held % size == 0 else -1
        if 0 <= i < len(slots) and placed[i] is None:
            placed[i] = n
        else:
            rest.append(n)
    return [n if n is not None else rest.pop(0) for n in placed]


def _keep_without_standby(s: RdzvState, live: Set[str]) -> RdzvState:
    """Quarantined slot holders that no live standby can replace keep their slots (their quarantine
    is lifted) and restart in place, from the step their failure asks for: a slot waiting for a
    standby that is not there stopped the job for good (a second SDC after the only standby was
    admitted). A lost node's slot still waits: its node cannot restart. `pending["kept"]` names
    them."""
    quarantined = [n for n in s.slots if n is not None and n in s.excluded and n in live]
    if not quarantined:
        return s
    holes = sum(1 for n in s.slots if n is None or n not in live) + len(quarantined)
    spare = sum(1 for n in s.standbys if n in live and n not in s.excluded)
    kept = quarantined[: max(0, holes - spare)]
    if not kept:
        return s
    excluded = {n: why for n, why in s.excluded.items() if n not in kept}
    pending = {**s.pending, "kept": sorted({*s.pending.get("kept", ()), *kept})}
    return replace(s, excluded=excluded, pending=pending)


# Restarts in a row tolerated for the same failure (kind, reason, culprits) resumed from the same
# step: the next one would fail the same way again (a hang or stall at a fixed step of the data, a
# loop that ends early on one rank), so the run is closed as failed instead of looping for ever.
# Not for workers that exited without saying why (killed: an OOM killer, an operator, a chaos
# test) or nodes that left: each costs the failing node's agent one of torchrun's `--max-restarts`,
# the budget set for them, and workers killed again and again while they restarted, before any step
# ran, looked like a loop and ended a healthy job after three. The same exception type raised from
# the same step three times is a loop.
LOOP_LIMIT = 3
_LOOP_KEYS = ("failure_kind", "reason", "culprits", "checkpoint_step", "error_type")
_NOT_LOOPS = ("worker_exit", "restarts_exhausted", "agent_failed")


def _looping(history: tuple[Mapping[str, Any], ...], entry: Mapping[str, Any]) -> str:
    """Why publishing `entry` would repeat the last `LOOP_LIMIT` generations' restart ("" if not)."""
    last = history[-LOOP_LIMIT:]
    if entry["failure_kind"] == "none" or entry["reason"] in _NOT_LOOPS or len(last) < LOOP_LIMIT:
        return ""
    if any(tuple(h.get(k) for k in _LOOP_KEYS) != tuple(entry[k] for k in _LOOP_KEYS) for h in last):
        return ""
    return (
        f"generations {[h.get('generation') for h in last]} were restarted for the same failure "
        f"({entry['failure_kind']}: {entry['reason']}, nodes {entry['culprits']}) from the same step "
        f"({entry['checkpoint_step']}) and failed again: a restart would repeat it"
    )


def _error_type(pending: Mapping[str, Any]) -> str:
    """The exception type a failing worker named ("FileNotFoundError"; "" for none): what two
    failures share when their texts differ (the path of each rank's file, say)."""
    return str(pending.get("error", "")).split(":", 1)[0][:80]


# Restarts in place for one kind the job trains on through (RecoveryPolicyConfig.restart_in_place_on),
# in the history's generations: a durable folder every node shares that turns read-only is reported by
# every node, and a restart per node would stop a large job again and again.
RESTART_IN_PLACE_MAX = 3


def restarted_for(s: RdzvState, failure_kind: str, culprits: Iterable[str]) -> bool:
    """Whether a restart in place for `failure_kind` (a kind the job trains on through: a slow
    rank, a damaged copy) would repeat one: a generation of this run (the history's last 64) was
    restarted for it on exactly these nodes (a second restart would not fix what the first did
    not), or RESTART_IN_PLACE_MAX were for it on any nodes."""
    nodes = sorted(set(culprits))
    mine = [h for h in s.history if h.get("failure_kind") == failure_kind]
    return len(mine) >= RESTART_IN_PLACE_MAX or any(sorted(h.get("culprits", ())) == nodes for h in mine)


def slow_again(s: RdzvState, failure_kind: str, culprits: Iterable[str]) -> bool:
    """Whether a verdict that the job is slow (a straggler, a data stall) on `culprits` comes after a
    restart in place this run made for the same kind on exactly those nodes: the restart did not
    make them faster, their nodes are slow (a parked standby should take their slots). False for no
    culprits, or for nodes already quarantined."""
    nodes = sorted(set(culprits))
    if not nodes or set(nodes) & set(s.excluded):
        return False
    return any(
        h.get("failure_kind") == failure_kind and sorted(h.get("culprits", ())) == nodes for h in s.history
    )


def repeat_offender(s: RdzvState) -> str | None:
    """The node to quarantine instead of restarting it in place again: the one culprit of this
    restart's process failure, when the restart that published the failing generation was the
    same failure (kind, reason, exception type) of the same lone node. Two in a row: a third restart
    in place would only fail again and use up torchrun's restarts. None otherwise."""
    p = s.pending
    culprits = list(p.get("culprits", ()))
    if s.phase != RESTARTING or p.get("failure_kind") != "process_failure" or len(culprits) != 1:
        return None
    if not s.history or s.history[-1].get("generation") != s.generation:
        return None
    before = s.history[-1]
    same = (
        before.get("failure_kind") == p.get("failure_kind")
        and list(before.get("culprits", ())) == culprits
        and before.get("reason") == p.get("reason")
        and before.get("error_type", "") == _error_type(p)
    )
    return culprits[0] if same and culprits[0] not in s.excluded else None


def close(s: RdzvState) -> RdzvState:
    return s if s.phase == CLOSED else replace(s, phase=CLOSED)


def give_up(s: RdzvState, why: str) -> RdzvState:
    """Close the run as failed: every agent's next rendezvous raises with `why`."""
    return s if s.phase == CLOSED else replace(s, phase=CLOSED, pending={**s.pending, "gave_up": why})


def end_failing(s: RdzvState, why: str) -> RdzvState:
    """Close the run with a failure no restart can follow: nodes whose workers all ended their
    scripts wait in torch's exit barrier, out of a restart's reach. No agent is asked to restart
    (one still running ends its script; one waiting for a generation fails with `why`)."""
    return s if s.phase == CLOSED else replace(s, phase=CLOSED, pending={**s.pending, "ended_failing": why})


def unfillable_slots(s: RdzvState) -> list[int]:
    """Slots a restart waits for with no standby to fill them (their node was lost): the run can only
    go on when that node comes back."""
    if s.phase != RESTARTING or any(n not in s.excluded for n in s.standbys):
        return []
    return [i for i, n in enumerate(s.slots) if n is None]


# ---------------------------------------------------------------------------------------------------
# Encoding: one JSON document.


def encode(s: RdzvState) -> str:
    doc = {
        "schema": SCHEMA,
        "nonce": s.nonce,
        "min_nodes": s.min_nodes,
        "max_nodes": s.max_nodes,
        "policy_digest": s.policy_digest,
        "term": s.term,
        "leader": s.leader,
        "generation": s.generation,
        "phase": s.phase,
        "slots": list(s.slots),
        "nodes": {
            n: [i.arrival, i.addr, i.local_world_size, i.held_rank] for n, i in sorted(s.nodes.items())
        },
        "standbys": list(s.standbys),
        "excluded": dict(s.excluded),
        "arrived": list(s.arrived),
        "pending": dict(s.pending),
        "plan": dict(s.plan),
        "next_arrival": s.next_arrival,
        "history": [dict(h) for h in s.history],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def decode(raw: str | bytes) -> RdzvState:
    """Parse the stored document; ValueError naming what is wrong."""
    try:
        doc = json.loads(raw)
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"rendezvous state schema {doc.get('schema')!r}, expected {SCHEMA}")
        if doc["phase"] not in PHASES:
            raise ValueError(f"unknown rendezvous phase {doc['phase']!r}")
        return RdzvState(
            nonce=str(doc["nonce"]),
            min_nodes=int(doc["min_nodes"]),
            max_nodes=int(doc["max_nodes"]),
            policy_digest=str(doc["policy_digest"]),
            term=int(doc["term"]),
            leader=doc["leader"],
            generation=int(doc["generation"]),
            phase=doc["phase"],
            slots=tuple(doc["slots"]),
            nodes={
                n: NodeInfo(n, int(v[0]), str(v[1]), int(v[2]), int(v[3]) if len(v) > 3 else -1)
                for n, v in doc["nodes"].items()
            },
            standbys=tuple(doc["standbys"]),
            excluded=dict(doc["excluded"]),
            arrived=tuple(doc["arrived"]),
            pending=dict(doc["pending"]),
            plan=dict(doc["plan"]),
            next_arrival=int(doc["next_arrival"]),
            history=tuple(doc["history"]),
        )
    except (KeyError, IndexError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed rendezvous state: {exc!r}") from exc


# ---------------------------------------------------------------------------------------------------
# Liveness: heartbeat counters judged on the observer's own monotonic clock (no wall-clock compare).


class Liveness:
    """A node is live while its counter keeps moving; `now` is the observer's monotonic time."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._seen: dict[str, tuple[int, float]] = {}

    def observe(self, node: str, counter: int, now: float) -> None:
        last = self._seen.get(node)
        if last is None or counter != last[0]:
            self._seen[node] = (counter, now)

    def live(self, now: float) -> set[str]:
        return {n for n, (_, t) in self._seen.items() if now - t <= self.timeout_s}

    def dead(self, now: float) -> set[str]:
        return {n for n, (_, t) in self._seen.items() if now - t > self.timeout_s}

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)
