"""Build, cache and load the native C library (kvcodec/native/csrc/: one unit per stage).

On first use the C units are compiled together with the system C compiler (``$CC``, else
``cc``/``gcc``/``clang``) into a shared library cached under ``$KVCODEC_CACHE_DIR/native``
(default ``~/.cache/kvcodec/native``), keyed by every source, the compiler's version, the flags
and the platform, and loaded with :mod:`ctypes`; :func:`kvcodec.native.abi.apply` then sets the
functions' signatures. ``KVCODEC_NATIVE`` chooses the mode: ``auto`` (default: use it when it
builds), ``0`` (never), ``1`` (require it: :func:`lib` raises
:class:`~kvcodec.errors.DependencyError` if it cannot build).

Example:
    >>> from kvcodec.native import build
    >>> build.status()["mode"] in ("auto", "0", "1")
    True
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..errors import DependencyError
from . import abi

#: The C units compiled into the one library, and the headers they include (all in the key).
CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.c"))
HEADERS = sorted(CSRC.glob("*.h"))
#: Flags: no contraction of multiply-adds (bit-exact float code), position independent.
CFLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing"]

_lock = threading.Lock()
_state: dict[str, Any] = {"lib": None, "error": None, "tried": False, "path": None}


class Unsupported(Exception):
    """The native path does not take these operands, or the library is unavailable: the caller
    runs the reference implementation instead. Deliberately not a
    :class:`~kvcodec.errors.KVCodecError`: it is no user's error and never leaves kvcodec."""


#: CPython's own mapping behind os.environ (bytes keys on POSIX), read directly: the mode is read
#: on every native call (~600 an encode) and os.environ.get costs ~1 us; None elsewhere
_ENV_DATA = getattr(os.environ, "_data", None)
try:
    _ENV_KEY = os.environ.encodekey("KVCODEC_NATIVE")  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - not CPython's os._Environ
    _ENV_DATA = _ENV_KEY = None
_MODES: dict = {}  # raw value -> mode


def _mode() -> str:
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else None
    got = _MODES.get(raw) if _ENV_DATA is not None else None
    if got is not None:
        return got
    m = os.environ.get("KVCODEC_NATIVE", "auto").strip().lower()
    m = m if m in ("0", "1") else "auto"
    if _ENV_DATA is not None and len(_MODES) < 16:
        _MODES[raw] = m
    return m


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc.split()[0]):
        return cc.split()[0]
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _cache_root() -> Path:
    base = os.environ.get("KVCODEC_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "kvcodec"


def _source_key(ver: str) -> str:
    """Hash of every source and header (name and bytes), the compiler's version, the flags and
    the platform: the cached library's name."""
    h = hashlib.sha256()
    for p in [*SOURCES, *HEADERS]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update("\0".join([ver, *CFLAGS, platform.machine(), platform.system()]).encode())
    return h.hexdigest()[:20]


def _out_dir(name: str) -> Path:
    out_dir = _cache_root() / "native"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / name
        if not os.access(out_dir, os.W_OK) and not probe.exists():
            raise OSError("not writable")
    except OSError:
        out_dir = Path(tempfile.gettempdir()) / f"kvcodec-native-{os.getuid() if hasattr(os, 'getuid') else 0}"
        out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise DependencyError("no C compiler found (cc, gcc or clang; or set $CC)")
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise DependencyError(f"C compiler {cc!r} does not run: {e}") from None
    name = f"kvc_cpu-{_source_key(ver)}{'.dll' if os.name == 'nt' else '.so'}"
    out_dir = _out_dir(name)
    so = out_dir / name
    if not so.exists():
        # compile to a private name, then rename: concurrent builders never see a partial file
        fd, tmp = tempfile.mkstemp(prefix=".kvc_cpu-", suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            res = subprocess.run([cc, *CFLAGS, *(str(s) for s in SOURCES), "-o", tmp, "-lm"], capture_output=True,
                                 text=True, timeout=300)
            if res.returncode != 0:
                units = ", ".join(s.name for s in SOURCES)
                raise DependencyError(f"compiling {units} with {cc} failed: {res.stderr.strip()[:500]}")
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    if lib.kvn_abi_version() != abi.ABI_VERSION:
        raise DependencyError(f"{so} has ABI {lib.kvn_abi_version()}, expected {abi.ABI_VERSION}")
    abi.apply(lib)
    _state["path"] = str(so)
    return lib


def lib() -> ctypes.CDLL | None:
    """The loaded native library, or ``None`` when disabled or unavailable (``auto`` mode).

    Raises:
        DependencyError: ``KVCODEC_NATIVE=1`` and the library cannot be built.
    """
    mode = _mode()
    if mode == "0":
        return None
    if not _state["tried"]:  # (set only once the build is over: later calls skip the lock)
        with _lock:
            if not _state["tried"]:
                try:
                    _state["lib"] = _build()
                except (DependencyError, OSError) as e:
                    _state["error"] = str(e)
                _state["tried"] = True
    if _state["lib"] is None and mode == "1":
        raise DependencyError(f"KVCODEC_NATIVE=1 but the native CPU coder is unavailable: {_state['error']}")
    return _state["lib"]


def required() -> ctypes.CDLL:
    """The library, for the wrappers.

    Raises:
        Unsupported: the library is disabled or unavailable (``auto`` or ``0`` mode).
        DependencyError: ``KVCODEC_NATIVE=1`` and the library cannot be built.
    """
    lb = lib()
    if lb is None:
        raise Unsupported(f"native CPU coder unavailable: {_state['error'] or 'KVCODEC_NATIVE=0'}")
    return lb


def available() -> bool:
    """True when the native coder is enabled and builds on this machine."""
    try:
        return lib() is not None
    except DependencyError:
        return False


def status() -> dict[str, Any]:
    """``{"mode", "available", "path", "error"}``: what the native coder is doing and why."""
    ok = available()
    return {"mode": _mode(), "available": ok, "path": _state["path"], "error": None if ok else _state["error"]}
