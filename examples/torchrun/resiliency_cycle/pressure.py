"""Run fault campaigns against a real torchrun job and check the whole resiliency cycle.

    python -m examples.torchrun.resiliency_cycle.pressure orchestrate --framework pytorch \\
        --fault-campaign-dir DIR (--cpu-nodes N | --gpus 0,1,...) [--standby-nodes S] [--steps N] \\
        [--output-dir OUT]

One synthetic node per listed GPU (or per CPU node): a torchrun agent with the `lm_resiliency`
rendezvous backend and its own machine-id file, all on this host. The first nodes train, the last
`standby_nodes` park as standbys (the campaign's `metadata.standby_nodes`, else `--standby-nodes`,
default 1 from 3 nodes up). `metadata.total_steps` (else `--steps`) sets the run's length.

For each campaign (every `*.json` in the folder, all validated first), the orchestrator runs
`examples.production_loops.<framework>` once uninterrupted (the baseline, shared by campaigns of the
same shape) and once with the campaign armed (`LM_RESILIENCY_FAULT_CAMPAIGN`). The job finds each
fault with its own detection; the leader restarts in place or swaps a standby in. A campaign passes
only when:

- every incident completed: each occurrence the schedule fires within the run was injected;
- every successor generation restored the step and topology its restart context selected;
- the job finished and its final parameters equal the baseline's bit for bit.

It writes `summary.json` (per campaign: generations, incidents with the action the job took and the
one expected (the fault's `target.metadata.recovery_action`, else FAILURES.md's), the scoring of
detection against the ground truth, the verdict) to the output folder and exits 0 only when every
campaign passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from examples.torchrun.resiliency_cycle import cluster
from lm_resiliency.core.taxonomy import CYCLE_ACTIONS
from lm_resiliency.faults.campaign import Campaign, CampaignError, Schedule, load_campaigns
from lm_resiliency.faults.inject import check_injectable, read_ground_truth
from lm_resiliency.faults.scoring import evaluate, read_reports

FRAMEWORKS = ("pytorch", "deepspeed", "megatron", "torchtitan")
SHIPPED = ("pytorch", "megatron", "deepspeed")
# Loops that need a framework installed beside torch: (the module it imports, how to get it).
NEEDS = {"deepspeed": ("deepspeed", "pip install deepspeed")}


class UsageError(Exception):
    """A campaign or an option does not fit this run; the message says which."""


def _int_meta(c: Campaign, key: str) -> int | None:
    v = c.metadata.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UsageError(f"campaign {c.name!r}: metadata.{key} must be a JSON int >= 0, got {v!r}")
    return v


def shape(c: Campaign, nodes: int, standby_default: int, steps_default: int) -> tuple[int, int, int]:
    """(active nodes, standby nodes, steps) of a campaign's run on `nodes` synthetic nodes."""
    standby = _int_meta(c, "standby_nodes")
    standby = standby_default if standby is None else standby
    active = _int_meta(c, "active_nodes")
    if active is None:
        active = nodes - standby
    if active < 2:
        raise UsageError(f"campaign {c.name!r}: needs at least 2 active nodes, has {active}")
    if active + standby > nodes:
        raise UsageError(
            f"campaign {c.name!r}: {active} active + {standby} standby nodes, but only {nodes} were given"
        )
    steps = _int_meta(c, "total_steps") or steps_default
    for inc in c.incidents:
        for f in inc.faults:
            rank = f.target.rank if f.target.rank is not None else 0
            if rank >= active:
                raise UsageError(
                    f"campaign {c.name!r}: fault {f.fault_id!r} targets rank {rank}, "
                    f"but the job has ranks 0..{active - 1}"
                )
    return active, standby, steps


def loop_args(c: Campaign, framework: str) -> tuple[str, ...]:
    """The loop's own options a campaign's metadata sets: `zero_stage` (0, 1 or 2) and `bf16`
    (true: with ZeRO 1 or 2) for the DeepSpeed loop, which runs ZeRO stage 0 in fp32 otherwise."""
    stage = _int_meta(c, "zero_stage")
    bf16 = c.metadata.get("bf16", False)
    if not isinstance(bf16, bool):
        raise UsageError(f"campaign {c.name!r}: metadata.bf16 must be true or false, got {bf16!r}")
    if (stage is not None or bf16) and framework != "deepspeed":
        raise UsageError(
            f"campaign {c.name!r}: metadata.zero_stage and metadata.bf16 set the DeepSpeed loop's "
            f"engine; this run's framework is {framework!r}"
        )
    if stage is not None and stage > 2:
        raise UsageError(f"campaign {c.name!r}: metadata.zero_stage must be 0, 1 or 2, got {stage}")
    if bf16 and not stage:
        raise UsageError(f"campaign {c.name!r}: metadata.bf16 needs metadata.zero_stage 1 or 2")
    return (*(("--zero-stage", str(stage)) if stage is not None else ()), *(("--bf16",) if bf16 else ()))


def expected_occurrences(c: Campaign, steps: int) -> list[tuple[str, int]]:
    """(incident id, iteration) of each first occurrence the schedule fires in iterations 1..steps.
    Iteration `steps` is the run's last step: a fault in it (or after its optimizer step) is found
    and recovered from as any other's. Before, it was left out of the summary: a reordered output
    in the last step, never found, failed only the bitwise check, with no incident to say why."""
    s = Schedule(c)
    return [(o.incident_id, o.iteration) for i in range(1, steps + 1) for o in s.due(i)]


def _policy(base: Path, report_dir: Path, c: Campaign) -> Path:
    """The example's policy with this run's report folder (a node-local setting), and what the
    campaign's faults need to be seen at all:
    - a module's output damaged on one rank is averaged into every replica's gradients by the
      all-reduce: only an audit (a peer re-executing the rank's step) sees it, so every step is
      audited;
    - a byte flipped in a held copy is found by its checksums when a restore reads it; one that no
      restore needs (its owner's next capture replaces it) only by `verify_integrity`."""
    faults = [f for inc in c.incidents for f in inc.faults]
    lines = cluster.POLICY.read_text().splitlines()
    at = lines.index("[replay]") + 1
    lines.insert(at, f"report_dir = {json.dumps(str(report_dir))}")
    if any(f.target.surface == "output" for f in faults):
        lines.insert(at, "audit_interval = 1")
    if any(f.type == "checkpoint_corruption" for f in faults):
        lines.insert(lines.index("[checkpoint]") + 1, "verify_integrity = true")
    p = base / "policy.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def _generations(val: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(val.glob("generation-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        doc = json.loads(f.read_text())
        ctx = doc.get("restart_context") or {}
        dec = doc.get("recovery_decision") or {}
        g = {
            "generation": doc["generation"],
            "resumed_at_step": doc["start_step"],
            "selected_step": ctx.get("checkpoint_step"),
            "failure_kind": ctx.get("failure_kind", "none"),
            "reason_code": ctx.get("reason_code", "startup"),
            "culprits": ctx.get("culprits", []),
            "admitted": ctx.get("admitted", []),
            "recovery_mode": dec.get("recovery_mode"),
            "restored_from": dec.get("reason"),
        }
        problems = []
        if doc["generation"] > 0:
            want = ctx.get("checkpoint_step")
            if want is None:
                problems.append("no restart context")
            elif want >= 0 and (doc["start_step"] != want or dec.get("checkpoint_step") != want):
                problems.append(f"restored step {dec.get('checkpoint_step')}, the context selected {want}")
            topo, have = ctx.get("topology_digest"), dec.get("topology_digest")
            if topo and have and topo != have:
                problems.append(f"restored topology {have}, the context selected {topo}")
        g["restored_as_selected"] = not problems
        g["problems"] = problems
        out.append(g)
    return out


def _rolled_back(
    truth: list[Any], incident_id: str, iteration: int, gens: list[dict[str, Any]]
) -> int | None:
    """The generation that undid an occurrence before anything could find it: the first one after
    the one it was injected in that resumed at a step before its iteration (a recovery from an
    earlier incident, decided while the job trained on past this one). With `retrigger: once` it is
    not injected again, and its effect is gone with the steps rolled back: it cannot be found, and
    it is not missed. None when no generation did."""
    when = [g.generation or 0 for g in truth if (g.incident_id, g.iteration) == (incident_id, iteration)]
    if not when:
        return None
    after = [g for g in gens if g["generation"] > min(when) and g["resumed_at_step"] < iteration]
    return min(g["generation"] for g in after) if after else None


def _undone(
    occ: list[dict[str, Any]], truth: list[Any], incident_id: str, iteration: int, gens: list[dict[str, Any]]
) -> int | None:
    """`_rolled_back` for an occurrence nothing reported (`occ`: its scored occurrences). One that
    was detected was found, even where no verdict named its culprit (replicas split in halves, no
    majority): the recovery that rolled it back was its own. Before, such an occurrence read
    "rolled back by generation 1 before it could be found" of the generation its own verdict made."""
    if any(o["localized"] or o["detected"] for o in occ):
        return None
    return _rolled_back(truth, incident_id, iteration, gens)


def _action(
    truth: list[Any], incident_id: str, iteration: int, kinds: set[str], gens: list[dict[str, Any]]
) -> str:
    """What the job did about an occurrence: the generation after the one it was injected in, when
    a failure of one of `kinds` (what its verdicts said) started it, admitted a standby ("replace")
    or restarted on the same nodes ("restart"); "none" when the job went on without one for it (a
    damaged copy skipped, a slow rank only reported)."""
    when = [g.generation for g in truth if (g.incident_id, g.iteration) == (incident_id, iteration)]
    if not when or when[0] is None:
        return "none"
    after = [g for g in gens if g["generation"] == when[0] + 1 and g["failure_kind"] in kinds]
    if not after:
        return "none"
    return "replace" if after[0]["admitted"] else "restart"


def _final_equal(a: Path, b: Path) -> bool:
    import torch

    if not (a.exists() and b.exists()):
        return False
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run_campaign(
    c: Campaign,
    path: str,
    out: Path,
    baseline: Path,
    active: int,
    standby: int,
    steps: int,
    framework: str,
    gpus: list[int] | None,
    timeout: float,
    options: tuple[str, ...] = (),
) -> dict[str, Any]:
    name = f"campaign-{c.name}"
    base = out / name
    base.mkdir(parents=True, exist_ok=True)
    truth_dir, report_dir = base / "ground-truth", base / "reports"
    env = {"LM_RESILIENCY_FAULT_CAMPAIGN": path, "LM_RESILIENCY_FAULT_GROUND_TRUTH": str(truth_dir)}
    t0 = time.monotonic()
    procs, val = cluster.launch(
        out,
        name,
        active + standby,
        steps,
        min_nodes=active,
        policy=_policy(base, report_dir, c),
        framework=framework,
        env=env,
        gpus=gpus,
        loop_args=options,
    )
    codes = cluster.finish(procs, timeout)
    wall = time.monotonic() - t0
    truth = read_ground_truth(truth_dir)
    reports = read_reports(report_dir) if report_dir.is_dir() else []
    score = evaluate(truth, reports)
    injected = {(g.incident_id, g.iteration, g.fault_id) for g in truth}
    gens = _generations(val)
    incidents = []
    for incident_id, iteration in expected_occurrences(c, steps):
        inc = c.incident(incident_id)
        missing = [f.fault_id for f in inc.faults if (incident_id, iteration, f.fault_id) not in injected]
        occ = [
            o
            for o in score["occurrences"]
            if o["occurrence_id"].split("#")[0] == f"{incident_id}@{iteration}"
        ]
        # The campaign's own word (a fault's `target.metadata.recovery_action`), else FAILURES.md's.
        wanted = {
            str(f.target.metadata.get("recovery_action") or CYCLE_ACTIONS.get(f.type)) for f in inc.faults
        }
        incidents.append(
            {
                "occurrence": f"{incident_id}@{iteration}",
                "completed": not missing,
                "not_injected": missing,
                "localized": any(o["localized"] for o in occ),
                "kind_match": any(o["kind_match"] for o in occ),
                "reported_kind": occ[0]["reported_kind"] if occ else None,
                "detection_latency_s": occ[0]["detection_latency_s"] if occ else None,
                "action": _action(
                    truth,
                    incident_id,
                    iteration,
                    {o["reported_kind"] for o in occ} | {k for o in occ for k in o["expected_kinds"]},
                    gens,
                ),
                "expected_action": "replace" if "replace" in wanted else "restart",
                "rolled_back_by_generation": _undone(occ, truth, incident_id, iteration, gens),
            }
        )
    finished = (val / "final.pt").exists()
    equal = _final_equal(baseline / "final.pt", val / "final.pt")
    passed = (
        all(i["completed"] for i in incidents)
        and all(g["restored_as_selected"] for g in gens)
        and finished
        and equal
    )
    return {
        "campaign": c.name,
        "file": path,
        "digest": c.digest(),
        "nodes": {"active": active, "standby": standby},
        "steps": steps,
        "wall_s": round(wall, 1),
        "agent_exit_codes": codes,
        "generations": gens,
        "incidents": incidents,
        "evaluation": {
            **{k: v for k, v in score.items() if k != "occurrences"},
            # Occurrences a recovery from an earlier incident undid before they could be found.
            "rolled_back_before_found": sum(
                1 for i in incidents if i["rolled_back_by_generation"] is not None
            ),
            "actions_as_expected": sum(1 for i in incidents if i["action"] == i["expected_action"]),
        },
        "finished": finished,
        "final_state_bitwise_equal_to_baseline": equal,
        "passed": passed,
        "logs": str(base),
    }


def orchestrate(args: argparse.Namespace) -> int:
    if args.framework not in SHIPPED:
        print(
            f"pressure: framework {args.framework!r}: examples.production_loops.{args.framework} is not "
            f"shipped by this version (shipped: {', '.join(SHIPPED)})",
            file=sys.stderr,
        )
        return 2
    if args.framework in NEEDS:
        module, install = NEEDS[args.framework]
        if importlib.util.find_spec(module) is None:
            print(
                f"pressure: framework {args.framework!r}: examples.production_loops.{args.framework} "
                f"needs {module!r}, which this Python cannot import ({install})",
                file=sys.stderr,
            )
            return 2
    gpus = None
    if args.gpus is not None:
        try:
            gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
        except ValueError:
            print(
                f"pressure: --gpus expects a comma-separated list of GPU indices, got {args.gpus!r}",
                file=sys.stderr,
            )
            return 2
        nodes = len(gpus)
    else:
        nodes = args.cpu_nodes
    standby_default = args.standby_nodes if args.standby_nodes is not None else (1 if nodes >= 3 else 0)
    try:
        campaigns = load_campaigns(args.fault_campaign_dir)
        plans = []
        for c in campaigns:
            check_injectable(c)
            plans.append((c, *shape(c, nodes, standby_default, args.steps), loop_args(c, args.framework)))
    except (CampaignError, UsageError) as exc:
        print(f"pressure: {exc}", file=sys.stderr)
        return 2
    folder = Path(args.fault_campaign_dir)
    paths = sorted(f for f in folder.glob("*.json") if f.is_file()) if folder.is_dir() else [folder]
    files = {c.name: str(f.resolve()) for c, f in zip(campaigns, paths, strict=True)}
    out = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="lmr-pressure-"))
    out.mkdir(parents=True, exist_ok=True)
    baselines: dict[tuple[int, int, tuple[str, ...]], Path] = {}
    results = []
    for c, active, standby, steps, options in plans:
        key = (active, steps, options)
        if key not in baselines:
            print(f"baseline: {active} nodes, {steps} steps {' '.join(options)}...", flush=True)
            procs, val = cluster.launch(
                out,
                f"baseline-{active}x{steps}{''.join(options).replace('--', '-')}",
                active,
                steps,
                framework=args.framework,
                gpus=gpus,
                loop_args=options,
            )
            codes = cluster.finish(procs, args.timeout_s)
            if any(code != 0 for code in codes) or not (val / "final.pt").exists():
                print(
                    f"pressure: the uninterrupted run failed (exit codes {codes}); logs in {val.parent}",
                    file=sys.stderr,
                )
                return 1
            baselines[key] = val
        print(
            f"campaign {c.name!r}: {active} active + {standby} standby nodes, {steps} steps ...", flush=True
        )
        r = run_campaign(
            c,
            files[c.name],
            out,
            baselines[key],
            active,
            standby,
            steps,
            args.framework,
            gpus,
            args.timeout_s,
            options,
        )
        results.append(r)
        for g in r["generations"]:
            print(
                f"   generation {g['generation']}: resumed at step {g['resumed_at_step']} "
                f"({g['failure_kind']}/{g['reason_code']}, culprits {g['culprits']}, "
                f"admitted {g['admitted']})",
                flush=True,
            )
        for i in r["incidents"]:
            print(
                f"   {i['occurrence']}: completed={i['completed']} localized={i['localized']} "
                f"kind={i['reported_kind']} action={i['action']} (expected: {i['expected_action']})"
                + (
                    f" rolled back by generation {i['rolled_back_by_generation']} before it could be found"
                    if i["rolled_back_by_generation"] is not None
                    else ""
                ),
                flush=True,
            )
        print(f"   passed={r['passed']} (bitwise={r['final_state_bitwise_equal_to_baseline']})", flush=True)
    summary = {
        "framework": args.framework,
        "nodes": nodes,
        "device": "gpu" if gpus is not None else "cpu",
        "campaigns": results,
        "passed": all(r["passed"] for r in results),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"summary: {out / 'summary.json'} (passed={summary['passed']})", flush=True)
    if summary["passed"] and not args.keep:
        for d in out.iterdir():
            if d.is_dir():
                shutil.rmtree(d / "shm", ignore_errors=True)
    return 0 if summary["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m examples.torchrun.resiliency_cycle.pressure",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    o = sub.add_parser("orchestrate", help="run every campaign in a folder against a torchrun job")
    o.add_argument("--framework", choices=FRAMEWORKS, default="pytorch")
    o.add_argument("--fault-campaign-dir", required=True, help="a campaign file, or a folder of *.json")
    where = o.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", help="one synthetic node per listed GPU: 0,1,2,...")
    where.add_argument("--cpu-nodes", type=int, help="on a machine without GPUs: this many synthetic nodes")
    o.add_argument(
        "--standby-nodes", type=int, default=None, help="parked standbys (default: 1 from 3 nodes up)"
    )
    o.add_argument("--steps", type=int, default=40, help="steps when a campaign has no metadata.total_steps")
    o.add_argument(
        "--output-dir", default=None, help="summary.json and the logs (default: a new temp folder)"
    )
    o.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    o.add_argument("--keep", action="store_true", help="keep GEMINI's shared-memory files after a pass")
    args = ap.parse_args(argv)
    if args.cpu_nodes is not None and args.cpu_nodes < 2:
        ap.error("--cpu-nodes must be >= 2")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
