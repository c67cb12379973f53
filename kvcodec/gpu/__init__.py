"""GPU decoding: CUDA kernels from ``cuda/`` compiled at run time with NVRTC and launched on
torch's current stream.

The kernels are plain CUDA C++ (no torch headers). The package has one module per job:

* :mod:`~kvcodec.gpu.nvrtc` finds the kernel sources (``kvcodec/_cuda`` in a wheel, else the
  checkout's ``cuda/``), compiles each program with NVRTC (``cuda.bindings``, the ``[cuda]``
  extra) straight to a cubin for the device's architecture, and caches the cubin on disk;
* :mod:`~kvcodec.gpu.device` loads the cubins into torch's primary context and launches kernels
  on ``torch.cuda.current_stream().cuda_stream`` with raw pointers of torch tensors (and holds
  the test hooks: patch them there);
* :mod:`~kvcodec.gpu.batch` prepares a tensor's decode (:class:`DecodePlan`) and spreads a file's
  tensors over CUDA streams (:class:`batched_decode`);
* :mod:`~kvcodec.gpu.registry` maps codec ids to GPU decoders and implements
  :func:`decode_tensor_device`, which :mod:`kvcodec.decoding` calls for ``device != "cpu"``;
* :mod:`~kvcodec.gpu.stage` is the entropy (ANS) stage on a device, shared by the ANS codecs;
* :mod:`~kvcodec.gpu.decoders` holds one decoder per codec family, each consuming the object its
  codec's ``parse_tensor`` returns, the same one the CPU decoder uses.

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

from . import decoders  # noqa: F401 - registers every GPU decoder
from .batch import DecodePlan, batched_decode, sync_batch_streams
from .decoders.fp8 import Fp8Params, fp8_launch, scale_layout
from .decoders.kivi import IntqParams, intq_launch
from .decoders.kvc import KVC_STEP_CHANNEL, KVC_STEP_KTOK, KVC_STEP_TOKEN, KvcParams, fwht_torch
from .decoders.nvfp4 import Nvfp4Params, nvfp4_launch
from .device import MAX_ELEMENTS, Launch, device_modules, run_launch, to_device
from .nvrtc import (NVRTC_OPTIONS, PROGRAMS, compile_cubin, cubin_cache_key, cuda_source_dir, kernel_names,
                    nvrtc_version, supported_archs)
from .registry import GpuDecoder, decode_tensor_device, gpu_codec_ids, prepare_decode, register_gpu_decoder
from .stage import ANS_THREADS, BUCKET_BITS, SINK_KIVI, SINK_SYMBOLS, SINK_TOKSYM, AnsParams, DeviceStage

# private names the tests read through the package (they are read, never patched: safe to re-export)
from .batch import _active_batch  # noqa: E402,F401
from .registry import _GPU_DECODERS  # noqa: E402,F401

__all__ = [
    "ANS_THREADS", "BUCKET_BITS", "KVC_STEP_CHANNEL", "KVC_STEP_KTOK", "KVC_STEP_TOKEN", "MAX_ELEMENTS",
    "NVRTC_OPTIONS", "PROGRAMS", "SINK_KIVI", "SINK_SYMBOLS", "SINK_TOKSYM",
    "AnsParams", "DecodePlan", "DeviceStage", "Fp8Params", "GpuDecoder", "IntqParams", "KvcParams", "Launch",
    "Nvfp4Params", "batched_decode", "compile_cubin", "cubin_cache_key", "cuda_source_dir", "decode_tensor_device",
    "device_modules", "fp8_launch", "fwht_torch", "gpu_codec_ids", "intq_launch", "kernel_names", "nvfp4_launch",
    "nvrtc_version", "prepare_decode", "register_gpu_decoder", "run_launch", "scale_layout", "supported_archs",
    "sync_batch_streams", "to_device",
]

#: Test hooks that moved to :mod:`kvcodec.gpu.device`. They are not re-exported here: a copy on the
#: package would take a patch silently and change nothing, since the code reads them there.
_HOOKS = ("_HOST_RUNNER", "_resolve_device")


def __getattr__(name: str):
    if name in _HOOKS:
        raise AttributeError(f"kvcodec.gpu.{name} moved: read or patch kvcodec.gpu.device.{name}")
    raise AttributeError(f"module 'kvcodec.gpu' has no attribute {name!r}")
