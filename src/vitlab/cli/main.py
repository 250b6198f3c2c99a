"""`vitlab` entry point: parses the command line and dispatches to one subcommand module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vitlab import __version__
from vitlab.cli import analyze, convert, cost, export, models, predict, train
from vitlab.cli import eval as eval_cmd
from vitlab.config import ConfigError
from vitlab.models.registry import UnknownModelError

COMMANDS = (models, cost, train, eval_cmd, predict, analyze, convert, export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitlab",
        description="Vision Transformers (Dosovitskiy et al., ICLR 2021): build, inspect and "
        "measure ViTs, and convert and export their checkpoints. `vitlab COMMAND --help` "
        "explains each command.",
    )
    parser.add_argument("--version", action="version", version=f"vitlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (ConfigError, UnknownModelError, ValueError) as e:
        print(f"vitlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `vitlab models | head`
        return 0
