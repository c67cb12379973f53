"""One module per CLI subcommand; each defines ``register(subparsers)``.

The modules import nothing heavy at their top level (torch, numpy, the codecs): building the parser
imports them all, and ``kvcodec --help`` should answer at once. Each ``run`` imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any, Callable


def print_json(obj: Any) -> None:
    """Print one JSON document to stdout (progress and messages go to stderr)."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def format_table(rows: list[dict[str, Any]], columns: list[str], headers: dict[str, str] | None = None,
                 width: int | None = None) -> str:
    """A plain fixed-width text table without trailing spaces.

    ``headers`` renames columns in the header line; with ``width``, the last column wraps onto
    continuation lines so that no line is longer (when the other columns leave it room).

    Example:
        >>> print(format_table([{"a": 1, "b": "a description long enough to wrap"}], ["a", "b"],
        ...                    {"a": "n"}, width=25))
        n  b
        1  a description long
           enough to wrap
    """
    names = [(headers or {}).get(c, c) for c in columns]
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(n)] + [len(row[i]) for row in cells]) for i, n in enumerate(names)]
    room = None if width is None else width - sum(w + 2 for w in widths[:-1])
    lines = ["  ".join(c.ljust(w) for c, w in zip(names, widths)).rstrip()]
    for row in cells:
        last = [row[-1]]
        if room is not None and room >= 20 and len(row[-1]) > room:
            last = textwrap.wrap(row[-1], room, break_on_hyphens=False) or [""]
        for k, piece in enumerate(last):
            lead = row[:-1] if k == 0 else [""] * (len(row) - 1)
            lines.append("  ".join(v.ljust(w) for v, w in zip(lead + [piece], widths)).rstrip())
    return "\n".join(lines)


class HelpFormatter(argparse.HelpFormatter):
    """Every command's help: each paragraph of a description or epilog wrapped on its own, one with
    indented lines (examples) kept as written, and an option's default shown unless its help states it or
    it has none (None, False)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paras = []
        for para in text.split("\n\n"):
            if any(line.startswith(" ") for line in para.splitlines()):
                paras.append("\n".join(indent + line for line in para.splitlines()))
            else:
                paras.append(super()._fill_text(para, width, indent))
        return "\n\n".join(paras)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if action.option_strings and "default" not in text and not (d is None or d is False or d is argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with :class:`HelpFormatter`; subcommand parsers inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer >= ``lo``, else a usage error (exit 2) before any work.

    Example:
        >>> int_at_least(1)("3")
        3
        >>> int_at_least(1)("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be an integer >= 1, got 0
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {value}")
        return value

    parse.__name__ = f"int>={lo}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def codes_with_fixed_steps(codec: Any) -> bool:
    """Whether ``codec`` is a kvc quality level (``target_kl``) that, lacking a calibration file,
    falls back to fixed steps measured on our models rather than on the user's."""
    p = codec.params
    return bool(p.get("target_kl") and not p.get("calibration") and p.get("fallback") == "steps"
                and "calibration" not in codec.requires)
