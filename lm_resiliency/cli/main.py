"""`lm-resiliency`: the command-line entry point.

Subcommands: `check-policy`, `shm` (GEMINI's shared-memory use and cleanup), `campaign` (validate a
fault campaign, preview its schedule, run a command with it armed, score a run against its ground
truth), `report` (render a job's fault reports), `monitor` (the live view of a torchrun job) and
`demo` (the quickstart). Parsing and rendering
only: the work is the library's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lm_resiliency._version import __version__
from lm_resiliency.config import DEFAULT_SHM_DIR

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lm-resiliency",
        description="Keep distributed LLM pre-training alive: SCOUT fault localization, GEMINI checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"lm-resiliency {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    check = sub.add_parser("check-policy", help="validate a worker policy TOML file and print its settings")
    check.add_argument("path", help="path to the policy TOML (schema_version = 1)")
    shm = sub.add_parser("shm", help="list what GEMINI holds in shared memory on this host; --clean reclaims")
    shm.add_argument(
        "--dir",
        default=None,
        help="GEMINI's shared-memory folder (default: $LM_RESILIENCY_SHM_DIR, as the jobs use it, "
        f"else {DEFAULT_SHM_DIR})",
    )
    shm.add_argument("--clean", action="store_true", help="delete runs with no live owner process")
    shm.add_argument(
        "--older-than",
        type=float,
        default=3600.0,
        metavar="S",
        help="only runs idle for at least S seconds (default 3600)",
    )
    camp = sub.add_parser("campaign", help="fault campaigns (schema_version 1): validate, schedule, score")
    csub = camp.add_subparsers(dest="campaign_command", metavar="ACTION")
    val = csub.add_parser("validate", help="check campaign files (or folders of *.json) and summarize them")
    val.add_argument("paths", nargs="+", metavar="PATH")
    sched = csub.add_parser("schedule", help="the occurrences a campaign fires in a run without restarts")
    sched.add_argument("path", metavar="PATH")
    sched.add_argument("--iterations", type=int, required=True, metavar="N", help="iterations 1..N")
    run = csub.add_parser(
        "run",
        help="run a command (a torchrun job, a script) with a campaign armed, then score it",
        description="Runs COMMAND with LM_RESILIENCY_FAULT_CAMPAIGN, LM_RESILIENCY_FAULT_GROUND_TRUTH and "
        "LM_RESILIENCY_REPORT_DIR set (ground truth and reports under --output-dir), then scores the "
        "job's reports against the ground truth: evaluation.json, printed too. Exit status: the "
        "command's when it failed, else 0.",
    )
    run.add_argument("path", metavar="CAMPAIGN")
    run.add_argument("--output-dir", required=True, metavar="DIR")
    run.add_argument("--window-s", type=float, default=120.0, help="a verdict's time after an injection")
    run.epilog = "usage: lm-resiliency campaign run CAMPAIGN --output-dir DIR -- COMMAND [ARG ...]"
    score = csub.add_parser("score", help="score a run: ground truth against the job's fault reports (JSON)")
    score.add_argument(
        "--ground-truth", required=True, metavar="DIR", help="the injector's ground-truth folder"
    )
    score.add_argument(
        "--reports", required=True, metavar="DIR", help="the job's report_dir (reports-rank*.jsonl)"
    )
    score.add_argument("--clean", nargs="*", default=[], metavar="DIR", help="report dirs of clean runs")
    score.add_argument("--window-s", type=float, default=120.0, help="a verdict's time after an injection")
    sub.add_parser(
        "demo",
        help="train, checkpoint, SIGKILL and resume one process; print JSON (lm-resiliency-quickstart)",
    )
    rep = sub.add_parser("report", help="render a job's fault reports (its report_dir), one line per verdict")
    rep.add_argument("dir", metavar="DIR", help="the report_dir (reports-rank*.jsonl)")
    rep.add_argument("--json", action="store_true", help="print the verdicts as JSON lines")
    mon = sub.add_parser(
        "monitor",
        help="the live view of a torchrun job (--rdzv-backend=lm_resiliency): nodes, copies, incidents",
        description="Reads the job's control store (the rendezvous endpoint) and shows its phase and "
        "generation, each node's role and agent liveness, each rank's GEMINI copies (in memory, held "
        "by peers, on disk, certified by SCOUT), the SCOUT verdicts of the current generation and the "
        "generations published so far. It only reads. Exit status: 0 when the run closed or the watch "
        "ended, 1 when the run gave up or its store went away, 2 when the store or the run is not found.",
    )
    mon.add_argument(
        "endpoint", metavar="ENDPOINT", help="the --rdzv-endpoint HOST:PORT (a path with --store-type file)"
    )
    mon.add_argument("--run-id", required=True, help="the job's --rdzv-id")
    mon.add_argument("--store-type", choices=("tcp", "file"), default="tcp", help="the rdzv-conf store_type")
    mon.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between views (> 0)")
    mon.add_argument(
        "--once", action="store_true", help="one view (liveness judged over one interval), then exit"
    )
    mon.add_argument(
        "--count", type=int, default=0, metavar="N", help="stop after N views (0: until the run closes)"
    )
    mon.add_argument("--json", action="store_true", help="one JSON object per view")
    mon.add_argument("--timeout", type=float, default=10.0, metavar="S", help="store connection timeout")
    return parser


def _campaign(args: argparse.Namespace) -> int:
    import json

    from lm_resiliency.faults.campaign import CampaignError, Schedule, load_campaign, load_campaigns
    from lm_resiliency.faults.scoring import read_reports

    try:
        if args.campaign_command == "validate":
            for path in args.paths:
                for c in load_campaigns(path):
                    faults = [f for inc in c.incidents for f in inc.faults]
                    print(
                        json.dumps(
                            {
                                "name": c.name,
                                "seed": c.seed,
                                "digest": c.digest(),
                                "incidents": len(c.incidents),
                                "faults": len(faults),
                                "types": sorted({f.type for f in faults}),
                                "injectable": _injectable(c),
                            },
                            sort_keys=True,
                        )
                    )
            return 0
        if args.campaign_command == "schedule":
            if args.iterations < 0:
                print("lm-resiliency: --iterations must be >= 0", file=sys.stderr)
                return 2
            c = load_campaign(args.path)
            s = Schedule(c)
            for i in range(1, args.iterations + 1):
                for occ in s.due(i):
                    inc = c.incident(occ.incident_id)
                    for f in inc.faults:
                        rank = f.target.rank if f.target.rank is not None else 0
                        print(f"{occ.occurrence_id}\t{f.fault_id}\t{f.type}\trank {rank}\t{f.target.surface}")
            return 0
    except CampaignError as exc:
        print(f"lm-resiliency: invalid campaign: {exc}", file=sys.stderr)
        return 2
    if args.campaign_command == "run":
        return _campaign_run(args)
    if args.campaign_command == "score":
        from lm_resiliency.faults.inject import read_ground_truth
        from lm_resiliency.faults.scoring import evaluate, evaluate_clean

        skipped: list[str] = []
        try:
            if not os.path.isdir(args.ground_truth):
                raise FileNotFoundError(f"no ground-truth folder {args.ground_truth}")
            truth = read_ground_truth(args.ground_truth, skipped)
            out = evaluate(truth, read_reports(args.reports, skipped), window_s=args.window_s)
            if args.clean:
                out["clean"] = evaluate_clean([read_reports(d, skipped) for d in args.clean])
        except OSError as exc:
            print(f"lm-resiliency: {exc}", file=sys.stderr)
            return 2
        _warn_skipped(skipped)
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print("lm-resiliency campaign: choose validate, schedule or score", file=sys.stderr)
    return 2


def _campaign_run(args: argparse.Namespace) -> int:
    import json
    import subprocess
    from pathlib import Path

    from lm_resiliency.faults.campaign import CampaignError, load_campaign
    from lm_resiliency.faults.inject import check_injectable, read_ground_truth
    from lm_resiliency.faults.scoring import evaluate, read_reports

    cmd = args.cmd
    if not cmd:
        print("lm-resiliency campaign run: give the command after --", file=sys.stderr)
        return 2
    try:
        campaign = load_campaign(args.path)
        check_injectable(campaign)
    except CampaignError as exc:
        print(f"lm-resiliency: invalid campaign: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output_dir).resolve()
    truth, reports = out / "ground-truth", out / "reports"
    env = {
        **os.environ,
        "LM_RESILIENCY_FAULT_CAMPAIGN": str(Path(args.path).resolve()),
        "LM_RESILIENCY_FAULT_GROUND_TRUTH": str(truth),
        "LM_RESILIENCY_REPORT_DIR": str(reports),
    }
    reports.mkdir(parents=True, exist_ok=True)
    try:
        code = subprocess.call(cmd, env=env)
    except OSError as exc:
        print(f"lm-resiliency: cannot run {cmd[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    skipped: list[str] = []
    ev = evaluate(
        read_ground_truth(truth, skipped) if truth.is_dir() else [],
        read_reports(str(reports), skipped),
        args.window_s,
    )
    _warn_skipped(skipped)
    ev["campaign"], ev["command_exit_code"] = campaign.name, code
    (out / "evaluation.json").write_text(json.dumps(ev, indent=2, sort_keys=True))
    print(json.dumps(ev, indent=2, sort_keys=True))
    return code if code >= 0 else 128 - code  # a signal, as a shell reports it


def _warn_skipped(skipped: list[str], shown: int = 5) -> None:
    """Lines of the reports or ground truth that were no record, on stderr (a torn last line from
    a kill is not among them): a damaged file is said, not scored as if nothing were in it."""
    if not skipped:
        return
    print(f"lm-resiliency: {len(skipped)} unreadable line(s) skipped:", file=sys.stderr)
    for line in skipped[:shown]:
        print(f"  {line}", file=sys.stderr)
    if len(skipped) > shown:
        print(f"  ... and {len(skipped) - shown} more", file=sys.stderr)


def _injectable(c: object) -> str:
    """'yes', or why this version cannot inject the campaign (the CLI imports no torch for it)."""
    try:
        from lm_resiliency.faults.inject import check_injectable
    except ImportError as exc:  # pragma: no cover - torch missing
        return f"unknown ({exc})"
    from lm_resiliency.faults.campaign import CampaignError

    try:
        check_injectable(c)  # type: ignore[arg-type]
    except CampaignError as exc:
        return f"no: {exc}"
    return "yes"


def _report(args: argparse.Namespace) -> int:
    import datetime
    import json

    from lm_resiliency.faults.scoring import read_reports, verdicts

    skipped: list[str] = []
    try:
        reports = read_reports(args.dir, skipped)
    except OSError as exc:
        print(f"lm-resiliency: {exc}", file=sys.stderr)
        return 2
    _warn_skipped(skipped)
    found = verdicts(reports)
    for v in found:
        if args.json:
            print(
                json.dumps(
                    {
                        "time": v.time,
                        "kind": v.kind,
                        "failed_ranks": list(v.failed_ranks),
                        "scope": v.scope,
                        "reason": v.reason,
                        "reported_by": v.reports,
                        "resources": sorted(v.resources),
                    },
                    sort_keys=True,
                )
            )
            continue
        when = datetime.datetime.fromtimestamp(v.time).strftime("%Y-%m-%d %H:%M:%S")
        ranks = ",".join(map(str, v.failed_ranks)) or "-"
        print(f"{when}  {v.kind:<18} ranks {ranks:<10} {v.scope:<10} {v.reason}  ({v.reports} reports)")
    if not args.json:
        print(f"{len(found)} verdicts from {len(reports)} reports")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # What follows `--` is a command to run (`campaign run`), never our options.
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.cmd = cmd
    if args.command == "check-policy":
        import dataclasses
        import json

        from lm_resiliency.config import load_policy
        from lm_resiliency.errors import ConfigError

        try:
            policy = load_policy(args.path)
        except ConfigError as exc:
            print(f"lm-resiliency: invalid policy: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(dataclasses.asdict(policy), indent=2, sort_keys=True))
        return 0
    if args.command == "shm":
        from lm_resiliency.gemini.hygiene import reclaim_stale_runs, usage

        if args.dir is None:
            args.dir = os.environ.get("LM_RESILIENCY_SHM_DIR") or DEFAULT_SHM_DIR

        if args.clean:
            for u in reclaim_stale_runs(args.dir, args.older_than):
                print(
                    f"reclaimed {u.run}/{u.node}: {u.bytes} bytes in {u.files} files (idle {u.idle_s:.0f}s)"
                )
        for u in usage(args.dir):
            owners = ",".join(map(str, u.live_owners)) or "none"
            print(
                f"{u.run}/{u.node}: {u.bytes} bytes in {u.files} files, "
                f"live owner pids: {owners}, idle {u.idle_s:.0f}s"
            )
        return 0
    if args.command == "campaign":
        return _campaign(args)
    if args.command == "report":
        return _report(args)
    if args.command == "monitor":
        from lm_resiliency.cli.monitor import run_monitor

        if not args.interval > 0 or not args.timeout > 0 or args.count < 0:
            print(
                "lm-resiliency monitor: --interval and --timeout must be > 0, --count >= 0", file=sys.stderr
            )
            return 2
        return run_monitor(
            args.endpoint,
            args.run_id,
            store_type=args.store_type,
            interval_s=args.interval,
            once=args.once,
            as_json=args.json,
            timeout_s=args.timeout,
            count=args.count,
        )
    if args.command == "demo":
        from lm_resiliency.cli.quickstart import main as quickstart

        return quickstart([])
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
