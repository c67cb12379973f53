"""Devices and launches: the loaded kernels of each CUDA device, uploads, and one kernel launch.

* :func:`device_modules` retains torch's primary context of a device, loads the cubins that
  :mod:`kvcodec.gpu.nvrtc` builds and caches the kernel handles;
* :class:`Launch` describes one launch (program, kernel, items, ctypes arguments);
  :func:`run_launch` runs it on torch's current stream with raw pointers of torch tensors;
* :func:`to_device`, the grid and size checks and the dtype tables the decoders share.

Test hooks live here and only here: the CPU tests and the GPU tests' dry run (tests/_cuda_host.py,
``KVCODEC_GPU_DRYRUN=1``) patch ``kvcodec.gpu.device._HOST_RUNNER``, ``_resolve_device``,
``run_launch`` and ``device_modules`` on this module; every caller in the package reads them from
here at call time, so a patch reaches all of them (patching the names the package re-exports
would not).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

import numpy as np
import torch

from ..errors import DeviceError
from .nvrtc import _HINT, _bindings, _unwrap, compile_cubin, supported_archs

_OUT_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_THREADS = 256
#: The kernels index a tensor with 32-bit arithmetic (64-bit division is a slow called routine).
MAX_ELEMENTS = 2**31 - 1


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


_BITS_VIEW = {torch.float32: np.int32, torch.float16: np.int16, torch.bfloat16: np.int16}
#: Largest finite value of each source dtype (the saturation bound of formats/SPEC.md §11.1).
_DTYPE_MAX = {dt: float(torch.finfo(dt).max) for dt in (torch.float16, torch.bfloat16, torch.float32)}


def _check_size(shape: tuple[int, ...]) -> None:
    n = 1
    for s in shape:
        n *= int(s)
    if n > MAX_ELEMENTS:
        raise DeviceError(f"tensor of shape {list(shape)} has more than 2**31 - 1 elements; "
                          "the GPU kernels index 32-bit: split it, or decode with device='cpu'")


# ---------------------------------------------------------------------------- device choice
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


#: Tests install a runner that executes launches built from CPU tensors through the host build
#: of the kernel code (tests/_cuda_host.py), so every decoder of :mod:`kvcodec.gpu.decoders` is
#: checked without a GPU.
_HOST_RUNNER: Callable[[Launch], None] | None = None


def _decode_launch(dev: torch.device, launch: Launch) -> None:
    """Run a decoder's launch: through the host runner for CPU tensors when tests installed one,
    else on the GPU (the hooks are read from this module at call time)."""
    if dev.type == "cpu" and _HOST_RUNNER is not None:
        _HOST_RUNNER(launch)
        return
    run_launch(device_modules(dev), launch)
