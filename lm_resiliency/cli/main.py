"""`lm-resiliency`: the command-line entry point.

Subcommands arrive with the capabilities they front (monitor, report, campaign, demo); this version
offers `--version`, `--help`, `check-policy` and `shm` (GEMINI's shared-memory use and cleanup).
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
