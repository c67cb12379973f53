"""One provenance header and one file pair for every result in ``eval/results/``.

Every study, bench and fuzzer under ``eval/`` writes its result with :func:`write_result`:

* ``<stem>.json``: ``{"schema": "kvcodec.result/1", "provenance": {...}, ...the study's data}``;
* ``<stem>.md``: the study's report, with the same provenance as a block under its title.

The provenance (:func:`provenance`) says how to make the file again and what made it:
``command`` (re-runnable, from the repository root), ``commit`` (``git rev-parse HEAD``, or
``"unknown"`` outside a checkout), ``dirty`` (the tracked files differed from the commit),
``machine``, ``python``, ``torch``, ``kvcodec`` and ``date`` (UTC). eval/results/README.md
documents the schema and each study's fields. Only the standard library is imported here (the
torch version is read from the installed package), so GPU machines without the ``[eval]`` extra
can use it.

Example:
    >>> import tempfile, json
    >>> from pathlib import Path
    >>> from kvcodec.harness.results import SCHEMA, provenance, write_result
    >>> prov = provenance(["--repeat", "3"], prog="python eval/studies/demo.py")
    >>> prov["command"]
    'python eval/studies/demo.py --repeat 3'
    >>> sorted(prov) == sorted(PROVENANCE_FIELDS)
    True
    >>> d = Path(tempfile.mkdtemp())
    >>> js, md = write_result(d / "demo", {"rows": [1, 2]}, "# Demo\\n\\n| a |\\n", prov=prov)
    >>> doc = json.loads(js.read_text())
    >>> doc["schema"], doc["rows"], doc["provenance"]["command"]
    ('kvcodec.result/1', [1, 2], 'python eval/studies/demo.py --repeat 3')
    >>> md.read_text().splitlines()[2]
    '- command: `python eval/studies/demo.py --repeat 3`'
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

SCHEMA = "kvcodec.result/1"
#: The provenance keys, in the order they are written (JSON and Markdown alike).
PROVENANCE_FIELDS = ("command", "commit", "dirty", "machine", "python", "torch", "kvcodec", "date")
#: What a field of a file written before the uniform header says when the file did not state it.
UNKNOWN_BEFORE = "unknown (before the uniform header)"
#: The repository root when the package runs from a checkout (``kvcodec/`` sits in it).
ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    if not ((ROOT / "pyproject.toml").is_file() and (ROOT / "kvcodec").is_dir()):
        return None  # an installed package: the git repository around it, if any, is not ours
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _prog(argv0: str) -> str:
    """How the running program is invoked again: ``python <path from the root>`` for a script,
    ``kvcodec`` for the CLI (console script, ``python -m kvcodec.cli``)."""
    p = Path(argv0)
    if p.name == "kvcodec" or (p.parent.name == "kvcodec" and p.name in ("cli.py", "__main__.py")):
        return "kvcodec"
    try:
        rel = p.resolve().relative_to(ROOT)
    except ValueError:
        rel = p
    return f"python {rel.as_posix()}"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    text = f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}"
    torch = sys.modules.get("torch")  # a GPU only when the run already imported torch (no import here)
    if torch is not None and torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(0)}"
    return text


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get(dist)
        return getattr(mod, "__version__", "not installed")


def provenance(argv: list[str] | None = None, *, prog: str | None = None,
               command: str | None = None) -> dict[str, Any]:
    """What made a result: the fields of :data:`PROVENANCE_FIELDS`.

    Args:
        argv: the program's arguments (default ``sys.argv[1:]``); quoted with :func:`shlex.join`
            so the command runs again as written.
        prog: how the program is called (default from ``sys.argv[0]``: ``python eval/...py`` or
            ``kvcodec``).
        command: the whole command, when the caller knows it better (overrides the two above).

    Returns:
        ``command``; ``commit`` (40 hex digits, or ``"unknown"`` outside a git checkout);
        ``dirty`` (True when tracked files differ from the commit, None when unknown);
        ``machine``; ``python``, ``torch`` and ``kvcodec`` versions; ``date`` (UTC, ISO 8601).

    Example:
        >>> p = provenance([], prog="kvcodec bench")
        >>> p["command"], p["date"].endswith("Z"), len(p["commit"]) in (7, 40) or p["commit"] == "unknown"
        ('kvcodec bench', True, True)
    """
    if command is None:
        args = sys.argv[1:] if argv is None else list(argv)
        command = " ".join([prog or _prog(sys.argv[0]), *([shlex.join(args)] if args else [])])
    commit = _git("rev-parse", "HEAD") or "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no") if commit != "unknown" else None
    from .._version import __version__

    return {
        "command": command,
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "machine": _machine(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "kvcodec": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def provenance_markdown(prov: dict[str, Any]) -> str:
    """The provenance as the Markdown block every report carries under its title.

    Example:
        >>> print(provenance_markdown({"command": "kvcodec bench", "commit": "ab12", "dirty": False,
        ...       "machine": "x86_64", "python": "3.11.7", "torch": "2.13.0", "kvcodec": "0.1",
        ...       "date": "2026-12-02T14:00:00Z"}))
        - command: `kvcodec bench`
        - commit: `ab12`
        - machine: x86_64
        - versions: python 3.11.7, torch 2.13.0, kvcodec 0.1
        - date: 2026-12-02T14:00:00Z
        <BLANKLINE>
    """
    dirty = prov.get("dirty")
    commit = f"`{prov['commit']}`" if prov.get("commit") not in (None, "unknown", UNKNOWN_BEFORE) else prov.get("commit")
    if dirty is True:
        commit += " (with uncommitted changes to tracked files)"
    elif isinstance(dirty, str):
        commit += f"; uncommitted changes: {dirty}"
    lines = [f"- command: `{prov['command']}`", f"- commit: {commit}", f"- machine: {prov['machine']}",
             f"- versions: python {prov['python']}, torch {prov['torch']}, kvcodec {prov['kvcodec']}",
             f"- date: {prov['date']}"]
    lines += [f"- {k.replace('_', ' ')}: {v}" for k, v in prov.items() if k not in PROVENANCE_FIELDS]
    return "\n".join(lines) + "\n"


def with_provenance_block(markdown: str, prov: dict[str, Any]) -> str:
    """``markdown`` with the provenance block under its ``# title`` (at the top without one)."""
    block = provenance_markdown(prov)
    lines = markdown.split("\n")
    if lines and lines[0].startswith("# "):
        rest = "\n".join(lines[1:]).lstrip("\n")
        return f"{lines[0]}\n\n{block}\n{rest}"
    return f"{block}\n{markdown}"


def write_result(stem: str | os.PathLike[str], doc: dict[str, Any], markdown: str, *,
                 prov: dict[str, Any] | None = None, echo: bool = False) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` with one provenance (schema :data:`SCHEMA`).

    Args:
        stem: the path without suffix (``eval/results/kvc_ctx``); its folder is created.
        doc: the study's data (JSON-serialisable; ``default=str`` for the rest); must not carry
            ``schema`` or ``provenance`` itself.
        markdown: the report, starting with its ``# title``.
        prov: :func:`provenance` of the run (default: made now from ``sys.argv``).
        echo: also print the report.

    Returns:
        The two paths written.
    """
    if "schema" in doc or "provenance" in doc:
        raise ValueError("doc must not carry 'schema' or 'provenance': write_result adds them")
    prov = provenance() if prov is None else prov
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    js, md = Path(f"{stem}.json"), Path(f"{stem}.md")
    js.write_text(json.dumps({"schema": SCHEMA, "provenance": prov, **doc}, indent=1, default=str) + "\n")
    text = with_provenance_block(markdown if markdown.endswith("\n") else markdown + "\n", prov)
    md.write_text(text)
    if echo:
        print(text)
    return js, md


def read_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A result JSON, checked to carry a ``schema`` and a ``provenance`` with every field."""
    doc = json.loads(Path(path).read_text())
    prov = doc.get("provenance")
    if "schema" not in doc or not isinstance(prov, dict) or any(k not in prov for k in PROVENANCE_FIELDS):
        raise ValueError(f"{path}: not a result file (no schema or incomplete provenance)")
    return doc
