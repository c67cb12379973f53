"""Kernel sources and their build: NVRTC compiles each program of ``cuda/`` straight to a cubin.

* :func:`cuda_source_dir` finds the sources: ``kvcodec/_cuda`` inside an installed wheel first,
  then the source checkout's top-level ``cuda/`` folder;
* :func:`compile_cubin` compiles one program with NVRTC (``cuda.bindings``, the ``[cuda]`` extra)
  for one architecture and caches the cubin on disk, keyed (:func:`cubin_cache_key`) by the
  sources' hash, the architecture, the compile options and the NVRTC version;
* :func:`kernel_names` lists the kernels each program must define.

Nothing here needs a GPU (CI compiles every program); loading and launching is
:mod:`kvcodec.gpu.device`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import DeviceError

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


# ---------------------------------------------------------------------------- sources
def cuda_source_dir() -> Path:
    """The folder holding the kernel sources.

    An installed wheel carries them as ``kvcodec/_cuda`` (pyproject force-include); a source
    checkout has them in the top-level ``cuda/`` folder. The packaged copy wins.

    Raises:
        DeviceError: neither folder holds the kernel sources.
    """
    here = Path(__file__).resolve().parent.parent  # the kvcodec package folder
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
