"""Host build of the kernels' per-item device code (cuda/host_harness.cpp), for CPU tests.

The kernels are thin loops over ``__host__ __device__`` functions; compiling those same functions
with g++ lets the CPU tests check the exact code the GPU runs against the CPU reference decoders.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from kvcodec import gpu

#: Codec configs every GPU decoder is checked with (host build and device), odd sizes included.
GPU_CODEC_CONFIGS = [
    {"id": "fp8", "format": "e4m3"}, {"id": "fp8", "format": "e5m2", "k_granularity": "channel"},
    {"id": "fp8", "k_granularity": "block", "block": 16}, {"id": "fp8", "k_granularity": "block", "block": 24},
    {"id": "fp8", "k_granularity": "token"}, {"id": "fp8", "k_granularity": "tensor"},
    {"id": "nvfp4"},
    {"id": "kivi", "bits": 4}, {"id": "kivi", "bits": 2, "group": 16}, {"id": "kivi", "bits": 3, "group": 5},
    {"id": "kivi", "bits": 8, "residual": 4}, {"id": "kivi", "bits": 1, "group": 64}, {"id": "kivi", "bits": 5},
    {"id": "kivi-ans", "bits": 4}, {"id": "kivi-ans", "bits": 2, "chunk": 8, "group": 5},
    {"id": "kivi-ans", "bits": 4, "delta": 8, "chunk": 16}, {"id": "kivi-ans", "bits": 3, "tables": "cluster", "n_tables": 3},
    {"id": "cachegen-lmcache", "chunk": 8}, {"id": "cachegen"}, {"id": "cachegen", "group": 1},
    {"id": "cachegen", "group": 4, "chunk": 5, "anchor_levels": 31},
    # kvc: the -cal presets (magnitude contexts, k_tok step rows, reconstruction offsets; coded
    # without a calibration file here), plain kvc (scope 0, token-mode V), Hadamard, per-head V
    # steps with centring and forced deltas, and small streams/chunks with contexts
    {"id": "kvc-near-cal"}, {"id": "kvc-aggressive-cal"}, {"id": "kvc"}, {"id": "kvc", "transform": "hadamard"},
    {"id": "kvc", "v_scale": "head", "v_center": True, "delta": 2, "max_level": 4},
    # (contexts are coded only on tensors with a recency ramp: kvc's encoder rule)
    {"id": "kvc", "ctx": [4, 12, 20], "rows_per_stream": 5, "chunk": 7, "k_recon": 3, "delta": 2, "recent": 2,
     "recent_ramp": 16, "recent_fine": 4.0},
]

_OUT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def build_harness(tmpdir: Path) -> ctypes.CDLL | None:
    """Compile cuda/host_harness.cpp into a shared library; None without a C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None
    src = gpu.cuda_source_dir() / "host_harness.cpp"
    so = tmpdir / "kvc_harness.so"
    # $KVCODEC_HARNESS_CFLAGS adds flags, e.g. "-fsanitize=address,undefined" (with the sanitizer
    # runtime preloaded: see cuda/README.md) to check the kernel code's memory accesses
    extra = os.environ.get("KVCODEC_HARNESS_CFLAGS", "").split()
    cmd = [cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", "-Werror", *extra,
           "-shared", "-fPIC", str(src), "-o", str(so)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise AssertionError(f"host harness failed to compile:\n{' '.join(cmd)}\n{res.stderr}")
    lib = ctypes.CDLL(str(so))
    for name in ("kvc_fp8_host", "kvc_nvfp4_host", "kvc_intq_host", "kvc_ans_host", "kvc_convert_host",
                 "kvc_ans_tokens_host", "kvc_kvc_host"):
        getattr(lib, name).restype = None
    lib.kvc_sizeof.restype = ctypes.c_int64
    lib.kvc_sizeof.argtypes = [ctypes.c_int]
    return lib


def run_on_host(lib: ctypes.CDLL, launch: gpu.Launch) -> None:
    """Run a kernel launch description (built from CPU tensors) through the host build."""
    k = launch.kernel
    p = ctypes.byref(launch.args[0])
    n = ctypes.c_int64(launch.items)
    if k.startswith("fp8_"):
        _, fmt, out, *vec = k.split("_")
        lib.kvc_fp8_host(p, ctypes.c_int(0 if fmt == "e4m3" else 1), ctypes.c_int(["f32", "f16", "bf16"].index(out)),
                         ctypes.c_int(1 if vec else 0), n)
    elif k.startswith("nvfp4_"):
        lib.kvc_nvfp4_host(p, ctypes.c_int(["f32", "f16", "bf16"].index(k.split("_")[1])), n)
    elif k in ("ans_tokens", "ans_tokens_blk"):
        lib.kvc_ans_tokens_host(p, ctypes.c_int(1 if k.endswith("_blk") else 0))
    elif k.startswith("kvc_"):
        which = 0 if k == "kvc_esc_count" else 1 if k == "kvc_join" else 2
        out = ["f32", "f16", "bf16"].index(k.split("_")[-1]) if which == 2 else 0
        lib.kvc_kvc_host(p, ctypes.c_int(which), ctypes.c_int(out), n)
    elif k.startswith("ans_"):
        parts = k.split("_")
        sink = {"symbols": 0, "kivi": 1, "kivix": 1, "toksym": 2, "toksymx": 2}[parts[1]]
        gen = 1 if parts[1].endswith("x") or sink == 0 else 0
        out = ["f32", "f16", "bf16"].index(parts[2]) if sink else 0
        mode = 1 if k.endswith("_smem") else 2 if k.endswith("_blk") else 0
        lib.kvc_ans_host(p, ctypes.c_int(sink), ctypes.c_int(out), ctypes.c_int(mode), ctypes.c_int(gen))
    elif k.startswith("intq_"):
        out = [o for o in ("f32", "f16", "bf16") if f"_{o}" in k][0]
        lib.kvc_intq_host(p, ctypes.c_int(["f32", "f16", "bf16"].index(out)), ctypes.c_int(1 if k.endswith("_v16") else 0), n)
    else:
        raise AssertionError(f"no host runner for kernel {k}")


def convert(lib: ctypes.CDLL, which: int, values: np.ndarray) -> np.ndarray:
    """Run one of the element conversions of kvc_common.cuh over uint32 inputs."""
    a = np.ascontiguousarray(values, dtype=np.uint32)
    out = np.empty_like(a)
    lib.kvc_convert_host(ctypes.c_int(which), a.ctypes.data_as(ctypes.c_void_p),
                         out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(a.size))
    return out
