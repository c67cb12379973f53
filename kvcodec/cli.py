"""The ``kvcodec`` command line. ``main(argv)`` is callable from tests and returns the exit code.

Each subcommand lives in its own module under :mod:`kvcodec.commands` and registers itself with
``register(subparsers)``. Errors that kvcodec raises on purpose print one line to stderr and
exit 1; argument errors exit 2.

Example:
    >>> from kvcodec.cli import main
    >>> main(["codecs"]) == 0  # doctest: +ELLIPSIS
    name...
    True
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from ._version import __version__
from .commands import Parser
from .errors import KVCodecError

#: Subcommand modules in the order ``--help`` lists them.
COMMANDS = ("codecs", "encode", "decode", "info", "verify", "capture", "calibrate", "eval", "bench")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="kvcodec", description="Compress, inspect and evaluate LLM KV caches.",
        epilog="`kvcodec COMMAND --help` describes each command; `kvcodec codecs` lists the codecs.",
    )
    p.add_argument("--version", action="version", version=f"kvcodec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f".commands.{name}", __package__)
        except ModuleNotFoundError as e:
            if e.name == f"{__package__}.commands.{name}":
                continue  # command not built yet
            raise
        mod.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on bad arguments
        return int(e.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in results files
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KVCodecError as e:
        print(f"kvcodec {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvcodec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (``kvcodec info f.kvc | head``): stop quietly, as Unix tools do;
        # point stdout at devnull so the interpreter's final flush does not raise again
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141


def entry() -> None:  # pragma: no cover - console script
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    entry()
