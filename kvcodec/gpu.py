"""GPU decoding: CUDA kernels from ``cuda/`` compiled at run time with NVRTC and launched on
torch's current stream.

The kernels are plain CUDA C++ (no torch headers). This module

* finds their sources: ``kvcodec/_cuda`` inside an installed wheel first, then the source
  checkout's top-level ``cuda/`` folder;
* compiles each program with NVRTC (``cuda.bindings``, the ``[cuda]`` extra) straight to a cubin
  for the device's architecture, and caches the cubin on disk keyed by the sources' hash, the
  architecture, the compile options and the NVRTC version;
* loads the cubin with the driver API into torch's primary context and launches kernels on
  ``torch.cuda.current_stream().cuda_stream`` with raw pointers of torch tensors;
* implements :func:`decode_tensor_device`, which the container calls for ``device != "cpu"``.

Every kernel reproduces its codec's CPU reference decode bit for bit (tests/test_cuda_kernels.py).

Example:
    >>> import kvcodec, torch
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(8, 2, 16), torch.randn(8, 2, 16))])
    >>> blob = kvcodec.get_codec("fp16").encode(cache)
    >>> try:
    ...     out = kvcodec.decode(blob, device="cuda")   # GPU kernels, same values as "cpu"
    ... except kvcodec.errors.DeviceError as e:          # no GPU or no [cuda] extra here
    ...     out = kvcodec.decode(blob)
    >>> out.num_tokens
    8
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .errors import DeviceError, FormatError

if TYPE_CHECKING:
    from .codec import Codec, EncodedTensor, TensorContext

#: Kernel programs (one NVRTC compilation each) in the cuda/ folder.
PROGRAMS = ("dequant.cu", "intq.cu", "ans.cu", "kvc_codec.cu")

#: NVRTC options shared by run time and the CI compile test. Bit-exactness with the CPU
#: reference needs IEEE single precision everywhere: no FMA contraction (torch rounds after each
#: multiply and add), no flush of subnormals to zero, correctly rounded division.
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

_HINT = (
    "decode with device='cpu' (the reference decoder), or install the GPU extra: "
    "pip install 'kvcodec[cuda]' (cuda-bindings, nvidia-cuda-nvrtc) on a machine with an NVIDIA GPU"
)

_OUT_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_THREADS = 256
#: The kernels index a tensor with 32-bit arithmetic (64-bit division is a slow called routine).
MAX_ELEMENTS = 2**31 - 1


# ---------------------------------------------------------------------------- sources
def cuda_source_dir() -> Path:
    """The folder holding the kernel sources.

    An installed wheel carries them as ``kvcodec/_cuda`` (pyproject force-include); a source
    checkout has them in the top-level ``cuda/`` folder. The packaged copy wins.

    Raises:
        DeviceError: neither folder holds the kernel sources.
    """
    here = Path(__file__).resolve().parent
    for cand in (here / "_cuda", here.parent / "cuda"):
        if (cand / PROGRAMS[0]).is_file():
            return cand
    raise DeviceError(
        f"CUDA kernel sources not found in {here / '_cuda'} nor {here.parent / 'cuda'}; "
        "reinstall kvcodec from a wheel or a full source checkout"
    )


def _read_sources(program: str) -> tuple[str, dict[str, str]]:
    """The program's text and every header of the folder (NVRTC gets them in memory, so the
    cache key covers exactly what was compiled)."""
    d = cuda_source_dir()
    path = d / program
    if not path.is_file():
        raise DeviceError(f"kernel program {program!r} not found in {d}")
    headers = {p.name: p.read_text(encoding="utf-8") for p in sorted(d.glob("*.cuh"))}
    return path.read_text(encoding="utf-8"), headers


# ---------------------------------------------------------------------------- bindings
def _bindings() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, nvrtc  # type: ignore[import-not-found]
    except ImportError as e:
        raise DeviceError(f"CUDA Python bindings are not installed ({e}); {_HINT}") from None
    return driver, nvrtc


def _nvrtc_check(nvrtc: Any, res: Any, what: str, prog: Any = None) -> Any:
    err = res[0] if isinstance(res, tuple) else res
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = ""
        if prog is not None:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            buf = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = buf.decode(errors="replace").rstrip("\x00 ")
        raise DeviceError(f"NVRTC {what} failed: {err}\n{log}".rstrip())
    return _unwrap(res)


def _unwrap(res: Any) -> Any:
    """The value(s) after the error code of a cuda.bindings result tuple."""
    if not isinstance(res, tuple) or len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor) version.

    Raises:
        DeviceError: the ``[cuda]`` extra is missing.
    """
    _, nvrtc = _bindings()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001 - a missing libnvrtc surfaces as a loader error
        raise DeviceError(f"NVRTC is not usable ({e}); {_HINT}") from None
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise DeviceError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def supported_archs() -> list[int]:
    """The real architectures (for example 80, 90) this NVRTC can compile cubins for."""
    _, nvrtc = _bindings()
    return [int(a) for a in _nvrtc_check(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "GetSupportedArchs")]


def _cache_dir() -> Path | None:
    env = os.environ.get("KVCODEC_CUBIN_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcodec" / "cubin"


def cubin_cache_key(program: str, arch: int) -> str:
    """Cache file name of one compiled program: sources hash + arch + options + NVRTC version."""
    src, headers = _read_sources(program)
    h = hashlib.sha256()
    for part in (program, src, *(f"{k}\0{v}" for k, v in sorted(headers.items())), *NVRTC_OPTIONS):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    major, minor = nvrtc_version()
    return f"{Path(program).stem}-{h.hexdigest()[:20]}-sm{arch}-nvrtc{major}.{minor}.cubin"


def compile_cubin(program: str, arch: int, use_cache: bool = True) -> bytes:
    """Compile one kernel program in ``cuda/`` to a cubin for ``sm_{arch}`` with NVRTC.

    Needs no GPU (CI calls it). Cubins are cached on disk (``$KVCODEC_CUBIN_CACHE`` or
    ``~/.cache/kvcodec/cubin``); an unwritable cache folder only disables caching.

    Example:
        >>> cubin = compile_cubin("dequant.cu", 90)   # doctest: +SKIP
        >>> cubin[:4] == b"\\x7fELF"                   # doctest: +SKIP
        True

    Raises:
        DeviceError: no bindings, or the program does not compile (the NVRTC log is attached).
    """
    _, nvrtc = _bindings()
    cdir = _cache_dir() if use_cache else None
    key = cubin_cache_key(program, arch)
    if cdir is not None:
        cached = cdir / key
        try:
            data = cached.read_bytes()
            if data[:4] == b"\x7fELF":
                return data
        except OSError:
            pass
    src, headers = _read_sources(program)
    names = list(headers)
    res = nvrtc.nvrtcCreateProgram(
        src.encode(), program.encode(), len(names),
        [headers[n].encode() for n in names], [n.encode() for n in names],
    )
    prog = _nvrtc_check(nvrtc, res, "CreateProgram")
    try:
        opts = [f"--gpu-architecture=sm_{arch}".encode(), *(o.encode() for o in NVRTC_OPTIONS)]
        _nvrtc_check(nvrtc, nvrtc.nvrtcCompileProgram(prog, len(opts), opts), f"compile of {program}", prog)
        size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "GetCUBINSize")
        buf = b" " * int(size)
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, buf), "GetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if cdir is not None:
        try:
            cdir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cdir, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(buf)
            os.replace(tmp, cdir / key)  # atomic: a concurrent reader sees all or nothing
        except OSError:
            pass
    return buf


# ---------------------------------------------------------------------------- device side
def _device_index(device: str | torch.device) -> int:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"bad device {device!r}: {e}") from None
    if dev.type != "cuda":
        raise DeviceError(f"GPU decode needs a 'cuda' device, got {device!r}; {_HINT}")
    try:
        ok = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver means no GPU
        ok = False
    if not ok:
        raise DeviceError(f"no CUDA device is available to torch (asked for {device!r}); {_HINT}")
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx >= torch.cuda.device_count():
        raise DeviceError(f"{device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    return idx


class _DeviceModules:
    """Loaded modules of one device: primary context, cubins, kernel handles."""

    def __init__(self, index: int) -> None:
        driver, _ = _bindings()
        self.driver = driver
        self.index = index
        try:
            self._check(driver.cuInit(0), "cuInit")
        except DeviceError:
            raise
        except Exception as e:  # noqa: BLE001 - no libcuda: the bindings raise their own error
            raise DeviceError(f"the CUDA driver library is not usable ({e}); {_HINT}") from None
        self.cu_device = self._check(driver.cuDeviceGet(index), "cuDeviceGet")
        # torch's runtime uses the primary context; retaining it gives us the same context.
        torch.cuda.init()
        self.ctx = self._check(driver.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain")
        major, minor = torch.cuda.get_device_capability(index)
        self.arch = _pick_arch(10 * major + minor)
        self.sm_count = torch.cuda.get_device_properties(index).multi_processor_count
        self.modules: dict[str, Any] = {}
        self.functions: dict[tuple[str, str], Any] = {}

    def _check(self, res: Any, what: str) -> Any:
        err = res[0] if isinstance(res, tuple) else res
        if err != self.driver.CUresult.CUDA_SUCCESS:
            try:
                _, name = self.driver.cuGetErrorName(err)
                name = name.decode() if isinstance(name, bytes) else str(name)
            except Exception:  # noqa: BLE001 - the name is only for the message
                name = str(err)
            raise DeviceError(f"CUDA driver call {what} failed: {name}")
        return _unwrap(res)

    def function(self, program: str, kernel: str) -> Any:
        key = (program, kernel)
        fn = self.functions.get(key)
        if fn is None:
            with self:
                mod = self.modules.get(program)
                if mod is None:
                    cubin = compile_cubin(program, self.arch)
                    # pass the image by address (the documented cuda-bindings idiom for void*)
                    image = np.frombuffer(cubin, dtype=np.uint8).copy()
                    mod = self._check(self.driver.cuModuleLoadData(image.ctypes.data), f"cuModuleLoadData({program})")
                    self.modules[program] = mod
                fn = self._check(self.driver.cuModuleGetFunction(mod, kernel.encode()), f"cuModuleGetFunction({kernel})")
            self.functions[key] = fn
        return fn

    def __enter__(self) -> "_DeviceModules":
        self._check(self.driver.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.driver.cuCtxPopCurrent()

    def launch(self, program: str, kernel: str, grid: int, args: list[Any], block: int = _THREADS, smem: int = 0) -> None:
        """Launch ``kernel`` on torch's current stream of this device; ``args`` are ctypes values
        (structs or scalars) in the kernel's parameter order."""
        if grid <= 0:
            return
        if grid > 2**31 - 1:
            raise DeviceError(f"{kernel}: grid of {grid} blocks is too large")
        fn = self.function(program, kernel)
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = torch.cuda.current_stream(self.index).cuda_stream
        with self:
            self._check(
                self.driver.cuLaunchKernel(
                    fn, grid, 1, 1, block, 1, 1, smem, self.driver.CUstream(stream),
                    ctypes.addressof(ptrs), 0,
                ),
                f"cuLaunchKernel({kernel})",
            )


def _pick_arch(arch: int) -> int:
    """The device's arch if NVRTC can build a cubin for it, else the newest supported arch of
    the same major version at or below it (a cubin runs on later minors of its major)."""
    archs = supported_archs()
    if arch in archs:
        return arch
    same = [a for a in archs if a // 10 == arch // 10 and a <= arch]
    if same:
        return max(same)
    raise DeviceError(f"this NVRTC cannot compile for sm_{arch} (supports {archs}); update nvidia-cuda-nvrtc")


_DEVICES: dict[int, _DeviceModules] = {}
_LOCK = threading.Lock()


def device_modules(device: str | torch.device = "cuda") -> _DeviceModules:
    """The (cached) kernel loader of one device.

    Raises:
        DeviceError: no GPU, no bindings, or no driver; the message says what to do.
    """
    idx = _device_index(device)
    with _LOCK:
        mods = _DEVICES.get(idx)
        if mods is None:
            mods = _DEVICES[idx] = _DeviceModules(idx)
    return mods


# ---------------------------------------------------------------------------- helpers
def to_device(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Copy a numpy plane to the device (read-only planes are copied first: torch refuses to
    wrap them without a warning)."""
    if not a.flags.writeable or not a.flags.c_contiguous:
        a = np.array(a, copy=True, order="C")
    return torch.from_numpy(a).to(dev)


def _grid(n: int, threads: int = _THREADS) -> int:
    return (n + threads - 1) // threads


def _out_name(dtype: torch.dtype) -> str:
    try:
        return _OUT_NAMES[dtype]
    except KeyError:
        raise DeviceError(f"GPU decode does not produce {dtype}") from None


# ---------------------------------------------------------------------------- dispatch
class DecodePlan:
    """A tensor's decode prepared on a device: planes validated and uploaded, launches ready.

    Calling it (``plan()``) runs the kernels on torch's current stream and returns the output;
    ``plan(check=False)`` skips the stream-status checks (which synchronise), for timing or to
    check later: ``plan.verify()`` raises what ``plan()`` would have raised for the last run
    (``StreamError``, ``FormatError``...), once its kernels are done.
    """

    def __init__(self, run: Callable[[], torch.Tensor], verify: Callable[[], None] | None = None) -> None:
        self._run = run
        self._verify = verify

    def __call__(self, check: bool = True) -> torch.Tensor:
        out = self._run()
        if check:
            self.verify()
        return out

    def verify(self) -> None:
        """The status checks of the last ``plan(check=False)`` (synchronises; no-op for codecs
        whose kernels cannot fail)."""
        if self._verify is not None:
            self._verify()


class _Batch:
    def __init__(self, dev: torch.device, n_streams: int) -> None:
        self.dev = dev
        self.streams = [torch.cuda.Stream(device=dev) for _ in range(n_streams)] if dev.type == "cuda" else []
        self.next = 0
        self.pending: list[DecodePlan] = []


_BATCH = threading.local()


class batched_decode:
    """Context manager: inside it, :func:`decode_tensor_device` on ``device`` launches each tensor's
    kernels on the next of ``streams`` CUDA streams without waiting, and the stream-status checks
    of all of them run once on exit (after torch's current stream has waited for every stream).

    A tensor whose entropy stage has few streams (kvc: one per 64 rows and 2048 tokens) keeps few
    GPU threads busy, so a file's tensors decode concurrently this way instead of one after the
    other. The returned tensors are safe to use on the current stream after the block; an error of
    any tensor is raised on exit, naming the tensor. ``kvcodec.decode(..., device="cuda")`` uses it.

    Example:
        >>> import kvcodec, torch
        >>> blob = kvcodec.get_codec("fp16").encode(kvcodec.KVCache.from_tensors([(torch.ones(4, 1, 8),) * 2]))
        >>> try:
        ...     with batched_decode("cuda"):
        ...         out = kvcodec.decode(blob, device="cuda")
        ... except kvcodec.errors.DeviceError:   # no GPU here
        ...     out = kvcodec.decode(blob)
    """

    def __init__(self, device: str | torch.device = "cuda", streams: int = 16) -> None:
        self.device, self.n_streams = device, max(1, int(streams))
        self._outer = None

    def __enter__(self) -> "batched_decode":
        self._outer = getattr(_BATCH, "b", None)
        if self._outer is None:  # nested blocks share the outermost batch
            _BATCH.b = _Batch(_resolve_device(self.device), self.n_streams)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._outer is not None:
            return
        b, _BATCH.b = _BATCH.b, None
        if b.streams:  # whatever happens, nothing decoded is read before its stream is done
            cur = torch.cuda.current_stream(b.dev)
            for st in b.streams:
                cur.wait_stream(st)
        if exc_type is None:
            for plan in b.pending:
                plan.verify()


def _active_batch(dev: torch.device) -> _Batch | None:
    b = getattr(_BATCH, "b", None)
    return b if b is not None and b.dev == dev else None  # a batch for another device: decode now


def _batched_run(b: _Batch, make: Callable[[], DecodePlan]) -> torch.Tensor:
    """Prepare (uploads) and launch a tensor's decode on the batch's next stream, checks deferred."""
    if not b.streams:  # host runner (tests): no streams, the checks still deferred
        plan = make()
        b.pending.append(plan)
        return plan(check=False)
    st = b.streams[b.next % len(b.streams)]
    b.next += 1
    with torch.cuda.stream(st):  # uploads, scratch and kernels all ordered on st
        plan = make()
        out = plan(check=False)
    b.pending.append(plan)
    out.record_stream(torch.cuda.current_stream(b.dev))  # read there later: not reused before that
    return out


def sync_batch_streams() -> None:
    """Inside :class:`batched_decode`: make torch's current stream wait for every tensor decoded so
    far (before torch ops read them, e.g. concatenating a file's token chunks); else nothing."""
    b = getattr(_BATCH, "b", None)
    if b is not None and b.streams:
        cur = torch.cuda.current_stream(b.dev)
        for st in b.streams:
            cur.wait_stream(st)


GpuDecoder = Callable[["Codec", "EncodedTensor", "TensorContext", torch.device], DecodePlan]
_GPU_DECODERS: dict[str, GpuDecoder] = {}


def register_gpu_decoder(codec_id: str) -> Callable[[GpuDecoder], GpuDecoder]:
    """Decorator: register the GPU decode function of a codec id."""

    def deco(fn: GpuDecoder) -> GpuDecoder:
        _GPU_DECODERS[codec_id] = fn
        return fn

    return deco


def gpu_codec_ids() -> list[str]:
    """Codec ids that decode on the GPU."""
    return sorted(_GPU_DECODERS)


def decode_tensor_device(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", device: str | torch.device) -> torch.Tensor:
    """Decode one tensor on a CUDA device; the result equals ``codec.decode_tensor`` bit for bit.

    Args:
        codec: the file's codec.
        enc: its coded planes (numpy) and params.
        ctx: the tensor's context (shape, output dtype, globals).
        device: a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device``).

    Returns:
        A ``ctx.shape`` tensor of ``ctx.dtype`` on ``device``.

    Raises:
        DeviceError: no GPU, no bindings, or no GPU decoder for this codec (message has a hint).
        FormatError: the planes do not match the declared shape.
    """
    fn = _GPU_DECODERS.get(codec.codec_id)
    if fn is None:
        raise DeviceError(
            f"codec {codec.codec_id!r} has no GPU decoder (GPU codecs: {', '.join(gpu_codec_ids())}); "
            "decode it with device='cpu'"
        )
    dev = _resolve_device(device)
    b = _active_batch(dev)
    if b is None:
        return prepare_decode(codec, enc, ctx, dev)()
    return _batched_run(b, lambda: prepare_decode(codec, enc, ctx, dev))


def prepare_decode(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", device: str | torch.device) -> DecodePlan:
    """Validate and upload one tensor's planes; return the :class:`DecodePlan` that decodes it.

    Raises:
        DeviceError, FormatError: as :func:`decode_tensor_device`.
    """
    fn = _GPU_DECODERS.get(codec.codec_id)
    if fn is None:
        raise DeviceError(
            f"codec {codec.codec_id!r} has no GPU decoder (GPU codecs: {', '.join(gpu_codec_ids())}); "
            "decode it with device='cpu'"
        )
    return fn(codec, enc, ctx, _resolve_device(device))


def _resolve_device(device: str | torch.device) -> torch.device:
    """``torch.device("cuda", index)`` of a CUDA device spec (DeviceError for anything else).
    (The GPU tests' dry run replaces it to decode on the CPU through the host build.)"""
    return torch.device("cuda", _device_index(device))


# ---------------------------------------------------------------------------- kernel launches
# Each launch is described by a `Launch`: the program, kernel name, item count and the ctypes
# arguments. The same description runs on the GPU (`run_launch`) or, in the CPU tests, through
# the host build of the very same per-item code (cuda/host_harness.cpp).
class Launch:
    """One kernel launch: ``program``/``kernel``, ``items`` (one per thread) and ctypes ``args``."""

    def __init__(self, program: str, kernel: str, items: int, args: list[Any], keep: list[Any] | None = None,
                 block: int = _THREADS, smem: int = 0, grid: int | None = None) -> None:
        self.program, self.kernel, self.items, self.args = program, kernel, int(items), args
        self.keep = keep or []  # tensors whose memory the raw pointers refer to
        self.block, self.smem = block, smem
        self.grid = _grid(self.items, block) if grid is None else grid

    def __repr__(self) -> str:
        return f"Launch({self.kernel}, items={self.items}, grid={self.grid})"


def run_launch(mods: _DeviceModules, launch: Launch) -> None:
    """Launch on torch's current stream of the device of ``mods``."""
    mods.launch(launch.program, launch.kernel, launch.grid, launch.args, block=launch.block, smem=launch.smem)


class Fp8Params(ctypes.Structure):
    """Mirror of ``kvc::Fp8Params`` (cuda/dequant.cuh)."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("rows", ctypes.c_int64), ("s_t", ctypes.c_int64), ("s_h", ctypes.c_int64), ("s_d", ctypes.c_int64),
        ("heads", ctypes.c_int32), ("dim", ctypes.c_int32),
        ("t_blk", ctypes.c_int32), ("h_blk", ctypes.c_int32), ("d_blk", ctypes.c_int32),
        ("scale_const16", ctypes.c_int32),
    ]


class Nvfp4Params(ctypes.Structure):
    """Mirror of ``kvc::Nvfp4Params`` (cuda/dequant.cuh)."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("block_scale", ctypes.c_void_p), ("tensor_scale", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("rows", ctypes.c_int64), ("dim", ctypes.c_int32), ("dim_padded", ctypes.c_int32),
    ]


def scale_layout(scale_shape: tuple[int, ...], shape: tuple[int, int, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Strides and block sizes that map a ``[T, H, D]`` coordinate onto a scale plane.

    The scale plane is broadcast onto ``shape`` after left-padding its shape with ones; an axis
    of size ``S < N`` (``S > 1``) holds one scale per block of ``ceil(N / S)`` coordinates.
    Returns ``((s_t, s_h, s_d), (t_blk, h_blk, d_blk))`` in elements.

    Raises:
        FormatError: the scale plane does not fit the tensor.
    """
    sshape = (1,) * (3 - len(scale_shape)) + tuple(int(s) for s in scale_shape)
    if len(sshape) != 3:
        raise FormatError(f"scale plane of shape {list(scale_shape)} does not broadcast onto {list(shape)}")
    contiguous = (sshape[1] * sshape[2], sshape[2], 1)
    strides, blks = [], []
    for s, n, c in zip(sshape, shape, contiguous):
        if s == 1:
            strides.append(0)
            blks.append(1)
            continue
        blk = -(-n // s) if n else 1
        if s > n or -(-n // blk) != s:
            raise FormatError(f"scale plane of shape {list(scale_shape)} does not fit a tensor of shape {list(shape)}")
        strides.append(c)
        blks.append(blk)
    return (strides[0], strides[1], strides[2]), (blks[0], blks[1], blks[2])


def _check_size(shape: tuple[int, ...]) -> None:
    n = 1
    for s in shape:
        n *= int(s)
    if n > MAX_ELEMENTS:
        raise DeviceError(f"tensor of shape {list(shape)} has more than 2**31 - 1 elements; "
                          "the GPU kernels index 32-bit: split it, or decode with device='cpu'")


def fp8_launch(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fmt: str,
               d_block: int | None = None) -> Launch:
    """FP8 dequantization ``out = (f32(codes) * scale).to(out.dtype)``.

    Args:
        codes: uint8 ``[T, H, D]`` FP8 bit patterns (contiguous).
        scale: float32 plane broadcast onto ``[T, H, D]`` (see :func:`scale_layout`).
        out: ``[T, H, D]`` float32/float16/bfloat16 output (contiguous).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        d_block: block length along D when the scale has one value per block of ``d_block``
            channels (the last block may be shorter); by default ``ceil(D / scale.shape[-1])``.
    """
    t, h, d = out.shape
    _check_size(out.shape)
    (s_t, s_h, s_d), (t_blk, h_blk, d_blk) = scale_layout(tuple(scale.shape), (t, h, d))
    if d_block is not None and s_d:
        if -(-d // d_block) != scale.shape[-1]:
            raise FormatError(f"scale plane {list(scale.shape)} does not hold one value per {d_block} channels of {d}")
        d_blk = d_block
    const16 = int(d % 16 == 0 and (s_d == 0 or d_blk % 16 == 0))
    vec = d % 16 == 0 and codes.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
    p = Fp8Params(codes.data_ptr(), scale.data_ptr(), out.data_ptr(), t * h, s_t, s_h, s_d, h, d,
                  t_blk, h_blk, d_blk, const16)
    n = t * h * d // 16 if vec else t * h * d
    name = f"fp8_{fmt}_{_out_name(out.dtype)}" + ("_v16" if vec else "")
    return Launch("dequant.cu", name, n, [p, ctypes.c_int64(n)], keep=[codes, scale, out])


def nvfp4_launch(codes: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor, out: torch.Tensor) -> Launch:
    """NVFP4 dequantization ``out = ((e2m1 * block_scale) * tensor_scale).to(out.dtype)``.

    Args:
        codes: uint8 ``[T, H, Dp/2]`` (low nibble = even index).
        block_scale: uint8 E4M3 ``[T, H, Dp/16]``.
        tensor_scale: float32 ``[1]``.
        out: ``[T, H, D]`` output, ``D <= Dp``.
    """
    t, h, d = out.shape
    _check_size(codes.shape)
    dp = codes.shape[-1] * 2
    if dp % 16 or not (d <= dp < d + 16) or block_scale.numel() != t * h * (dp // 16) or codes.numel() != t * h * dp // 2:
        raise FormatError(f"NVFP4 planes ({list(codes.shape)}, {list(block_scale.shape)}) do not fit {list(out.shape)}")
    if tensor_scale.numel() != 1:
        raise FormatError("NVFP4 tensor_scale must hold one value")
    p = Nvfp4Params(codes.data_ptr(), block_scale.data_ptr(), tensor_scale.data_ptr(), out.data_ptr(), t * h, d, dp)
    n = t * h * (dp // 16)
    return Launch("dequant.cu", f"nvfp4_{_out_name(out.dtype)}", n, [p, ctypes.c_int64(n)],
                  keep=[codes, block_scale, tensor_scale, out])


def kernel_names(program: str) -> list[str]:
    """Every ``extern "C"`` kernel a program must define (the compile tests check them all)."""
    outs = ("f32", "f16", "bf16")
    if program == "dequant.cu":
        fp8 = [f"fp8_{f}_{o}{v}" for f in ("e4m3", "e5m2") for o in outs for v in ("", "_v16")]
        return fp8 + [f"nvfp4_{o}" for o in outs]
    if program == "intq.cu":
        return [f"intq_{o}" for o in outs] + [f"intq_b{b}_{o}_v16" for b in range(1, 9) for o in outs]
    if program == "ans.cu":
        base = ["ans_symbols"] + [f"ans_{k}_{o}" for k in ("kivi", "kivix", "toksym", "toksymx") for o in outs]
        return base + [b + "_smem" for b in base] + [b + "_blk" for b in base] + ["ans_tokens", "ans_tokens_blk"]
    if program == "kvc_codec.cu":
        return ["kvc_esc_count", "kvc_join"] + [f"kvc_dequant_{o}" for o in outs]
    raise DeviceError(f"unknown kernel program {program!r}")


class IntqParams(ctypes.Structure):
    """Mirror of ``kvc::IntqParams`` (cuda/intq.cuh)."""

    _fields_ = [
        ("packed", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("heads", ctypes.c_int32), ("dim", ctypes.c_int32), ("group", ctypes.c_int32),
        ("axis", ctypes.c_int32), ("bits", ctypes.c_int32), ("pad_", ctypes.c_int32),
    ]


def intq_launch(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor,
                bits: int, axis: str, group: int) -> Launch:
    """KIVI-style dequantization ``out = (f32(code) * f32(scale) + f32(zero)).to(out.dtype)``.

    Args:
        packed: uint8 LSB-first bit stream of the ``[Tq, H, D]`` codes.
        scale, zero: float16 planes (``[ceil(Tq/g), H, D]`` for axis ``"channel"``,
            ``[Tq, H, ceil(D/g)]`` for ``"token"``).
        out: ``[Tq, H, D]`` output (contiguous; may be the first ``Tq`` tokens of a larger tensor).
        bits, axis, group: the tensor's params.
    """
    tq, h, d = out.shape
    _check_size(out.shape)
    n = tq * h * d
    if packed.numel() != (n * bits + 7) // 8:
        raise FormatError(f"packed codes hold {packed.numel()} bytes; {n} codes of {bits} bits need {(n * bits + 7) // 8}")
    ps = (-(-tq // group), h, d) if axis == "channel" else (tq, h, -(-d // group))
    if scale.numel() != ps[0] * ps[1] * ps[2] or zero.numel() != scale.numel():
        raise FormatError(f"scale/zero planes do not have shape {list(ps)}")
    vec = d % 16 == 0 and packed.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0 and scale.data_ptr() % 16 == 0 \
        and zero.data_ptr() % 16 == 0
    p = IntqParams(packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), n, h, d, group,
                   0 if axis == "channel" else 1, bits, 0)
    items = n // 16 if vec else n
    name = f"intq_b{bits}_{_out_name(out.dtype)}_v16" if vec else f"intq_{_out_name(out.dtype)}"
    return Launch("intq.cu", name, items, [p, ctypes.c_int64(items)], keep=[packed, scale, zero, out])


# ---------------------------------------------------------------------------- codec decoders
def _where(ctx: "TensorContext") -> str:
    return f"layers.{ctx.layer}.{ctx.role}"


#: Tests install a runner that executes launches built from CPU tensors through the host build
#: of the kernel code (tests/_cuda_host.py), so every decoder below is checked without a GPU.
_HOST_RUNNER: Callable[[Launch], None] | None = None


def _decode_launch(dev: torch.device, launch: Launch) -> None:
    if dev.type == "cpu" and _HOST_RUNNER is not None:
        _HOST_RUNNER(launch)
        return
    run_launch(device_modules(dev), launch)


@register_gpu_decoder("raw")
def _gpu_raw(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    # bits only: the CPU decode is already a copy, so the GPU path is the upload itself
    t = codec.decode_tensor(enc, ctx).to(dev)
    return DecodePlan(t.clone)


@register_gpu_decoder("fp16")
def _gpu_fp16(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    a = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation
    h = to_device(a, dev).view(torch.float16).reshape(ctx.shape)
    # the cast fp16 -> source dtype is exact (fp32) or RNE (bf16) on both devices
    return DecodePlan(lambda: h.to(ctx.dtype, copy=True))


@register_gpu_decoder("fp8")
def _gpu_fp8(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> torch.Tensor:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.2)
    c = to_device(v.codes, dev)
    s = to_device(v.scale, dev)

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        if out.numel():
            _decode_launch(dev, fp8_launch(c, s, out, v.format, d_block=v.block if v.granularity == "block" else None))
        return out

    return DecodePlan(run)


@register_gpu_decoder("nvfp4")
def _gpu_nvfp4(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> torch.Tensor:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.3)
    c_dev = to_device(v.codes, dev)
    bs_dev = to_device(v.block_scale, dev)
    ts_dev = to_device(v.tensor_scale, dev)

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        if out.numel():
            _decode_launch(dev, nvfp4_launch(c_dev, bs_dev, ts_dev, out))
        return out

    return DecodePlan(run)


_BITS_VIEW = {torch.float32: np.int32, torch.float16: np.int16, torch.bfloat16: np.int16}
#: Largest finite value of each source dtype (the saturation bound of formats/SPEC.md §11.1).
_DTYPE_MAX = {dt: float(torch.finfo(dt).max) for dt in (torch.float16, torch.bfloat16, torch.float32)}


@register_gpu_decoder("kivi")
def _gpu_kivi(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> torch.Tensor:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.4)
    t, h, d = ctx.shape
    tq = t - v.recent
    n = tq * h * d
    if v.recent:
        r_dev = to_device(v.recent_bits, dev).view(ctx.dtype)
    pk = to_device(v.codes, dev)
    s_dev = to_device(v.scale.view(np.int16), dev)
    z_dev = to_device(v.zero.view(np.int16), dev)

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        if n:
            _decode_launch(dev, intq_launch(pk, s_dev, z_dev, out[:tq], v.bits, v.axis, v.group))
        if v.recent:
            out[tq:] = r_dev
        return out

    return DecodePlan(run)


# ---------------------------------------------------------------------------- ANS stages
ANS_THREADS = 128
#: Bits of the bucket index of the _blk kernels (256 entries per table).
BUCKET_BITS = 8
#: Shared memory a block may use without opting in; the _smem kernels need blockDim*(A+1)*4.
_SMEM_DEFAULT_LIMIT = 48 * 1024
SINK_SYMBOLS, SINK_KIVI, SINK_TOKSYM = 0, 1, 2
_ANS_STATUS = {1: "ends in a zero word", 2: "not consumed exactly (corrupt or wrong index)",
               3: "decodes to a code outside the quantizer's range"}


class AnsParams(ctypes.Structure):
    """Mirror of ``kvc::AnsParams`` (cuda/ans.cuh)."""

    _fields_ = [
        ("words", ctypes.c_void_p), ("offsets", ctypes.c_void_p), ("cdf", ctypes.c_void_p),
        ("table_of", ctypes.c_void_p), ("status", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("base", ctypes.c_void_p),
        *[(n, ctypes.c_int32) for n in ("R", "N", "C", "G", "A", "n_groups", "n_streams", "scope",
                                        "heads", "dim", "group", "axis", "mid", "max_code",
                                        "tmul", "tdiv", "tadd", "out_is_t", "base_group")],
        ("aux", ctypes.c_void_p),
        *[(n, ctypes.c_int32) for n in ("aux_mode", "code_off", "code_max", "blk_words", "cs", "half")],
        ("bucket", ctypes.c_void_p), ("bucket_bits", ctypes.c_int32), ("bucket_words", ctypes.c_int32),
        ("acc", ctypes.c_void_p), ("thr", ctypes.c_void_p), ("n_thr", ctypes.c_int32), ("center", ctypes.c_int32),
    ]


class DeviceStage:
    """An entropy stage (formats/ANS.md §3) validated on the host and uploaded to a device.

    Validation is :func:`kvcodec.entropy.stage.parse_planes`, the CPU decoder's own, so both
    devices accept and reject the same planes. Tables become cumulative frequencies at
    precision 24, each padded with ``2**24`` to ``cs = 2**LOG + 1`` entries (``2**LOG >= A``) for
    the kernels' fixed-step binary search (``cdf [n_sets * K, cs]``), and ``table_of [n_sets, R]``
    indexes them.
    """

    def __init__(self, planes: dict[str, np.ndarray], dev: torch.device, tables: np.ndarray | None = None,
                 row_table: np.ndarray | None = None) -> None:
        from .entropy.stage import parse_planes

        lay, words, off, tsets, rts = parse_planes(planes, tables, row_table)
        if lay.scope == 2 and min(lay.G, lay.R) * (lay.A // 2 + 1) >= 2**31:
            # the kernels keep §3.1's magnitude sums in int32 (a stream has at most min(G, R) rows)
            raise DeviceError("entropy stage scope 2 with magnitude sums beyond int32 (rows per stream "
                              f"{min(lay.G, lay.R)}, alphabet {lay.A}): decode this file with device='cpu'")
        self.layout = lay
        f = tsets.astype(np.uint64) << np.uint64(24 - lay.P)  # [n_sets, K, A] at precision 24
        log = max(1, (lay.A - 1).bit_length())  # 2**log >= A
        self.cs, self.half = (1 << log) + 1, 1 << (log - 1)
        cdf = np.full((lay.n_sets * lay.K, self.cs), 1 << 24, dtype=np.uint32)
        if cdf.size:
            cdf[:, 0] = 0
            cdf[:, 1:lay.A + 1] = np.cumsum(f.reshape(-1, lay.A), axis=1).astype(np.uint32)
        sets = np.arange(lay.n_sets, dtype=np.int64)[:, None] * lay.K
        # [n_sets, R]; scope 2: [Q, R], the table of each (class, row) in the one set
        table_of = (sets + np.asarray(rts, dtype=np.int64)).astype(np.int32)
        if lay.n_streams >= 2**31 or words.size >= 2**32:
            raise DeviceError("entropy stage too large for the GPU decoder")
        self.words = to_device(np.ascontiguousarray(words, dtype=np.uint32), dev)
        self.offsets = to_device(off.astype(np.uint32), dev)
        self.cdf = to_device(cdf, dev)
        self.table_of = to_device(np.ascontiguousarray(table_of), dev)
        self.status = torch.zeros(max(1, lay.n_streams), dtype=torch.int32, device=dev)
        self._cdf_host = cdf if lay.n_sets == 1 else None
        self.thr = to_device(np.array(lay.thresholds or (0,), dtype=np.int32), dev)
        self._dev = dev
        self._bucket: tuple[torch.Tensor, int] | None = None

    def bucket(self, bits: int) -> torch.Tensor:
        """The bucket index of table set 0: ``uint16 [K, 2**bits]``, entry ``b`` = the symbol whose
        interval holds ``b << (24 - bits)`` (formats/ANS.md allows any exact symbol search)."""
        if self._bucket is None or self._bucket[1] != bits:
            lay = self.layout
            cdf = self._cdf_host[: lay.K, : lay.A + 1].astype(np.int64)
            starts = np.arange(1 << bits, dtype=np.int64) << (24 - bits)
            b = np.stack([np.searchsorted(row, starts, side="right") - 1 for row in cdf]).astype(np.uint16)
            self._bucket = (to_device(np.ascontiguousarray(b), self._dev), bits)
        return self._bucket[0]

    def launch(self, sink: int, out: torch.Tensor, out_dtype: torch.dtype | None = None, *,
               scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, base: torch.Tensor | None = None,
               heads: int = 0, dim: int = 0, group: int = 1, axis: int = 0, mid: int = 0, max_code: int | None = None,
               tmul: int = 1, tdiv: int = 0, tadd: int = 0, out_is_t: int = 1, base_group: int = 1,
               aux: torch.Tensor | None = None, aux_mode: int = 0, code_off: int = 0, code_max: int = 0,
               tables: str | None = None, use_bucket: bool = True) -> Launch:
        """The launch that decodes every stream into ``out`` through ``sink``.

        ``tables`` forces where the kernel reads the tables (``"blk"``, ``"smem"``, ``"global"``);
        by default the block-shared copy when the stage has one table set that fits in 48 KB of
        shared memory, else per-thread copies when they fit, else global memory.
        """
        lay = self.layout
        if lay.scope == 2:
            raise DeviceError("a scope-2 stage (magnitude contexts) decodes through launch_tokens only")
        ptr = (lambda t: t.data_ptr() if t is not None else 0)
        blk_words = lay.K * self.cs
        bits = self._bucket_bits(blk_words)
        if tables is None:
            if lay.scope == 0 and blk_words * 4 <= _SMEM_DEFAULT_LIMIT:
                tables = "blk"
            elif ANS_THREADS * self.cs * 4 <= _SMEM_DEFAULT_LIMIT:
                tables = "smem"
            else:
                tables = "global"
        if tables == "blk" and (lay.scope != 0 or blk_words * 4 > _SMEM_DEFAULT_LIMIT):
            raise DeviceError("block-shared tables need one table set of at most 48 KB")
        if tables == "smem" and ANS_THREADS * self.cs * 4 > _SMEM_DEFAULT_LIMIT:
            raise DeviceError("per-thread tables need at most 48 KB of shared memory per block")
        if tables != "blk" or not use_bucket:
            bits = 0
        bkt = self.bucket(bits) if bits else None
        bucket_words = lay.K * (1 << bits) // 2 if bits else 0
        p = AnsParams(self.words.data_ptr(), self.offsets.data_ptr(), self.cdf.data_ptr(), self.table_of.data_ptr(),
                      self.status.data_ptr(), out.data_ptr(), ptr(scale), ptr(zero), ptr(base),
                      lay.R, lay.N, lay.C, lay.G, lay.A, lay.n_groups, lay.n_streams, lay.scope,
                      heads, dim, group, axis, mid, lay.A - 1 if max_code is None else max_code,
                      tmul, tdiv, tadd, out_is_t, base_group, ptr(aux), aux_mode, code_off, code_max, blk_words,
                      self.cs, self.half, ptr(bkt), bits, bucket_words, 0, self.thr.data_ptr(), 0, 0)
        smem = {"blk": (blk_words + bucket_words) * 4, "smem": ANS_THREADS * self.cs * 4, "global": 0}[tables]
        if sink == SINK_SYMBOLS:
            name = "ans_symbols"
        else:
            # the fast kernels take column j as token j with no anchors; the "x" ones any mapping
            general = (tmul, tdiv, tadd) != (1, 0, 0) or aux_mode != 0 or base is not None or not out_is_t
            kind = ("kivi" if sink == SINK_KIVI else "toksym") + ("x" if general else "")
            name = f"ans_{kind}_{_out_name(out_dtype or out.dtype)}"
        keep = [self.words, self.offsets, self.cdf, self.table_of, self.status, out, scale, zero, base, aux, bkt]
        return Launch("ans.cu", name + ("" if tables == "global" else "_" + tables), lay.n_streams, [p], keep=keep,
                      block=ANS_THREADS, smem=smem)

    def _bucket_bits(self, blk_words: int) -> int:
        """Bits of the _blk kernels' bucket index: ``2**bits`` entries per table (``bits <= P``:
        finer buckets than the table's own quantum would not help), as many as fit next to the
        tables in 48 KB; 0 for none."""
        lay = self.layout
        if lay.n_sets != 1 or lay.A > 65535:
            return 0
        for b in range(min(lay.P, BUCKET_BITS), 3, -1):
            if (blk_words + lay.K * (1 << b) // 2) * 4 <= _SMEM_DEFAULT_LIMIT:
                return b
        return 0

    def launch_tokens(self, out: torch.Tensor, *, tables: str | None = None, use_bucket: bool = True) -> Launch:
        """The launch that decodes every stream into token-major ``int32 out [N, R]`` (any scope,
        magnitude contexts included: the ``ans_tokens`` kernels).

        ``tables``: ``"blk"`` (one table set in shared memory; the default when it fits in
        48 KB) or ``"global"``.
        """
        lay = self.layout
        blk_words = lay.K * self.cs
        fits = lay.n_sets == 1 and blk_words * 4 <= _SMEM_DEFAULT_LIMIT
        if tables is None:
            tables = "blk" if fits else "global"
        if tables not in ("blk", "global") or (tables == "blk" and not fits):
            raise DeviceError("ans_tokens: tables 'blk' need one table set of at most 48 KB, else 'global'")
        if tuple(out.shape) != (lay.N, lay.R) or out.dtype != torch.int32 or not out.is_contiguous():
            raise DeviceError(f"ans_tokens: out must be a contiguous int32 [{lay.N}, {lay.R}] tensor")
        bits = self._bucket_bits(blk_words) if tables == "blk" and use_bucket else 0
        bkt = self.bucket(bits) if bits else None
        bucket_words = lay.K * (1 << bits) // 2 if bits else 0
        acc = None
        if lay.scope == 2:  # per (stream group, token): the magnitude sum of the rows decoded so far
            acc = torch.empty((lay.n_groups, max(1, lay.N)), dtype=torch.int32, device=out.device)
        p = AnsParams(self.words.data_ptr(), self.offsets.data_ptr(), self.cdf.data_ptr(), self.table_of.data_ptr(),
                      self.status.data_ptr(), out.data_ptr(), 0, 0, 0,
                      lay.R, lay.N, lay.C, lay.G, lay.A, lay.n_groups, lay.n_streams, lay.scope,
                      0, 0, 1, 0, 0, lay.A - 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, blk_words,
                      self.cs, self.half, 0 if bkt is None else bkt.data_ptr(), bits, bucket_words,
                      0 if acc is None else acc.data_ptr(), self.thr.data_ptr(), lay.Q - 1, lay.center)
        smem = (blk_words + bucket_words) * 4 if tables == "blk" else 0
        keep = [self.words, self.offsets, self.cdf, self.table_of, self.status, out, bkt, acc, self.thr]
        return Launch("ans.cu", "ans_tokens" + ("_blk" if tables == "blk" else ""), lay.n_streams, [p], keep=keep,
                      block=ANS_THREADS, smem=smem)

    def check(self, where: str) -> None:
        """Raise :class:`~kvcodec.errors.StreamError` if any stream failed (synchronises)."""
        from .errors import StreamError

        if self.layout.n_streams == 0:
            return
        st = self.status[: self.layout.n_streams]
        bad = torch.nonzero(st).flatten()
        if bad.numel():
            i = int(bad[0])
            code = int(st[i])
            raise StreamError(f"{where}: ANS stream {i} {_ANS_STATUS.get(code, f'failed ({code})')}")


def _run_stage(dev: torch.device, stage: DeviceStage, launch: Launch) -> None:
    if stage.layout.n_streams:
        _decode_launch(dev, launch)


@register_gpu_decoder("kivi-ans")
def _gpu_kivi_ans(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.5)
    where = _where(ctx)
    bits, group, axis, dl = v.bits, v.group, v.axis, v.delta
    t, h, d = ctx.shape
    c = h * d
    _check_size(ctx.shape)
    if dl:
        na = v.anc_expected[1]
        anc_st = DeviceStage(v.anc, dev)
        dif_st = DeviceStage(v.ans, dev)
    else:
        st = DeviceStage(v.ans, dev)
    s_dev = to_device(v.scale.view(np.int16).reshape(-1), dev)
    z_dev = to_device(v.zero.view(np.int16).reshape(-1), dev)
    ax = 0 if axis == "channel" else 1

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        kw = dict(scale=s_dev, zero=z_dev, heads=h, dim=d, group=group, axis=ax)
        if not dl:
            # one pass: ANS decode fused with the kivi dequantization, straight into [T, H, D]
            _run_stage(dev, st, st.launch(SINK_KIVI, out, **kw))
            return out
        # delta: the anchors' stage decodes and dequantizes tokens 0, dl, 2*dl, ... and keeps their
        # codes; the differences' stage adds each token's anchor code (range-checked) and
        # dequantizes the rest. Both fused, in stream order on the same CUDA stream.
        anc_codes = torch.empty((na, c), dtype=torch.uint8, device=dev)
        _run_stage(dev, anc_st, anc_st.launch(SINK_KIVI, out, tmul=dl, aux=anc_codes, aux_mode=1, **kw))
        if t - na:
            launch = dif_st.launch(SINK_KIVI, out, tmul=1, tdiv=dl - 1, tadd=1, base_group=dl, aux=anc_codes,
                                   aux_mode=2, code_off=(1 << bits) - 1, code_max=(1 << bits) - 1, **kw)
            _run_stage(dev, dif_st, launch)
        return out

    def verify() -> None:
        for stage in ([anc_st, dif_st] if dl else [st]):
            stage.check(where)

    return DecodePlan(run, verify)


@register_gpu_decoder("cachegen-lmcache")
def _gpu_cachegen_lmcache(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.7)
    where = _where(ctx)
    _check_size(ctx.shape)
    st = DeviceStage(v.ans, dev)
    s_dev = to_device(v.scale.view(np.int16), dev)
    levels = v.bins - 1

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        launch = st.launch(SINK_TOKSYM, out, scale=s_dev, mid=(levels - 1) // 2, max_code=v.bins - 2)
        _run_stage(dev, st, launch)
        return out

    return DecodePlan(run, lambda: st.check(where))


@register_gpu_decoder("cachegen")
def _gpu_cachegen(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.6)
    where = _where(ctx)
    rec, g, la = v.levels, v.group, v.anchor_levels
    t, h, d = ctx.shape
    c = h * d
    _check_size(ctx.shape)
    na = v.anc_expected[1]
    anc_st = DeviceStage(v.anc, dev)
    dl_st = DeviceStage(v.ans, dev)
    s_dev = to_device(v.scale.view(np.int16), dev)
    fmax = _DTYPE_MAX[ctx.dtype]

    def run() -> torch.Tensor:
        # anchors: fp32 values (code - Ma) * scale[j * g], kept for the deltas
        anc_hat = torch.empty((na, c), dtype=torch.float32, device=dev)
        _run_stage(dev, anc_st, anc_st.launch(SINK_TOKSYM, anc_hat, scale=s_dev, mid=(la - 1) // 2, tmul=g, out_is_t=0))
        out = torch.empty((t, c), dtype=ctx.dtype, device=dev)
        if na:
            # the same saturating RNE cast as the CPU decoders (formats/SPEC.md §11.1)
            out[0::g] = anc_hat.clamp(-fmax, fmax).to(ctx.dtype)
        if t - na:
            # delta column j is token j + j // (g-1) + 1; value = anchor + (code - M) * scale[t]
            launch = dl_st.launch(SINK_TOKSYM, out, out_dtype=ctx.dtype, scale=s_dev, base=anc_hat,
                                  mid=(rec - 1) // 2, tmul=1, tdiv=g - 1, tadd=1, out_is_t=1, base_group=g)
            _run_stage(dev, dl_st, launch)
        return out.reshape(ctx.shape)

    def verify() -> None:
        anc_st.check(where)
        dl_st.check(where)

    return DecodePlan(run, verify)


# ---------------------------------------------------------------------------- kvc
class KvcParams(ctypes.Structure):
    """Mirror of ``kvc::KvcParams`` (cuda/kvc_codec.cuh)."""

    _fields_ = [
        *[(n, ctypes.c_void_p) for n in ("codes", "esc", "esc_count", "esc_base", "pred", "step_ch", "sc", "step_tab",
                                        "mean", "recon", "tok", "out", "status")],
        *[(n, ctypes.c_int32) for n in ("n", "R", "H", "D", "L", "n_esc", "n_recon", "step_mode", "raw", "pad_")],
    ]


KVC_STEP_CHANNEL, KVC_STEP_KTOK, KVC_STEP_TOKEN = 0, 1, 2
_KVC_THREADS = 256


def fwht_torch(x: torch.Tensor) -> torch.Tensor:
    """:func:`kvcodec.transforms.hadamard.fwht` on a float32 tensor of any device: the same
    butterflies and the same final float32 multiply, so the same bits (each add, subtract and
    multiply is one IEEE rounding on either device)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = x.clone()
    h = 1
    while h < d:
        v = y.view(*lead, d // (2 * h), 2, h)
        a = v[..., 0, :].clone()
        b = v[..., 1, :]
        v[..., 0, :] = a + b
        v[..., 1, :] = a - b  # b still holds the odd halves: only the even ones were overwritten
        h *= 2
    return y * torch.tensor(np.float32(1.0 / np.sqrt(d)), device=y.device)


_STEP_TABLES: dict[torch.device, torch.Tensor] = {}


def _step_table(dev: torch.device) -> torch.Tensor:
    """The float32 step of every log-step code (kvcodec.quant.deadzone.step_from_code), on ``dev``."""
    from .quant.deadzone import STEP_CODE_MAX, STEP_CODE_MIN, step_from_code

    if dev not in _STEP_TABLES:
        tab = to_device(step_from_code(np.arange(STEP_CODE_MIN, STEP_CODE_MAX + 1)), dev)
        if dev.type == "cuda":  # shared by every stream from now on: the upload must be complete
            torch.cuda.synchronize(dev)
        _STEP_TABLES[dev] = tab
    return _STEP_TABLES[dev]


def _kvc_error(code: int, where: str, n_esc: int) -> Exception:
    from .quant.deadzone import STEP_CODE_MAX, STEP_CODE_MIN

    if code == 1:
        return FormatError(f"{where}: kvc: the escape symbols and the esc plane's {n_esc} values disagree in number")
    if code == 2:
        return FormatError(f"{where}: kvc: an escaped code lies inside the regular range")
    if code == 3:
        return DeviceError(f"{where}: kvc codes beyond 32 bits, which the GPU decoder does not hold; "
                           "decode this file with device='cpu'")
    return FormatError(f"{where}: kvc step code outside [{STEP_CODE_MIN}, {STEP_CODE_MAX}]")


@register_gpu_decoder("kvc")
def _gpu_kvc(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    """kvc on the GPU: the entropy stage (any scope, magnitude contexts included) to token-major
    symbols, escape join and token-delta sums per row, then dequantization straight into the
    ``[T, H, D]`` output (protected tokens copied as they are). Validation is the CPU decoder's
    own (:meth:`~kvcodec.codecs.kvc.KVCCodec.parse_tensor`)."""
    from .entropy.stage import StageLayout
    from .quant.deadzone import recon_values, step_from_code

    v = codec.parse_tensor(enc, ctx)
    t, h, d = ctx.shape
    _check_size(ctx.shape)
    where, n = v.where, v.n
    bits = _BITS_VIEW[ctx.dtype]
    ibits = {np.int16: torch.int16, np.int32: torch.int32}[bits]
    keep_idx = torch.from_numpy(np.flatnonzero(v.mask)).to(dev)
    prot = to_device(np.ascontiguousarray(v.prot, dtype=bits), dev)

    def protected() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        if keep_idx.numel():
            out.view(ibits)[keep_idx] = prot
        return out

    if n == 0:
        return DecodePlan(protected)
    lv, rows = v.lv, v.rows
    try:  # the geometry the CPU decoder checks before it allocates, then the stage's own checks
        if "meta" not in v.stage_planes:
            raise FormatError("ANS stage plane 'meta' is missing")
        lay = StageLayout(v.stage_planes["meta"])
        if (lay.R, lay.N, lay.A) != (rows, n, 2 * lv):
            raise FormatError(f"ANS stage is [{lay.R}, {lay.N}] over {lay.A} symbols, expected "
                              f"[{rows}, {n}] over {2 * lv}")
        stage = DeviceStage(v.stage_planes, dev)
    except FormatError as e:
        raise type(e)(f"{where}: kvc entropy stage: {e}") from None
    hd = h * d
    if v.per_channel and not v.k_tok:
        mode, sc = KVC_STEP_CHANNEL, np.zeros(1, np.int32)
        step_ch = step_from_code(v.sc_ch).reshape(-1)
    else:
        mode = KVC_STEP_KTOK if v.per_channel else KVC_STEP_TOKEN
        if v.per_channel:  # channel codes: already checked to lie in the step-code range
            sc = v.sc_ch.reshape(-1).astype(np.int32)
        else:
            if not all(-2**31 <= b < 2**31 for b in v.base):
                raise DeviceError(f"{where}: kvc step_base beyond 32 bits; decode this file with device='cpu'")
            sc = np.array(v.base, dtype=np.int32)
        step_ch = np.zeros(1, np.float32)
    m = len(v.rc) if v.rc else 0
    recon = recon_values(np.arange(-m, m + 1), v.rc) if m else np.zeros(1, np.float32)
    esc = v.esc.astype(np.int32).reshape(-1)
    n_esc = esc.size
    d_esc = to_device(esc if n_esc else np.zeros(1, np.int32), dev)
    d_pred = to_device(v.use.astype(np.uint8), dev) if v.use is not None else None
    d_step_ch = to_device(np.ascontiguousarray(step_ch, dtype=np.float32), dev)
    d_sc = to_device(sc, dev)
    d_tab = _step_table(dev)
    d_mean = to_device(np.ascontiguousarray(v.mean.reshape(-1), dtype=np.float32), dev)
    d_recon = to_device(np.ascontiguousarray(recon, dtype=np.float32), dev)
    free = np.flatnonzero(~v.mask)
    d_tok = to_device(free.astype(np.int32), dev)
    d_free = torch.from_numpy(free).to(dev)
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    raw = v.tr == "hadamard"
    lim = float(torch.finfo(ctx.dtype).max)

    def params(codes, counts, base, out) -> KvcParams:
        ptr = (lambda x: 0 if x is None else x.data_ptr())
        return KvcParams(codes.data_ptr(), d_esc.data_ptr(), ptr(counts), ptr(base), ptr(d_pred), d_step_ch.data_ptr(),
                         d_sc.data_ptr(), d_tab.data_ptr(), d_mean.data_ptr(), d_recon.data_ptr() if m else 0,
                         d_tok.data_ptr(), ptr(out), status.data_ptr(), n, rows, h, d, lv, n_esc, m, mode,
                         1 if raw else 0, 0)

    def run() -> torch.Tensor:
        out = protected()
        codes = torch.empty((n, rows), dtype=torch.int32, device=dev)
        _run_stage(dev, stage, stage.launch_tokens(codes))
        status.zero_()
        counts = torch.empty(rows, dtype=torch.int32, device=dev)
        keep = [codes, counts, d_esc, d_pred, status, d_step_ch, d_sc, d_tab, d_mean, d_recon, d_tok]

        def launch(kernel: str, items: int, p: KvcParams, *more: torch.Tensor) -> None:
            _decode_launch(dev, Launch("kvc_codec.cu", kernel, items, [p, ctypes.c_int64(items)],
                                       keep=keep + list(more), block=_KVC_THREADS))

        launch("kvc_esc_count", rows, params(codes, counts, None, None))
        base = torch.cumsum(counts, 0, dtype=torch.int32) - counts  # row r's first escape
        launch("kvc_join", rows, params(codes, counts, base, None), base)
        dst = torch.empty((n, h, d), dtype=torch.float32, device=dev) if raw else out
        launch("kvc_dequant_" + _out_name(torch.float32 if raw else ctx.dtype), n * hd,
               params(codes, None, None, dst), dst)
        if raw:  # Hadamard files: the reference's inverse transform, mean, saturation and cast
            xh = torch.clamp(fwht_torch(dst) + d_mean.view(1, h, d), -lim, lim)
            out[d_free] = xh.to(ctx.dtype)
        return out

    def verify() -> None:
        try:
            stage.check(where)
        except FormatError as e:
            raise type(e)(f"{where}: kvc entropy stage: {str(e).removeprefix(where + ': ')}") from None
        code = int(status[0])
        if code:
            raise _kvc_error(code, where, n_esc)

    return DecodePlan(run, verify)
