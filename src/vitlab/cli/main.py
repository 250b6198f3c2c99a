"""`vitlab` entry point: parses the command line and dispatches to one subcommand module."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from vitlab import __version__
from vitlab.validation import ConfigError

# The commands' modules import PyTorch (about 2 s): build_parser imports them, inside main's
# handling of a Ctrl-C, so that one in the command's first seconds is said in one line.
COMMANDS = (
    "models",
    "cost",
    "train",
    "eval",
    "fewshot",
    "probe",
    "predict",
    "analyze",
    "convert",
    "export",
    "data",
    "reproduce",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitlab",
        description="Vision Transformers (Dosovitskiy et al., ICLR 2021): build, inspect and "
        "measure ViTs, and convert and export their checkpoints. `vitlab COMMAND --help` "
        "explains each command.",
    )
    parser.add_argument("--version", action="version", version=f"vitlab {__version__}")
    add_verbosity(parser)
    parser.set_defaults(verbose=0, quiet=0)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"vitlab.cli.{name}").add_parser(sub)
    commands = list(sub.choices.values())
    for command in commands:  # `vitlab -q train`, `vitlab train -q`, `vitlab data shard -q`
        add_verbosity(command)
        for action in command._actions:  # a command's own commands (data shard) too
            if isinstance(action, argparse._SubParsersAction):
                commands += action.choices.values()
    return parser


def add_verbosity(parser: argparse.ArgumentParser) -> None:
    """-v / -q, counted; SUPPRESS keeps a subcommand's absent flag from hiding the main one's."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="more messages: -v adds details (debug), each on a line naming its module",
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="count",
        default=argparse.SUPPRESS,
        help="fewer messages: -q hides notes and warnings (skipped images, loading notes, "
        "guesses, libraries' warnings) and progress bars, leaving results and errors",
    )


class _CliFormatter(logging.Formatter):
    """`vitlab: warning: MESSAGE` (no source line, unlike warnings.warn); with -v each line also
    names the module that wrote it."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        kind = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        where = f" [{record.name}]" if self.verbose else ""
        return f"vitlab: {kind}{record.getMessage()}{where}"


def _library_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: object
) -> None:
    """A Python warning (PyTorch's, another library's) as a `vitlab: warning:` line naming its
    kind and source, which -q hides with vitlab's own."""
    parts = Path(filename).parts
    if "site-packages" in parts:  # torch/utils/data/dataloader.py, not the venv's whole path
        parts = parts[len(parts) - parts[::-1].index("site-packages") :]
    where = "/".join(parts[-4:])
    logging.getLogger("vitlab.warnings").warning(
        "%s (%s, %s:%d)", str(message).strip(), category.__name__, where, lineno
    )


@contextlib.contextmanager
def cli_logging(verbose: int, quiet: int, python_warnings: bool = False) -> Iterator[None]:
    """While a command runs, messages of the `vitlab` loggers go to stderr through one handler,
    at the level -v / -q set (default: notes and warnings shown); with `python_warnings` (the
    command, not an in-process call) Python's warnings too, as vitlab's warning lines."""
    level = logging.DEBUG if verbose > quiet else logging.ERROR if quiet > verbose else logging.INFO
    logger = logging.getLogger("vitlab")
    saved = logger.level, logger.propagate, warnings.showwarning
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CliFormatter(level == logging.DEBUG))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    if python_warnings:
        warnings.showwarning = _library_warning
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate, warnings.showwarning = saved


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with KEY=VALUE overrides taken wherever they stand (argparse leaves
    those after an option, as in `convert SRC DST --to hf num_classes=10`, unparsed)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = [x for x in rest if "=" in x and not x.startswith("-")]
    if rest and (overrides != rest or not hasattr(args, "overrides")):
        while chosen := [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
            parser = chosen[0].choices[getattr(args, chosen[0].dest)]  # the command's own usage
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


_AFTER_CTRL_C = {
    "train": " (a run keeps the checkpoints it saved: `vitlab train --resume RUN` continues "
    "from the last one, and finishes the test evaluation of a trained run)",
    "reproduce": "; rerun the same command to continue",
}


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread while the command runs (so it ends with a
    line that says what was kept, not silently), the caller's handler restored after. Left as it
    is: off the main thread, where the caller ignores SIGTERM, and under torchrun (whose agent
    sends it to every rank, maybe inside a collective that a Python handler would wait out)."""

    def handle(signum: int, frame: object) -> None:
        raise Terminated

    from vitlab.runtime import Terminated, handling, launched_processes

    alone = launched_processes() == 1
    with handling((signal.SIGTERM,) if alone else (), handle, keep_ignored=True):
        yield


# a file where a folder is needed, a folder where a file is, no permission: input, not a fault
BLOCKED = (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def _blocked(e: OSError) -> str:
    """What an OSError from writing or reading a path says: a file where a folder is needed
    (`--cache-dir FILE`, a DST that is a file) by name, else the path and the reason."""
    from vitlab.runtime import blocking_file

    file = e.filename and blocking_file(Path(os.fsdecode(e.filename)))
    if isinstance(e, FileExistsError | NotADirectoryError) and file:
        return f"{file} is a file, not a folder: name a folder (new or existing) there"
    if e.filename and e.strerror:  # "cannot write or read there: [Errno 30] ...: 'PATH'"
        return f"cannot write or read {os.fsdecode(e.filename)}: {e.strerror}"
    return f"cannot write or read there: {e}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)  # imports the commands' modules, and PyTorch with them
    except KeyboardInterrupt:  # a Ctrl-C in those first seconds, before any work
        print("vitlab: interrupted", file=sys.stderr)
        return 130
    from vitlab.models.registry import UnknownModelError
    from vitlab.runtime import Terminated, first_rank, tune_allocator

    if argv is None:  # the command (not a caller's in-process call): reuse freed memory
        tune_allocator()
    try:
        with cli_logging(args.verbose, args.quiet, argv is None), sigterm_raises():
            return args.run(args) or 0
    except (ConfigError, UnknownModelError, ValueError) as e:
        mine = not isinstance(e, ConfigError | UnknownModelError)  # settings: every rank of a
        if mine or first_rank(local=True):  # machine refuses them alike,
            print(f"vitlab {args.command}: error: {e}", file=sys.stderr)  # one says so
        return 2
    except BrokenPipeError:  # `vitlab models | head`
        return 0
    except KeyboardInterrupt:  # a Ctrl-C outside training's loop (a second one inside it)
        if args.verbose > args.quiet:
            raise
        print(f"vitlab {args.command}: interrupted{_AFTER_CTRL_C.get(args.command, '')}",
              file=sys.stderr)  # fmt: skip
        return 130
    except Terminated:  # 128 + SIGTERM, as the default handler's exit would give
        print(f"vitlab {args.command}: terminated{_AFTER_CTRL_C.get(args.command, '')}",
              file=sys.stderr)  # fmt: skip
        return 143
    except OSError as e:  # a lost mount, a full disk outside checkpoints: one line (-v: raised)
        if isinstance(e, BLOCKED) or e.errno == errno.EROFS:  # a place the command cannot use:
            print(f"vitlab {args.command}: error: {_blocked(e)}", file=sys.stderr)  # input (2)
            return 2
        if args.verbose > args.quiet:
            raise
        print(f"vitlab {args.command}: error: {e} (-v shows where)", file=sys.stderr)
        return 1
