"""kvc with a calibration file: query statistics, re-rotated queries, attention-weighted steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.codec import TensorContext
from kvcodec.codecs.kvc import _attn_factor
from kvcodec.errors import ConfigError, FormatError, InputError
from kvcodec.harness.calibration import (
    QueryStats,
    attention_estimate,
    load_query_statistics,
    pair_mean,
    rotate_queries,
    save_query_statistics,
)
from kvcodec.quant.deadzone import step_from_code
from kvc_tools import query_stats as _stats
from kvc_tools import small_cache as _cache


def test_pair_mean_and_rotation_compose_and_keep_norm():
    e = np.arange(8.0).reshape(1, 8)
    assert pair_mean(e).tolist() == [[2.0, 3.0, 4.0, 5.0, 2.0, 3.0, 4.0, 5.0]]
    assert pair_mean(np.ones((2, 5))).shape == (2, 5)  # odd width: unchanged
    q = np.random.default_rng(0).normal(size=(3, 5, 16))
    r = rotate_queries(q, 7, 1e4)
    np.testing.assert_allclose(np.linalg.norm(r, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(rotate_queries(r, 13, 1e4), rotate_queries(q, 20, 1e4), atol=1e-12)
    assert not np.allclose(r, q)
    assert rotate_queries(q, 7, 0.0) is q  # no RoPE: untouched


def test_stats_file_round_trip_and_rejections(tmp_path):
    cache = _cache()
    st = _stats(cache)
    p = tmp_path / "q.safetensors"
    save_query_statistics(st, p)
    back = load_query_statistics(p)
    assert back.num_layers == 2 and back.q_position == 200 and back.rope_theta == 10000.0
    assert all(np.array_equal(a, b) for a, b in zip(back.q_energy, st.q_energy))
    assert all(np.array_equal(a, b) for a, b in zip(back.q_sample, st.q_sample))
    from safetensors.numpy import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"layers.0.q_energy": np.ones((2, 16), np.float32)}, str(bad), metadata={"format": "other"})
    with pytest.raises(FormatError, match="qstats"):
        load_query_statistics(bad)
    save_file({"layers.0.q_energy": np.full((2, 16), np.nan, np.float32)}, str(bad),
              metadata={"format": "kvcodec.qstats/1", "num_layers": "1", "q_position": "0", "rope_theta": "0.0"})
    with pytest.raises(FormatError, match="finite"):
        load_query_statistics(bad)
    (tmp_path / "junk").write_bytes(b"not a file")
    with pytest.raises(FormatError):
        load_query_statistics(tmp_path / "junk")
    with pytest.raises(InputError):
        load_query_statistics(tmp_path / "missing")


def test_attention_estimate_is_a_distribution_and_finds_the_heavy_token():
    cache = _cache(layers=1)
    st = _stats(cache)
    st.q_sample[0][2:4] = st.q_sample[0][2, 0]  # query heads 2, 3 (KV head 1): one direction
    k = cache.layers[0]["k"].float().numpy().copy()
    # make token 5 of head 1 align with that query: it must receive the most attention
    q = rotate_queries(st.q_sample[0], float(k.shape[0] - st.q_position), st.rope_theta)
    k[5, 1] = 3.0 * q[2, 0]
    a = attention_estimate(st, 0, k)
    assert a.shape == (k.shape[0], 2)
    np.testing.assert_allclose(a.sum(axis=0), 1.0, rtol=1e-5)
    assert int(a[:, 1].argmax()) == 5
    assert attention_estimate(st, 3, k) is None  # no such layer


def test_attention_estimate_takes_the_queries_where_query_pos_says():
    """A chunk cut from a sequence (keys rotated at positions 300..339) read by queries at the
    sequence's end (position 400): ``query_pos`` turns the calibration queries there. It equals
    the estimate of the same keys when they end a cache at 400 (the default) and differs from the
    default estimate of the chunk alone (queries just after its 40 tokens)."""
    cache = _cache(layers=1)
    st = _stats(cache)
    k = cache.layers[0]["k"].float().numpy()
    t = k.shape[0]
    direct = attention_estimate(st, 0, k, query_pos=400)
    st_shift = QueryStats(st.q_energy, st.q_sample, q_position=st.q_position - (400 - t),
                          rope_theta=st.rope_theta, meta=st.meta)
    np.testing.assert_allclose(direct, attention_estimate(st_shift, 0, k), rtol=1e-5, atol=1e-7)
    assert not np.allclose(direct, attention_estimate(st, 0, k), atol=1e-4)
    np.testing.assert_array_equal(attention_estimate(st, 0, k, query_pos=t), attention_estimate(st, 0, k))
    with pytest.raises(ConfigError, match="query_pos"):
        attention_estimate(st, 0, k, query_pos=t - 1)


def test_query_pos_moves_the_calibrated_steps_and_is_not_recorded(tmp_path):
    cache = _cache()
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache), p)
    base = {"id": "kvc-near", "calibration": str(p)}
    a = kvcodec.get_codec(base).encode(cache)
    b = kvcodec.get_codec({**base, "query_pos": 5000}).encode(cache)
    assert a != b  # other attention estimates: other steps
    with kvcodec.open(b) as r:
        assert "query_pos" not in r.manifest["codec"]  # encoder-only
    assert kvcodec.decode(b).num_tokens == cache.num_tokens
    plain = kvcodec.get_codec("kvc-near").encode(cache)  # without a calibration it changes nothing
    assert kvcodec.get_codec({"id": "kvc-near", "query_pos": 5000}).encode(cache) == plain
    for bad in (-1, 1.5, True, 1 << 41):
        with pytest.raises(ConfigError, match="query_pos"):
            kvcodec.get_codec({"id": "kvc", "query_pos": bad})
    near = kvcodec.get_codec(base)
    assert near.part_config(query_pos=777)["query_pos"] == 777
    assert near.part_config()["query_pos"] == 0


def test_encode_parts_gives_each_part_the_whole_files_steps(tmp_path):
    """Parts coded by ``encode_parts`` take the whole cache's attention estimates, normalised
    over all its tokens: one part is the whole file byte for byte, and every part's steps (its
    decoded values) equal the whole file's on those tokens, where a part that estimates its own
    attention (``query_pos``) does not."""
    cache = _cache()
    t = cache.num_tokens
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache), p)
    near = kvcodec.get_codec({"id": "kvc-near", "calibration": str(p), "recent_ramp": 0})
    assert near.encode_parts(cache, t) == [near.encode(cache)]
    assert near.encode_parts(cache, t + 5) == [near.encode(cache)]
    whole = kvcodec.decode(near.encode(cache))
    c = t // 2
    parts = [kvcodec.decode(b) for b in near.encode_parts(cache, c)]
    assert [x.num_tokens for x in parts] == [c, t - c]
    for r in ("k", "v"):  # the parts code the same tokens to about the whole file's error
        ref = cache.layers[0][r].float()
        err_w = (whole.layers[0][r].float() - ref).pow(2).mean()
        err_p = (torch.cat([x.layers[0][r] for x in parts]).float() - ref).pow(2).mean()
        assert 0 < err_p < 2 * err_w, (r, err_p, err_w)
    # a part's per-token step factors are the whole file's on its tokens (the norm is the whole
    # cache's mean weight); normalised within the part, as before, they are not
    a = attention_estimate(load_query_statistics(p), 0, cache.layers[0]["k"].float().numpy())
    for e in (1.0, 0.5):
        w = np.maximum(a.astype(np.float64), 1e-12) ** e
        norm = np.array([w[:, j].mean() for j in range(w.shape[1])])  # per head, as the encoder sums
        full = _attn_factor(a, e, 3.0, 1.0)
        np.testing.assert_array_equal(_attn_factor(a[c:], e, 3.0, 1.0, norm), full[c:])
        assert not np.array_equal(_attn_factor(a[c:], e, 3.0, 1.0), full[c:])
    # the attention a middle part's tokens get is the whole cache's slice, not renormalised
    seq = near._sequence_attention(cache, kvcodec.get_codec(near.part_config()).params)
    for i, (att, norm) in seq.items():
        np.testing.assert_array_equal(att, attention_estimate(load_query_statistics(p), i,
                                                              cache.layers[i]["k"].float().numpy()))
        assert norm["k"].shape == (att.shape[1],) and (norm["k"] > 0).all()
    with pytest.raises(ConfigError, match="chunk_tokens"):
        near.encode_parts(cache, 0)


def test_attn_factor_normalised_and_clipped():
    a = np.random.default_rng(0).dirichlet(np.full(50, 0.3), size=3).T  # [n=50, H=3]
    m = _attn_factor(a, 1.0, 1e6)
    # weighted distortion sum a * m^2 of the unweighted steps is kept
    np.testing.assert_allclose((a * m * m).mean(axis=0), a.mean(axis=0), rtol=1e-9)
    m2 = _attn_factor(a, 1.0, 2.0)
    assert m2.min() >= 0.5 and m2.max() <= 2.0
    assert np.all(np.diff(m[np.argsort(a[:, 0]), 0]) <= 1e-12)  # more attention, finer step


def test_calibrated_encode_decodes_without_the_file(tmp_path):
    cache = _cache()
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache), p)
    plain = kvcodec.get_codec("kvc-near")
    cal = kvcodec.get_codec({**plain.get_config(), "calibration": str(p)})
    blob = cal.encode(cache)
    p.unlink()  # the decoder never reads it
    out = kvcodec.decode(blob)
    ref = plain.decode(plain.encode(cache))
    for a, b, c in zip(out.layers, ref.layers, cache.layers):
        for r in ("k", "v"):
            assert a[r].dtype == c[r].dtype and a[r].shape == c[r].shape
            rel = (a[r].float() - c[r].float()).pow(2).mean() / c[r].float().var()
            rel0 = (b[r].float() - c[r].float()).pow(2).mean() / c[r].float().var()
            # the weights move error between channels and tokens; it stays a faithful reconstruction
            assert rel < 8 * rel0 + 1e-3, (r, float(rel), float(rel0))
    # the calibrated steps differ from the plain ones, and the K file records per-token offsets
    assert not all(torch.equal(a["v"], b["v"]) for a, b in zip(out.layers, ref.layers))


def test_calibrated_k_error_within_half_of_its_per_token_step(tmp_path):
    cache = _cache(layers=1, t=64)
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache), p)
    codec = kvcodec.get_codec({"id": "kvc", "calibration": str(p), "k_step": 0.3, "sinks": 0, "sink_v_ratio": 0.0})
    k = cache.layers[0]["k"]
    with codec.plan(cache) as call:
        plan = call.state
        enc = codec.encode_planes(k, TensorContext(0, "k", tuple(k.shape), k.dtype, state=plan))
    assert enc.params["k_tok"] == 1
    dec = codec.decode_tensor(enc, TensorContext(0, "k", tuple(k.shape), k.dtype))
    sc = enc.planes["side"][1].astype(np.int64)
    # per-token offsets: recompute them the way the encoder does
    m = _attn_factor(plan[0]["attn"], codec.params["k_attn"], codec.params["attn_clip"], codec.params["attn_coarse"])
    from kvcodec.quant.deadzone import step_code

    step = torch.from_numpy(step_from_code(sc[None] + step_code(m)[:, :, None].astype(np.int64)))
    err = (dec.float() - k.float()).abs()
    assert bool((err <= step / 2 + k.float().abs() * 2.0 ** -11 + 1e-6).all())
    # a hostile k_tok is refused
    enc.params["k_tok"] = 2
    with pytest.raises(FormatError, match="k_tok"):
        codec.decode_tensor(enc, TensorContext(0, "k", tuple(k.shape), k.dtype))


def test_calibrated_file_names_its_statistics_by_hash(tmp_path):
    import hashlib

    from kvcodec import open as open_kvc

    cache = _cache()
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache), p)
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    cal = kvcodec.get_codec({"id": "kvc-near", "calibration": str(p)})
    blob = cal.encode(cache)
    with open_kvc(blob) as r:
        assert r.manifest["codec"]["calibration_sha256"] == digest
    assert cal.params["calibration_sha256"] == ""  # the codec object is left as configured
    plain = kvcodec.get_codec("kvc-near").encode(cache)
    with open_kvc(plain) as r:
        assert r.manifest["codec"]["calibration_sha256"] == ""
    # naming the hash pins the file: the same statistics encode, others are refused
    pinned = kvcodec.get_codec({"id": "kvc-near", "calibration": str(p), "calibration_sha256": digest})
    assert pinned.encode(cache) == blob
    save_query_statistics(_stats(cache, seed=7), p)
    with pytest.raises(ConfigError, match="SHA-256"):
        pinned.encode(cache)
    for bad in ("ABC", "0" * 63, 5):
        with pytest.raises(ConfigError, match="calibration_sha256"):
            kvcodec.get_codec({"id": "kvc", "calibration_sha256": bad})
    with pytest.raises(InputError, match="cannot be read"):
        kvcodec.get_codec({"id": "kvc", "calibration": str(tmp_path / "missing.safetensors")}).encode(cache)


def test_background_attention_estimates_give_the_same_file(tmp_path, monkeypatch):
    """The encoder computes the attention estimates on a second thread; the bytes are those of
    the plan computed up front, and an error in the estimate reaches the caller."""
    from kvcodec.codecs.kvc import codec as kvc_mod

    cache = _cache(layers=3)
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache), p)
    codec = kvcodec.get_codec({"id": "kvc-near", "calibration": str(p)})
    threaded = codec.encode(cache)
    orig = kvc_mod.KVCCodec._calibration_plan
    monkeypatch.setattr(kvc_mod.KVCCodec, "_calibration_plan", lambda self, c, st, pool=None, params=None: orig(self, c, st, None, params))
    assert codec.encode(cache) == threaded
    monkeypatch.setattr(kvc_mod.KVCCodec, "_calibration_plan", orig)

    def boom(*a, **k):
        raise RuntimeError("estimate failed")

    monkeypatch.setattr(kvc_mod, "attention_estimate", boom)
    with pytest.raises(RuntimeError, match="estimate failed"):
        codec.encode(cache)


def test_calibration_for_another_model_is_refused(tmp_path):
    cache = _cache(layers=2)
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(_cache(layers=3)), p)
    with pytest.raises(ConfigError, match="layers"):
        kvcodec.get_codec({"id": "kvc", "calibration": str(p)}).encode(cache)
    save_query_statistics(_stats(_cache(layers=2, d=8)), p)
    with pytest.raises(ConfigError, match="query energy"):
        kvcodec.get_codec({"id": "kvc", "calibration": str(p)}).encode(cache)


def test_without_calibration_the_new_params_change_nothing():
    cache = _cache()
    a = kvcodec.get_codec({"id": "kvc"})
    b = kvcodec.get_codec({"id": "kvc", "v_attn": 2.0, "k_attn": 3.0, "k_qgamma": 0.5, "attn_clip": 8.0})
    da, db = a.decode(a.encode(cache)), b.decode(b.encode(cache))
    assert all(torch.equal(x[r], y[r]) for x, y in zip(da.layers, db.layers) for r in ("k", "v"))
    with pytest.raises(ConfigError):
        kvcodec.get_codec({"id": "kvc", "v_attn": -1.0})
    with pytest.raises(ConfigError):
        kvcodec.get_codec({"id": "kvc", "attn_clip": 0.5})


# ---------------------------------------------------------------- on a tiny random-init model
transformers = pytest.importorskip("transformers")


def _tiny_qwen2():
    tokenizers = pytest.importorskip("tokenizers")
    from kvcodec.harness.capture import default_text

    text = default_text()[:4000]
    words = sorted(set(text.split()))
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>")
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=1, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), tok, text


def test_query_statistics_on_a_tiny_model_and_rope_matches_the_model(tmp_path):
    from kvcodec.harness.calibration import query_statistics
    from kvcodec.harness.capture import capture
    from kvcodec.harness.evaluate import record_queries

    model, tok, text = _tiny_qwen2()
    st = query_statistics(model, tok, text, context=40, skip_tokens=30, samples=8)
    assert st.num_layers == 2 and st.q_position == 32 and st.rope_theta > 0
    assert all(e.shape == (2, 16) and s.shape == (4, 8, 16) for e, s in zip(st.q_energy, st.q_sample))
    assert np.array_equal(st.q_energy[0], pair_mean(st.q_energy[0]))
    # our RoPE re-rotation is the model's: queries at positions p + 9 == rotate(queries at p, 9)
    ids = torch.arange(2, 22)[None]
    with torch.no_grad(), record_queries(model) as store:
        model(ids, use_cache=False)
        q0 = store[1]["q"].numpy()
        model(ids, position_ids=torch.arange(9, 29)[None], use_cache=False)
        q9 = store[1]["q"].numpy()
    np.testing.assert_allclose(rotate_queries(q0, 9, st.rope_theta), q9, atol=1e-4)
    # and a calibrated kvc encode of this model's cache works end to end
    cache = capture(model, tok, text, context=48, dtype=torch.float16)
    p = tmp_path / "q.safetensors"
    save_query_statistics(st, p)
    codec = kvcodec.get_codec({**kvcodec.get_codec("kvc-near-cal").get_config(), "calibration": str(p)})
    out = kvcodec.decode(codec.encode(cache))
    assert out.layers[1]["v"].shape == cache.layers[1]["v"].shape


def test_cli_calibrate_rejects_bad_arguments(capsys):
    from kvcodec.cli import main

    assert main(["calibrate", "--context", "1", "--out", "x.safetensors"]) != 0
    assert "context" in capsys.readouterr().err


def test_token_steps_equal_the_direct_formula():
    from kvcodec.codecs.kvc import token_steps

    rng = np.random.default_rng(3)
    sc = rng.integers(-60, 20, size=(3, 10))
    off = rng.integers(-16, 17, size=(50, 3))
    direct = step_from_code(sc[None] + off[:, :, None])
    assert np.array_equal(token_steps(sc, off).view(np.int32), direct.view(np.int32))
    with pytest.raises(FormatError, match="step code"):
        token_steps(np.full((1, 2), 315), np.array([[10]]))
