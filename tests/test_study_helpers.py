"""The cross-layer prediction studies' shared helpers (kvcodec.harness.studies): the RoPE rotation
is the model's own and undoes itself; the ridge fit recovers a linear map with its bias."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.harness.studies import ridge_fit, rope_rotate


def test_rope_rotate_matches_the_models_rope_and_undoes_itself():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    t, heads, d, theta = 40, 3, 16, 10000.0
    cfg = transformers.LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, head_dim=d,
                                   rope_theta=theta, max_position_embeddings=64)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((t, heads * d))
    emb = LlamaRotaryEmbedding(cfg)
    x = torch.from_numpy(k).reshape(1, t, heads, d).transpose(1, 2)  # [1, H, T, D]
    cos, sin = emb(x, torch.arange(t)[None])
    want, _ = apply_rotary_pos_emb(x, x, cos.double(), sin.double())
    want = want.transpose(1, 2).reshape(t, heads * d).numpy()
    got = rope_rotate(k, heads, theta, 1)
    # the sine table resolves 2**-16 turn: within 1e-4 of the model's float rotation
    assert np.abs(got - want).max() < 1e-3 * np.abs(k).max()
    assert np.allclose(got[0], k[0])  # position 0 does not turn
    back = rope_rotate(got, heads, theta, -1)
    assert np.allclose(back, k, atol=1e-9)


def test_ridge_fit_recovers_a_linear_map_and_its_bias():
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((2000, 6))
    w = rng.standard_normal((6, 3))
    b = np.array([0.5, -2.0, 3.0])
    ys = xs @ w + b
    fit = ridge_fit(xs, ys)
    assert fit.shape == (7, 3)
    assert np.allclose(fit[:-1], w, atol=1e-2) and np.allclose(fit[-1], b, atol=1e-2)
    # the ridge pulls toward zero, never away
    assert np.abs(fit[:-1]).sum() <= np.abs(w).sum() + 1e-9
