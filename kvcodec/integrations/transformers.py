"""transformers interop: ``DynamicCache`` <-> :class:`~kvcodec.cache.KVCache` (batch 1).

transformers keeps K and V per layer as ``[batch, kv_heads, tokens, head_dim]`` (K after RoPE);
kvcodec keeps ``[tokens, kv_heads, head_dim]``. Older releases (and GPT-2 style models in them)
return a tuple of ``(K, V)`` pairs instead of a Cache object; :func:`from_dynamic_cache` accepts
both. transformers 5 renamed the ``past_key_values=`` keyword to ``cache=``;
:func:`cache_kwargs` and :func:`output_cache` hide that.

Example:
    >>> import torch
    >>> from kvcodec import KVCache
    >>> from kvcodec.integrations.transformers import to_dynamic_cache, from_dynamic_cache
    >>> c = KVCache.from_tensors([(torch.randn(5, 2, 8), torch.randn(5, 2, 8))])
    >>> dc = to_dynamic_cache(c)
    >>> tuple(dc.layers[0].keys.shape)
    (1, 2, 5, 8)
    >>> from_dynamic_cache(dc).equal(c)
    True
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import warnings
from typing import Any

import torch

from ..cache import KVCache, LayerInfo, ModelIdentity
from ..errors import DependencyError, InputError


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise DependencyError(
            "DynamicCache conversion needs transformers; install it with pip install 'kvcodec[eval]'"
        ) from None
    return transformers


def _layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(K, V)]`` in transformers layout from a Cache object or a legacy tuple."""
    if hasattr(cache, "self_attention_cache"):  # EncoderDecoderCache: decoder self-attention only
        cache = cache.self_attention_cache
    if hasattr(cache, "layers"):
        out = []
        for i, layer in enumerate(cache.layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if "LinearAttention" in type(layer).__name__:  # transformers' layers of hybrid models
                raise InputError(f"cache layer {i} is a {type(layer).__name__} (a hybrid model's recurrent or "
                                 f"convolution state): kvcodec codes caches whose every layer is attention")
            if type(layer).__name__ == "DummyLayer":  # Gemma 3n's layers that read an earlier layer's KV
                raise InputError(f"cache layer {i} holds no KV of its own (it reads an earlier layer's, as Gemma 3n's "
                                 f"last layers do): kvcodec codes caches whose every layer holds its own KV")
            if k is None or v is None or (isinstance(k, torch.Tensor) and k.numel() == 0 and k.dim() < 4):
                raise InputError(f"cache layer {i} is empty (was the model run with use_cache=True?)")
            out.append((k, v))
        return out
    if hasattr(cache, "key_cache"):  # transformers 4.x DynamicCache
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (tuple, list)):
        return [(pair[0], pair[1]) for pair in cache]
    raise InputError(f"unsupported cache object {type(cache).__name__}")


def from_dynamic_cache(cache: Any, batch_index: int = 0, **kwargs: Any) -> KVCache:
    """Convert a transformers cache (``DynamicCache`` or legacy tuple) into a :class:`KVCache`.

    Args:
        cache: the model's cache, tensors ``[B, H, T, D]``.
        batch_index: which sequence of the batch to take.
        **kwargs: passed to :class:`KVCache` (``layer_info``, ``token_ids``, ``model`` ...).

    Raises:
        InputError: a layer is empty, or its shape is not ``[B, H, T, D]``.
    """
    layers = []
    for i, (k, v) in enumerate(_layer_tensors(cache)):
        if k.dim() != 4 or v.dim() != 4:
            raise InputError(
                f"cache layer {i} has K {list(k.shape)} / V {list(v.shape)}; expected [B, H, T, D]"
            )
        layers.append({
            "k": k[batch_index].transpose(0, 1).detach().cpu().contiguous(),
            "v": v[batch_index].transpose(0, 1).detach().cpu().contiguous(),
        })
    return KVCache(layers=layers, **kwargs)


def to_dynamic_cache(
    cache: KVCache, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    state: "HybridState | None" = None,
) -> Any:
    """Build a transformers ``DynamicCache`` (batch 1) holding ``cache``'s K and V.

    Every layer becomes a full (non-sliding) layer holding all tokens, so sliding-window layers
    keep their whole captured cache; the model still applies its window through the mask.
    ``state``: a hybrid model's recurrent layers at the end of the cache's tokens
    (:class:`HybridState`); the cache's layers are then its attention layers, in order.

    Raises:
        InputError: the cache holds MLA latent layers (transformers caches hold K and V), or
            does not fit ``state``.
    """
    tf = _require_transformers()
    if state is not None:
        if cache.num_layers != len(state.kv_layers):
            raise InputError(f"the cache has {cache.num_layers} layers, the hybrid model "
                             f"{len(state.kv_layers)} attention layers")
        # every token kept, as below; recurrent states stored by assignment when a gradient
        # will flow back to the cache
        dc = state.cache(grad=any(t.requires_grad for layer in cache.layers for t in layer.values()))
    else:
        dc = tf.DynamicCache()
    for j, layer in enumerate(cache.layers):
        if "kv" in layer:
            raise InputError(f"layer {j} is an MLA latent tensor; transformers caches need K and V")
        k = layer["k"].transpose(0, 1).unsqueeze(0)
        v = layer["v"].transpose(0, 1).unsqueeze(0)
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        dc.update(k.to(device).contiguous(), v.to(device).contiguous(), j if state is None else state.kv_layers[j])
    return dc


def _store_by_assignment(layer: Any) -> None:
    """Make a copied transformers ``LinearAttentionLayer`` keep each new conv and recurrent
    state as a new tensor rather than writing it over the old one (``copy_``)."""
    if hasattr(layer, "activate_past_recording"):
        layer.activate_past_recording(0)  # conv states: concatenated and assigned, not copied over
    update = getattr(layer, "update_recurrent_state", None)
    if update is None:
        return

    def assigning(recurrent_states: Any, state_idx: int = 0, **kwargs: Any) -> Any:
        if not layer.is_recurrent_states_initialized.get(state_idx, False):
            return update(recurrent_states, state_idx, **kwargs)
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        layer.recurrent_states[state_idx] = last
        return last

    layer.update_recurrent_state = assigning


class HybridState:
    """What a hybrid model (linear-attention, Mamba or convolution layers beside attention
    layers: Qwen3-Next, Qwen3.5, LFM2, Granite 4.0-H, Falcon-H1) keeps besides its KV cache,
    after a prefill: each such layer's transformers cache layer (conv and recurrent states,
    fixed-size, not compressed; a layer with attention beside its state, as Falcon-H1's, is
    kept without its KV), and which model layers hold the KV that a :class:`KVCache` of it
    lists (``kv_layers``, in order). :func:`to_dynamic_cache` rebuilds the model's cache from
    the two, so a harness can run the model on a decoded cache; each call gets fresh copies of
    the states (the model updates them in place)."""

    def __init__(self, config: Any, kv_layers: list[int], recurrent: dict[int, Any]) -> None:
        self.config = config
        self.kv_layers = list(kv_layers)
        self.recurrent = recurrent

    def copies(self, batch: int = 1, grad: bool = False) -> dict[int, Any]:
        """Fresh copies of the recurrent layers, their states repeated ``batch`` times along the
        batch axis. ``grad``: for a run that a gradient flows back through (sensitivities):
        transformers writes each new state over the old one in place, which autograd kept for
        the backward pass; these copies store the new states as new tensors instead (the same
        values; the states are not read again)."""
        import copy

        out = {}
        for i, layer in self.recurrent.items():
            c = copy.deepcopy(layer)
            if i in self.kv_layers:  # attention and a state in one layer: the KV comes from the cache
                c.keys = c.values = None
                c.is_initialized = False
            if grad:
                _store_by_assignment(c)
            if batch > 1:
                for name in ("conv_states", "recurrent_states"):
                    d = getattr(c, name, None)
                    if isinstance(d, dict):
                        setattr(c, name, {k: v.repeat_interleave(batch, 0) if isinstance(v, torch.Tensor) else v
                                          for k, v in d.items()})
            out[i] = c
        return out

    def cache(self, batch: int = 1, grad: bool = False) -> Any:
        """An empty transformers cache of the model with fresh copies of the recurrent layers
        (:meth:`copies`) and full (every-token) layers where the attention layers go (filled by
        ``update`` at their model layer index)."""
        tf = _require_transformers()
        from transformers.cache_utils import DynamicLayer

        dc = tf.DynamicCache(config=self.config)
        for i in self.kv_layers:
            dc.layers[i] = DynamicLayer()
        for i, layer in self.copies(batch, grad).items():
            dc.layers[i] = layer
        return dc


def cache_keyword(model: Any) -> str:
    """The forward keyword that takes the cache: ``"cache"`` (transformers >= 5.x) or
    ``"past_key_values"`` (older releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(...)``, whichever name this transformers release uses.

    Example:
        >>> out = model(ids, use_cache=True, **cache_kwargs(model, dc))   # doctest: +SKIP
    """
    return {cache_keyword(model): cache}


def last_logits_kwargs(model: Any) -> dict[str, Any]:
    """``{"logits_to_keep": 1}`` when ``model.forward`` takes it, else ``{}``: a prefill that
    only wants the cache skips the output projection of every token but the last (on a 0.5B
    model with a 152k vocabulary, 4 of 18 s for 1024 tokens on 2 cores)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def output_cache(outputs: Any) -> Any:
    """The cache returned by a forward pass (``outputs.cache`` or ``outputs.past_key_values``)."""
    for name in ("cache", "past_key_values"):
        c = getattr(outputs, name, None) if not isinstance(outputs, dict) else outputs.get(name)
        if c is not None:
            return c
    raise InputError("the model returned no cache; call it with use_cache=True")


#: Layer types (transformers' ``layer_types``) whose only state is a KV cache growing with the tokens.
KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
#: Layer types whose state is fixed-size (linear attention, Mamba and short convolutions, which
#: transformers' cache holds as ``linear_attention`` and ``conv`` layers) or none (MLP-only
#: layers): a hybrid model's other layers, kept as they are beside the KV that kvcodec codes
#: (:class:`HybridState`).
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "mlp", "moe"})
#: Layer types with attention and a Mamba state side by side (Falcon-H1, Zamba): a KV cache
#: kvcodec codes, and a state kept as it is, in one transformers cache layer.
BOTH_LAYER_TYPES = frozenset({"hybrid", "hybrid_sliding"})


def kv_layer_map(model_or_config: Any) -> list[int] | None:
    """The model layers that hold a KV cache of their own, in order: for a hybrid model
    (transformers' ``layer_types`` naming recurrent layers too), and for one whose last layers
    read the KV of earlier ones (Gemma 3n's ``num_kv_shared_layers``: those hold none). None
    when every layer holds its own (then the :class:`KVCache` layer ``i`` is model layer ``i``)."""
    config = getattr(model_or_config, "config", model_or_config)
    config = getattr(config, "text_config", None) or config
    types = getattr(config, "layer_types", None)
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if not isinstance(types, (list, tuple)):
        if not shared:
            return None
        types = ["full_attention"] * int(config.num_hidden_layers)
    if not shared and all(str(t) in KV_LAYER_TYPES for t in types):
        return None
    own = len(types) - shared
    return [i for i, t in enumerate(types) if str(t) in KV_LAYER_TYPES | BOTH_LAYER_TYPES and i < own]


def require_kv_layers(model: Any) -> None:
    """Raise :class:`InputError` unless every layer of ``model`` keeps its state as a KV cache,
    as a fixed-size recurrent state that transformers' cache holds per layer (linear attention:
    Qwen3-Next, Qwen3.5; Mamba: Jamba, Granite 4.0-H, Bamba, Nemotron-H; short convolutions:
    LFM2), which the harness keeps as it is (:class:`HybridState`), or none (MLP-only layers).

    Layers with attention and Mamba side by side (Falcon-H1, Zamba: transformers' ``hybrid``
    type) pass too: their KV is coded, their state kept. Configs without ``layer_types`` that
    hold Mamba state, and indexed (sparse) attention, which keeps an indexer's cache beside its
    KV: kvcodec does not capture, evaluate or calibrate those yet, and says so before running
    the model (which would otherwise fail deep inside transformers). Llama 4's chunked
    attention passes: its cache is plain KV (calibration's attention estimate treats it as full
    attention, which can cost bits, never quality: the closed loop scores the model's real KL)."""
    config = getattr(model, "config", model)
    config = getattr(config, "text_config", None) or config
    kind = getattr(config, "model_type", "") or type(model).__name__
    types = getattr(config, "layer_types", None)
    known = KV_LAYER_TYPES | RECURRENT_LAYER_TYPES | BOTH_LAYER_TYPES
    other = sorted({str(t) for t in types} - known) if isinstance(types, (list, tuple)) else []
    if not isinstance(types, (list, tuple)) and any(str(a).startswith(("mamba_", "ssm_", "conv_L"))
                                                    for a in vars(config)):
        other = ["recurrent (Mamba/SSM or convolution) state"]
    if other:
        raise InputError(
            f"{kind}: layers of type {', '.join(other)}; kvcodec captures, evaluates and calibrates models whose "
            f"layers are attention with a KV cache, or linear attention, Mamba or convolution layers beside them "
            f"(sparse attention, and Mamba state without transformers' layer_types, are not supported yet)")


def layer_infos(config: Any, num_layers: int) -> list[LayerInfo]:
    """:class:`LayerInfo` per layer from a transformers config (``layer_types``, ``sliding_window``).

    With ``layer_types`` each layer is what it names. Without them, a config with a
    ``sliding_window`` (Mistral, Mixtral, Starcoder2, Phi-3) slides on every layer, as those
    models build one sliding-window mask for all layers, unless ``use_sliding_window`` is False.

    Example:
        >>> from types import SimpleNamespace as N
        >>> [i.kind for i in layer_infos(N(sliding_window=8), 2)], layer_infos(N(), 1)[0].kind
        (['sliding', 'sliding'], 'full')
    """
    config = getattr(config, "text_config", None) or config
    types = getattr(config, "layer_types", None)
    window = int(getattr(config, "sliding_window", 0) or 0)
    default = "sliding_attention" if window and getattr(config, "use_sliding_window", True) else "full_attention"
    infos = []
    for i in range(num_layers):
        t = types[i] if types is not None and i < len(types) else default
        if "sliding" in str(t) and window:
            infos.append(LayerInfo(kind="sliding", window=window))
        else:
            infos.append(LayerInfo(kind="full"))
    return infos


# ---------------------------------------------------------------------- identity
def config_hash(config: Any) -> str:
    """SHA-256 (first 16 hex digits) of a model config's canonical JSON (geometry, RoPE ...)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"):
        d.pop(k, None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tokenizer_hash(tok: Any) -> str:
    """SHA-256 (first 16 hex digits) of a tokenizer's vocabulary."""
    try:
        vocab = tok.get_vocab()
    except Exception:  # noqa: BLE001 - some tokenizers cannot list their vocabulary
        return "unknown"
    blob = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_identity(model: Any, tokenizer: Any = None) -> ModelIdentity:
    """The :class:`ModelIdentity` of a model (set by :func:`~kvcodec.harness.models.load_model`,
    or derived from its config for models loaded elsewhere)."""
    ident = getattr(model, "kvcodec_identity", None)
    if isinstance(ident, ModelIdentity):
        return ident
    cfg = model.config
    return ModelIdentity(
        model_id=str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "")),
        revision=str(getattr(cfg, "_commit_hash", "") or ""),
        config_hash=config_hash(cfg),
        tokenizer=(f"{type(tokenizer).__name__}:{tokenizer_hash(tokenizer)}" if tokenizer else ""),
    )


def rope_info(config: Any) -> tuple[bool, dict[str, Any]]:
    """``(rope_applied, rope_params)`` for a transformers config. Models with learned absolute
    positions (GPT-2) have no RoPE: ``(False, {"type": "none"})``."""
    config = getattr(config, "text_config", None) or config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    theta = getattr(config, "rope_theta", None)
    if params is None and theta is None:
        kind = getattr(config, "model_type", "")
        if kind in ("gptj", "codegen") and getattr(config, "rotary_dim", None):
            # RoPE on the first rotary_dim channels of each head, interleaved pairs, base 10000
            # written in the model's code rather than its config
            return True, {"rope_type": "default", "rope_theta": 10000.0, "rotary_dim": int(config.rotary_dim)}
        if kind in ("gpt2", "gpt_neo", "gptj", "codegen", "opt", "bloom"):
            return False, {"type": "none"}
        return False, {"type": "unknown"}
    d: dict[str, Any] = {}
    if isinstance(params, dict):
        d.update({k: v for k, v in params.items() if isinstance(v, (int, float, str, bool, dict))})
    if theta is not None:
        d.setdefault("rope_theta", theta)
    # K in a transformers cache is stored after rotation.
    return True, json.loads(json.dumps(d, default=str))


# ---------------------------------------------------------------------- save / load
def _layer_kinds(cache: Any, model: Any, n: int) -> list[LayerInfo]:
    if model is not None:
        return layer_infos(model.config, n)
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None) or [None] * n
    out = []
    for layer in layers:
        window = int(getattr(layer, "sliding_window", 0) or 0)
        out.append(LayerInfo(kind="sliding", window=window) if getattr(layer, "is_sliding", False) and window
                   else LayerInfo(kind="full"))
    return out


def _seq_length(cache: Any, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Tokens the cache covers: a sliding-window layer holds only its last ``window - 1``."""
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None) or []
    seen = [int(getattr(layer, "cumulative_length", 0) or 0) for layer in layers]
    return max([k.shape[2] for k, _ in tensors] + seen)


def _as_batch(ids: Any, batch: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(ids)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[0] != batch:
        raise InputError(f"{what} has shape {list(t.shape)}; expected [{batch}, tokens]")
    return t.to(torch.int64).cpu()


def save(cache: Any, path: str | os.PathLike[str], codec: Any = "kvc-near", *, model: Any = None,
         input_ids: Any = None) -> int:
    """Encode a transformers cache (or a :class:`KVCache`) to ``path``; return the bytes written.

    * Batch 1 writes one KVC file at ``path``; batch ``B > 1`` writes a folder ``path`` holding
      one file per sequence (``00000.kvc``, ``00001.kvc``, ...), each a plain KVC file.
    * Sliding-window layers hold only their last ``window - 1`` tokens in a transformers cache:
      they are stored at the full length, the tokens outside the window repeating the first one
      held (no query attends to them; :func:`load` drops them again).
    * With ``model`` the file records the model's identity (name, config hash, RoPE) and its layer
      kinds; :func:`load` with a model then refuses a cache of another one. Without it the file
      names no model, and ``save`` warns (``UserWarning``). With ``input_ids``
      (the prompt, ``[B, T]`` or ``[T]``) it records the token ids the cache covers, which
      :func:`load` checks against the new prompt.

    Writes are atomic (a temporary file renamed over the target).

    Raises:
        InputError: the cache is empty or its layers disagree; ``input_ids`` are shorter than
            the cache or of another batch size.
    """
    from ..codec import Codec, get_codec

    c = codec if isinstance(codec, Codec) else get_codec(codec)
    if isinstance(cache, KVCache):
        return len(c.encode(cache, path))
    caches = to_kvcaches(cache, model=model, input_ids=input_ids)
    if model is None:
        warnings.warn("kvcodec.save: no model= given, so the file records no model identity ('(unknown model)' "
                      "in kvcodec info) and kvcodec.load cannot refuse it for another model; pass model=model",
                      UserWarning, stacklevel=2)
    if len(caches) == 1:
        return len(c.encode(caches[0], path))
    os.makedirs(path, exist_ok=True)
    return sum(len(c.encode(one, os.path.join(path, f"{b:05d}.kvc"))) for b, one in enumerate(caches))


def to_kvcaches(cache: Any, *, model: Any = None, input_ids: Any = None) -> list[KVCache]:
    """One :class:`KVCache` per sequence of a transformers cache (see :func:`save`)."""
    tensors = _layer_tensors(cache)
    for i, (k, v) in enumerate(tensors):
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise InputError(f"cache layer {i} has K {list(k.shape)} / V {list(v.shape)}; expected [B, H, T, D]")
    batch, total = tensors[0][0].shape[0], _seq_length(cache, tensors)
    if total == 0:
        raise InputError("the cache is empty (was the model run with use_cache=True?)")
    kinds = _layer_kinds(cache, model, len(tensors))
    ids = None
    if input_ids is not None:
        ids = _as_batch(input_ids, batch, "input_ids")
        if ids.shape[1] < total:
            raise InputError(f"input_ids hold {ids.shape[1]} tokens, the cache covers {total}")
        ids = ids[:, :total]
    ident, rope_applied, rope = ModelIdentity(), True, {}
    if model is not None:
        ident = model_identity(model)
        rope_applied, rope = rope_info(model.config)
    out = []
    for b in range(batch):
        layers = []
        for i, (k, v) in enumerate(tensors):
            held = k.shape[2]
            if held != total and kinds[i].kind != "sliding":
                raise InputError(f"cache layer {i} holds {held} tokens of {total} but is not a sliding-window layer")
            kv = {}
            for role, t in (("k", k), ("v", v)):
                x = t[b].transpose(0, 1).detach().cpu()
                if held < total:  # outside the window: never attended; repeat the first token held
                    x = torch.cat([x[:1].expand(total - held, -1, -1), x])
                kv[role] = x.contiguous()
            layers.append(kv)
        out.append(KVCache(layers=layers, layer_info=list(kinds), token_ids=None if ids is None else ids[b].clone(),
                           model=ident, rope_applied=rope_applied, rope=rope))
    return out


def load(path: str | os.PathLike[str], *, model: Any = None, input_ids: Any = None,
         device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> Any:
    """A transformers ``DynamicCache`` from what :func:`save` wrote (a file, or a folder of them).

    With ``model``: the cache is checked against the model's identity, built with its layer
    kinds (sliding-window layers keep their window), on its device and in its dtype.
    With ``input_ids`` (the prompt that follows up, ``[B, L]``, starting with the cached tokens):
    the recorded token ids are checked against it, and the cache is cut to at most ``L - 1``
    tokens, transformers' rule for ``generate``: the last prompt token must be computed again,
    as a cache holding the whole prompt makes ``generate`` continue from the wrong state. A
    model with sliding-window layers cannot cut its cache (those layers keep only their last
    ``window - 1`` tokens): save the cache of the prompt without its last token, which every
    model continues exactly, or continue with a longer prompt.

    Example:
        >>> kvcodec.save(model(ids).past_key_values, "p.kvc", model=model, input_ids=ids)   # doctest: +SKIP
        >>> cache = kvcodec.load("p.kvc", model=model, input_ids=prompt)                      # doctest: +SKIP
        >>> model.generate(prompt, past_key_values=cache)                                     # doctest: +SKIP

    Raises:
        InputError: a cache of another model, other tokens, or sequences that disagree.
        FormatError: a damaged file.
    """
    from ..api import decode

    tf = _require_transformers()
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".kvc"))
        if not files:
            raise InputError(f"{path} is a folder without .kvc files")
        caches = [decode(os.path.join(path, f)) for f in files]
    else:
        caches = [decode(path)]
    first = caches[0]
    for b, c in enumerate(caches[1:], 1):
        if c.num_layers != first.num_layers or c.num_tokens != first.num_tokens or \
                [tuple(x["k"].shape) for x in c.layers] != [tuple(x["k"].shape) for x in first.layers]:
            raise InputError(f"sequence {b} of {path} has another geometry than sequence 0")
    if model is not None:
        want, got = model_identity(model), first.model
        if got.config_hash and want.config_hash and got.config_hash != want.config_hash:
            raise InputError(f"{path} holds a cache of {got.model_id or 'another model'} (config {got.config_hash}); "
                             f"this model is {want.model_id} (config {want.config_hash})")
        p = next(model.parameters())
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
    n = first.num_tokens
    if input_ids is not None:
        ids = _as_batch(input_ids, len(caches), "input_ids")
        n = min(n, ids.shape[1] - 1)
        for b, c in enumerate(caches):
            if c.token_ids is not None and not torch.equal(c.token_ids[:n], ids[b, :n]):
                raise InputError(f"sequence {b}: input_ids do not start with the {n} tokens the cache holds")
        if n < 1:
            raise InputError("input_ids need at least 2 tokens to continue from a cache")
        if n < first.num_tokens:
            for i, info in enumerate(first.layer_info):
                if info.kind == "sliding" and info.window and first.num_tokens > info.window - 1:
                    raise InputError(
                        f"layer {i} has a sliding window of {info.window}: a transformers cache keeps only its "
                        f"last {info.window - 1} tokens, so this cache of {first.num_tokens} tokens cannot be cut "
                        f"back to {n} to continue a prompt of {ids.shape[1]}. Save the cache of the prompt "
                        "without its last token (model(prompt[:, :-1])), or continue with a longer prompt")
    dc = tf.DynamicCache(config=model.config) if model is not None else tf.DynamicCache()
    for i in range(first.num_layers):
        kv = []
        for role in ("k", "v"):
            t = torch.stack([c.layers[i][role][:n] for c in caches]).transpose(1, 2)
            if dtype is not None:
                t = t.to(dtype)
            kv.append(t.to(device or "cpu").contiguous())
        dc.update(kv[0], kv[1], i)
    return dc


__all__ = ["BOTH_LAYER_TYPES", "HybridState", "KV_LAYER_TYPES", "RECURRENT_LAYER_TYPES", "kv_layer_map", "require_kv_layers",
           "cache_keyword", "cache_kwargs", "from_dynamic_cache", "last_logits_kwargs", "layer_infos", "load", "output_cache", "save",
           "to_dynamic_cache", "to_kvcaches"]
