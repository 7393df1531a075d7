"""`lm-resiliency monitor`: the live view of a torchrun job run with `--rdzv-backend=lm_resiliency`.

It reads what the job's agents and workers keep in the control store (the rendezvous endpoint):
the rendezvous document (phase, generation, leader, slots, standbys, quarantined nodes, the
restart under way and one entry per published generation), each agent's heartbeat counter, each
rank's GEMINI inventory (the steps it holds in memory, replicas of others' state, on disk, and
which SCOUT certified) and the SCOUT verdicts posted in the current generation. It only reads: a
monitor never changes the run, and any number of them may watch it.

`snapshot()` builds one JSON-ready view (`--json` prints it); `render()` lays it out for a terminal.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["render", "run_monitor", "snapshot"]


def snapshot(
    manager: Any, beats_before: Mapping[str, int] | None = None, window_s: float = 0.0
) -> dict[str, Any]:
    """One view of the run behind `manager` (a `RunManager`). A node's agent is `live` when its
    heartbeat counter moved since `beats_before` (counters read `window_s` seconds earlier); with
    no earlier reading, `live` is None (unknown)."""
    at = manager.read()  # one read of the document: every part below describes the same moment
    state = manager.state(at)
    beats = manager.heartbeats(at)
    inventories = manager.inventories(at)
    slots: list[str | None] = list(state["slots"])
    nodes_info: dict[str, Any] = state["nodes"]
    first: dict[str, int] = {}
    rank = 0
    for n in slots:
        if n is not None:
            first[n] = rank
            rank += int(nodes_info[n]["local_world_size"])
    world = rank
    nodes: list[dict[str, Any]] = []
    for name, info in sorted(nodes_info.items(), key=lambda kv: int(kv[1]["arrival"])):
        if name in state["excluded"]:
            role = "quarantined"
        elif name in slots:
            role = f"slot {slots.index(name)}"
        elif name in state["standbys"]:
            role = "standby"
        else:
            role = "registered"
        lws = int(info["local_world_size"])
        moved = None
        if beats_before is not None and name in beats:
            moved = beats[name] != beats_before.get(name)
        nodes.append(
            {
                "node": name,
                "role": role,
                "leader": name == state["leader"],
                "ranks": list(range(first[name], first[name] + lws)) if name in first else [],
                "local_world_size": lws,
                "addr": info["addr"],
                "heartbeat": beats.get(name),
                "live": moved,
                "excluded_for": state["excluded"].get(name),
            }
        )
    node_of = {r: n["node"] for n in nodes for r in n["ranks"]}
    held_elsewhere: dict[int, set[int]] = {}  # owner -> steps other ranks hold of its state
    for holder, inv in inventories.items():
        for owner, steps in _mapping(inv.get("replicas")).items():
            if str(owner).lstrip("-").isdigit() and int(owner) != holder:
                held_elsewhere.setdefault(int(owner), set()).update(_ints(steps))
    ranks: list[dict[str, Any]] = []
    for r in range(world):
        inv = inventories.get(r)
        if inv is None:
            ranks.append({"rank": r, "node": node_of.get(r), "inventory": False})
            continue
        local, disk, cert = _ints(inv.get("local")), _ints(inv.get("disk")), _ints(inv.get("certified"))
        ranks.append(
            {
                "rank": r,
                "node": node_of.get(r),
                "inventory": True,
                "generation": inv.get("generation"),
                "local": sorted(local),
                "replicated": sorted(held_elsewhere.get(r, ())),
                "disk": sorted(disk),
                "certified": sorted(cert),
                "newest": max(local | held_elsewhere.get(r, set()) | disk, default=-1),
            }
        )
    decisions = [
        {
            k: h.get(k)
            for k in (
                "generation",
                "failure_kind",
                "reason",
                "culprits",
                "admitted",
                "checkpoint_step",
                "slots",
            )
            if k in h
        }
        for h in manager.decisions(at)
    ]
    plan = state.get("plan") or {}
    return {
        "run_id": manager.run_id,
        "time": time.time(),
        "phase": state["phase"],
        "generation": state["generation"],
        "leader": state["leader"],
        "term": state["term"],
        "min_nodes": state["min_nodes"],
        "max_nodes": state["max_nodes"],
        "world_size": world,
        "restoring": {
            k: plan[k]
            for k in ("checkpoint_step", "checkpoint_source", "recovery_mode", "failure_kind")
            if k in plan
        },
        "pending": dict(state["pending"]),
        "window_s": window_s,
        "nodes": nodes,
        "ranks": ranks,
        "incidents": manager.incidents(at),
        "decisions": decisions,
    }


def _mapping(v: Any) -> Mapping[Any, Any]:
    return v if isinstance(v, Mapping) else {}


def _ints(v: Any) -> set[int]:
    """The ints of a JSON list (a malformed inventory shows as empty, never stops the view)."""
    return {x for x in v if type(x) is int} if isinstance(v, list) else set()


def _steps(steps: list[int]) -> str:
    if not steps:
        return "-"
    return ",".join(map(str, steps[-3:])) if len(steps) <= 3 else "..," + ",".join(map(str, steps[-2:]))


def render(snap: Mapping[str, Any]) -> str:
    """`snap` laid out for a terminal: the run, its nodes, its ranks' copies, incidents, decisions."""
    when = time.strftime("%H:%M:%S", time.localtime(snap["time"]))
    lines = [
        f"run {snap['run_id']}  {when}  phase {snap['phase']}  generation {snap['generation']}  "
        f"leader {snap['leader'] or '-'} (term {snap['term']})  world {snap['world_size']}  "
        f"nodes {snap['min_nodes']}:{snap['max_nodes']}"
    ]
    if snap["restoring"]:
        r = snap["restoring"]
        lines.append(
            f"  generation {snap['generation']} restored step {r.get('checkpoint_step', -1)} "
            f"({r.get('checkpoint_source', '-')}, {r.get('recovery_mode', '-')}) "
            f"after {r.get('failure_kind', '-')}"
        )
    if snap["pending"].get("gave_up"):
        lines.append(f"  gave up: {snap['pending']['gave_up']}")
    elif snap["pending"].get("ended_failing"):
        lines.append(f"  ended failing: {snap['pending']['ended_failing']}")
    elif snap["pending"]:
        p = snap["pending"]
        lines.append(
            f"  restarting: {p.get('failure_kind', '?')} ({p.get('reason', '?')}), culprits "
            f"{', '.join(p.get('culprits', [])) or '-'}{', quarantined' if p.get('quarantine') else ''}"
        )
    lines += ["", f"{'NODE':<24} {'ROLE':<12} {'RANKS':<10} {'AGENT':<9} {'HEARTBEAT':>9}  ADDRESS"]
    for n in snap["nodes"]:
        ranks = f"{n['ranks'][0]}-{n['ranks'][-1]}" if n["ranks"] else "-"
        live = {True: "live", False: "SILENT", None: "?"}[n["live"]]
        role = n["role"] + ("*" if n["leader"] else "")
        if n["excluded_for"]:
            role = f"out: {n['excluded_for']}"
        beat = "-" if n["heartbeat"] is None else str(n["heartbeat"])
        lines.append(f"{n['node'][:24]:<24} {role[:12]:<12} {ranks:<10} {live:<9} {beat:>9}  {n['addr']}")
    lines += [
        "",
        f"{'RANK':>4}  {'NODE':<24} {'NEWEST':>6}  {'LOCAL':<12} {'REPLICATED':<12} {'DISK':<12} CERTIFIED",
    ]
    for r in snap["ranks"]:
        node = (r["node"] or "-")[:24]
        if not r["inventory"]:
            lines.append(f"{r['rank']:>4}  {node:<24} {'-':>6}  (no inventory yet)")
            continue
        lines.append(
            f"{r['rank']:>4}  {node:<24} {r['newest']:>6}  {_steps(r['local']):<12} "
            f"{_steps(r['replicated']):<12} {_steps(r['disk']):<12} {_steps(r['certified'])}"
        )
    incidents = snap["incidents"]
    lines += ["", f"incidents in generation {snap['generation']}: {len(incidents)}"]
    for v in incidents[-8:]:
        ranks = ",".join(str(x) for x in v.get("failed_ranks", [])) or "-"
        lines.append(
            f"  {v.get('kind', v.get('failure_kind', '?')):<18} ranks {ranks:<8} "
            f"{v.get('reason', '')}  [{v.get('source', '')}]"
        )
    lines += ["", "generations:"]
    for d in snap["decisions"][-6:]:
        culprits = ",".join(d.get("culprits") or []) or "-"
        admitted = ",".join(a.get("node", "?") for a in d.get("admitted") or []) or "-"
        step = d.get("checkpoint_step", "-")
        lines.append(
            f"  g{d.get('generation')}: {d.get('failure_kind', '?')} ({d.get('reason', '?')}) "
            f"culprits {culprits}  admitted {admitted}  restored step {step}"
        )
    return "\n".join(lines)


def run_monitor(
    endpoint: str,
    run_id: str,
    store_type: str = "tcp",
    interval_s: float = 2.0,
    once: bool = False,
    as_json: bool = False,
    timeout_s: float = 10.0,
    count: int = 0,
) -> int:
    """Watch the run until it closes (or `count` views, or one with `once`). Exit status: 0 when
    the run closed well or the watch ended, 1 when it gave up or its store went away, 2 when the
    store or the run cannot be found."""
    from lm_resiliency.manager import RunManager

    try:
        manager = RunManager(endpoint, run_id, store_type=store_type, timeout_s=timeout_s)
        manager.state()
    except (ValueError, LookupError) as exc:
        print(f"lm-resiliency monitor: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the store library's own errors (refused, timed out)
        print(f"lm-resiliency monitor: cannot reach the control store at {endpoint}: {exc}", file=sys.stderr)
        return 2
    tty = sys.stdout.isatty() and not as_json and not once
    shown = 0
    before: dict[str, int] | None = None
    try:
        if once:  # one view, with the agents' liveness judged over one interval
            before = manager.heartbeats()
            time.sleep(interval_s)
        while True:
            try:
                snap = snapshot(manager, before, interval_s)
                before = {n["node"]: n["heartbeat"] for n in snap["nodes"] if n["heartbeat"] is not None}
            except Exception as exc:
                print(
                    f"lm-resiliency monitor: the control store at {endpoint} went away (the job ended, or "
                    f"its store's host was lost): {exc}",
                    file=sys.stderr,
                )
                return 1
            if as_json:
                print(json.dumps(snap, sort_keys=True), flush=True)
            else:
                print(("\x1b[H\x1b[2J" if tty else "") + render(snap) + ("" if tty else "\n"), flush=True)
            shown += 1
            if snap["phase"] == "closed":
                return 1 if snap["pending"].get("gave_up") or snap["pending"].get("ended_failing") else 0
            if once or (count and shown >= count):
                return 0
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
