"""The `reasoning-engine` command line: each subsystem registers its own subcommands."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """Collect the subcommands; each module owns its arguments through a `register_cli(subparsers)` function."""
    from reasoning_engine import commands

    parser = argparse.ArgumentParser(prog="reasoning-engine", description="Inference engine and OpenAI-compatible server for reasoning models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in commands.REGISTRARS:
        register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
