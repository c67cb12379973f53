"""Native CPU coder: kvcodec's hot loops in C, called through :mod:`ctypes`.

The C sources ship inside the package and are compiled on first use with the system C compiler
(:mod:`.build`: compiler discovery, the cache, ``KVCODEC_NATIVE``) — no build step at install
time, no Python headers, no extra dependency. Every function is bit-identical to the reference it
names (tests/test_native.py), so the native path is purely a speed-up: without a compiler kvcodec
runs the references (constriction, numpy, torch) with the same results.

Rooms:
    build     compile, cache, load; :func:`lib`, :func:`available`, :func:`status`
    abi       ABI version, status codes and the one signature table of every ``kvn_*`` function
    convert   float16 widened to float32 (F16C where the CPU has it)
    ans       ANS stage encode/decode, symbol histograms (plain and per magnitude context)
    tables    the stage's table clustering (member sums)
    intq      KIVI quantize/dequantize
    deadzone  dead-zone quantization and reconstruction sums
    tokens    CacheGen's per-token quantization and row-affine dequantization
    rope      kvc's rotating means (turned and unturned channel means)
    attention kvc's attention estimate (the mean of each query row's softmax)
    xpred     kvc's prediction across layers (the affine pass) and the encoder's closed loop
              around it (residual, decoded plus prediction)
    kvc       kvc's escape split/join, dequantization and token-delta statistics, and
              ``kvc_decode``: a whole kvc tensor in one call (stage, join, steps, rotating
              means, dequantization; csrc/kvc_decode.c), which holds no Python lock

One failure rule for every wrapper: it returns its result or raises. Bad data raises kvcodec's
own error, of the class and with the message the reference raises (a corrupt stream, a code past
its levels). :class:`Unsupported` (not a :class:`~kvcodec.errors.KVCodecError`) means the C path
does not take these operands or the library is unavailable: the caller catches it and runs the
reference. No wrapper returns None or False to mean "fall back".

``KVCODEC_NATIVE`` controls it: ``auto`` (default: use it when it builds), ``0`` (never),
``1`` (require it: :func:`lib` raises :class:`~kvcodec.errors.DependencyError` if it cannot build).

Example:
    >>> from kvcodec import native
    >>> native.status()["mode"] in ("auto", "0", "1")
    True
"""

from __future__ import annotations

from .abi import ABI_VERSION, F_BF16, F_F16, F_F32, OUT_I32_RN, OUT_U8_NR, OUT_U16_NR, float_kind
from .ans import ctx_histograms, decode_stage, encode_stage, histograms, symbol_view
from .build import CFLAGS, Unsupported, available, lib, status
from .deadzone import deadzone_quantize, deadzone_recon, recon_sums
from .intq import intq_dequantize, intq_quantize
from .kvc import (
    delta_histograms,
    escape_join_tokens,
    escape_split_ctx_tokens,
    escape_split_tokens,
    kvc_decode,
    kvc_dequantize,
)
from .tokens import rows_affine, token_quantize

__all__ = ["ABI_VERSION", "CFLAGS", "F_BF16", "F_F16", "F_F32", "OUT_I32_RN", "OUT_U16_NR", "OUT_U8_NR",
           "available", "ctx_histograms", "deadzone_quantize", "deadzone_recon", "decode_stage", "delta_histograms",
           "encode_stage", "escape_join_tokens", "escape_split_ctx_tokens", "escape_split_tokens", "float_kind",
           "histograms", "intq_dequantize", "intq_quantize", "kvc_decode", "kvc_dequantize", "lib",
           "recon_sums", "rows_affine", "status", "symbol_view", "token_quantize", "Unsupported"]
