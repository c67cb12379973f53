"""GPU kernels against the CPU reference decoders, at zero tolerance (bit views compared).

Marked ``gpu``: skipped (never faked) without a CUDA device; eval/gpu_check.sh runs them on one.
Covers every codec with a GPU decoder on random caches with odd sizes (T=0, T=1, odd head_dim),
the edge-case value table of kvcodec.testing, a real SmolLM2 cache when one is available
(``$KVCODEC_REAL_CACHE`` or ``.whl/real_cache_*.safetensors``; with a calibration file there too,
the calibrated kvc presets), corrupt ANS streams, and launches
on a non-default stream.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import gpu
from kvcodec.codec import TensorContext
from kvcodec.errors import InputError, StreamError

from _cuda_host import GPU_CODEC_CONFIGS  # noqa: E402
from kvcodec.testing import SHAPES, spelled_out, value_cases

#: KVCODEC_GPU_DRYRUN=1 runs this module without a GPU: every launch goes through the host
#: build of the kernel code (tests/_cuda_host.py) on CPU tensors. It checks the tests themselves
#: (and the decoders' plumbing) before the few minutes of GPU time they get; it verifies nothing
#: about the GPU.
DRYRUN = os.environ.get("KVCODEC_GPU_DRYRUN") == "1"
pytestmark = [] if DRYRUN else pytest.mark.gpu
DEV = torch.device("cpu" if DRYRUN else "cuda")


@pytest.fixture(autouse=True, scope="module")
def _dryrun_host_runner(tmp_path_factory):
    if not DRYRUN:
        yield
        return
    from _cuda_host import build_harness, run_on_host

    lib = build_harness(tmp_path_factory.mktemp("harness"))
    mp = pytest.MonkeyPatch()
    # the hooks live in kvcodec.gpu.device, which reads them at call time (the package's names are copies)
    mp.setattr(gpu.device, "_HOST_RUNNER", lambda launch: run_on_host(lib, launch))
    mp.setattr(gpu.device, "run_launch", lambda mods, launch: run_on_host(lib, launch))
    mp.setattr(gpu.device, "device_modules", lambda device="cuda": None)
    mp.setattr(gpu.device, "_resolve_device", lambda device: DEV)
    yield
    mp.undo()
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
CONFIGS = GPU_CODEC_CONFIGS + [{"id": "raw"}, {"id": "fp16"}]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[x.dtype])


def _assert_bit_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.device.type == DEV.type, what
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), what
    g, w = _bits(got), _bits(want)
    bad = (g != w) & ~nan
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {want.numel()} values differ"


def _encode(codec, x: torch.Tensor, role: str, layers: int = 3, layer: int = 1):
    cache = kvcodec.KVCache.from_tensors([(x, x)] * layers)
    ctx = TensorContext(layer=layer, role=role, shape=tuple(x.shape), dtype=x.dtype,
                        globals=codec.encode_globals(cache))
    return codec.encode_tensor(x, ctx), ctx


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + torch.randn(1, shape[1], shape[2], generator=g) * 5
    return x.to(dtype)


def _assert_file_decodes_equal(blob: bytes, label: str) -> None:
    """``kvcodec.decode(blob, device="cuda")`` equals the CPU decode, tensor by tensor."""
    cpu = kvcodec.decode(blob)
    dev = kvcodec.decode(blob, device="cuda")
    for (i, role, t_cpu), (_, _, t_dev) in zip(cpu.tensors(), dev.tensors()):
        _assert_bit_equal(t_dev, t_cpu, f"{label} layers.{i}.{role}")


def _presets_with_gpu():
    return [n for n in kvcodec.list_codecs() if kvcodec.get_codec(n).codec_id in gpu.gpu_codec_ids()]


@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_whole_cache_decode_on_cuda(tokens):
    from conftest import make_cache

    for dtype in DTYPES:
        cache = make_cache(layers=3, tokens=tokens, heads=2, dim=40, dtype=dtype, seed=tokens)
        for name in _presets_with_gpu():
            _assert_file_decodes_equal(spelled_out(name).encode(cache), f"{name} {dtype} T={tokens}")


@pytest.mark.parametrize("name", ["kvc-near-cal", "kvc-aggressive-cal", "kvc", "kivi-4-ans", "cachegen", "fp8-e4m3"])
def test_chunked_file_decode_on_cuda(name):
    """Token chunks of a file decode on several CUDA streams (gpu.batched_decode) and are
    concatenated on the current stream: the result must equal the CPU decode."""
    from conftest import make_cache

    cache = make_cache(layers=6, tokens=300, heads=3, dim=64, dtype=torch.float16, seed=7)
    _assert_file_decodes_equal(spelled_out(name).encode(cache, tokens_per_chunk=64), f"{name} chunked")


def test_batched_decode_checks_on_exit():
    codec = kvcodec.get_codec({"id": "kvc-near-cal", "pack": 0})
    x = _rand((200, 2, 64), torch.float16, 11)
    enc, ctx = _encode(codec, x, "k")
    w = enc.planes["ans_words"].copy()
    w[len(w) // 2] ^= 0x00040000
    bad = kvcodec.codec.EncodedTensor({**enc.planes, "ans_words": w}, dict(enc.params))
    reached = False
    with pytest.raises(StreamError, match="kvc entropy stage"):
        with gpu.batched_decode("cuda"):
            good = gpu.decode_tensor_device(codec, enc, ctx, "cuda")
            gpu.decode_tensor_device(codec, bad, ctx, "cuda")
            reached = True
    assert reached
    _assert_bit_equal(good, codec.decode_tensor(enc, ctx), "batched good tensor")


def _carried(env: str, pattern: str):
    """A file named by ``$env``, else the first ``.whl/<pattern>`` (eval/gpu_prepare.sh), else None."""
    if os.environ.get(env):
        return os.environ[env]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(here, ".whl", pattern)))
    return found[0] if found else None


def _real_cache_path():
    return _carried("KVCODEC_REAL_CACHE", "real_cache_*.safetensors")


def _real_calibration_path():
    """A kvc calibration file for the real cache, or None."""
    return _carried("KVCODEC_REAL_CALIBRATION", "*.qstats.safetensors")


def test_real_cache_decode_on_cuda():
    path = _real_cache_path()
    if path is None:
        pytest.skip("no real cache file ($KVCODEC_REAL_CACHE or .whl/real_cache_*.safetensors): not checked")
    full = kvcodec.KVCache.from_safetensors(path)
    # a few layers keep the CPU reference encode/decode of every preset within the time budget;
    # first, second and last layers cover the layer-dependent bins of the cachegen codecs
    keep = sorted({0, 1, 2, full.num_layers // 2, full.num_layers - 1})
    cache = kvcodec.KVCache(layers=[full.layers[i] for i in keep], token_ids=full.token_ids, model=full.model)
    # spelled out: the -cal presets refuse to encode without a calibration file; their steps and
    # stage layout are still checked here, uncalibrated, on every layer kept
    configs = [(name, spelled_out(name), cache) for name in _presets_with_gpu()]
    cal = _real_calibration_path()
    if cal is not None:  # the -cal presets as shipped: calibrated steps (attention, sensitivities), all layers
        configs += [(f"{n} + {os.path.basename(cal)}", {"id": n, "calibration": cal}, full)
                    for n in ("kvc-transparent-cal", "kvc-near-cal", "kvc-aggressive-cal")]
    for label, config, c in configs:
        _assert_file_decodes_equal(kvcodec.get_codec(config).encode(c), f"real cache {label}")


@pytest.mark.parametrize("name", ["kvc-near-cal", "kivi-4-ans", "fp8-e4m3"])
def test_lmcache_chunk_frame_decodes_into_a_cuda_chunk(name):
    """A kvcodec serde frame (LMCache's [2, layers, tokens, hidden] chunk) decoded into a chunk on
    the device holds the CPU decode's bits."""
    from conftest import make_cache
    from kvcodec.integrations.lmcache import ChunkCoder, to_chunks

    chunk = to_chunks(make_cache(layers=4, tokens=256, heads=2, dim=64, dtype=torch.float16, seed=5), 256)[0]
    coder = ChunkCoder(spelled_out(name).get_config(), num_kv_heads=2, head_dim=64)
    frame = coder.encode(chunk)
    want = torch.empty_like(chunk)
    coder.decode_into(frame, want)
    got = torch.full(chunk.shape, 7.0, dtype=chunk.dtype, device=DEV)
    coder.decode_into(frame, got)
    _assert_bit_equal(got, want, f"{name} chunk frame")


@pytest.mark.parametrize("fmt,dtype8", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_kernel_every_code(fmt, dtype8, dtype):
    # all 256 codes (NaN and inf included) times scales that push products into fp16/bf16
    # subnormals and overflow: checks the PTX conversions, which the host build replaces
    codes = torch.arange(256, dtype=torch.uint8).repeat(64).reshape(64, 4, 64)
    scale = torch.logspace(-30, 30, 64, dtype=torch.float32).reshape(64, 1, 1)
    out = torch.empty(codes.shape, dtype=dtype, device=DEV)
    gpu.device.run_launch(gpu.device.device_modules(DEV), gpu.fp8_launch(codes.to(DEV), scale.to(DEV), out, fmt))
    want = (codes.view(dtype8).float() * scale).to(dtype)
    _assert_bit_equal(out, want, f"fp8 {fmt} all codes {dtype}")


def test_unaligned_output_takes_the_scalar_path():
    codes = torch.randint(0, 120, (9, 2, 32), dtype=torch.uint8)
    scale = torch.rand(1, 2, 1) + 0.5
    buf = torch.empty(codes.numel() + 1, dtype=torch.float16, device=DEV)
    out = buf[1:].view(codes.shape)  # 2-byte offset: no 16-byte vector stores possible
    launch = gpu.fp8_launch(codes.to(DEV), scale.to(DEV), out, "e4m3")
    assert not launch.kernel.endswith("_v16")
    gpu.device.run_launch(gpu.device.device_modules(DEV), launch)
    _assert_bit_equal(out, (codes.view(torch.float8_e4m3fn).float() * scale).half(), "unaligned fp8")


def test_decode_on_a_side_stream():
    if DRYRUN:
        pytest.skip("dry run: no CUDA streams without a GPU")
    codec = kvcodec.get_codec("kivi-4-ans")
    x = _rand((257, 2, 64), torch.float16, 3)
    enc, ctx = _encode(codec, x, "k")
    want = codec.decode_tensor(enc, ctx)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got = gpu.decode_tensor_device(codec, enc, ctx, "cuda")
    s.synchronize()
    _assert_bit_equal(got, want, "side stream")


def test_corrupt_ans_stream_raises_on_gpu():
    codec = kvcodec.get_codec({"id": "kivi-ans", "bits": 4, "chunk": 32})
    x = _rand((100, 2, 16), torch.float16, 5)
    enc, ctx = _encode(codec, x, "v")
    w = enc.planes["ans_words"].copy()
    w[len(w) // 3] ^= 0x00100000
    enc.planes["ans_words"] = w
    with pytest.raises(StreamError):
        codec.decode_tensor(enc, ctx)
    with pytest.raises(StreamError):
        gpu.decode_tensor_device(codec, enc, ctx, "cuda")


def test_large_stage_many_streams():
    # enough streams to fill the GPU several times; checks grid mapping beyond one block row
    codec = kvcodec.get_codec({"id": "kivi-ans", "bits": 2, "chunk": 64})
    x = _rand((4096, 8, 128), torch.bfloat16, 9)
    enc, ctx = _encode(codec, x, "k")
    _assert_bit_equal(gpu.decode_tensor_device(codec, enc, ctx, "cuda"), codec.decode_tensor(enc, ctx), "large stage")
    assert np.asarray(enc.planes["ans_offsets"]).size - 1 == 64 * 1024


# The broad sweeps last: a time-limited run on a GPU machine reports the targeted checks first.
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(33, 3, 64), (17, 2, 40), (1, 1, 16), (0, 2, 32), (5, 1, 7), (300, 2, 128)])
def test_gpu_decode_equals_reference(config, dtype, shape):
    codec = kvcodec.get_codec(config)
    for role in ("k", "v"):
        x = _rand(shape, dtype, seed=sum(shape))
        enc, ctx = _encode(codec, x, role)
        want = codec.decode_tensor(enc, ctx)
        got = gpu.decode_tensor_device(codec, enc, ctx, "cuda")
        _assert_bit_equal(got, want, f"{config} {role} {dtype} {shape}")


@pytest.mark.parametrize("config", [c for c in CONFIGS if c["id"] in ("fp8", "nvfp4", "kivi-ans", "cachegen-lmcache")][::2]
                         + [{"id": "kivi", "bits": 4}, {"id": "cachegen"}], ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_decode_edge_cases(config, dtype):
    codec = kvcodec.get_codec(config)
    for shape_name, shape in SHAPES.items():
        for name, x in value_cases(dtype, shape).items():
            try:
                enc, ctx = _encode(codec, x, "k")
            except InputError:
                continue  # e.g. fp16 side information cannot hold the source max: refused on encode
            want = codec.decode_tensor(enc, ctx)
            got = gpu.decode_tensor_device(codec, enc, ctx, "cuda")
            _assert_bit_equal(got, want, f"{config} {dtype} {shape_name} {name}")
