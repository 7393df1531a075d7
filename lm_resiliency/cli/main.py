"""`lm-resiliency`: the command-line entry point.

Subcommands arrive with the capabilities they front (monitor, report, campaign, demo); this version
offers `--version`, `--help` and `check-policy`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lm_resiliency._version import __version__

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
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
