"""Query statistics for the ``kvc`` encoder (optional calibration; the decoder never needs them,
only a profile's cross-layer predictors, :mod:`kvcodec.harness.xpred`).

The model sees K through ``q · k`` and V through the attention weights, so the error that matters
is weighted by the queries: a K channel the queries ignore can be coarse, and a token that
receives almost no attention can be coarse in V. :func:`query_statistics` runs one prefill of a
model on a calibration text and records, per layer, what the ``kvc`` encoder uses:

* ``layers.<i>.q_energy`` float32 ``[Hkv, D]``: the mean squared query per channel, averaged
  over the query heads that share each KV head (GQA) and, with RoPE, over each rotation pair
  ``(c, c + D/2)`` — the rotation moves energy inside a pair, so the pair mean does not depend
  on the position (K step weights: ``step_c ∝ q_energy_c ** -1/2``).
* ``layers.<i>.q_sample`` float32 ``[Hq, N, D]``: the last ``N`` queries of the calibration
  context (after RoPE, times the attention scaling), to estimate how much attention each cached
  token will receive (V step per token). Their RoPE position is recorded (``q_position``, the
  first sample's) so the encoder can rotate them to the end of the cache it codes.

* ``layers.<i>.k_sens`` / ``layers.<i>.v_sens`` float32 ``[Hkv, D]`` (optional, from
  :func:`fisher_sensitivity`): how much the next-token distribution moves per unit of *relative*
  noise in each K / V (head, channel) — the diagonal of the Fisher information of the model's
  own next-token distribution with respect to the cached values, averaged over the cached tokens
  (the first, an attention sink the encoder stores exactly, left out) and scaled by kvc's step
  unit (K: the head's RMS after centring; V: each token's RMS). Layers and heads differ by more
  than 100x on SmolLM2; the encoder gives each (layer, head) a step in proportion to
  ``sens ** -1/2`` (the allocation that minimises the summed weighted error at a given rate).

Per attention variant (``layer_attention``, one :class:`LayerAttention` per layer; each rule
is tested against the model's own eager attention in ``tests/test_calibration_architectures.py``):

* RoPE, any type whose angle is linear in position (default, linear, YaRN, Llama 3, per-layer
  bases such as Gemma 3's local/global): the layer's own inverse frequencies are read from the
  model (``rotary_frequencies``) and which channels turn, and how, is found by running a few
  tokens at shifted positions and keeping the rotation that reproduces the model's queries:
  rotate-half or interleaved (Cohere, GLM), on the first ``R`` channels (partial rotary: Phi-3,
  GPT-NeoX ``rotary_pct``) or the last (DeepSeek MLA). ``q_energy`` is averaged over exactly
  those pairs; the encoder turns the sampled queries with them. Frequencies that depend on the
  sequence length (``dynamic``, ``longrope``) are those of the calibration prefill; when a
  layer's queries move in a way no candidate reproduces the layer is ``"unknown"`` and gets no
  attention estimate. (Llama 4's NoPE layers scale their queries by the cache position past
  ``floor_scale`` = 8192 tokens, temperature tuning: the probe moves position ids, not cache
  positions, so they fit as ``"none"``, and the estimate keeps the calibration prefill's scale,
  1 below 8192 tokens: off for longer caches, which costs bits, not quality.)
* RoPE computed without an ``inv_freq`` buffer (GPT-J and CodeGen build a sine table from
  ``rotary_dim``): the frequencies the config describes (:func:`config_frequencies`), kept
  only where they reproduce the model's shifted queries like any other candidate.
* No RoPE (GPT-2's and OPT's learned positions, NoPE layers such as SmolLM3's every fourth
  and EXAONE 4's global ones): ``"none"``, queries used as recorded.
* Sliding windows (Mistral, Starcoder2, Gemma 2/3 local layers): the window the attention was
  called with; the estimate gives tokens outside every future query's window exactly 0.
* Logit soft-capping (Gemma 2): recorded and applied to the estimate's logits. The attention
  scaling (``query_pre_attn_scalar``, MLA's YaRN mscale) is folded into ``q_sample``; QK-norm
  and GQA/MQA need nothing (the recorded query is the one the model uses).
* MLA (``kv_lora_rank``: the cache holds latents, not per-head K): no ``q_energy`` /
  ``q_sample`` (no estimate); sensitivities are taken with respect to the latents.
* Learned attention sinks (GPT-OSS): the per-head sink logits the attention was called with
  (``s_aux``) are recorded (``sinks``) and take part in the estimate's softmax, whose sink
  share is then dropped, as the model does.
* Chunked attention (Llama 4's RoPE layers: a query sees the keys of its own chunk of
  ``attention_chunk_size`` positions): recorded (``chunk``) and applied to the estimate, which
  places the cache's tokens just before the future queries. Models whose
  attention transformers' attention interface does not run (GPT-Neo, BLOOM's ALiBi) record no
  queries: calibration stops with an error saying so.
* Hybrid models (Qwen3.5 and Qwen3-Next's linear attention, LFM2's convolutions, Mamba layers
  in Granite 4.0-H, Jamba, Nemotron-H and beside attention in Falcon-H1, MLP-only layers): the cache's
  layers are the attention layers (:func:`~kvcodec.integrations.transformers.kv_layer_map`;
  queries, rotations and sensitivities are indexed by them), and the recurrent layers' states
  after the prefill are kept as they are (``HybridState``), so the model runs on a decoded
  cache as it ran on its own. Layers that read an earlier layer's KV (Gemma 3n's
  ``num_kv_shared_layers``) hold none: the cache is the owners' layers, and their statistics
  are the owners' queries. Sparse indexed attention is refused before the model runs
  (:func:`~kvcodec.integrations.transformers.require_kv_layers`); Zamba's shared attention
  records no queries (an error).

File metadata (``__metadata__``): ``format = "kvcodec.qstats/5"`` (``/1``-``/4`` still read),
``num_layers``, ``q_position``, ``rope_theta`` (the default RoPE base when the model has one, else
0: what files before ``/4`` re-rotate every layer with), ``attention`` (JSON, one object per
layer: ``rope``, ``window``, ``softcap``, for rotary layers ``offset`` and ``style``,
``"sinks": true`` for layers with attention sinks and ``chunk`` for chunked layers (``/5``);
with a float32 tensor ``layers.<i>.rope_inv_freq`` per rotary layer and
``layers.<i>.attn_sinks`` ``[Hq]`` per layer with sinks), the model identity and optionally a
``profile``. Stored as safetensors (no pickle).

Calibrate on text that is NOT the text you evaluate on (``skip_tokens`` skips the start of the
text, where the built-in evaluation takes its context).

Example:
    >>> from kvcodec.harness.calibration import query_statistics, save_query_statistics  # doctest: +SKIP
    >>> from kvcodec.harness import load_model, default_text                             # doctest: +SKIP
    >>> model, tok = load_model()                                                        # doctest: +SKIP
    >>> stats = query_statistics(model, tok, default_text(), skip_tokens=8192)           # doctest: +SKIP
    >>> save_query_statistics(stats, "smollm2.qstats.safetensors")                       # doctest: +SKIP
    >>> import kvcodec                                                                   # doctest: +SKIP
    >>> codec = kvcodec.get_codec({**kvcodec.get_codec("kvc-near").get_config(),
    ...                            "calibration": "smollm2.qstats.safetensors"})          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache import KVCache
from ..codecs.kvc.calibration import (  # noqa: F401  (the file format lives with the codec that reads it)
    QSTATS_FORMAT,
    QSTATS_FORMATS,
    ROPE_STYLES,
    Calibration,
    LayerAttention,
    QueryStats,
    attention_estimate,
    load_query_statistics,
    rotate_layer,
    rotate_queries,
    save_query_statistics,
)
from ..errors import FormatError, InputError

def pair_mean(e: np.ndarray) -> np.ndarray:
    """Average the last axis over RoPE rotation pairs ``(c, c + D/2)`` (even ``D`` only).

    Example:
        >>> pair_mean(np.array([1.0, 2.0, 3.0, 6.0])).tolist()
        [2.0, 4.0, 2.0, 4.0]
    """
    d = e.shape[-1]
    if d % 2:
        return e
    m = 0.5 * (e[..., : d // 2] + e[..., d // 2:])
    return np.concatenate([m, m], axis=-1)


def layer_pair_mean(e: np.ndarray, la: LayerAttention) -> np.ndarray:
    """Average ``e [..., D]`` over the layer's rotation pairs (:meth:`LayerAttention.pairs`);
    channels that never turn (partial rotary, no RoPE) are left as they are.

    Example:
        >>> la = LayerAttention("rotary", np.ones(1, np.float32), offset=1)
        >>> layer_pair_mean(np.array([1.0, 2.0, 4.0, 8.0]), la).tolist()
        [1.0, 3.0, 3.0, 8.0]
    """
    a, b = la.pairs()
    if a.size == 0:
        return e
    out = np.array(e, copy=True)
    m = 0.5 * (e[..., a] + e[..., b])
    out[..., a] = m
    out[..., b] = m
    return out


def rotary_frequencies(model: Any, num_layers: int) -> list[np.ndarray | None]:
    """Per layer the inverse RoPE frequencies ``[R/2]`` (float32) the model holds for it, or None.

    Read from the model's rotary-embedding buffers as they are now (after a forward pass: what
    that pass used, dynamic scaling included): a rotary module inside the layer first, then the
    model's; ``<layer_type>_inv_freq`` (Gemma 3's per-type bases) before ``inv_freq``. Vision
    towers are skipped. Which channels turn, and how, is not read here:
    :func:`query_statistics` tests it against the model (:func:`_fit_rotation`).
    """
    cfg = getattr(model.config, "text_config", None) or model.config
    types = getattr(cfg, "layer_types", None)
    found: list[tuple[str, dict[str, torch.Tensor]]] = []
    for name, mod in model.named_modules():
        if "vision" in name or "visual" in name:
            continue
        bufs = {b: t for b, t in mod.named_buffers(recurse=False)
                if (b == "inv_freq" or b.endswith("_inv_freq")) and not b.endswith("original_inv_freq")}
        if bufs:
            found.append((name, bufs))
    out: list[np.ndarray | None] = []
    for i in range(num_layers):
        lt = str(types[i]) if types is not None and i < len(types) else None
        f = None
        for _, bufs in sorted(found, key=lambda x: f"layers.{i}." not in f"{x[0]}."):
            t = bufs.get(f"{lt}_inv_freq") if lt else None
            t = t if t is not None else bufs.get("inv_freq")
            if t is not None:
                f = t.detach().float().cpu().numpy().reshape(-1).copy()
                break
        out.append(f)
    return out


def config_frequencies(config: Any, rope: dict[str, Any], head_dim: int) -> np.ndarray | None:
    """The inverse RoPE frequencies ``[R/2]`` (float32) a model's config describes, for models
    that compute their rotation without an ``inv_freq`` buffer (GPT-J and CodeGen build a
    sine table from ``rotary_dim`` and base 10000): ``R`` from ``rotary_dim``, else
    ``partial_rotary_factor`` / ``rotary_pct`` of ``head_dim``; the base from ``rope``
    (:func:`~kvcodec.integrations.transformers.rope_info`), else 10000. A candidate only:
    :func:`_fit_rotation` keeps it where it reproduces the model's own queries."""
    cfg = getattr(config, "text_config", None) or config
    r = getattr(cfg, "rotary_dim", None)
    if not r:
        frac = getattr(cfg, "partial_rotary_factor", None) or getattr(cfg, "rotary_pct", None) or 1.0
        r = int(round(head_dim * float(frac)))
    r = int(r) // 2 * 2
    base = float(rope.get("rope_theta") or 10000.0)
    if not 0 < r <= head_dim or not base > 1.0:
        return None
    return (1.0 / base ** (np.arange(0, r, 2, dtype=np.float64) / r)).astype(np.float32)


def _fit_rotation(q0: np.ndarray, q1: np.ndarray, delta: int, inv_freq: np.ndarray | None) -> LayerAttention:
    """Which rotation turns the queries ``q0 [.., D]`` (positions ``p``) into ``q1`` (the same
    hidden states at ``p + delta``): none, or ``inv_freq`` on the first or the last ``R``
    channels, rotate-half or interleaved. ``"unknown"`` when none reproduces the model's own
    queries to 1e-3 (relative)."""
    scale = float(np.linalg.norm(q1))
    cands = [LayerAttention("none")]
    d = q0.shape[-1]
    if inv_freq is not None and 0 < 2 * inv_freq.shape[0] <= d:
        for off in sorted({0, d - 2 * inv_freq.shape[0]}):
            cands += [LayerAttention("rotary", inv_freq, off, style) for style in ROPE_STYLES]
    if scale == 0:
        return cands[0]
    errs = [float(np.linalg.norm(rotate_layer(q0, delta, c) - q1)) / scale for c in cands]
    best = int(np.argmin(errs))
    return cands[best] if errs[best] <= 1e-3 else LayerAttention("unknown")


@torch.no_grad()
def layer_attention(model: Any, ids: torch.Tensor, store: dict[int, dict[str, Any]], num_layers: int,
                    probe: int = 16, delta: int = 7) -> list[LayerAttention]:
    """Per layer :class:`LayerAttention` of ``model``: the window and softcap its attention
    was called with (recorded in ``store`` by ``record_queries``) and its rotation, found by
    running the first ``probe`` tokens of ``ids`` at positions ``0..`` and ``delta..`` (with
    RoPE, a shift of every position leaves every hidden state as it was and turns every query:
    the rotation that reproduces the shifted queries is the model's)."""
    from .capture import rope_info
    from .evaluate import record_queries

    from ..integrations.transformers import kv_layer_map

    kv_map = kv_layer_map(model)
    if kv_map is None:
        freqs = rotary_frequencies(model, num_layers)
    else:  # a hybrid model: the cache's layer i is model layer kv_map[i]
        every = rotary_frequencies(model, max(kv_map) + 1)
        freqs = [every[m] for m in kv_map]
    applied, rope = rope_info(model.config)
    rot: dict[int, LayerAttention] = {}
    if applied or any(f is not None for f in freqs):
        device = next(model.parameters()).device
        m = min(int(ids.numel()), probe)
        x = ids[:m][None].to(device)
        with record_queries(model) as st:
            model(x, position_ids=torch.arange(m, device=device)[None], use_cache=False)
            q0 = {i: st[i]["q"].double().numpy() for i in st}
            model(x, position_ids=torch.arange(delta, delta + m, device=device)[None], use_cache=False)
            q1 = {i: st[i]["q"].double().numpy() for i in st}
        rot = {}
        for i in q0:
            if i not in q1:
                continue
            f = freqs[i] if i < len(freqs) else None
            if f is None and applied:  # RoPE without a frequency buffer (GPT-J): the config's, tested too
                f = config_frequencies(model.config, rope, q0[i].shape[-1])
            rot[i] = _fit_rotation(q0[i], q1[i], delta, f)
    out = []
    for i in range(num_layers):
        r = rot.get(i, LayerAttention("none"))
        rec = store.get(i, {})
        window = int(rec.get("sliding_window") or 0)
        cap = float(rec.get("softcap") or 0.0)
        out.append(LayerAttention(r.rope, r.inv_freq, r.offset, r.style, window, cap, rec.get("sinks"),
                                  int(rec.get("chunk") or 0)))
    return out


@torch.no_grad()
def query_statistics(
    model: Any,
    tokenizer: Any,
    text: str,
    context: int = 1024,
    skip_tokens: int = 0,
    samples: int = 64,
    sensitivity_samples: int = 0,
    continuation: int = 512,
    progress: Any = None,
    token_ids: torch.Tensor | None = None,
) -> QueryStats:
    """Prefill ``context`` tokens of ``text`` (after skipping ``skip_tokens``; a BOS token is put
    first when the tokenizer has one) and return the query statistics of every layer.

    With ``sensitivity_samples > 0`` also measure ``k_sens`` / ``v_sens``
    (:func:`fisher_sensitivity`, scoring the next ``continuation`` tokens of the text on top of
    the cache; one forward and backward pass per sample, ~10 s each for SmolLM2 on one CPU).

    Raises:
        InputError: the text is too short, or the model does not route attention through
            transformers' ``AttentionInterface``.
    """
    from .capture import rope_info, tokenize
    from .evaluate import record_queries

    if context < 2 or samples < 1:
        raise InputError(f"context must be >= 2 and samples >= 1 (got {context}, {samples})")
    extra = continuation if sensitivity_samples > 0 else 0
    if sensitivity_samples < 0 or (sensitivity_samples and continuation < 1):
        raise InputError("sensitivity_samples must be >= 0 and continuation >= 1")
    if token_ids is not None:  # a window the caller cut (kvcodec.harness.profile): used as given
        if token_ids.ndim != 1 or token_ids.numel() < context + extra or skip_tokens:
            raise InputError(f"token_ids must be 1-D with >= {context + extra} ids (and no skip_tokens)")
        ids = token_ids[: context + extra].to(torch.int64)
    else:
        ids = tokenize(tokenizer, text, skip_tokens + context + extra)
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = ids[skip_tokens:] if skip_tokens else ids
    if bos is not None and skip_tokens:
        ids = torch.cat([torch.tensor([bos]), ids[:-1]])
    cont_ids = ids[context:]
    ids = ids[:context]
    device = next(model.parameters()).device
    from ..integrations.transformers import kv_layer_map, last_logits_kwargs, require_kv_layers

    require_kv_layers(model)  # before the model runs
    with record_queries(model) as store, torch.no_grad():
        model(ids[None].to(device), use_cache=False, **last_logits_kwargs(model))
    cfg = getattr(model.config, "text_config", None) or model.config
    applied, rope = rope_info(model.config)
    theta = float(rope.get("rope_theta", 0.0)) if applied and rope.get("rope_type", "default") == "default" else 0.0
    kv_map = kv_layer_map(model)  # a hybrid model: its attention layers, the cache's layers
    n_layers = int(getattr(cfg, "num_hidden_layers", len(store))) if kv_map is None else len(kv_map)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads"))
    energy: list[np.ndarray | None] = []
    sample: list[np.ndarray | None] = []
    attention = layer_attention(model, ids, store, n_layers)
    n = min(samples, context)
    # MLA (DeepSeek V2/V3, kv_lora_rank): the cache holds latents, not per-head K: no query
    # statistics fit it (the layers' rotation is still recorded)
    mla = getattr(cfg, "kv_lora_rank", None) is not None
    for i in range(n_layers):
        if i not in store or mla:
            energy.append(None)
            sample.append(None)
            continue
        q = store[i]["q"].double() * store[i]["scaling"]  # [T, Hq, D]
        hq, d = q.shape[1], q.shape[2]
        g = max(1, hq // hkv)
        # token 0 (BOS) queries are atypical: leave them out of the energy
        e = q[1:].pow(2).mean(0).reshape(hq // g, g, d).mean(1).numpy()
        energy.append(layer_pair_mean(e, attention[i]).astype(np.float32))
        sample.append(q[-n:].transpose(0, 1).float().numpy().copy())
    if not store:
        raise InputError("no attention layer recorded any query")
    meta = {"model": str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", ""))}
    out = QueryStats(energy, sample, int(ids.numel() - n), theta, meta, attention=attention)
    if sensitivity_samples:
        out.k_sens, out.v_sens = fisher_sensitivity(model, ids, cont_ids, sensitivity_samples,
                                                    progress=progress)
        meta["sensitivity"] = f"fisher, {sensitivity_samples} samples, {cont_ids.numel()} scored tokens"
    return out


def fisher_diagonal(
    model: Any,
    ids: torch.Tensor,
    cont_ids: torch.Tensor,
    samples: int = 4,
    seed: int = 0,
    progress: Any = None,
    exact: bool = False,
    reference: KVCache | None = None,
    state: Any = None,
) -> tuple[KVCache, list[dict[str, torch.Tensor]]]:
    """The cache of ``ids`` (float32) and, per layer, ``{"k", "v"}`` ``[T, Hkv, D]`` float64: the
    diagonal of the Fisher information of the next-token distributions over ``cont_ids``
    (continuing the cache) with respect to every cached value, per scored token.

    For a small change ``d`` of the cache, the mean next-token KL grows by about
    ``0.5 * sum_i F_ii d_i**2`` (off-diagonal terms left out). ``F_ii`` is estimated without
    bias by sampling: draw each scored token from the model's own distribution, backpropagate
    the summed log-likelihood to the cached K and V, square; ``samples`` draws (seeded) are
    averaged. Parameters are not differentiated (only the cache leaves).

    With ``exact=True`` (a reference for tiny vocabularies; ``samples`` is ignored) every token
    ``y`` is enumerated instead: ``F = mean_pos sum_y p(y) (d log p(y) / d cache)**2``, one
    batched pass per 64 tokens, each batch row holding its own copy of the cache.

    ``reference``: the cache of ``ids`` when the caller holds it already (taken as float32; the
    closed-loop search passes its first window's, saving a prefill), with ``state``, a hybrid
    model's recurrent layers after it (:func:`~kvcodec.harness.capture.capture_with_state`).

    Raises:
        InputError: the model's cache holds MLA latents (no separate K and V), or nothing to score.
    """
    from ..integrations.transformers import cache_kwargs, kv_layer_map, to_dynamic_cache
    from .capture import capture_with_state

    if samples < 1 or cont_ids.numel() < 1:
        raise InputError("fisher_diagonal needs samples >= 1 and at least one scored token")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if reference is not None:
        if reference.num_tokens != ids.numel():
            raise InputError(f"the reference caches {reference.num_tokens} tokens, ids has {ids.numel()}")
        if (state is None) != (kv_layer_map(model) is None):
            raise InputError("a hybrid model's reference needs its recurrent state (capture_with_state)")
        ref = reference.to(torch.float32)
    else:
        with torch.no_grad():
            ref, state = capture_with_state(model, None, token_ids=ids, dtype=torch.float32)
    if any("kv" in layer for layer in ref.layers):
        raise InputError("sensitivity needs separate K and V caches (this model caches MLA latents)")
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    acc = [{r: torch.zeros(layer[r].shape, dtype=torch.float64) for r in ("k", "v")} for layer in ref.layers]
    if exact:
        try:
            _exact_fisher(model, ref, cont_ids, acc, device, dtype, state=state)
        finally:
            for p, f in zip(model.parameters(), flags):
                p.requires_grad_(f)
        return ref, [{r: a[r] / cont_ids.numel() for r in a} for a in acc]
    try:
        with torch.enable_grad():
            for s in range(samples):
                leaves = [{r: layer[r].clone().requires_grad_(True) for r in ("k", "v")} for layer in ref.layers]
                # the layout, dtype and device moves are differentiable: gradients reach the leaves
                dc = to_dynamic_cache(dataclasses.replace(ref, layers=leaves), device=device, dtype=dtype,
                                      state=state)
                logits = model(cont_ids[None].to(device), use_cache=True, **cache_kwargs(model, dc)).logits[0]
                logp = torch.log_softmax(logits.float(), dim=-1)
                y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=gen)[:, 0].to(device)
                (-logp.gather(1, y[:, None]).sum()).backward()
                for a, lv in zip(acc, leaves):
                    for r in ("k", "v"):
                        a[r] += lv[r].grad.detach().double().cpu().pow(2)
                del leaves, dc, logits, logp
                if progress is not None:
                    progress(s + 1, samples)
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
    n = samples * cont_ids.numel()
    return ref, [{r: a[r] / n for r in a} for a in acc]


def fisher_kl(fisher: list[dict[str, torch.Tensor]], ref: KVCache, decoded: KVCache) -> float:
    """The mean next-token KL that :func:`fisher_diagonal`'s ``fisher`` predicts for ``decoded``
    against ``ref`` (the cache it was measured on): ``0.5 * sum_i F_ii d_i**2``.

    For quantisation errors that are independent across elements the diagonal is exact in
    expectation (the off-diagonal terms average out); what the second-order expansion misses at
    coarse steps, the closed-loop search corrects by measuring (:mod:`kvcodec.harness.profile`).
    """
    if decoded.num_layers != len(fisher) or decoded.num_tokens != ref.num_tokens:
        raise InputError("fisher_kl needs a cache of the reference's geometry")
    total = 0.0
    for f, r, d in zip(fisher, ref.layers, decoded.layers):
        for role in ("k", "v"):
            e = d[role].double() - r[role].double()
            total += float((f[role] * e * e).sum())
    return 0.5 * total


def _exact_fisher(model: Any, ref: KVCache, cont_ids: torch.Tensor, acc: list[dict[str, torch.Tensor]],
                  device: Any, dtype: torch.dtype, chunk: int = 64, state: Any = None) -> None:
    """Add ``sum_pos sum_y p(y) grad(log p(y))**2`` into ``acc`` (``fisher_diagonal(exact=True)``);
    ``state``: a hybrid model's recurrent layers (repeated for every batch row)."""
    import transformers

    from ..integrations.transformers import cache_kwargs

    p_cont = cont_ids.numel()
    with torch.enable_grad():
        vocab = None
        start = 0
        while vocab is None or start < vocab:
            b = chunk if vocab is None else min(chunk, vocab - start)
            leaves = [{r: layer[r].transpose(0, 1)[None].expand(b, -1, -1, -1).to(device, dtype)
                       .contiguous().requires_grad_(True) for r in ("k", "v")} for layer in ref.layers]
            if state is None:
                dc = transformers.DynamicCache()
            else:
                dc = state.cache(batch=b, grad=True)
            for i, lv in enumerate(leaves):
                dc.update(lv["k"], lv["v"], i if state is None else state.kv_layers[i])
            x = cont_ids[None].expand(b, -1).to(device)
            logp = torch.log_softmax(model(x, use_cache=True, **cache_kwargs(model, dc)).logits.float(), -1)
            if vocab is None:
                vocab = int(logp.shape[-1])
                b = min(b, vocab)
            ys = torch.arange(start, start + b, device=device)
            flat = [lv[r] for lv in leaves for r in ("k", "v")]
            for pos in range(p_cont):
                sel = logp[torch.arange(b, device=device), pos, ys]  # row j: log p(y = start + j)
                grads = torch.autograd.grad(sel.sum(), flat, retain_graph=pos < p_cont - 1)
                w = sel.detach().exp().double().cpu()  # p(y)
                for j, (a, r) in enumerate((a, r) for a in acc for r in ("k", "v")):
                    g2 = grads[j][:b].detach().double().cpu().pow(2)  # [b, H, T, D]
                    a[r] += torch.einsum("b,bhtd->thd", w, g2)
            start += b
            del leaves, dc, logp


def fisher_sensitivity(
    model: Any,
    ids: torch.Tensor,
    cont_ids: torch.Tensor,
    samples: int = 4,
    seed: int = 0,
    progress: Any = None,
) -> tuple[list[np.ndarray | None], list[np.ndarray | None]]:
    """Per layer ``(k_sens, v_sens)`` ``[Hkv, D]`` float32: :func:`fisher_diagonal` in kvc's
    relative units, averaged over the cached tokens but the first (stored exactly by kvc):
    ``k_sens[h, c] = mean_t F[t, h, c] * u_h**2`` with ``u_h`` the RMS of head ``h`` after
    centring each channel, ``v_sens[h, c] = mean_t F[t, h, c] * u_{t,h}**2`` with ``u_{t,h}``
    the RMS of token ``t`` in head ``h`` (the units kvc's steps are fractions of).
    """
    return sensitivities(*fisher_diagonal(model, ids, cont_ids, samples, seed, progress))


def sensitivities(ref: KVCache, fisher: list[dict[str, torch.Tensor]], rope: list[Any] | None = None,
                  ) -> tuple[list[np.ndarray | None], list[np.ndarray | None]]:
    """:func:`fisher_sensitivity` from a :func:`fisher_diagonal` result. K's step unit is its
    head RMS after centring as kvc centres it: with ``rope`` (per layer a
    :class:`~kvcodec.codecs.kvc.calibration.LayerAttention`, for ``k_rope_mean``) by rotating
    means on the layers that rotate (the cache's positions start at 0), else by channel means."""
    from ..transforms.rope import layer_rotates, phase_steps, rotated_means, unrotated_mean

    k_sens: list[np.ndarray | None] = []
    v_sens: list[np.ndarray | None] = []
    for i, (f, layer) in enumerate(zip(fisher, ref.layers)):
        k = layer["k"][1:].double()
        v = layer["v"][1:].double()
        if k.shape[0] == 0:
            k_sens.append(None)
            v_sens.append(None)
            continue
        la = rope[i] if rope is not None and i < len(rope) else None
        if la is not None and layer_rotates(la, k.shape[2]):
            pos = np.arange(1, k.shape[0] + 1)
            st = phase_steps(la.inv_freq)
            mu = unrotated_mean(k.numpy(), pos, st, la.offset, la.style)
            rot = torch.from_numpy(rotated_means(mu.astype(np.float32), pos, st, la.offset, la.style)).double()
            uk = (k - rot).pow(2).mean(dim=(0, 2))  # [H]
        else:
            uk = (k - k.mean(0, keepdim=True)).pow(2).mean(dim=(0, 2))  # [H]
        uv = v.pow(2).mean(dim=2)  # [T, H]
        k_sens.append((f["k"][1:].mean(0) * uk[:, None]).float().numpy())
        v_sens.append((f["v"][1:] * uv[:, :, None]).mean(0).float().numpy())
    return k_sens, v_sens


__all__ = ["QSTATS_FORMAT", "QSTATS_FORMATS", "QueryStats", "attention_estimate", "fisher_diagonal", "fisher_kl", "fisher_sensitivity", "load_query_statistics", "pair_mean",
           "query_statistics", "rotate_queries", "save_query_statistics", "sensitivities"]
