"""CI checks of the CUDA kernels that need no GPU.

* Every program in cuda/ compiles with nvcc for sm_90 and sm_80, and ``ptxas -v`` reports no
  register spills and shared memory within the per-block limit.
* Every program compiles through NVRTC to a cubin, the very path kvcodec.gpu takes at run time.
* The kernels' per-item device code, compiled for the host (cuda/host_harness.cpp), reproduces
  the CPU reference decoders bit for bit. (What runs only on a GPU -- the PTX conversions and the
  grid mapping -- is checked by tests/test_cuda_kernels.py on a GPU.)
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvcodec import gpu
from kvcodec.errors import DeviceError, FormatError
from kvcodec.testing import spelled_out

from _cuda_host import GPU_CODEC_CONFIGS, build_harness, convert, run_on_host

ARCHS = (90, 80)
#: Static shared memory a block may use without opting in (both sm_80 and sm_90).
SMEM_LIMIT = 48 * 1024


def _have_nvrtc() -> bool:
    try:
        gpu.nvrtc_version()
        return True
    except DeviceError:
        return False


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per-kernel resource use from ``nvcc -Xptxas -v`` output."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            current = m.group(1)
            out[current] = {"spill_stores": -1, "spill_loads": -1, "smem": 0, "registers": -1}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[current]["spill_stores"] = int(m.group(1))
            out[current]["spill_loads"] = int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            out[current]["smem"] = int(m.group(1))
    return out


def test_parse_ptxas_reads_spills_and_smem():
    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90'\n"
        "ptxas info    : Function properties for k1\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]\n"
    )
    assert parse_ptxas(log) == {"k1": {"spill_stores": 4, "spill_loads": 12, "smem": 4096, "registers": 40}}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("program", gpu.PROGRAMS)
def test_nvcc_compiles_without_spills(program, arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the nvcc/ptxas check was not run")
    src = gpu.cuda_source_dir() / program
    cmd = [nvcc, "-cubin", f"-arch=sm_{arch}", "-std=c++17", "--fmad=false", "-Xptxas", "-v",
           str(src), "-o", str(tmp_path / "k.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    info = parse_ptxas(res.stdout + res.stderr)
    missing = set(gpu.kernel_names(program)) - set(info)
    assert not missing, f"kernels not compiled: {sorted(missing)}"
    for name, r in info.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{name} sm_{arch} spills: {r}"
        assert r["registers"] > 0, f"{name}: no register report"
        assert r["smem"] <= SMEM_LIMIT, f"{name} sm_{arch} uses {r['smem']} bytes of static shared memory"


@pytest.mark.parametrize("arch", [90])  # the run-time path for the H100/H200; nvcc covers sm_80
@pytest.mark.parametrize("program", gpu.PROGRAMS)
def test_nvrtc_compiles_to_cubin(program, arch):
    if not _have_nvrtc():
        pytest.skip("cuda-bindings/NVRTC ([cuda] extra) not installed: NVRTC check not run")
    cubin = gpu.compile_cubin(program, arch, use_cache=False)
    assert cubin[:4] == b"\x7fELF"
    for name in gpu.kernel_names(program):
        assert name.encode() + b"\x00" in cubin, f"{name} not in the {program} cubin"


def test_cubin_cache_is_keyed_and_reused(tmp_path, monkeypatch):
    if not _have_nvrtc():
        pytest.skip("cuda-bindings/NVRTC ([cuda] extra) not installed")
    monkeypatch.setenv("KVCODEC_CUBIN_CACHE", str(tmp_path))
    key = gpu.cubin_cache_key("dequant.cu", 90)
    assert "sm90" in key and "nvrtc" in key and key != gpu.cubin_cache_key("dequant.cu", 80)
    first = gpu.compile_cubin("dequant.cu", 90)
    assert (tmp_path / key).read_bytes() == first
    # A cached cubin is used as is (planted marker proves no recompilation happened).
    (tmp_path / key).write_bytes(b"\x7fELF-cached")
    assert gpu.compile_cubin("dequant.cu", 90) == b"\x7fELF-cached"


def test_sources_found_and_errors_are_clear(monkeypatch):
    assert (gpu.cuda_source_dir() / "dequant.cu").is_file()
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="device='cpu'"):
            gpu.device_modules("cuda")
    with pytest.raises(DeviceError, match="'cuda' device"):
        gpu.device_modules("cpu")


def test_unsupported_codec_raises_device_error():
    import kvcodec
    from kvcodec.codec import EncodedTensor, TensorContext

    class NoGpu(kvcodec.codec.Codec):
        codec_id = "test-no-gpu"

        def encode_tensor(self, x, ctx):  # pragma: no cover - never called
            raise NotImplementedError

        def decode_tensor(self, enc, ctx):  # pragma: no cover - never called
            raise NotImplementedError

    ctx = TensorContext(layer=0, role="k", shape=(1, 1, 1), dtype=torch.float16)
    with pytest.raises(DeviceError, match="no GPU decoder"):
        gpu.decode_tensor_device(NoGpu(), EncodedTensor({}), ctx, "cuda")


# ---------------------------------------------------------------------------- host harness
@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    lib = build_harness(tmp_path_factory.mktemp("harness"))
    if lib is None:
        pytest.skip("no C++ compiler: host build of the kernel code not checked")
    return lib


def test_param_structs_match_ctypes(harness):
    assert harness.kvc_sizeof(0) == ctypes_sizeof(gpu.Fp8Params)
    assert harness.kvc_sizeof(1) == ctypes_sizeof(gpu.Nvfp4Params)
    assert harness.kvc_sizeof(2) == ctypes_sizeof(gpu.IntqParams)
    assert harness.kvc_sizeof(3) == ctypes_sizeof(gpu.AnsParams)
    assert harness.kvc_sizeof(4) == ctypes_sizeof(gpu.KvcParams)


def ctypes_sizeof(t):
    import ctypes

    return ctypes.sizeof(t)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[x.dtype])


@pytest.mark.parametrize("which,dtype", [(0, torch.float8_e4m3fn), (1, torch.float8_e5m2)])
def test_fp8_to_f32_all_codes_match_torch(harness, which, dtype):
    codes = np.arange(256, dtype=np.uint32)
    got = convert(harness, which, codes).view(np.float32)
    want = torch.from_numpy(codes.astype(np.uint8)).view(dtype).float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_e2m1_table(harness):
    got = convert(harness, 2, np.arange(16, dtype=np.uint32)).view(np.float32)
    mags = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    want = np.array(mags + [-float(m) for m in mags], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # 0x8 is -0


def _edge_f32() -> np.ndarray:
    g = np.random.default_rng(7)
    special = np.array([0, 0x80000000, 1, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x477FE000, 0x477FF000,
                        0x477FEFFF, 0x47800000, 0x33000000, 0x33000001, 0x337FFFFF, 0x38800000, 0x387FFFFF,
                        0x38000000, 0x3F800000, 0x3F801000, 0x3F803000, 0x3F808000, 0x3F818000],
                       dtype=np.uint32)
    rand = g.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    # values around fp16's range and subnormals, where rounding is subtle
    near = (g.integers(0x32000000, 0x47900000, size=200_000, dtype=np.uint64).astype(np.uint32)
            | (g.integers(0, 2, size=200_000, dtype=np.uint64).astype(np.uint32) << 31))
    a = np.concatenate([special, special | 0x80000000, rand, near])
    return a[~np.isnan(a.view(np.float32))]


@pytest.mark.parametrize("which,dtype", [(3, torch.float16), (4, torch.bfloat16)])
def test_f32_to_half_rounding_matches_torch(harness, which, dtype):
    a = _edge_f32()
    got = convert(harness, which, a).astype(np.uint16)
    want = torch.from_numpy(a.view(np.float32)).to(dtype).view(torch.int16).numpy().view(np.uint16)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} mismatches, first input 0x{a[bad[0]]:08x}: {got[bad[0]]:04x} != {want[bad[0]]:04x}"


def test_f16_to_f32_all_codes(harness):
    codes = np.arange(65536, dtype=np.uint32)
    got = convert(harness, 5, codes).view(np.float32)
    want = torch.from_numpy(codes.astype(np.uint16).view(np.int16)).view(torch.float16).float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def fp8_expected(codes: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 decode formula: exact fp8 -> fp32, one fp32 multiply, one rounding cast."""
    t, h, d = codes.shape
    (_, _, _), (tb, hb, db) = gpu.scale_layout(tuple(scale.shape), (t, h, d))
    s = scale.reshape((1,) * (3 - scale.dim()) + tuple(scale.shape))
    s = s.repeat_interleave(tb, 0)[:t] if s.shape[0] > 1 else s
    s = s.repeat_interleave(hb, 1)[:, :h] if s.shape[1] > 1 else s
    s = s.repeat_interleave(db, 2)[:, :, :d] if s.shape[2] > 1 else s
    f8 = codes.view(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2).float()
    return (f8 * s).to(dtype)


FP8_CASES = [
    ((5, 3, 32), (1,)),              # per tensor
    ((5, 3, 32), (1, 3, 1)),         # per head
    ((5, 3, 32), (1, 3, 32)),        # per channel
    ((5, 3, 32), (5, 1, 1)),         # per token
    ((5, 3, 32), (5, 3, 2)),         # blocks of 16 along D
    ((5, 3, 32), (5, 3, 4)),         # blocks of 8 along D (not constant over 16)
    ((7, 2, 24), (1, 2, 24)),        # D not a multiple of 16: scalar path
    ((7, 2, 24), (7, 2, 3)),         # padded blocks of 8 along an odd D
    ((3, 1, 5), (2, 1, 1)),          # blocks of 2 tokens, odd everything
    ((1, 1, 16), (1,)),              # T = 1
    ((0, 2, 16), (1,)),              # T = 0
]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,sshape", FP8_CASES)
def test_fp8_host_matches_formula(harness, fmt, dtype, shape, sshape):
    g = torch.Generator().manual_seed(sum(shape) + len(sshape))
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    nan = (codes & 0x7F) == 0x7F if fmt == "e4m3" else (codes & 0x7F) > 0x7C
    codes[nan] = 0  # no NaN codes: NaN payloads differ between CPU and GPU arithmetic
    scale = torch.rand(sshape, generator=g) * 4 + 1e-3
    out = torch.full(shape, 7, dtype=dtype)
    launch = gpu.fp8_launch(codes, scale, out, fmt)
    assert launch.kernel.endswith("_v16") == (shape[2] % 16 == 0)
    run_on_host(harness, launch)
    want = fp8_expected(codes, scale, fmt, dtype)
    assert torch.equal(_bits(out), _bits(want))


def test_scale_layout_rejects_misfits():
    with pytest.raises(FormatError):
        gpu.scale_layout((4, 1, 1), (3, 2, 8))
    with pytest.raises(FormatError):
        gpu.scale_layout((1, 1, 5), (3, 2, 8))  # no block size gives exactly 5 blocks over 8
    with pytest.raises(FormatError):
        gpu.scale_layout((2, 1, 1, 1), (3, 2, 8))
    assert gpu.scale_layout((1, 1, 3), (3, 2, 8)) == ((0, 0, 1), (1, 1, 3))  # padded last block
    assert gpu.scale_layout((1, 2, 8), (3, 2, 8)) == ((0, 8, 1), (1, 1, 1))


# ---------------------------------------------------------------------------- whole decoders
@pytest.fixture
def host_runner(harness, monkeypatch):
    """Route the GPU decoders' launches (built from CPU tensors) through the host build."""
    monkeypatch.setattr(gpu.device, "_HOST_RUNNER", lambda launch: run_on_host(harness, launch))
    return harness


def _decode_both(codec, x: torch.Tensor, role: str = "k", layer: int = 0, layers: int = 3):
    from kvcodec import KVCache
    from kvcodec.codec import TensorContext

    cache = KVCache.from_tensors([(x, x)] * layers)
    globals_ = codec.encode_globals(cache)
    ctx = TensorContext(layer=layer, role=role, shape=tuple(x.shape), dtype=x.dtype, globals=globals_)
    enc = codec.encode_tensor(x, ctx)
    want = codec.decode_tensor(enc, ctx)
    got = gpu._GPU_DECODERS[codec.codec_id](codec, enc, ctx, torch.device("cpu"))()
    return got, want


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + torch.randn(1, shape[1], shape[2], generator=g) * 5
    return x.to(dtype)


SHAPES = [(33, 3, 64), (17, 2, 40), (1, 1, 16), (0, 2, 32), (5, 1, 7)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("config", GPU_CODEC_CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_decoder_host_build_matches_reference(host_runner, config, dtype, shape):
    import kvcodec

    codec = kvcodec.get_codec(config)
    for role in ("k", "v"):
        x = _rand(shape, dtype, seed=sum(shape) + len(str(config)))
        got, want = _decode_both(codec, x, role)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(_bits(got), _bits(want)), f"{config} {role} {dtype} {shape}"


# ---------------------------------------------------------------------------- ANS stages
def _random_stage(seed, r, n, a, **cfg):
    from kvcodec.entropy import EntropyStage

    g = np.random.default_rng(seed)
    p = g.dirichlet(np.ones(a) * 0.3)
    x = g.choice(a, size=(r, n), p=p).astype(np.int32)
    st = EntropyStage(**cfg)
    return x, st, st.encode(x, alphabet=a)


@pytest.mark.parametrize("r,n,a,cfg", [
    (5, 300, 16, {"chunk": 64}),                                      # smem tables, several chunks
    (7, 97, 2, {"chunk": 10, "rows_per_stream": 3, "precision": 1}),   # smallest alphabet/precision
    (4, 200, 300, {"chunk": 50, "precision": 16}),                      # big alphabet: global tables
    (9, 130, 12, {"chunk": 32, "tables": "cluster", "n_tables": 3}),    # row_table
    (3, 100, 8, {"chunk": 16, "scope": "chunk", "precision": 24}),      # a table set per chunk, P=24
    (5, 400, 40, {"chunk": 100, "precision": 24}),                      # P=24: coarse buckets, skewed
    (6, 300, 5, {"chunk": 64, "precision": 3}),                         # P < bucket bits
    (6, 0, 4, {"chunk": 16}),                                           # no tokens
    (1, 1, 3, {}),                                                      # one symbol
    (40, 64, 255, {"chunk": 32, "tables": "cluster", "n_tables": 8}),  # cachegen anchors: big A, blk
])
def test_ans_stage_host_build_matches_reference(harness, r, n, a, cfg):
    x, st, planes = _random_stage(r * 1000 + n, r, n, a, **cfg)
    ref = st.decode(planes, method="reference")
    assert np.array_equal(ref, x)
    stage = gpu.DeviceStage(planes, torch.device("cpu"))
    lay = stage.layout
    assert stage.cs == 2 ** max(1, (a - 1).bit_length()) + 1 and stage.cs - 1 >= a
    fits_blk = lay.scope == 0 and lay.K * stage.cs * 4 <= 48 * 1024
    fits_thread = gpu.ANS_THREADS * stage.cs * 4 <= 48 * 1024
    default = stage.launch(gpu.SINK_SYMBOLS, torch.zeros((r, n), dtype=torch.int32)).kernel
    assert default == "ans_symbols" + ("_blk" if fits_blk else "_smem" if fits_thread else "")
    modes = [("global", True)] + ([("smem", True)] if fits_thread else []) + \
        ([("blk", True), ("blk", False)] if fits_blk else [])
    for mode, bucket in modes:
        out = torch.full((r, n), -1, dtype=torch.int32)
        launch = stage.launch(gpu.SINK_SYMBOLS, out, tables=mode, use_bucket=bucket)
        if lay.n_streams:
            run_on_host(harness, launch)
        stage.check("test")
        assert np.array_equal(out.numpy(), x), (mode, bucket)


@pytest.mark.parametrize("r,n,a,cfg", [
    (6, 120, 9, {"chunk": 40, "rows_per_stream": 3, "tables": "cluster", "n_tables": 3, "scope": "ctx",
                 "thresholds": [4, 12]}),
    (13, 77, 20, {"chunk": 16, "rows_per_stream": 13, "tables": "cluster", "n_tables": 5, "scope": "ctx",
                  "thresholds": [0, 3, 8, 30, 65536]}),                   # T_1 = 0, T = max
    (5, 50, 64, {"chunk": 64, "rows_per_stream": 1, "tables": "cluster", "n_tables": 2, "scope": "ctx",
                 "thresholds": [8]}),                                     # G = 1: every class 0
    (40, 33, 2, {"chunk": 5, "rows_per_stream": 16, "tables": "cluster", "n_tables": 2, "scope": "ctx",
                 "thresholds": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], "precision": 3}),  # Q = 16
    (7, 90, 12, {"chunk": 20, "rows_per_stream": 4}),                       # scope 0
    (5, 60, 6, {"chunk": 16, "scope": "chunk"}),                            # scope 1: global tables
    (4, 0, 6, {"chunk": 16, "scope": "ctx", "tables": "cluster", "n_tables": 2, "thresholds": [4]}),  # no tokens
])
def test_ans_tokens_host_build_matches_reference(harness, r, n, a, cfg):
    """The token-major stage kernels (kvc's): every scope, formats/ANS.md §3.1's magnitude
    classes included, equal the pure-integer reference decoder, with tables in shared memory
    (with and without the bucket index) and in global memory."""
    from kvcodec.entropy.stage import magnitude_classes

    x, st, planes = _random_stage(r * 7 + n, r, n, a, **cfg)
    if cfg.get("scope") == "ctx" and n:
        # skewed magnitudes along the tokens so that several classes occur
        g = np.random.default_rng(r + n)
        width = np.where(np.arange(n) % 3 == 0, a // 2, 1)
        c = (a - 1) // 2
        x = np.clip(c + (g.integers(-a, a + 1, size=(r, n)) * width // a), 0, a - 1).astype(np.int32)
        planes = st.encode(x, alphabet=a)
        if cfg["rows_per_stream"] > 1 and len(cfg["thresholds"]) > 1:
            assert len(np.unique(magnitude_classes(x, cfg["rows_per_stream"], cfg["thresholds"], c))) >= 2
    assert np.array_equal(st.decode(planes, method="reference"), x)
    stage = gpu.DeviceStage(planes, torch.device("cpu"))
    lay = stage.layout
    modes = [("global", True)] + ([("blk", True), ("blk", False)] if lay.n_sets == 1 else [])
    assert stage.launch_tokens(torch.zeros((n, r), dtype=torch.int32)).kernel == \
        ("ans_tokens_blk" if lay.n_sets == 1 else "ans_tokens")
    for mode, bucket in modes:
        out = torch.full((n, r), -1, dtype=torch.int32)
        launch = stage.launch_tokens(out, tables=mode, use_bucket=bucket)
        if lay.n_streams:
            run_on_host(harness, launch)
        stage.check("test")
        assert np.array_equal(out.numpy(), x.T), (mode, bucket)


def test_scope_2_stage_only_through_the_token_kernels():
    """The sink kernels know no magnitude classes: a scope-2 stage given to them is refused, not
    decoded with the wrong tables."""
    x, st, planes = _random_stage(11, 6, 120, 9, chunk=40, rows_per_stream=3, tables="cluster", n_tables=3,
                                  scope="ctx", thresholds=[4, 12])
    stage = gpu.DeviceStage(planes, torch.device("cpu"))
    with pytest.raises(DeviceError, match="launch_tokens"):
        stage.launch(gpu.SINK_SYMBOLS, torch.zeros((6, 120), dtype=torch.int32))
    with pytest.raises(DeviceError, match="int32"):
        stage.launch_tokens(torch.zeros((6, 120), dtype=torch.int64))


def test_ans_tokens_host_build_rejects_corrupt_ctx_streams(harness):
    from kvcodec.errors import StreamError

    x, st, planes = _random_stage(3, 8, 150, 10, chunk=50, rows_per_stream=4, tables="cluster", n_tables=3,
                                  scope="ctx", thresholds=[4, 12])
    bad = dict(planes)
    w = planes["words"].copy()
    w[len(w) // 2] ^= 0x00010000
    bad["words"] = w
    with pytest.raises(StreamError):
        st.decode(bad, method="reference")
    stage = gpu.DeviceStage(bad, torch.device("cpu"))
    run_on_host(harness, stage.launch_tokens(torch.zeros((150, 8), dtype=torch.int32)))
    with pytest.raises(StreamError):
        stage.check("test")


def test_fwht_torch_equals_the_reference():
    from kvcodec.transforms.hadamard import fwht

    g = np.random.default_rng(4)
    for d in (1, 2, 16, 128, 256):
        x = (g.standard_normal((9, 3, d)) * 10.0 ** g.integers(-3, 4, size=(9, 3, 1))).astype(np.float32)
        got = gpu.fwht_torch(torch.from_numpy(x)).numpy()
        assert np.array_equal(got.view(np.uint32), fwht(x).view(np.uint32)), d


def _kvc_tensor(config, shape=(40, 2, 16), role="k", seed=0, dtype=torch.float16):
    import kvcodec
    from kvcodec.codec import TensorContext

    codec = kvcodec.get_codec(config)
    x = _rand(shape, dtype, seed)
    x[3, 0, 2] = 300.0  # an escape
    cache = kvcodec.KVCache.from_tensors([(x, x)] * 2)
    ctx = TensorContext(layer=0, role=role, shape=shape, dtype=dtype, globals=codec.encode_globals(cache))
    return codec, codec.encode_tensor(x, ctx), ctx


def _unpacked(codec, enc, ctx):
    """The tensor's planes as separate planes (what a packed tensor holds), for mutation."""
    from kvcodec.codec import EncodedTensor
    from kvcodec.codecs.kvc import PACK_PIECES
    from kvcodec.format.pack import unpack_planes

    pr = dict(enc.params)
    planes = unpack_planes(enc.planes["pack"], pr.pop("pk"), PACK_PIECES, "test") if "pk" in pr else dict(enc.planes)
    return EncodedTensor(dict(planes), pr)


def _kvc_mutations():
    def more_esc(e):
        e.planes["esc"] = np.concatenate([e.planes["esc"], e.planes["esc"][:1]])

    def fewer_esc(e):
        e.planes["esc"] = e.planes["esc"][1:]

    def esc_inside(e):
        v = e.planes["esc"].copy()
        v[0] = 1
        e.planes["esc"] = v

    def step_far(e):
        side = e.planes["side"].copy()
        side[1, 0, 0] = 400.0  # channel step code outside [-320, 320]
        e.planes["side"] = side

    def tok_far(e):  # k_tok rows: a channel code near the bottom, so an offset pushes it out
        side = e.planes["side"].copy()
        side[1, 1, 5] = -318.0  # recency offsets are negative (finer steps)
        e.planes["side"] = side

    def base_far(e):
        e.params["step_base"] = [e.params["step_base"][0] + 700] + e.params["step_base"][1:]

    def flip_word(e):
        w = e.planes["ans_words"].copy()
        w[len(w) // 2] ^= 0x00040000
        e.planes["ans_words"] = w

    return {"more_esc": more_esc, "fewer_esc": fewer_esc, "esc_inside": esc_inside, "step_far": step_far,
            "tok_far": tok_far, "base_far": base_far, "flip_word": flip_word}


_PLAIN = {"id": "kvc", "pack": 0, "max_level": 6}
_CAL = {"id": "kvc-near-cal", "pack": 0, "max_level": 6}  # k_tok step rows, contexts, rc
_COMMON = ("more_esc", "fewer_esc", "esc_inside", "flip_word")
KVC_FORGERIES = ([(_PLAIN, "k", m) for m in _COMMON + ("step_far",)] + [(_PLAIN, "v", m) for m in _COMMON + ("base_far",)]
                 + [(_CAL, "k", m) for m in _COMMON + ("step_far", "tok_far")] + [(_CAL, "v", "base_far")])


@pytest.mark.parametrize("config,role,mutation", KVC_FORGERIES,
                         ids=[f"{c['id']}-{r}-{m}" for c, r, m in KVC_FORGERIES])
def test_kvc_gpu_decoder_rejects_what_the_reference_rejects(host_runner, config, role, mutation):
    """Forged kvc tensors: the GPU decoder (host build) raises the reference decoder's error class
    (escape counts, escapes inside the regular range, step codes out of range, corrupt streams)."""
    from kvcodec.errors import KVCodecError

    codec, enc, ctx = _kvc_tensor(config, role=role, seed=len(mutation))
    enc = _unpacked(codec, enc, ctx)
    assert "esc" in enc.planes, "the test tensor was meant to have escapes"
    assert bool(enc.params.get("k_tok")) == (config is _CAL and role == "k")
    _kvc_mutations()[mutation](enc)
    with pytest.raises(KVCodecError) as cpu:
        codec.decode_tensor(enc, ctx)
    with pytest.raises(KVCodecError) as dev:
        gpu._GPU_DECODERS["kvc"](codec, enc, ctx, torch.device("cpu"))()
    assert type(dev.value) is type(cpu.value), (cpu.value, dev.value)


def test_ans_stage_host_build_rejects_corrupt_streams(harness):
    from kvcodec.errors import StreamError

    x, st, planes = _random_stage(5, 4, 200, 8, chunk=50)
    for mutate in ("flip", "zero_last"):
        bad = dict(planes)
        w = planes["words"].copy()
        if mutate == "flip":
            w[len(w) // 2] ^= 0x00010000
        else:
            w[int(planes["offsets"][1]) - 1] = 0
        bad["words"] = w
        with pytest.raises(StreamError):
            st.decode(bad, method="reference")
        stage = gpu.DeviceStage(bad, torch.device("cpu"))
        run_on_host(harness, stage.launch(gpu.SINK_SYMBOLS, torch.zeros((4, 200), dtype=torch.int32)))
        with pytest.raises(StreamError):
            stage.check("test")


def test_missing_bindings_raise_device_error_naming_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name.startswith("cuda"):
            raise ImportError("No module named 'cuda'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    with pytest.raises(DeviceError, match=r"kvcodec\[cuda\]"):
        gpu.nvrtc_version()
    with pytest.raises(DeviceError, match=r"kvcodec\[cuda\]"):
        gpu.compile_cubin("dequant.cu", 90)


def test_decode_on_cuda_without_a_gpu_is_a_clear_error():
    import kvcodec
    from conftest import make_cache

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the no-GPU error path is not reachable here")
    blob = kvcodec.get_codec("fp8-e4m3").encode(make_cache(layers=1, tokens=3))
    with pytest.raises(DeviceError, match="device='cpu'"):
        kvcodec.decode(blob, device="cuda")


def test_ans_stage_host_build_random_geometries(harness):
    """Random stage geometries and table modes, every table placement, against the reference."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(r=st.integers(1, 9), n=st.integers(0, 90), a=st.integers(2, 70), p=st.integers(7, 24),
           chunk=st.integers(0, 40), g=st.integers(1, 4), tables=st.sampled_from(["row", "shared", "cluster"]),
           scope=st.sampled_from(["all", "chunk"]), seed=st.integers(0, 2**16))
    def check(r, n, a, p, chunk, g, tables, scope, seed):
        if a > 1 << p:
            return
        cfg = {"precision": p, "chunk": chunk, "rows_per_stream": g, "tables": tables, "n_tables": 3, "scope": scope}
        x, st_, planes = _random_stage(seed, r, n, a, **cfg)
        stage = gpu.DeviceStage(planes, torch.device("cpu"))
        lay = stage.layout
        modes = [("global", True)]
        if gpu.ANS_THREADS * stage.cs * 4 <= 48 * 1024:
            modes.append(("smem", True))
        if lay.scope == 0 and lay.K * stage.cs * 4 <= 48 * 1024:
            modes += [("blk", True), ("blk", False)]
        for mode, bucket in modes:
            out = torch.full((r, n), -1, dtype=torch.int32)
            launch = stage.launch(gpu.SINK_SYMBOLS, out, tables=mode, use_bucket=bucket)
            if lay.n_streams:
                run_on_host(harness, launch)
            stage.check("test")
            assert np.array_equal(out.numpy(), x), (cfg, mode, bucket)

    check()


# ---------------------------------------------------------------------------- whole files, batched
@pytest.fixture
def host_device(host_runner, monkeypatch):
    """``device="cuda"`` decodes on the CPU through the host build (the GPU tests' dry run)."""
    monkeypatch.setattr(gpu.device, "_resolve_device", lambda device: torch.device("cpu"))
    return host_runner


@pytest.mark.parametrize("name", ["kvc-near-cal", "kvc", "kivi-4-ans", "cachegen"])
@pytest.mark.parametrize("tokens_per_chunk", [0, 32])
def test_whole_file_device_decode_through_the_host_build(host_device, name, tokens_per_chunk):
    """``kvcodec.decode(..., device="cuda")`` — the batched path (:class:`gpu.batched_decode`,
    checks deferred to the end, chunked tensors concatenated) — equals the CPU decode bit for bit."""
    import kvcodec
    from conftest import make_cache

    cache = make_cache(layers=3, tokens=70, heads=2, dim=40, dtype=torch.bfloat16, seed=2)
    blob = spelled_out(name).encode(cache, tokens_per_chunk=tokens_per_chunk)
    want, got = kvcodec.decode(blob), kvcodec.decode(blob, device="cuda")
    for (i, role, a), (_, _, b) in zip(want.tensors(), got.tensors()):
        assert torch.equal(_bits(b), _bits(a)), f"{name} chunk {tokens_per_chunk} layers.{i}.{role}"


def test_batched_decode_raises_on_exit_naming_the_tensor(host_device):
    from kvcodec.errors import StreamError

    codec, good, ctx = _kvc_tensor({"id": "kvc-near-cal", "pack": 0})
    bad = _unpacked(codec, good, ctx)
    w = bad.planes["ans_words"].copy()
    w[len(w) // 2] ^= 0x00040000
    bad.planes["ans_words"] = w
    with pytest.raises(StreamError, match=r"layers\.0\.k: kvc entropy stage"):
        codec.decode_tensor(bad, ctx)
    reached = False
    with pytest.raises(StreamError, match=r"layers\.0\.k: kvc entropy stage"):
        with gpu.batched_decode("cuda"):
            ok = gpu.decode_tensor_device(codec, good, ctx, "cuda")
            gpu.decode_tensor_device(codec, bad, ctx, "cuda")  # launched; its check waits for the exit
            reached = True
    assert reached
    assert torch.equal(_bits(ok), _bits(codec.decode_tensor(good, ctx)))
    assert gpu._active_batch(torch.device("cpu")) is None  # the batch is gone after an error


def test_kvc_gpu_decoder_on_mutated_planes_agrees_with_the_reference(host_runner):
    """Random bit flips, byte overwrites, resized planes and shifted params on kvc tensors (the
    host build of the kernels): the GPU decoder raises only kvcodec errors, accepts exactly what the
    CPU decoder accepts, with the same bits, and rejects with the same error class -- except
    DeviceError, its documented limit (codes or step bases past 32 bits, magnitude sums past int32).
    (Run the same under AddressSanitizer to check the kernel code's memory accesses.)"""
    import random

    from kvcodec.codec import EncodedTensor
    from kvcodec.errors import DeviceError, KVCodecError

    rng = random.Random(12)
    base = [_kvc_tensor(c, shape=(50, 2, 16), role=r, seed=i)
            for i, (c, r) in enumerate([(_CAL, "k"), (_CAL, "v"), (_PLAIN, "k"), (_PLAIN, "v"),
                                        ({"id": "kvc", "pack": 0, "ctx": [4, 12], "rows_per_stream": 5, "chunk": 7,
                                          "k_recon": 2, "delta": 2, "recent_ramp": 16, "recent_fine": 4.0}, "k")])]
    outcomes = {"accepted": 0, "rejected": 0}

    def run(f):
        try:
            return f()
        except KVCodecError as e:
            return type(e)

    for _ in range(250):
        codec, enc, ctx = rng.choice(base)
        planes = {k: np.array(v, copy=True) for k, v in enc.planes.items()}
        params = dict(enc.params)
        for _ in range(rng.randint(1, 3)):
            k = rng.choice(sorted(planes))
            a = planes[k]
            if not a.size:
                continue
            if rng.random() < 0.2:  # one element more or fewer
                planes[k] = np.resize(a.reshape(-1), a.size + rng.choice([-1, 1])).astype(a.dtype)
                continue
            b = a.view(np.uint8).reshape(-1).copy()
            i = rng.randrange(b.size)
            b[i] = b[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.7 else rng.randrange(256)
            planes[k] = b.view(a.dtype).reshape(a.shape)
        if rng.random() < 0.2:
            key = rng.choice(sorted(params))
            v = params[key]
            if isinstance(v, int) and not isinstance(v, bool):
                params[key] = v + rng.choice([-1, 1, 1000])
            elif isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                params[key] = [x + rng.choice([0, 1, -1, 500]) for x in v]
        e = EncodedTensor(planes, params)
        got = run(lambda: gpu._GPU_DECODERS["kvc"](codec, e, ctx, torch.device("cpu"))())
        want = run(lambda: codec.decode_tensor(e, ctx))
        if got is DeviceError:
            continue
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), f"GPU path rejected ({got.__name__}) what the reference accepts"
            assert torch.equal(_bits(got), _bits(want))
            outcomes["accepted"] += 1
        else:
            assert got is want, f"GPU path: {got}, reference: {want.__name__}"
            outcomes["rejected"] += 1
    assert outcomes["accepted"] >= 10 and outcomes["rejected"] >= 100, outcomes
