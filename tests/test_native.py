"""The native C coder (kvcodec/native): bit-exact with the reference encoder and decoder, same
errors, exact float conversions and dequantization, and a clean fallback without a compiler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcodec
from conftest import make_cache
from kvcodec import native
from kvcodec.entropy import EntropyStage, StageLayout
from kvcodec.entropy.ans_ref import ans_decode_segments_reference
from kvcodec.errors import DependencyError, FormatError, InputError, StreamError
from kvcodec.quant.fast import intq_dequantize_fast
from kvcodec.quant.intq import IntQTensor, intq_param_shape

pytestmark = pytest.mark.skipif(native.build._compiler() is None, reason="no C compiler on this machine")


def _random_stage(rng, big_alphabet=False):
    r, n = int(rng.integers(1, 14)), int(rng.integers(0, 260))
    a = int(rng.integers(2, 70000 if big_alphabet else 300))
    p = int(rng.integers(max(1, (a - 1).bit_length()), 25))
    cfg = {"precision": p, "chunk": int(rng.integers(0, 90)), "rows_per_stream": int(rng.integers(1, 5)),
           "tables": str(rng.choice(["row", "shared", "cluster"])), "n_tables": int(rng.integers(1, 6)),
           "scope": str(rng.choice(["all", "chunk"]))}
    x = np.minimum(rng.geometric(float(rng.uniform(0.05, 0.9)), size=(r, n)) - 1, a - 1)
    return EntropyStage(**cfg), x, a


def test_native_builds_here():
    """Where a C compiler exists the native coder must build (a silent fallback would hide it)."""
    assert native.available(), native.status()
    assert native.status()["path"]


@pytest.mark.parametrize("seed", range(4))
def test_encode_decode_bit_exact_with_reference(seed):
    rng = np.random.default_rng(seed)
    for trial in range(60):
        st, x, a = _random_stage(rng, big_alphabet=trial % 15 == 0)
        want = st.encode(x, alphabet=a, method="constriction")  # == the reference encoder (test_entropy)
        for planes in (st.encode(x, alphabet=a, method="native"),
                       st.encode(np.ascontiguousarray(x.T), alphabet=a, method="native", layout="tokens")):
            assert sorted(planes) == sorted(want)
            for k in want:
                assert planes[k].dtype == want[k].dtype and np.array_equal(planes[k], want[k]), (trial, k)
        assert np.array_equal(st.decode(want, method="native"), x)
        tok = st.decode(want, method="native", layout="tokens")
        assert tok.dtype == (np.uint8 if a <= 256 else np.uint16 if a <= 65536 else np.int32)
        assert np.array_equal(tok, x.T)
        if x.size <= 400:
            assert np.array_equal(st.decode(want, method="reference"), x)


def test_slot_table_resolutions():
    """Precision above the slot-table resolution (per-chunk tables: coarse slots plus a forward
    search) and at it (one lookup) decode the same."""
    rng = np.random.default_rng(7)
    x = np.minimum(rng.geometric(0.2, size=(64, 512)) - 1, 31)
    for cfg in ({"precision": 16, "chunk": 16, "scope": "chunk"}, {"precision": 24, "chunk": 512},
                {"precision": 12, "chunk": 64}, {"precision": 5, "chunk": 3}):
        st = EntropyStage(**cfg)
        planes = st.encode(x, alphabet=32, method="constriction")
        assert np.array_equal(st.decode(planes, method="native"), x), cfg
        assert np.array_equal(st.decode(planes, method="numpy"), x), cfg
    # many tables for few symbols: slots much coarser than the symbols (binary search between the
    # symbols of two neighbouring slots), the slot memory bounded by the output size
    y = np.minimum(rng.geometric(0.02, size=(2000, 2)) - 1, 299)
    st = EntropyStage(precision=16, chunk=1)
    planes = st.encode(y, alphabet=300, method="constriction")
    assert np.array_equal(st.decode(planes, method="native"), y)
    assert np.array_equal(st.decode(planes, method="reference"), y)


def test_corrupt_streams_same_verdict_and_stream_as_reference():
    rng = np.random.default_rng(8)
    x = rng.integers(0, 9, size=(9, 70))
    st = EntropyStage(chunk=25, rows_per_stream=2)
    planes = st.encode(x, alphabet=9)
    for trial in range(60):
        bad = {k: v.copy() for k, v in planes.items()}
        if trial % 3 == 2 and bad["words"].size > 2:  # move a word between streams
            s = int(rng.integers(1, bad["offsets"].size - 1))
            if bad["offsets"][s] < bad["offsets"][s + 1]:
                bad["offsets"][s] += 1
        else:
            i = int(rng.integers(bad["words"].size))
            bad["words"][i] ^= np.uint32(1 << int(rng.integers(32)))
        out = {}
        for method in ("reference", "native", "constriction"):
            try:
                out[method] = st.decode(bad, method=method).tolist()
            except StreamError as e:
                out[method] = "error " + str(e).split(":")[0].split(" not")[0]
        assert out["native"] == out["reference"], trial
        assert isinstance(out["constriction"], str) == isinstance(out["reference"], str)


def test_zero_last_word_and_exact_consumption():
    f = np.array([3, 1], dtype=np.uint32)
    st = EntropyStage(precision=2, chunk=0, tables="shared")
    planes = st.encode(np.array([[0, 1, 0, 0, 1]]), alphabet=2)
    bad = {k: v.copy() for k, v in planes.items()}
    bad["words"] = np.append(bad["words"], np.uint32(0))
    bad["offsets"][-1] += 1
    with pytest.raises(StreamError, match="zero word"):
        st.decode(bad, method="native")
    with pytest.raises(StreamError, match="zero word"):
        ans_decode_segments_reference(bad["words"], [(f, 5)])


def test_out_of_range_symbols_rejected():
    st = EntropyStage(chunk=8)
    x = np.array([[0, 1, 2, 3]], dtype=np.uint8)
    for layout, arr in (("rows", x), ("tokens", np.ascontiguousarray(x.T))):
        with pytest.raises(InputError):
            st.encode(arr, alphabet=3, method="native", layout=layout)
    with pytest.raises(InputError):  # int64 values that would wrap in int32 are not taken
        st.encode(np.array([[1, 2**32 + 1]]), alphabet=4, method="native")


@pytest.fixture(params=["hw", "soft"])
def f16_path(request):
    """Both float16 conversions: F16C where the CPU has it, and the portable one."""
    lb = native.lib()
    on = lb.kvn_set_hw_f16(1 if request.param == "hw" else 0)
    if request.param == "hw" and not on:
        pytest.skip("this CPU has no F16C: only the portable conversion exists here")
    yield request.param
    lb.kvn_set_hw_f16(1)


def test_float16_conversion_exact_against_torch(f16_path):
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f32 = np.empty(65536, dtype=np.float32)
    native.lib().kvn_convert(1, 1, halves.ctypes.data, f32.ctypes.data, 65536)
    want = torch.from_numpy(halves.view(np.int16)).view(torch.float16).float().numpy()
    fin = np.isfinite(want)
    assert np.array_equal(f32.view(np.uint32)[fin], want.view(np.uint32)[fin])
    assert np.array_equal(np.isnan(f32), np.isnan(want))
    # float32 -> float16: every half, the midpoints between neighbours and one ulp either side,
    # the overflow boundary, and random values of every magnitude
    fin_h = want[fin & (want >= 0)]
    mids = (fin_h[:-1].astype(np.float64) + fin_h[1:]) / 2
    cands = [want[fin], mids.astype(np.float32), np.array([65504, 65519.996, 65520, 65536, 1e30, 2**-25, 2**-26], np.float32)]
    m32 = mids.astype(np.float32).view(np.uint32)
    cands += [(m32 + 1).view(np.float32), (m32 - 1).view(np.float32)]
    rnd = np.random.default_rng(9).integers(0, 2**32, size=200000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    cands.append(rnd[np.isfinite(rnd)])
    x = np.concatenate(cands).astype(np.float32)
    x = np.concatenate([x, -x])
    got = np.empty(x.size, dtype=np.uint16)
    native.lib().kvn_convert(1, 0, x.ctypes.data, got.ctypes.data, x.size)
    assert np.array_equal(got, torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16))
    gotb = np.empty(x.size, dtype=np.uint16)
    native.lib().kvn_convert(2, 0, x.ctypes.data, gotb.ctypes.data, x.size)
    assert np.array_equal(gotb, torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def _clusterings(hist, k, p, monkeypatch):
    """``_cluster_tables(hist, k, p)`` three ways: all in one C call (kvn_cluster_tables), the
    numpy start with the C passes (kvn_cluster_iterate), and numpy alone (the reference)."""
    from kvcodec.entropy import clustering
    from kvcodec.native import tables as ntables

    whole = clustering._cluster_tables(hist, k, p)
    with monkeypatch.context() as m:
        m.setattr(ntables, "cluster_tables", lambda *a: (_ for _ in ()).throw(native.Unsupported("off")))
        passes = clustering._cluster_tables(hist, k, p)
        m.setattr(clustering, "_native_run", lambda h, k, c, n: None)
        ref = clustering._cluster_tables(hist, k, p)
    return whole, passes, ref


@pytest.mark.parametrize("seed", range(8))
def test_table_clustering_passes_equal_numpy(seed, monkeypatch):
    """kvn_cluster_tables (the first centres: rows by mean symbol, ties by index, picked at
    numpy's linspace rounded half to even; kvn_cluster_iterate's passes: the logs, the gains in
    ascending symbol order, argmax, the test for a change, member sums, the next distributions;
    then the tables from integer counts) gives the tables and assignments of the numpy code, ties
    included: duplicated rows make identical centres, whose gains tie exactly (the first table
    wins); sparse rows (zero counts skipped in C, added as -0 in numpy) and rows that converge
    before the last pass."""
    rng = np.random.default_rng(seed)
    r, a, k = int(rng.integers(3, 600)), int(rng.integers(2, 70)), int(rng.integers(1, 12))
    hist = rng.integers(0, 50, (r, a)) * (rng.random((r, a)) < (0.6 if seed % 2 else 0.08))
    hist[: r // 3] = hist[0]  # a third of the rows alike
    if seed == 7:
        hist[:, a // 2:] = 0  # whole columns of zeros
    whole, passes, ref = _clusterings(hist, min(k, r), 12, monkeypatch)
    for got in (whole, passes):
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1]) and got[1].dtype == ref[1].dtype
    with pytest.raises(ValueError):
        native.tables.cluster_iterate(np.ones((r, a)), 2, np.ones((3, a)), 8)


@pytest.mark.parametrize("r,k", [(4, 3), (6, 5), (2, 2), (1, 1), (1, 4), (3, 8), (10, 1), (9, 5), (102, 9), (130, 8)])
def test_table_clustering_starts_as_numpy_on_halves_and_ties(r, k, monkeypatch):
    """The first centres where numpy's linspace lands on halves (rounded to even: r 4, k 3 picks
    the rows at 0, 2, 3), where rows tie on their mean (then the lower index), with fewer rows
    than tables, and at each precision: the same tables and assignments as numpy's. Counts too
    large for the C path's int64 products, and an alphabet too wide for the precision, are left
    to numpy (Unsupported) and give what numpy gives."""
    rng = np.random.default_rng(r * 31 + k)
    a = 6
    hist = rng.integers(0, 4, (r, a))
    hist[::2] = hist[0]  # equal means
    hist[1::3, :] = 0  # empty rows (mean 0, like a row of zeros and ones at the start)
    for p in (3, 12, 16, 24):
        whole, passes, ref = _clusterings(hist, k, p, monkeypatch)
        assert np.array_equal(whole[0], ref[0]) and np.array_equal(whole[1], ref[1])
        assert np.array_equal(passes[0], ref[0]) and (whole[0].sum(axis=1) == 1 << p).all()
    with pytest.raises(native.Unsupported):
        native.tables.cluster_tables(hist * (1 << 40), k, 24, 8)
    with pytest.raises(native.Unsupported):
        native.tables.cluster_tables(hist, k, 2, 8)  # 6 symbols in 2 bits
    big = hist.astype(np.int64) * (1 << 36)
    whole, _, ref = _clusterings(big, k, 20, monkeypatch)
    assert np.array_equal(whole[0], ref[0]) and np.array_equal(whole[1], ref[1])


def test_table_clustering_never_costs_more_than_one_table():
    """The clustering's tables code the rows in no more bits than one shared table would (each
    pass never increases the total code length): the k-means is a real optimisation."""
    from kvcodec.entropy import clustering

    rng = np.random.default_rng(3)
    rows = [rng.dirichlet(np.ones(32) * s) for s in (0.1, 0.3, 1.0, 3.0) for _ in range(20)]
    hist = np.stack([rng.multinomial(400, p) for p in rows])
    tabs, assign = clustering._cluster_tables(hist, 4, 12)
    cost = -sum(float((hist[i] * np.log2(np.maximum(tabs[assign[i]], 1) / 4096.0)).sum()) for i in range(len(hist)))
    one = clustering.build_tables(hist.sum(0, keepdims=True), 12)[0]
    single = -float((hist * np.log2(np.maximum(one, 1) / 4096.0)).sum())
    assert cost < 0.97 * single


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_xpred_residual_and_sum_equal_torch_bit_for_bit(dtype, f16_path):
    """The encoder's closed loop in C (csrc/xpred.c kvn_xpred_residual, kvn_xpred_sum) against
    torch's rounding: values of every binade, exact midpoints between neighbours of the dtype
    (ties to even), sums that overflow it (the residual's flag), an odd count (the blocks'
    tails), and float16's exact widening (kvcodec.native.xpred.widen)."""
    from kvcodec.native import xpred as NX

    rng = np.random.default_rng(7)
    n = 3 * 1024 + 77
    big = 60000.0 if dtype == torch.float16 else 3e38
    top = 8 if dtype == torch.float16 else 10  # random sums stay inside float16's range
    x = torch.from_numpy((rng.normal(size=n) * np.exp(rng.uniform(-12, top, n))).astype(np.float32))
    x[:4] = torch.tensor([big, -big, 0.0, -0.0])
    x = x.clamp(-big, big).to(dtype)
    xf = x.float()
    pred = (rng.normal(size=n) * np.exp(rng.uniform(-12, top, n))).astype(np.float32)
    pred[:2] = [-big / 2, big / 2]  # x - pred overflows the dtype (float32: to infinity)
    if dtype != torch.float32:  # exact midpoints: x - pred = x + half an ulp of x
        ulp = (torch.nextafter(xf[4:500].to(dtype), torch.tensor(float("inf"), dtype=dtype)).float() - xf[4:500])
        pred[4:500] = (-ulp / 2).numpy()
    x32 = np.empty(n, np.float32)
    r, finite = NX.residual(x, pred, x32)
    want = (xf - torch.from_numpy(pred)).to(dtype)
    assert r.dtype == dtype and torch.equal(r.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                            want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert np.array_equal(x32.view(np.uint32), xf.numpy().view(np.uint32))
    assert finite is False and not bool(torch.isfinite(want).all())
    r2, finite2 = NX.residual(x[2:], pred[2:])  # without the overflowing values
    assert finite2 is True and torch.equal(r2.float(), want[2:].float())
    out = np.empty(n, np.float32)
    NX.prediction_sum(x, pred, out)
    want_sum = (xf + torch.from_numpy(pred)).to(dtype).float().numpy()
    assert np.array_equal(out.view(np.uint32), want_sum.view(np.uint32))
    if dtype == torch.float16:
        halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 16, 16)
        from kvcodec.native.convert import widen

        w = widen(halves)
        ref = halves.astype(np.float32)
        fin = np.isfinite(ref)
        assert w.shape == halves.shape and np.array_equal(w.view(np.uint32)[fin], ref.view(np.uint32)[fin])
        assert np.array_equal(np.isnan(w), np.isnan(ref))
    with pytest.raises(ValueError):
        NX.residual(x, pred[:-1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("axis,shape,group", [("channel", (37, 3, 24), 16), ("token", (29, 2, 40), 32),
                                             ("token", (5, 1, 7), 3), ("channel", (1, 2, 8), 64)])
def test_intq_dequantize_matches_fast_path(dtype, axis, shape, group, f16_path):
    rng = np.random.default_rng(10)
    bits = 4
    codes = rng.integers(0, 16, size=shape).astype(np.uint8)
    ps = intq_param_shape(shape, axis, group)
    scale = torch.from_numpy(rng.normal(0, 2, size=ps).astype(np.float16))
    zero = torch.from_numpy(rng.normal(0, 50, size=ps).astype(np.float16))
    scale[..., 0] = 60000  # exercise the clamp to the finite range
    want = intq_dequantize_fast(IntQTensor(torch.from_numpy(codes), scale, zero, bits, axis, group), dtype)
    got = native.intq_dequantize(codes, scale.numpy().astype(np.float32), zero.numpy().astype(np.float32),
                                 axis, group, dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                              want.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rows_affine_matches_torch(dtype, f16_path):
    rng = np.random.default_rng(11)
    codes = rng.integers(0, 31, size=(20, 12)).astype(np.uint16)
    scale = rng.uniform(0, 3000, size=20).astype(np.float16).astype(np.float32)
    base = rng.normal(0, 1000, size=(4, 12)).astype(np.float32)
    brow = np.arange(20) // 5
    orow = rng.permutation(20)
    out = torch.empty((20, 12), dtype=dtype)
    assert native.rows_affine(codes, orow, scale, 15, out, max_code=30, base=base, brow=brow) is out
    v = torch.from_numpy(base[brow]) + (torch.from_numpy(codes.astype(np.int64)) - 15).float() * torch.from_numpy(scale)[:, None]
    want = torch.empty((20, 12), dtype=dtype)
    want[torch.from_numpy(orow)] = v.to(dtype)
    assert torch.equal(out.float(), want.float())
    with pytest.raises(FormatError, match=f"code {int(codes.max())} outside the 30 levels"):  # bad data
        native.rows_affine(codes, orow, scale, 15, out, max_code=29)


def test_row_strided_symbols_give_what_a_contiguous_copy_gives():
    """symbol_view passes a view of a wider array's first columns as it lies (kvc's row-major
    symbols, rows a padded length apart): histograms, context counts with classes, the stage
    encoder and CacheGen's row dequantization give what they give on a contiguous copy."""
    from kvcodec.entropy import StageLayout

    rng = np.random.default_rng(53)
    r, n, a = 9, 37, 12
    wide = rng.integers(0, a, size=(r, n + 27)).astype(np.uint16)
    view, copy = wide[:, :n], np.ascontiguousarray(wide[:, :n])
    x, _, sr, st = native.ans.symbol_view(view, "rows")
    assert x.base is not None and (sr, st) == (n + 27, 1)  # not copied
    assert np.array_equal(native.histograms(view, a), native.histograms(copy, a))
    for got, want in zip(native.ctx_histograms(view, a, "rows", 4, [3, 8], classes=True),
                         native.ctx_histograms(copy, a, "rows", 4, [3, 8], classes=True)):
        assert np.array_equal(got, want)
    st_ = EntropyStage(precision=12, rows_per_stream=4, tables="cluster", n_tables=3, scope="ctx", thresholds=[3, 8])
    assert all(np.array_equal(u, v) for u, v in zip(st_.encode(view, alphabet=a, layout="rows").values(),
                                                   st_.encode(copy, alphabet=a, layout="rows").values()))
    # classes that lie otherwise than the symbols: both read alike (the same words)
    _, cls = native.ctx_histograms(copy, a, "rows", 4, [3, 8], classes=True)
    lay = StageLayout(st_.encode(copy, alphabet=a, layout="rows")["meta"])
    tabs, rts = np.full((1, 3, a), (1 << 12) // a, np.uint32), np.zeros((3, r), np.int64)
    tabs[0, :, 0] += (1 << 12) - a * ((1 << 12) // a)
    wide_cls = np.zeros((r, n + 27), np.uint8)
    wide_cls[:, :n] = cls
    for c in (cls, wide_cls[:, :n]):
        for sym in (view, copy):
            got = native.encode_stage(lay, sym, tabs, rts, layout="rows", classes=c)
            want = native.encode_stage(lay, copy, tabs, rts, layout="rows", classes=cls)
            assert all(np.array_equal(u, v) for u, v in zip(got, want))
    # CacheGen's rows: token-major [n, C] codes, a view of wider rows
    codes_wide = rng.integers(0, 31, size=(20, 17)).astype(np.uint16)
    scale = rng.uniform(0, 3, size=20).astype(np.float32)
    outs = []
    for c in (codes_wide[:, :12], np.ascontiguousarray(codes_wide[:, :12])):
        out = torch.empty((20, 12), dtype=torch.float32)
        outs.append(native.rows_affine(c, np.arange(20), scale, 15, out, max_code=30))
    assert torch.equal(outs[0], outs[1])


ENTROPY_CODECS = ["kivi-4-ans", "kivi-2-ans", "kivi-4-delta-ans", "cachegen", "cachegen-lmcache", "kvc-near",
                  {"id": "kivi-ans", "bits": 8, "delta": 3, "chunk": 7}, {"id": "cachegen", "group": 1},
                  {"id": "kvc-near", "delta": 2}, {"id": "kvc-near", "k_recon": 6},
                  {"id": "kvc-near", "pack": 0}]


@pytest.mark.parametrize("name", ENTROPY_CODECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_codecs_same_bytes_and_values_without_native(name, dtype, monkeypatch):
    """The fallback (constriction + numpy/torch) and the native path write the same file and
    decode the same bits."""
    cache = make_cache(layers=3, tokens=45, heads=2, dim=24, dtype=dtype, seed=3)
    codec = kvcodec.get_codec(name)
    blob = codec.encode(cache)
    out = kvcodec.decode(blob)
    monkeypatch.setenv("KVCODEC_NATIVE", "0")
    assert not native.available()
    assert codec.encode(cache) == blob
    assert kvcodec.decode(blob).equal(out)


def test_require_mode_raises_without_compiler(monkeypatch):
    # the loader's state lives in kvcodec.native.build
    monkeypatch.setattr(native.build, "_state", {"lib": None, "error": None, "tried": False, "path": None})
    monkeypatch.setattr(native.build, "_compiler", lambda: None)
    monkeypatch.setenv("KVCODEC_NATIVE", "1")
    with pytest.raises(DependencyError, match="no C compiler"):
        native.lib()
    monkeypatch.setenv("KVCODEC_NATIVE", "auto")
    assert native.lib() is None and not native.available()
    st = native.status()
    assert st["available"] is False and "compiler" in st["error"]
    # and everything still works through constriction
    x = np.arange(12).reshape(3, 4) % 5
    planes = EntropyStage(chunk=2).encode(x, alphabet=5)
    assert np.array_equal(EntropyStage().decode(planes), x)
    assert StageLayout(planes["meta"]).n_streams == 6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_intq_quantize_matches_numpy_path(dtype, axis, monkeypatch, f16_path):
    from kvcodec.quant.fast import intq_quantize_fast
    from kvcodec.quant.intq import intq_quantize_reference

    g = torch.Generator().manual_seed(12)
    for bits, shape, group in [(4, (37, 3, 24), 16), (2, (29, 2, 40), 32), (8, (5, 1, 7), 3), (1, (64, 2, 8), 64),
                               (3, (33, 1, 33), 5)]:
        x = (torch.randn(shape, generator=g) * 3 + torch.arange(shape[2]) * 0.5).to(dtype)
        x[0, 0, :3] = 0.0  # a constant group (scale 0) and a signed zero
        x[1, 0, 0] = -0.0
        x[2:4, 0, :] = x[2, 0, 0]
        if dtype == torch.float32:
            x[3, 0, 1] = 1e-42  # float32 subnormal
        got = intq_quantize_fast(x, bits, axis, group)
        with monkeypatch.context() as m:
            m.setenv("KVCODEC_NATIVE", "0")
            want = intq_quantize_fast(x, bits, axis, group)
        for a, b in ((got.codes, want.codes), (got.scale, want.scale), (got.zero, want.zero)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        if x.numel() < 2000:
            ref = intq_quantize_reference(x, bits, axis, group)
            assert torch.equal(ref.codes, got.codes) and torch.equal(ref.scale.view(torch.int16), got.scale.view(torch.int16))


def test_intq_quantize_rejects_like_numpy_path(monkeypatch):
    from kvcodec.quant.fast import intq_quantize_fast

    for bad in (torch.tensor([[[1.0, float("nan")]]]), torch.tensor([[[1.0, float("inf")]]]),
                torch.tensor([[[-7e4, 7e4]]])):
        with pytest.raises(InputError) as e1:
            intq_quantize_fast(bad, 4, "token", 32)
        with monkeypatch.context() as m:
            m.setenv("KVCODEC_NATIVE", "0")
            with pytest.raises(InputError) as e2:
                intq_quantize_fast(bad, 4, "token", 32)
        assert str(e1.value) == str(e2.value)


@pytest.mark.parametrize("name", ["cachegen", "cachegen-lmcache"])
def test_token_quantize_rejects_like_torch_path(name, monkeypatch):
    for bad in (float("nan"), float("inf"), 3e38):
        x = torch.randn(12, 2, 8, dtype=torch.float32)
        x[5, 1, 3] = bad
        cache = kvcodec.KVCache.from_tensors([(x, x.clone())] * 2)
        codec = kvcodec.get_codec(name)
        with pytest.raises(InputError) as e1:
            codec.encode(cache)
        with monkeypatch.context() as m:
            m.setenv("KVCODEC_NATIVE", "0")
            with pytest.raises(InputError) as e2:
                codec.encode(cache)
        assert str(e1.value) == str(e2.value)


def test_huge_group_from_a_file_is_one_group():
    """A file may declare any group; the native dequantizer treats a group at least as long as
    the axis as one group (as the numpy path does) instead of overflowing."""
    codes = np.arange(24, dtype=np.uint8).reshape(4, 2, 3) % 16
    for axis, ps in (("channel", (1, 2, 3)), ("token", (4, 2, 1))):
        s = np.full(ps, 0.5, np.float32)
        z = np.full(ps, -1.0, np.float32)
        a = native.intq_dequantize(codes, s, z, axis, 2**70, torch.float16)
        b = native.intq_dequantize(codes, s, z, axis, 4, torch.float16)
        assert torch.equal(a, b)


def test_deadzone_quantize_matches_numpy_path(monkeypatch):
    from kvcodec.quant.deadzone import deadzone_quantize, step_from_code

    rng = np.random.default_rng(13)
    x = (rng.laplace(0, 2, size=(37, 3, 24))).astype(np.float32)
    x[0, 0, :4] = [0.0, -0.0, 0.25, -0.75]  # zeros and exact ties at step 0.5
    for step in (step_from_code(np.array([-8]))[None],                          # scalar-like
                 step_from_code(rng.integers(-20, 10, size=(3, 24)))[None],      # per channel
                 step_from_code(rng.integers(-20, 10, size=(37, 3)))[:, :, None],  # per token
                 step_from_code(rng.integers(-20, 10, size=(37, 3, 24)))):       # per element
        for rho in (0.5, 0.3, 0.05):
            got = deadzone_quantize(x, step, rho)
            native.deadzone_quantize(x, step, rho)  # the native path takes these operands
            with monkeypatch.context() as m:
                m.setenv("KVCODEC_NATIVE", "0")
                want = deadzone_quantize(x, step, rho)
            assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want)
    # paths the native code leaves to numpy: non-finite input, float64 input, zero steps
    for xs, st in ((np.array([1.0, np.inf], np.float32), np.float32(0.5)), (np.array([1.0], np.float64), np.float32(0.5)),
                   (np.array([1.0], np.float32), np.float32(0.0))):
        with pytest.raises(native.Unsupported):
            native.deadzone_quantize(xs, st, 0.5)


def test_escape_split_and_join_match_kvc():
    from kvcodec.codecs.kvc import escape_join, escape_split
    from kvcodec.errors import FormatError

    rng = np.random.default_rng(14)
    for shape, scale, max_level in [((50, 7), 3.0, 8), ((40, 5), 40.0, 8), ((1, 1), 0.1, 4), ((0, 3), 1.0, 8),
                                    ((30, 4), 2.0**40, 1024)]:
        codes = np.round(rng.laplace(0, scale, size=shape)).astype(np.int64)
        sym, esc, lv = native.escape_split_tokens(codes, max_level)
        want_sym, want_esc, want_lv = escape_split(codes.T, max_level)
        assert lv == want_lv and np.array_equal(esc, want_esc) and esc.dtype == want_esc.dtype
        assert np.array_equal(sym.T, want_sym)
        back = native.escape_join_tokens(sym, esc, lv)
        assert np.array_equal(back.T, escape_join(want_sym, want_esc, lv))
        if esc.size:
            with pytest.raises(FormatError, match="escape symbols"):
                native.escape_join_tokens(sym, esc[:-1], lv)
            bad = esc.copy()
            bad[0] = 0
            with pytest.raises(FormatError, match="inside the regular range"):
                native.escape_join_tokens(sym, bad, lv)


def test_escape_join_narrow_and_dequantize_int32_codes_are_the_same_integers():
    """kvc's decoder asks the escape join for int32 codes (half the traffic into the
    dequantization): the same integers as int64, int64 again when a code does not fit (token
    deltas summing past 2^31, as a hostile file can make them), and the dequantized values of
    int32 codes equal those of int64 codes bit for bit."""
    from kvcodec.codecs.kvc import escape_split

    rng = np.random.default_rng(44)
    codes = np.round(rng.laplace(0, 6, size=(120, 24))).astype(np.int64)
    codes[5, 3] = 70000
    use = rng.random(24) < 0.5
    sym, esc, lv = native.escape_split_tokens(codes, 16, use)
    wide = native.escape_join_tokens(sym, esc, lv, use)
    narrow = native.escape_join_tokens(sym, esc, lv, use, narrow=True)
    assert wide.dtype == np.int64 and narrow.dtype == np.int32 and np.array_equal(wide, codes)
    assert np.array_equal(narrow, wide)
    # running sums past the int32 range: the narrow call falls back to int64 (numpy's wrap)
    big = np.zeros((4, 2), dtype=np.int64)
    big[:, 0] = [2**30, 2 * 2**30, 3 * 2**30, 4 * 2**30]
    d = big.copy()
    d[1:, 0] = np.diff(big[:, 0])
    s2, e2, l2 = escape_split(d.T, 8)
    got = native.escape_join_tokens(s2.T, e2, l2, np.array([True, False]), narrow=True)
    assert got.dtype == np.int64 and np.array_equal(got, big)
    step = rng.uniform(0.1, 2, size=(120, 2, 1)).astype(np.float32)
    mean = rng.normal(size=(2, 12)).astype(np.float32)
    main64, main32 = wide[:, :24].reshape(120, 2, 12), narrow[:, :24].reshape(120, 2, 12)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for rc in (None, [40, 20, 9]):
            a = native.kvc_dequantize(main64, step, mean, dtype, recon=rc)
            b = native.kvc_dequantize(main32, step, mean, dtype, recon=rc)
            assert torch.equal(a.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               b.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_dequantize_rows_vector_equals_plain():
    """kvc's dequantization rows in AVX2 (dq_row_i32_avx2: kvc_dequantize and kvc_decode's rows)
    give the plain loop's bits: every step layout, reconstruction offsets with codes past their
    table, clamps at the dtype's max, means per token, NaN and infinite steps, rows of 1 to 70."""
    lb = native.lib()
    rng = np.random.default_rng(47)
    for n, h, d in [(5, 1, 1), (9, 2, 7), (17, 3, 8), (33, 2, 64), (12, 1, 70)]:
        codes = rng.integers(-40, 41, size=(n, h, d)).astype(np.int32)
        codes[rng.random(codes.shape) < 0.05] = 2**30 + 7
        for step in (np.float32(0.37), rng.uniform(0.01, 3, size=(1, h, d)).astype(np.float32),
                     rng.uniform(0.01, 3, size=(n, h, 1)).astype(np.float32),
                     rng.uniform(0.01, 3, size=(n, h, d)).astype(np.float32),
                     np.array([[[np.inf]], [[np.nan]]] * (n // 2) + [[[1.0]]] * (n % 2), np.float32)):
            for mean in (rng.normal(size=(h, d)).astype(np.float32), rng.normal(size=(n, h, d)).astype(np.float32)):
                for recon in (None, [40, 20, 9]):
                    for dtype in (torch.float16, torch.bfloat16, torch.float32):
                        got = []
                        for on in (1, 0):
                            was = lb.kvn_kvc_vector(on)
                            try:
                                got.append(native.kvc_dequantize(codes, step, mean, dtype, recon=recon))
                            finally:
                                lb.kvn_kvc_vector(was)
                        a, b = (x.view(torch.int16 if dtype != torch.float32 else torch.int32) for x in got)
                        assert torch.equal(a, b), (n, h, d, np.shape(step), dtype, recon)


def test_escape_split_with_ctx_statistics_equals_the_two_calls():
    """The fused split (kvc's -cal presets) returns the split of escape_split_tokens and the
    counts and classes ctx_histograms takes of its symbols, for int64 and int32 codes, with and
    without delta columns, when L ends below max_level, for odd stream widths; None when the
    escapes overflow its scratch."""
    rng = np.random.default_rng(43)
    for n, r, g, th, max_level, frac in [(300, 195, 64, [3, 8, 20], 32, 0.01), (77, 13, 5, [2, 5], 16, 0.0),
                                         (40, 7, 64, [3], 8, 0.05), (1, 3, 2, [3, 8, 20], 32, 0.0),
                                         (50, 20, 7, [], 16, 0.02), (60, 30, 8, [1, 3, 8, 20], 32, 0.01),
                                         (60, 30, 8, [1, 2, 3, 8, 20], 32, 0.01)]:  # every specialised count
        codes = np.clip(np.round(rng.laplace(0, 3, size=(n, r))), -(max_level - 2), max_level - 2).astype(np.int64)
        hit = rng.random((n, r)) < frac
        codes[hit] = rng.integers(max_level, 4 * max_level, size=int(hit.sum()))
        use = rng.random(r) < 0.4
        for dl in (None, use):
            sym, esc, lv = native.escape_split_tokens(codes, max_level, dl)
            hist, cls = native.ctx_histograms(sym, 2 * lv, "tokens", g, th, classes=True)
            for dtype in (np.int64, np.int32):
                s2, e2, l2, h2, c2 = native.escape_split_ctx_tokens(codes.astype(dtype), max_level, dl, g, th)
                assert l2 == lv and np.array_equal(s2, sym) and np.array_equal(e2, esc)
                assert np.array_equal(h2, hist) and np.array_equal(c2, cls)
    # the AVX2 pass (eight tokens a block; blocks with codes of 2**30 or more, and the last n % 8
    # tokens, scalar) against the scalar pass, bit for bit: token deltas at token 0 and across
    # blocks, escapes of every row in token order, int32 extremes, streams of every width
    lb = native.lib()
    for n, r, g, th, max_level in [(8, 5, 2, [3], 8), (23, 130, 64, [3, 8, 20], 32), (64, 195, 64, [2, 5, 12], 16),
                                   (41, 17, 5, [1, 3, 8, 20], 48), (7, 9, 4, [3, 8], 16), (33, 12, 64, [3, 8], 32)]:
        codes = np.clip(np.round(rng.laplace(0, 1.5, size=(n, r))), -(max_level - 2), max_level - 2).astype(np.int32)
        hit = rng.random((n, r)) < 0.01
        codes[hit] = rng.integers(-4 * max_level, 4 * max_level, size=int(hit.sum()))
        if n > 20:  # a block past the vector pass's range, and extremes its deltas must not wrap
            codes[17, 3] = 2**31 - 1
            codes[18, 3] = -2**31
            codes[9, 0] = 2**30 - 1
            codes[10, 0] = -(2**30 - 1)
        for dl in (None, rng.random(r) < 0.5, np.ones(r, bool)):
            outs = []
            for on in (1, 0):
                for rows in (False, True):  # token-major outputs, or row-major ones seen as [n, R]
                    was = lb.kvn_kvc_vector(on)
                    try:
                        outs.append(native.escape_split_ctx_tokens(codes, max_level, dl, g, th, rows=rows))
                    finally:
                        lb.kvn_kvc_vector(was)
            assert outs[1][0].strides[0] == 2 and outs[1][4].strides[0] == 1  # row-major underneath
            s0, e0, l0, h0, c0 = outs[2]  # scalar, token-major
            for s1, e1, l1, h1, c1 in outs:
                assert l1 == l0 and np.array_equal(s1, s0) and np.array_equal(e1, e0)
                assert np.array_equal(h1, h0) and np.array_equal(c1, c0), (n, r, g, th)
    many = np.full((50, 10), 100, dtype=np.int64)  # every code escapes: beyond the 1/16 scratch
    with pytest.raises(native.Unsupported):
        native.escape_split_ctx_tokens(many, 16, None, 4, [3, 8])
    # the stage takes such statistics instead of counting again: the same planes; wrong shapes refused
    codes = np.round(rng.laplace(0, 3, size=(200, 70))).astype(np.int64)
    st = EntropyStage(precision=14, rows_per_stream=32, tables="cluster", n_tables=4, scope="ctx", thresholds=[3, 8])
    s2, _, l2, h2, c2 = native.escape_split_ctx_tokens(codes, 16, None, 32, [3, 8])
    want = st.encode(s2, alphabet=2 * l2, layout="tokens")
    got = st.encode(s2, alphabet=2 * l2, layout="tokens", ctx_stats=(h2, c2))
    assert all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(InputError, match="ctx_stats"):
        st.encode(s2, alphabet=2 * l2, layout="tokens", ctx_stats=(h2[:-1], c2))


@pytest.mark.parametrize("scope", ["all", "chunk", "ctx"])
def test_encoder_reads_token_major_uint16_in_place(scope):
    """kvc hands the coder token-major uint16 symbols (and, with contexts, their classes): the
    encoder reads them in place instead of gathering a row-major block. Same words as the
    reference from the row-major int32 matrix, odd sizes and several chunks included; a symbol
    outside the alphabet is still refused."""
    from kvcodec.entropy.stage import magnitude_classes

    rng = np.random.default_rng(77)
    for r, n, a, g, chunk in [(195, 301, 64, 64, 0), (37, 150, 20, 16, 64), (5, 9, 3, 2, 4), (70, 1, 96, 64, 0)]:
        cfg = dict(precision=14, chunk=chunk, rows_per_stream=g, tables="cluster", n_tables=5, scope=scope)
        if scope == "ctx":
            cfg["thresholds"] = [3, 8, 20]
        st = EntropyStage(**cfg)
        x = np.clip(np.round(rng.laplace(0, rng.uniform(1, 8, size=(r, 1)), size=(r, n))) + (a - 1) // 2, 0, a - 1)
        x = x.astype(np.int64)
        want = st.encode(x, alphabet=a, method="constriction")
        tok = np.ascontiguousarray(x.T).astype(np.uint16)
        got = st.encode(tok, alphabet=a, method="native", layout="tokens")
        assert all(np.array_equal(got[k], want[k]) for k in want)
        lay = StageLayout(want["meta"])
        # the encoder's own range check, on flat tables (every symbol codable)
        tsets = np.ones((lay.n_chunks if scope == "chunk" else 1, max(lay.K, 1), a), dtype=np.uint32)
        tsets[..., 0] = (1 << 14) - (a - 1)
        rts = np.zeros((tsets.shape[0] if scope != "ctx" else 4, r), dtype=np.int64)
        cls = magnitude_classes(x, g, [3, 8, 20], (a - 1) // 2).T.copy() if scope == "ctx" else None
        native.encode_stage(lay, tok, tsets, rts, layout="tokens", classes=cls)  # fine
        bad = tok.copy()
        bad[n // 2, r // 2] = a  # out of the alphabet
        with pytest.raises(StreamError):
            native.encode_stage(lay, bad, tsets, rts, layout="tokens", classes=cls)


def test_escape_split_one_pass_and_two_passes_agree():
    """The one-pass split (escapes in a scratch of 1/16 of the codes) and the two-pass one it
    falls back to give kvc's split, with and without delta columns, below and above the cap, and
    when nothing reaches max_level (a smaller L: the one pass shifts its symbols); from int64 or
    int32 codes alike (and the delta histograms too)."""
    from kvcodec.codecs.kvc import escape_split

    rng = np.random.default_rng(41)
    n, r = 400, 30
    for frac, max_level in [(0.0, 32), (0.01, 16), (0.05, 16), (0.2, 16), (0.9, 8)]:
        codes = np.round(rng.laplace(0, 2, size=(n, r))).astype(np.int64)
        codes = np.clip(codes, -(max_level - 2), max_level - 2)
        hit = rng.random((n, r)) < frac
        codes[hit] = rng.integers(max_level, 5 * max_level, size=int(hit.sum())) * rng.choice([-1, 1], int(hit.sum()))
        use = rng.random(r) < 0.3
        for dl in (None, use):
            d = codes.copy()
            if dl is not None:
                d[1:, dl] = np.diff(codes[:, dl], axis=0)
            want_sym, want_esc, want_lv = escape_split(d.T, max_level)
            for dtype in (np.int64, np.int32):  # kvc's encoder hands int32 codes when they fit
                sym, esc, lv = native.escape_split_tokens(codes.astype(dtype), max_level, dl)
                assert lv == want_lv and np.array_equal(sym.T, want_sym) and np.array_equal(esc, want_esc)
            hc, he = native.delta_histograms(codes, 3)
            hc32, he32 = native.delta_histograms(codes.astype(np.int32), 3)
            assert np.array_equal(hc, hc32) and np.array_equal(he, he32)
            if frac == 0.0 and dl is None:
                assert lv < max_level and esc.size == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kvc_dequantize_matches_numpy(dtype, f16_path):
    from kvcodec.quant.fast import from_f32_numpy

    rng = np.random.default_rng(15)
    codes = np.round(rng.laplace(0, 20, size=(33, 3, 24))).astype(np.int64)
    codes[0, 0, 0] = 10**6  # saturates fp16
    codes[0, 0, 1] = 2**62  # overflows float32 to inf: saturates there too
    mean = rng.normal(0, 5, size=(3, 24)).astype(np.float32)
    for step in (rng.uniform(0.01, 3, size=(1, 3, 24)).astype(np.float32),
                 rng.uniform(0.01, 3, size=(33, 3, 1)).astype(np.float32),
                 rng.uniform(0.01, 3, size=(33, 3, 24)).astype(np.float32)):
        got = native.kvc_dequantize(codes, step, mean, dtype)
        z = codes.astype(np.float32) * step + mean[None]
        lim = float(torch.finfo(dtype).max)
        want = from_f32_numpy(np.clip(z, -lim, lim), dtype)
        assert torch.equal(got.float(), want.float()) and got.dtype == dtype
        # in place, into rows 2..34 of a bigger tensor (kvc's decoder: the coded tokens' run)
        big = torch.full((40, 3, 24), 7.0, dtype=dtype)
        assert native.kvc_dequantize(codes, step, mean, dtype, out=big[2:35]).data_ptr() == big[2].data_ptr()
        assert torch.equal(big[2:35].float(), want.float())
        assert torch.all(big[:2] == 7) and torch.all(big[35:] == 7)
        # a mean per token (kvc's rotating K means): row t added to token t
        means = rng.normal(0, 5, size=(33, 3, 24)).astype(np.float32)
        got = native.kvc_dequantize(codes, step, means, dtype)
        want = from_f32_numpy(np.clip(codes.astype(np.float32) * step + means, -lim, lim), dtype)
        assert torch.equal(got.float(), want.float())
    with pytest.raises(ValueError, match="neither"):
        native.kvc_dequantize(codes, step, np.zeros((32, 3, 24), np.float32), dtype)
    for bad in (torch.empty((33, 3, 24), dtype=torch.float64 if dtype != torch.float64 else torch.float16),
                torch.empty((32, 3, 24), dtype=dtype), torch.empty((33, 24, 3), dtype=dtype).transpose(1, 2)):
        with pytest.raises(ValueError, match="out must be"):
            native.kvc_dequantize(codes, step, mean, dtype, out=bad)


def test_round_half_even_ties(monkeypatch):
    """Exact .5 ties go to the even code, as numpy's rint and torch's round do."""
    from kvcodec.codecs.cachegen import symmetric_token_quantize
    from kvcodec.quant.fast import intq_quantize_fast

    x = torch.tensor([[[0.0, 0.5, 1.5, 2.5, 3.5, 4.5, 14.5, 15.0]]])  # scale (15 - 0) / 15 = 1
    got = intq_quantize_fast(x, 4, "token", 8)
    assert got.codes.flatten().tolist() == [0, 0, 2, 2, 4, 4, 14, 15]
    y = torch.tensor([[-7.0, -6.5, -0.5, -0.25, 0.5, 1.5, 2.5, 7.0]])  # amax 7, M = 7: scale 1
    codes, _ = native.token_quantize(y, np.arange(1), 15)
    want, _ = symmetric_token_quantize(y, 15)
    assert codes.astype(np.int64).tolist() == want.tolist() == [[0, 1, 7, 7, 7, 9, 9, 14]]
    with monkeypatch.context() as m:
        m.setenv("KVCODEC_NATIVE", "0")
        assert torch.equal(intq_quantize_fast(x, 4, "token", 8).codes, got.codes)


def test_deadzone_writes_into_the_first_columns_of_a_wider_matrix(monkeypatch):
    from kvcodec.quant.deadzone import deadzone_quantize

    rng = np.random.default_rng(9)
    x = (rng.standard_normal((37, 3, 8)) * 4).astype(np.float32)
    for step in ((0.3 + rng.random((37, 3, 8))).astype(np.float32), (0.3 + rng.random((37, 3, 1))),
                 np.float32(0.7)):
        want = deadzone_quantize(x, step, 0.5).reshape(37, 24)
        for native_on in ("auto", "0"):
            with monkeypatch.context() as m:
                m.setenv("KVCODEC_NATIVE", native_on)
                wide = np.full((37, 27), -5, np.int64)
                got = deadzone_quantize(x, step, 0.5, out=wide[:, :24])
                assert np.array_equal(got, want) and np.array_equal(wide[:, :24], want)
                assert (wide[:, 24:] == -5).all()  # the other columns are left alone
    if native.available():
        with pytest.raises(ValueError, match="int64 or int32"):
            native.deadzone_quantize(x, np.float32(1.0), 0.5, out=np.zeros((37, 24), np.int16))
        # int32 codes (what kvc's encoder asks for): the same values, or Unsupported when one would not fit
        want = deadzone_quantize(x.astype(np.float64), np.float32(1.0), 0.5).reshape(37, 24)
        got32 = native.deadzone_quantize(x, np.float32(1.0), 0.5, out=np.zeros((37, 24), np.int32))
        assert got32.dtype == np.int32 and np.array_equal(got32, want)
        big = x.copy()
        big[3, 0, 0] = 2.5e9
        with pytest.raises(native.Unsupported):
            native.deadzone_quantize(big, np.float32(1.0), 0.5, out=np.zeros((37, 24), np.int32))
        assert native.deadzone_quantize(big, np.float32(1.0), 0.5, out=np.zeros((37, 24), np.int64))[3, 0] == 2500000000


def test_callers_reach_the_native_path_through_one_seam():
    """Callers call the native wrapper and catch native.Unsupported to run the reference (the one
    failure rule, kvcodec/native/__init__.py); only the entropy stage's explicit ``method`` choice
    asks native.available() itself."""
    import re
    from pathlib import Path

    pkg = Path(kvcodec.__file__).parent
    found = []
    for p in pkg.rglob("*.py"):
        if "native" in p.relative_to(pkg).parts[:1]:
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"native\.available\(\)", line):
                found.append(f"{p.relative_to(pkg)}:{i}")
    assert all(f.startswith("entropy/stage.py:") for f in found), found
    assert len(found) == 2, found


def test_ptr_gives_each_arrays_own_address():
    """native.abi.ptr reads a writable C-contiguous array's address through the buffer protocol
    and falls back to ``a.ctypes.data`` for the rest: the same address either way, for views
    with an offset, read-only, strided, transposed, broadcast, empty and 0-d arrays."""
    from kvcodec.native.abi import ptr

    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    ro = np.frombuffer(bytes(64), dtype=np.uint16)
    kinds = [base, base[2:], base[1:3, 2:], base[:, 1], base.T, ro, ro[3:], np.broadcast_to(base[0], (4, 8)),
             np.zeros(0, np.int64), np.array(5.0), np.zeros((3, 0), np.int32)]
    for a in kinds:
        assert ptr(a) == a.ctypes.data
    assert ptr(base[2:]) == ptr(base) + 2 * 8 * 4  # a view's first element, not its base's


def test_kept_ptr_remembers_live_arrays_within_its_bounds():
    """native.abi.kept_ptr gives ptr's address, remembered with the array itself (so the id of a
    remembered entry always names that array), and forgets everything past its bounds."""
    from kvcodec.native import abi

    ro = np.frombuffer(bytes(256), dtype=np.float32)
    assert abi.kept_ptr(ro) == ro.ctypes.data == abi.kept_ptr(ro)
    assert abi._KEPT[id(ro)][0] is ro
    for _ in range(abi._KEPT_MAX + 1):
        a = np.zeros(4)
        assert abi.kept_ptr(a) == a.ctypes.data
    assert len(abi._KEPT) <= abi._KEPT_MAX
    big = np.zeros(abi._KEPT_BYTES // 8 + 1)
    assert abi.kept_ptr(big) == big.ctypes.data and list(abi._KEPT) == [id(big)]
    abi._KEPT.clear()
    abi._kept_bytes[0] = 0
