"""The contract between kvcodec's Python and its C library (kvcodec/native/csrc/).

One table, :data:`SIGNATURES`, holds every exported ``kvn_*`` function's argument and return
types; :func:`apply` sets them on a loaded library in one loop. A signature change in C means a
change here and a bump of :data:`ABI_VERSION` on both sides (csrc/kvn_common.h): the loader
refuses a library of another version. The enums below mirror csrc/kvn_common.h.

Example:
    >>> from kvcodec.native import abi
    >>> "kvn_ans_decode" in abi.SIGNATURES
    True
"""

from __future__ import annotations

import ctypes

import numpy as np

#: Version of the C library's ABI (``kvn_abi_version()``; KVN_ABI_VERSION in csrc/kvn_common.h).
ABI_VERSION = 39

# status codes (KVN_* in kvn_common.h)
OK, ZERO_WORD, NOT_CONSUMED, NOMEM, BAD_SYMBOL, OVERFLOW = range(6)
# symbol matrix kinds: int32 [R, N]; uint16 / uint8 [N, R] (token-major)
OUT_I32_RN, OUT_U16_NR, OUT_U8_NR = 0, 1, 2
# float element kinds: float32, float16 bits, bfloat16 bits
F_F32, F_F16, F_BF16 = 0, 1, 2
# integer code element kinds
C_I64, C_I32 = 0, 1

_p, _i = ctypes.c_void_p, ctypes.c_int
_i32, _i64, _f32, _f64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_double

#: ``name -> (argtypes, restype)`` of every function the library exports, grouped by C unit.
SIGNATURES: dict[str, tuple[list, type | None]] = {
    # abi.c
    "kvn_abi_version": ([], _i),
    # attention.c
    "kvn_softmax_mean": ([_p, _i64, _i64, _i64, _p, _p, _i], _i),
    # ans_decode.c
    "kvn_ans_decode": ([_p, _p, _p, _p, _p, _p, _i, _p], _i),
    # ans_encode.c
    "kvn_ans_encode": ([_p, _p, _p, _p, _i, _i64, _i64, _p, _i64, _p, _p], _i),
    "kvn_hist": ([_p, _i, _i64, _i64, _i64, _i64, _i64, _i64, _p], _i),
    "kvn_ctx_hist": ([_p, _i, _i64, _i64, _i64, _i64, _i64, _i64, _p, _i64, _i64, _p, _p], _i),
    # convert.c
    "kvn_convert": ([_i, _i, _p, _p, _i64], None),
    "kvn_set_hw_f16": ([_i], _i),
    # quant.c
    "kvn_intq_dequant": ([_p, _i64, _i64, _i64, _i, _i64, _p, _p, _f32, _i, _p], _i),
    "kvn_intq_quant": ([_p, _i, _i64, _i64, _i64, _i, _i64, _i, _p, _p, _p], _i),
    "kvn_tok_quant": ([_p, _i, _i64, _i64, _p, _p, _p, _i32, _p, _p], _i),
    "kvn_rows_affine": ([_p, _i, _i64, _i64, _p, _p, _i32, _i32, _p, _p, _i, _p], _i),
    # deadzone.c
    "kvn_deadzone": ([_p, _i64, _i64, _i64, _p, _i, _i64, _i64, _i64, _f64, _p, _i, _i64], _i),
    "kvn_recon_sums": ([_p, _i64, _i64, _i64, _p, _i, _i64, _i64, _i64, _p, _i64, _i64, _p, _p], _i),
    "kvn_deadzone_recon": ([_p, _i64, _i64, _i64, _p, _i, _i64, _i64, _i64, _f64, _p, _i, _i64, _i64, _p, _p],
                           _i),
    # kvc.c
    "kvn_escape_split": ([_p, _i64, _i64, _i64, _p, _p, _p, _p, _p, _p], _i),
    "kvn_kvc_vector": ([_i], _i),
    "kvn_escape_split1": ([_p, _i, _i64, _i64, _i64, _p, _p, _p, _p, _p, _i64, _p, _p], _i),
    "kvn_escape_split_ctx": ([_p, _i, _i64, _i64, _i64, _p, _p, _p, _p, _p, _i64, _p, _p, _i64, _i64, _p, _p,
                              _p, _i64], _i),
    "kvn_escape_join": ([_p, _i64, _i64, _i64, _p, _i64, _p, _p, _i], _i),
    "kvn_kvc_dequant": ([_p, _i, _i64, _i64, _i64, _i64, _p, _i64, _i64, _i64, _p, _i64, _f32, _i, _p, _p, _i64], _i),
    "kvn_delta_hist": ([_p, _i, _i64, _i64, _i64, _p, _p], None),
    # kvc_decode.c
    "kvn_kvc_decode": ([_p, _p, _p, _p, _p, _p, _i64, _i64, _p, _i64, _i64, _i64, _i, _p, _p, _i64, _i64, _p, _i64,
                        _p, _p, _i64, _i64, _i, _p, _p, _i64, _f32, _i, _p, _p], _i),
    "kvn_kvc_decode_batch": ([_i64, _i64, _p, _p], _i64),
    # rope.c
    "kvn_rotated_means": ([_p, _i64, _i64, _i64, _p, _p, _i64, _i64, _i, _p, _i64, _p], None),
    "kvn_unrotated_mean": ([_p, _i, _i64, _i64, _i64, _p, _p, _i64, _i64, _i, _p, _i64, _p], None),
    "kvn_rope_centre": ([_p, _p, _i64, _i64, _i64, _p, _p, _i64, _i64, _i, _p, _i64, _p, _p], None),
    # tables.c
    "kvn_cluster_iterate": ([_p, _i64, _i64, _i64, _i, _p, _p, _p, _p, _p], _i),
    "kvn_cluster_tables": ([_p, _i64, _i64, _i64, _i, _i, _p, _p], _i),
    # xpred.c
    "kvn_xpred_affine": ([_p, _i64, _i64, _p, _p, _i64, _p, _i], _i),
    "kvn_xpred_pass": ([_i64, _i64, _i64, _p, _p, _p, _p, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _p, _p, _p, _p, _p,
                        _p, _p, _i64, _i, _i], _i),
    "kvn_xpred_residual": ([_p, _i, _p, _i64, _p, _p], _i),
    "kvn_xpred_sum": ([_p, _i, _p, _i64, _p], None),
}


def apply(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set every function's argtypes and restype from :data:`SIGNATURES`; returns ``lib``.

    Raises:
        AttributeError: the library lacks one of the functions (a stale or foreign build).
    """
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


_char_at = ctypes.c_char.from_buffer
_address = ctypes.addressof


def ptr(a: np.ndarray) -> int:
    """The address of a numpy array's first element, as the C functions take it.

    Read through the buffer protocol where the array lends a writable C-contiguous buffer (1 us
    against ``a.ctypes.data``'s 3: an encode of Qwen2.5-Coder-0.5B makes ~2,900 of these calls,
    each holding the GIL); else (read-only, strided or empty arrays) ``a.ctypes.data``. Both give
    the same address."""
    try:
        return _address(_char_at(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


#: addresses of the arrays callers pass on every call (module constants, tables kept per layer),
#: each with its array: a remembered address stays valid while its entry stands, as the entry
#: keeps the array alive (so its id cannot be reused). All forgotten at once past _KEPT_MAX
#: arrays or _KEPT_BYTES bytes (a clear is one atomic step for the threads that share it).
_KEPT: dict[int, tuple[np.ndarray, int]] = {}
_KEPT_MAX = 256
_KEPT_BYTES = 16 << 20
_kept_bytes = [0]  # bytes the entries hold (approximate under threads: it only bounds memory)


def kept_ptr(a: np.ndarray) -> int:
    """:func:`ptr` of an array a caller passes on many calls, remembered (a read-only array's
    :func:`ptr` takes the slow path, 3 us; a hit is one dict lookup). Only for arrays that live
    on: the memo keeps each one alive until it is cleared."""
    hit = _KEPT.get(id(a))
    if hit is not None and hit[0] is a:
        return hit[1]
    p = ptr(a)
    if len(_KEPT) >= _KEPT_MAX or _kept_bytes[0] + a.nbytes > _KEPT_BYTES:
        _KEPT.clear()
        _kept_bytes[0] = 0
    _KEPT[id(a)] = (a, p)
    _kept_bytes[0] += a.nbytes
    return p


def float_kind(dtype) -> int:
    """The C element kind (:data:`F_F32`, :data:`F_F16`, :data:`F_BF16`) of a torch float dtype."""
    import torch

    return {torch.float32: F_F32, torch.float16: F_F16, torch.bfloat16: F_BF16}[dtype]


def code_kind(codes: np.ndarray) -> int:
    """The C element kind of an int32 (:data:`C_I32`) or int64 (:data:`C_I64`) code array."""
    return C_I32 if codes.dtype == np.int32 else C_I64
