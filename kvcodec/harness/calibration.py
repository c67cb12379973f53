"""Query statistics for the ``kvc`` encoder (optional calibration; the decoder never needs them).

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

File metadata (``__metadata__``): ``format = "kvcodec.qstats/1"`` (or ``/2`` with sensitivities), ``num_layers``,
``q_position``, ``rope`` (``"default"`` with ``rope_theta`` when queries can be re-rotated,
otherwise ``"none"``) and the model identity. Stored as safetensors (no pickle).

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
    Calibration,
    QueryStats,
    attention_estimate,
    load_query_statistics,
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
    ids = tokenize(tokenizer, text, skip_tokens + context + extra)
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = ids[skip_tokens:] if skip_tokens else ids
    if bos is not None and skip_tokens:
        ids = torch.cat([torch.tensor([bos]), ids[:-1]])
    cont_ids = ids[context:]
    ids = ids[:context]
    device = next(model.parameters()).device
    with record_queries(model) as store:
        model(ids[None].to(device), use_cache=False)
    cfg = getattr(model.config, "text_config", None) or model.config
    applied, rope = rope_info(model.config)
    theta = float(rope.get("rope_theta", 0.0)) if applied and rope.get("rope_type", "default") == "default" else 0.0
    n_layers = int(getattr(cfg, "num_hidden_layers", len(store)))
    hkv = int(getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads"))
    energy: list[np.ndarray | None] = []
    sample: list[np.ndarray | None] = []
    n = min(samples, context)
    for i in range(n_layers):
        if i not in store:
            energy.append(None)
            sample.append(None)
            continue
        q = store[i]["q"].double() * store[i]["scaling"]  # [T, Hq, D]
        hq, d = q.shape[1], q.shape[2]
        g = max(1, hq // hkv)
        # token 0 (BOS) queries are atypical: leave them out of the energy
        e = q[1:].pow(2).mean(0).reshape(hq // g, g, d).mean(1).numpy()
        energy.append(pair_mean(e).astype(np.float32) if theta > 0 else e.astype(np.float32))
        sample.append(q[-n:].transpose(0, 1).float().numpy().copy())
    if not any(e is not None for e in energy):
        raise InputError("no attention layer recorded any query")
    meta = {"model": str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", ""))}
    out = QueryStats(energy, sample, int(ids.numel() - n), theta, meta)
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
) -> tuple[KVCache, list[dict[str, torch.Tensor]]]:
    """The cache of ``ids`` (float32) and, per layer, ``{"k", "v"}`` ``[T, Hkv, D]`` float64: the
    diagonal of the Fisher information of the next-token distributions over ``cont_ids``
    (continuing the cache) with respect to every cached value, per scored token.

    For a small change ``d`` of the cache, the mean next-token KL grows by about
    ``0.5 * sum_i F_ii d_i**2`` (off-diagonal terms left out). ``F_ii`` is estimated without
    bias by sampling: draw each scored token from the model's own distribution, backpropagate
    the summed log-likelihood to the cached K and V, square; ``samples`` draws (seeded) are
    averaged. Parameters are not differentiated (only the cache leaves).

    Raises:
        InputError: the model's cache holds MLA latents (no separate K and V), or nothing to score.
    """
    from ..integrations.transformers import cache_kwargs, to_dynamic_cache
    from .capture import capture

    if samples < 1 or cont_ids.numel() < 1:
        raise InputError("fisher_diagonal needs samples >= 1 and at least one scored token")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        ref = capture(model, None, token_ids=ids, dtype=torch.float32)
    if any("kv" in layer for layer in ref.layers):
        raise InputError("sensitivity needs separate K and V caches (this model caches MLA latents)")
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    acc = [{r: torch.zeros(layer[r].shape, dtype=torch.float64) for r in ("k", "v")} for layer in ref.layers]
    try:
        with torch.enable_grad():
            for s in range(samples):
                leaves = [{r: layer[r].clone().requires_grad_(True) for r in ("k", "v")} for layer in ref.layers]
                # the layout, dtype and device moves are differentiable: gradients reach the leaves
                dc = to_dynamic_cache(dataclasses.replace(ref, layers=leaves), device=device, dtype=dtype)
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
    ref, fisher = fisher_diagonal(model, ids, cont_ids, samples, seed, progress)
    k_sens: list[np.ndarray | None] = []
    v_sens: list[np.ndarray | None] = []
    for f, layer in zip(fisher, ref.layers):
        k = layer["k"][1:].double()
        v = layer["v"][1:].double()
        if k.shape[0] == 0:
            k_sens.append(None)
            v_sens.append(None)
            continue
        uk = (k - k.mean(0, keepdim=True)).pow(2).mean(dim=(0, 2))  # [H]
        uv = v.pow(2).mean(dim=2)  # [T, H]
        k_sens.append((f["k"][1:].mean(0) * uk[:, None]).float().numpy())
        v_sens.append((f["v"][1:] * uv[:, :, None]).mean(0).float().numpy())
    return k_sens, v_sens


__all__ = ["QSTATS_FORMAT", "QSTATS_FORMATS", "QueryStats", "attention_estimate", "fisher_diagonal", "fisher_sensitivity", "load_query_statistics", "pair_mean",
           "query_statistics", "rotate_queries", "save_query_statistics"]
