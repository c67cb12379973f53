"""Decode one KVC file on every path kvcodec has and report each path's outcome, so tests and the
differential fuzzer (eval/fuzz_diff.py) can require that the paths agree.

Paths: ``native`` (the C coder), ``fallback`` (``KVCODEC_NATIVE=0``: numpy/constriction),
``verify`` (:meth:`KVCReader.verify`, native), ``gpu-host`` (``device="cuda"`` through the host
build of the kernel code, tests/_cuda_host.py; only where a C++ compiler is present) and
``min-reader`` (formats/kvc_min_reader.py: container acceptance only). An outcome is
``("ok", sha256 of the decoded tensors' bits)``, ``("reject", error class)``, ``("crash", text)``
for any exception that is not a :class:`~kvcodec.errors.KVCodecError`, or ``("warn", text)`` when
a warning was emitted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

import kvcodec
from kvcodec import gpu, native
from kvcodec.errors import DeviceError, KVCodecError
from kvcodec.testing import load_file_module as _load

ROOT = Path(__file__).resolve().parents[1]


min_reader = _load("kvc_min_reader", ROOT / "formats" / "kvc_min_reader.py")
cuda_host = _load("_cuda_host", ROOT / "tests" / "_cuda_host.py")


@contextlib.contextmanager
def native_mode(mode: str):
    """``KVCODEC_NATIVE`` set to ``mode`` for the block (read on every call)."""
    old = os.environ.get("KVCODEC_NATIVE")
    os.environ["KVCODEC_NATIVE"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVCODEC_NATIVE", None)
        else:
            os.environ["KVCODEC_NATIVE"] = old


_HARNESS: dict[str, Any] = {}


def host_harness() -> Any:
    """The host build of the kernel code, built once per process; None without a C++ compiler."""
    if "lib" not in _HARNESS:
        _HARNESS["lib"] = cuda_host.build_harness(Path(tempfile.mkdtemp(prefix="kvc-harness-")))
    return _HARNESS["lib"]


@contextlib.contextmanager
def host_device(lib: Any):
    """``device="cuda"`` decodes on the CPU through the host build (the GPU tests' dry run)."""
    hooks = gpu.device  # the test hooks live there; the package does not re-export them
    old_runner, old_resolve = hooks._HOST_RUNNER, hooks._resolve_device
    hooks._HOST_RUNNER = lambda launch: cuda_host.run_on_host(lib, launch)
    hooks._resolve_device = lambda device: torch.device("cpu")
    try:
        yield
    finally:
        hooks._HOST_RUNNER, hooks._resolve_device = old_runner, old_resolve


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """Run ``fn`` and classify what happened (see the module docstring)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = fn()
        except KVCodecError as e:
            out = ("reject", type(e).__name__)
        except Exception as e:  # noqa: BLE001 - anything else is a finding
            out = ("crash", f"{type(e).__name__}: {str(e)[:200]}")
        else:
            out = ("ok", res)
    if caught:
        return ("warn", f"{caught[0].category.__name__}: {str(caught[0].message)[:200]}")
    return out


def _digest(cache: kvcodec.KVCache) -> str:
    """SHA-256 over every decoded tensor's dtype, shape and bits, in layer and role order."""
    h = hashlib.sha256()
    for layer in cache.layers:
        for role in sorted(layer):
            t = layer[role].contiguous()
            h.update(f"{role}{t.dtype}{list(t.shape)}".encode())
            h.update(t.view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2
                            else torch.int32).numpy().tobytes())
    return h.hexdigest()


def _verify(blob: bytes) -> str:
    opener = getattr(kvcodec, "open", None) or kvcodec.format.open  # kvcodec.open after the api move
    with opener(blob) as r:
        r.verify()
    return "verified"


def _min_read(blob: bytes) -> str:
    try:
        min_reader.read(blob)
    except min_reader.Reject as e:
        raise _MinReject(e.category) from None
    return "accepted"


class _MinReject(KVCodecError):
    """The minimal reader rejected the file (its category in the message)."""


def decode_paths(blob: bytes, gpu_host: bool = True) -> dict[str, tuple[str, str]]:
    """Outcome of every path on ``blob`` (see the module docstring)."""
    res: dict[str, tuple[str, str]] = {}
    if native.available():
        res["native"] = outcome(lambda: _digest(kvcodec.decode(blob)))
        res["verify"] = outcome(lambda: _verify(blob))
    with native_mode("0"):
        res["fallback"] = outcome(lambda: _digest(kvcodec.decode(blob)))
        if "verify" not in res:
            res["verify"] = outcome(lambda: _verify(blob))
    lib = host_harness() if gpu_host else None
    if lib is not None:
        with host_device(lib):
            o = outcome(lambda: _digest(kvcodec.decode(blob, device="cuda")))
        # DeviceError: a documented limit of the GPU decoder (it names device='cpu'), not a verdict
        if o != ("reject", DeviceError.__name__):
            res["gpu-host"] = o
    res["min-reader"] = outcome(lambda: _min_read(blob))
    return res


def disagreement(res: dict[str, tuple[str, str]]) -> str | None:
    """Why the outcomes of :func:`decode_paths` disagree, or None when they agree: every decoding
    path accepts with the same bits or rejects (any error class), verify agrees with decode, the
    minimal reader rejects nothing kvcodec accepts, and nothing crashes or warns."""
    for k, (kind, what) in res.items():
        if kind in ("crash", "warn"):
            return f"{k}: {kind} {what}"
    dec = {k: v for k, v in res.items() if k in ("native", "fallback", "gpu-host")}
    kinds = {v[0] for v in dec.values()}
    if len(kinds) > 1:
        return "accept/reject differ: " + ", ".join(f"{k}={v[0]}({v[1][:12]})" for k, v in dec.items())
    if kinds == {"ok"} and len({v[1] for v in dec.values()}) > 1:
        return "decoded bits differ: " + ", ".join(f"{k}={v[1][:12]}" for k, v in dec.items())
    if (res["verify"][0] == "ok") != (kinds == {"ok"}):
        return f"verify {res['verify'][0]} but decode {sorted(kinds)}"
    if res["min-reader"][0] == "reject" and kinds == {"ok"}:
        return f"min-reader rejects ({res['min-reader'][1]}) what kvcodec decodes"
    return None
