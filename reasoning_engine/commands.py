"""Where each subsystem's subcommands come from. A listed module defines `register_cli(subparsers)` and keeps its
heavy imports (torch, fastapi) inside the command functions so `reasoning-engine --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
from typing import Callable

_MODULES = [
    "reasoning_engine.server.cli",
    "reasoning_engine.generate_cli",
    "reasoning_engine.speculative.replay",
    "reasoning_engine.bench.cli",
    "reasoning_engine.router.cli",
]


def _registrar(module_name: str) -> Callable[[argparse._SubParsersAction], None]:
    def register(subparsers: argparse._SubParsersAction) -> None:
        importlib.import_module(module_name).register_cli(subparsers)

    return register


REGISTRARS = [_registrar(name) for name in _MODULES]
