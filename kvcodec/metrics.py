"""Quality metrics: what a compressed KV cache does to attention and to the model's predictions.

Two levels, both in plain torch (no transformers needed):

* **Per layer and head**, teacher-forced with the model's real queries (captured from the
  uncompressed run): :func:`attention_errors` compares attention over the reference K/V with
  attention over the decoded K/V — output relative L2 error and cosine, attention-probability
  KL, K logit error — and :func:`reconstruction_errors` gives the K and V relative L2 errors.
* **End to end**: :func:`next_token_metrics` compares the next-token distributions of the model
  run on the reference cache and on the decoded cache: KL (mean, p99, max), top-1 agreement,
  perplexity and its change.

All KL values are in nats, ``KL(reference || test)``. Queries attend causally: a query at
position ``p`` sees keys at positions ``j <= p`` (and, for a sliding-window layer of window
``w``, only ``p - j < w``, as transformers masks it).

Example:
    >>> import torch
    >>> from kvcodec.metrics import attention_errors
    >>> q, k, v = torch.randn(4, 2, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    >>> e = attention_errors(q, k, v, k, v * 1.1)          # V scaled by 1.1: output error 10%
    >>> round(float(e["out_rel_l2"].max()), 6), float(e["attn_kl"].abs().max())
    (0.1, 0.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .errors import InputError

#: Metric names of :func:`attention_errors` (per query head) and :func:`reconstruction_errors`
#: (per KV head), in report order.
ATTENTION_METRICS = ("out_rel_l2", "out_cosine", "attn_kl", "k_logit_rmse")
RECONSTRUCTION_METRICS = ("k_rel_l2", "v_rel_l2")


def visibility_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """Boolean ``[Tq, Tk]``: may the query at ``q_positions[i]`` see the key at ``k_positions[j]``?

    Causal (``j <= p``) and, when ``window > 0``, within the sliding window (``p - j < window``).

    Example:
        >>> visibility_mask(torch.tensor([2]), torch.arange(4), window=2).int().tolist()
        [[0, 1, 1, 0]]
    """
    d = q_positions.reshape(-1, 1) - k_positions.reshape(1, -1)
    m = d >= 0
    if window and window > 0:
        m &= d < window
    return m


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise InputError(
            f"expected q [Tq, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]; got {list(q.shape)}, "
            f"{list(k.shape)}, {list(v.shape)}"
        )
    hq, hkv = q.shape[1], k.shape[1]
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1] or q.shape[2] != k.shape[2]:
        raise InputError(f"shapes do not match: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise InputError(f"{hq} query heads cannot share {hkv} KV heads evenly")
    return hq, hkv


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[Tq, Hq, D]`` -> ``[Hkv, g*Tq, D]``: the queries of each KV head side by side (GQA/MQA;
    query head ``h`` reads KV head ``h // g``), so one batched matmul serves a whole group."""
    tq, hq, d = q.shape
    g = hq // hkv
    return q.reshape(tq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * tq, d)


def _per_query_head(x: torch.Tensor, tq: int, hq: int) -> torch.Tensor:
    """``[Hkv, g*Tq, ...]`` -> ``[Hq, Tq, ...]`` (inverse of :func:`_grouped`'s row order)."""
    return x.reshape(hq, tq, *x.shape[2:])


@dataclass
class AttentionReference:
    """Attention over the reference K/V for fixed queries, computed once and reused for every
    decoded cache (see :func:`attention_reference`)."""

    q: torch.Tensor  # [Hkv, g*Tq, D], visible rows only, compute dtype
    mask: torch.Tensor  # [1, g*Tq, T] bool, or None when every key is visible
    logp: torch.Tensor  # [Hkv, g*Tq, T]
    out: torch.Tensor  # [Hkv, g*Tq, Dv]
    k: torch.Tensor  # [Hkv, T, D]
    scaling: float
    hq: int
    tq: int
    dtype: torch.dtype


def _logp(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    logits = torch.matmul(q, k.transpose(1, 2)) * scaling
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def attention_reference(
    q: torch.Tensor,
    k_ref: torch.Tensor,
    v_ref: torch.Tensor,
    scaling: float | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    window: int = 0,
    dtype: torch.dtype = torch.float32,
) -> AttentionReference | None:
    """Precompute the reference side of :func:`attention_errors` (arguments as there).

    Returns ``None`` when no query sees any key (for example a short sliding window).
    """
    hq, hkv = _check_qkv(q, k_ref, v_ref)
    t, tq = k_ref.shape[0], q.shape[0]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    if k_positions is None:
        k_positions = torch.arange(t)
    if q_positions is None:
        q_positions = torch.arange(t, t + tq)
    mask = visibility_mask(q_positions, k_positions, window)  # [Tq, T]
    rows = mask.any(dim=1)
    if not bool(rows.any()):
        return None
    q, mask = q[rows], mask[rows]
    tq = q.shape[0]
    qg = _grouped(q.to(dtype), hkv)
    g = hq // hkv
    full = bool(mask.all())
    # Row r of a group is query r % tq; the mask repeats per group member.
    m = None if full else mask.repeat(g, 1)[None]
    kk = k_ref.to(dtype).transpose(0, 1).contiguous()
    logp = _logp(qg, kk, m, scaling)
    out = torch.matmul(logp.exp(), v_ref.to(dtype).transpose(0, 1))
    return AttentionReference(qg, m, logp, out, kk, float(scaling), hq, tq, dtype)


def attention_errors(
    q: torch.Tensor,
    k_ref: torch.Tensor,
    v_ref: torch.Tensor,
    k_test: torch.Tensor,
    v_test: torch.Tensor,
    scaling: float | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    window: int = 0,
    dtype: torch.dtype = torch.float32,
    reference: AttentionReference | None = None,
) -> dict[str, torch.Tensor]:
    """Per-query-head attention errors of ``(k_test, v_test)`` against ``(k_ref, v_ref)``.

    Args:
        q: real queries ``[Tq, Hq, D]`` (after RoPE and any query norm, as the model used them).
        k_ref, v_ref: reference keys/values ``[T, Hkv, D]`` / ``[T, Hkv, Dv]``.
        k_test, v_test: decoded keys/values, same shapes.
        scaling: logit scale (default ``D ** -0.5``).
        q_positions: positions of the queries (default: all after the keys, ``T .. T+Tq-1``).
        k_positions: positions of the keys (default ``0 .. T-1``).
        window: sliding-window size of the layer (0 = full attention).
        dtype: compute dtype (float32 is ample for errors above ~1e-6; float64 for tiny ones).
        reference: :func:`attention_reference` of the same arguments, to skip recomputing it.

    Returns:
        Float64 tensors ``[Hq]``: ``out_rel_l2`` (``‖O'−O‖ / ‖O‖`` over all queries),
        ``out_cosine`` (mean over queries of ``cos(O'_q, O_q)``), ``attn_kl`` (mean over queries
        of ``KL(P_q ‖ P'_q)``, nats) and ``k_logit_rmse`` (RMS of the scaled logit error
        ``s·q·(k'−k)`` over visible query–key pairs). Queries that see no key are left out;
        when no query sees a key every value is NaN.

    Raises:
        InputError: shapes are inconsistent.
    """
    hq, hkv = _check_qkv(q, k_ref, v_ref)
    if k_test.shape != k_ref.shape or v_test.shape != v_ref.shape:
        raise InputError(
            f"decoded K/V {list(k_test.shape)}/{list(v_test.shape)} differ from reference "
            f"{list(k_ref.shape)}/{list(v_ref.shape)}"
        )
    ref = reference or attention_reference(
        q, k_ref, v_ref, scaling, q_positions, k_positions, window, dtype
    )
    if ref is None:
        nan = torch.full((hq,), float("nan"), dtype=torch.float64)
        return {name: nan.clone() for name in ATTENTION_METRICS}
    dtype = ref.dtype
    kt = k_test.to(dtype).transpose(0, 1)
    logp_t = _logp(ref.q, kt, ref.mask, ref.scaling)
    out_t = torch.matmul(logp_t.exp(), v_test.to(dtype).transpose(0, 1))
    # Logit error straight from the key error: s·q·(k'−k), no cancellation between two logits.
    dl = torch.matmul(ref.q, (kt - ref.k).transpose(1, 2)) * ref.scaling
    if ref.mask is not None:
        dl = dl.masked_fill(~ref.mask, 0.0)
        n_visible = ref.mask.sum(dim=(1, 2)) / (hq // hkv)  # visible pairs per query head
    else:
        n_visible = torch.tensor(float(ref.tq * ref.k.shape[1]))
    # KL(P || P'): masked keys have P = 0 and add nothing (0 * (-inf - -inf) is avoided).
    p = ref.logp.exp()
    diff = ref.logp - logp_t
    if ref.mask is not None:
        diff = diff.masked_fill(~ref.mask, 0.0)
    kl = (p * diff).sum(-1).clamp_min(0.0)  # tiny negatives are rounding

    tq = ref.tq
    o_r = _per_query_head(ref.out, tq, hq).double()
    o_t = _per_query_head(out_t, tq, hq).double()
    err = (o_t - o_r).flatten(1).norm(dim=1)
    nrm = o_r.flatten(1).norm(dim=1)
    out_rel = torch.where(nrm > 0, err / nrm.clamp_min(1e-300), err)
    dot = (o_t * o_r).sum(-1)
    na, nb = o_t.norm(dim=-1), o_r.norm(dim=-1)
    # Zero-output rows (both zero) count as identical.
    cos = torch.where((na == 0) & (nb == 0), torch.ones_like(dot), dot / (na * nb).clamp_min(1e-300))
    return {
        "out_rel_l2": out_rel,
        "out_cosine": cos.mean(-1),
        "attn_kl": _per_query_head(kl, tq, hq).double().mean(-1),
        "k_logit_rmse": (_per_query_head(dl, tq, hq).double().pow(2).sum(dim=(1, 2)) / n_visible).sqrt(),
    }


def rel_l2(ref: torch.Tensor, test: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Relative L2 error ``‖test − ref‖ / ‖ref‖`` (0 when both are zero), reduced over ``dim``.

    Example:
        >>> float(rel_l2(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])))
        0.1
    """
    ref, test = ref.double(), test.double()
    if dim is None:
        num, den = (test - ref).norm(), ref.norm()
    else:
        num = (test - ref).pow(2).sum(dim=dim).sqrt()
        den = ref.pow(2).sum(dim=dim).sqrt()
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, torch.inf, 0.0))


def reconstruction_errors(
    k_ref: torch.Tensor, v_ref: torch.Tensor, k_test: torch.Tensor, v_test: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-KV-head relative L2 errors of decoded K and V (``[Hkv]`` float64 each).

    Example:
        >>> k = torch.ones(3, 2, 4)
        >>> reconstruction_errors(k, k, k, 2 * k)["v_rel_l2"].tolist()
        [1.0, 1.0]
    """
    return {
        "k_rel_l2": rel_l2(k_ref, k_test, dim=(0, 2)),
        "v_rel_l2": rel_l2(v_ref, v_test, dim=(0, 2)),
    }


def next_token_kl(ref_logits: torch.Tensor, test_logits: torch.Tensor,
                  ref_probs: torch.Tensor | None = None) -> torch.Tensor:
    """``KL(ref || test)`` per row (nats, float64 ``[N]``), as :func:`next_token_metrics` gives it
    but about 7x faster: the closed-loop calibration scores a window many times against one
    reference, so the reference's probabilities are passed in (``softmax(ref_logits)``, float32).

    With ``d = test - ref`` (float32 logits, so ``d`` is small where the codec is good), ``KL =
    log(sum_y p_y e^d_y) - sum_y p_y d_y`` and ``log(sum p e^d) = log1p(sum p expm1(d))``: both
    terms keep their precision however small the KL (``log_softmax`` of both sides loses ~1e-6
    nats to the ~30-nat magnitude of the logits). Rows whose ``d`` reaches 30 (``expm1``
    would lose range) are computed like :func:`next_token_metrics`, in float64.

    Example:
        >>> z = torch.tensor([[0.0, 1.0, 2.0]])
        >>> float(next_token_kl(z, z))
        0.0
    """
    if ref_logits.shape != test_logits.shape or ref_logits.dim() != 2:
        raise InputError(f"logits must both be [N, vocab]; got {list(ref_logits.shape)} and {list(test_logits.shape)}")
    zr, zt = ref_logits.float(), test_logits.float()
    p = torch.softmax(zr, dim=-1) if ref_probs is None else ref_probs
    d = zt - zr
    kl = (torch.log1p((p * torch.expm1(d)).sum(-1).clamp_min(-1.0 + 1e-12)) - (p * d).sum(-1)).double()
    wide = d.amax(-1) >= 30.0
    if bool(wide.any()):
        kl[wide] = _kl_float64(zr[wide], zt[wide])[0]
    return kl.clamp_min(0.0)


def _kl_float64(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``KL(ref || test)`` per row in float64 (not clamped), with both rows' log-probabilities."""
    lr = torch.log_softmax(ref_logits.double(), dim=-1)
    lt = torch.log_softmax(test_logits.double(), dim=-1)
    return (lr.exp() * (lr - lt)).sum(-1), lr, lt


def next_token_metrics(
    ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor | None = None
) -> dict[str, float]:
    """End-to-end comparison of next-token distributions (one row per scored position).

    Args:
        ref_logits: ``[N, vocab]`` logits with the reference (uncompressed) cache.
        test_logits: ``[N, vocab]`` logits with the decoded cache.
        targets: ``[N]`` the true next tokens, for perplexity (optional).

    Returns:
        ``kl_mean``, ``kl_p99``, ``kl_max`` (nats, ``KL(ref ‖ test)`` per position),
        ``top1_agreement`` (fraction of positions with the same argmax), and with ``targets``
        also ``nll_ref``, ``nll_test``, ``ppl_ref``, ``ppl_test`` and
        ``delta_ppl = ppl_test − ppl_ref``.

    Example:
        >>> z = torch.zeros(2, 4)
        >>> m = next_token_metrics(z, z, torch.tensor([0, 1]))
        >>> m["kl_mean"], m["top1_agreement"], m["ppl_ref"], m["delta_ppl"]
        (0.0, 1.0, 4.0, 0.0)
    """
    if ref_logits.shape != test_logits.shape or ref_logits.dim() != 2:
        raise InputError(
            f"logits must both be [N, vocab]; got {list(ref_logits.shape)} and {list(test_logits.shape)}"
        )
    n = ref_logits.shape[0]
    if n == 0:
        raise InputError("no positions to score")
    kl, lr, lt = _kl_float64(ref_logits, test_logits)
    kl = kl.clamp_min(0.0)
    out: dict[str, float] = {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)) if n > 1 else float(kl[0]),
        "kl_max": float(kl.max()),
        "top1_agreement": float((ref_logits.argmax(-1) == test_logits.argmax(-1)).double().mean()),
    }
    if targets is not None:
        targets = targets.reshape(-1).to(torch.int64)
        if targets.shape[0] != n:
            raise InputError(f"{targets.shape[0]} targets for {n} positions")
        nll_r = float(-lr.gather(1, targets[:, None]).mean())
        nll_t = float(-lt.gather(1, targets[:, None]).mean())
        out.update(nll_ref=nll_r, nll_test=nll_t, ppl_ref=math.exp(nll_r), ppl_test=math.exp(nll_t),
                   delta_ppl=math.exp(nll_t) - math.exp(nll_r))
    return out


def summarize(values: dict[str, Any]) -> dict[str, float]:
    """Mean of each metric over everything it holds (layers, heads), ignoring NaN."""
    out = {}
    for name, v in values.items():
        t = torch.as_tensor(v, dtype=torch.float64).flatten()
        t = t[~torch.isnan(t)]
        out[name] = float(t.mean()) if t.numel() else float("nan")
    return out


__all__ = [
    "ATTENTION_METRICS",
    "AttentionReference",
    "attention_reference",
    "RECONSTRUCTION_METRICS",
    "attention_errors",
    "next_token_kl",
    "next_token_metrics",
    "reconstruction_errors",
    "rel_l2",
    "summarize",
    "visibility_mask",
]
