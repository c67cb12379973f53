"""Named edge cases shared by unit, kernel and format tests (our "bitwise contract" table).

Everything here is deterministic and small. Import it from any test::

    from kvcodec.testing import SHAPES, SOURCE_DTYPES, value_cases, rounding_ties

Contents:

* :data:`SPECIAL_VALUES` — zero, -0, NaN, +-inf (the last three must be rejected by encoders).
* :data:`FORMAT_EDGES` — per number format (``e4m3``, ``e5m2``, ``e2m1``): min/max subnormal,
  min normal, max, the overflow midpoint (saturates to max), values beyond max, and the code each
  must encode to.
* :data:`SOURCE_DTYPES`, :data:`SOURCE_SUBNORMAL`, :data:`SOURCE_MAX` — fp16/bf16/fp32 sources.
* :data:`SHAPES` — ``[T, H, D]`` shapes: T=0, T=1, odd head_dim, non-powers of two, D=1,
  MLA latent (D=40), MQA, head_dim 256, D=17 (one element past a 16-block).
* :func:`rounding_ties` — every midpoint between consecutive codes with the RNE code it must get.
* :func:`value_cases` — finite ``[T, H, D]`` tensors by name: all-zero, all -0, one non-zero,
  constant, source subnormals, source max (saturation), tiny, outlier channel, mixed magnitudes.

Example:
    >>> from kvcodec.testing import FORMAT_EDGES, rounding_ties
    >>> FORMAT_EDGES["e4m3"]["max"]
    (448.0, 126)
    >>> ties, codes = rounding_ties("e2m1")
    >>> ties[:3].tolist(), codes[:3].tolist()
    ([0.25, 0.75, 1.25], [0, 2, 2])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .quant.fp8 import F4E2M1, F8E4M3, F8E5M2, MinifloatFormat, all_codes_values

#: Values every encoder must treat specially: the finite ones keep their sign, the rest raise.
SPECIAL_VALUES: dict[str, float] = {
    "zero": 0.0,
    "neg_zero": -0.0,
    "nan": math.nan,
    "pos_inf": math.inf,
    "neg_inf": -math.inf,
}
#: Names in :data:`SPECIAL_VALUES` that encoders must reject with ``InputError``.
NONFINITE = ("nan", "pos_inf", "neg_inf")

FORMATS: dict[str, MinifloatFormat] = {"e4m3": F8E4M3, "e5m2": F8E5M2, "e2m1": F4E2M1}

#: ``name -> (value, magnitude code)`` per format; the value is an unscaled input to the encoder.
FORMAT_EDGES: dict[str, dict[str, tuple[float, int]]] = {
    "e4m3": {
        "half_min_subnormal": (2.0**-10, 0x00),  # tie between 0 and 2^-9: to even (0)
        "min_subnormal": (2.0**-9, 0x01),
        "max_subnormal": (7 * 2.0**-9, 0x07),
        "min_normal": (2.0**-6, 0x08),
        "one": (1.0, 0x38),
        "max": (448.0, 0x7E),
        "overflow_midpoint": (464.0, 0x7E),  # would round to 512 without saturation
        "overflow": (1.0e4, 0x7E),
    },
    "e5m2": {
        "half_min_subnormal": (2.0**-17, 0x00),
        "min_subnormal": (2.0**-16, 0x01),
        "max_subnormal": (3 * 2.0**-16, 0x03),
        "min_normal": (2.0**-14, 0x04),
        "one": (1.0, 0x3C),
        "max": (57344.0, 0x7B),
        "overflow_midpoint": (61440.0, 0x7B),  # would round to inf without saturation
        "overflow": (1.0e6, 0x7B),
    },
    "e2m1": {
        "half_min_subnormal": (0.25, 0x0),
        "min_subnormal": (0.5, 0x1),
        "max_subnormal": (0.5, 0x1),
        "min_normal": (1.0, 0x2),
        "one": (1.0, 0x2),
        "max": (6.0, 0x7),
        "overflow_midpoint": (7.0, 0x7),
        "overflow": (100.0, 0x7),
    },
}

SOURCE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
#: Smallest positive subnormal of each source dtype.
SOURCE_SUBNORMAL: dict[torch.dtype, float] = {
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
    torch.float32: 2.0**-149,
}
#: Largest finite value of each source dtype.
SOURCE_MAX: dict[torch.dtype, float] = {d: float(torch.finfo(d).max) for d in SOURCE_DTYPES}

#: ``name -> [T, H, D]``: the geometries every codec and kernel must handle.
SHAPES: dict[str, tuple[int, int, int]] = {
    "T0": (0, 2, 16),
    "T1": (1, 2, 16),
    "odd_head_dim": (5, 3, 7),
    "non_pow2": (37, 3, 40),
    "D1": (4, 1, 1),
    "D17": (3, 2, 17),
    "mla_latent": (9, 1, 40),
    "mqa": (6, 1, 64),
    "head_dim_256": (3, 1, 256),
}


def rounding_ties(fmt: str | MinifloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Every midpoint between consecutive finite codes of ``fmt``, both signs.

    Returns:
        ``(ties, codes)``: float32 midpoints (exact in float32) and the uint8 code each must
        encode to under round-to-nearest-even: of the two neighbours, the one with an even code.
        Positive ties come first, in increasing order, then their negatives.
    """
    f = FORMATS[fmt] if isinstance(fmt, str) else fmt
    vals = all_codes_values(f)[: f.sign_bit]
    n = int(torch.isfinite(vals).sum())  # finite codes are 0..n-1 (NaN/inf sit at the top)
    lo, hi = vals[: n - 1].double(), vals[1:n].double()
    ties = ((lo + hi) / 2).float()
    assert torch.equal(ties.double(), (lo + hi) / 2), "tie not exact in float32"
    c = torch.arange(n - 1)
    codes = torch.where(c % 2 == 0, c, c + 1).to(torch.uint8)
    return torch.cat([ties, -ties]), torch.cat([codes, codes | f.sign_bit])


def value_cases(
    dtype: torch.dtype = torch.float32, shape: tuple[int, int, int] = (5, 3, 40), seed: int = 0
) -> dict[str, torch.Tensor]:
    """Finite ``[T, H, D]`` test tensors by name, in ``dtype``.

    Cases: ``all_zero``, ``all_neg_zero``, ``one_nonzero``, ``constant``, ``source_subnormal``
    (random signs times the dtype's smallest subnormal), ``source_max`` (+-the dtype's max:
    saturation; codecs with fp16 side information may reject it for bf16/fp32), ``tiny``
    (values near 1e-30, or the fp16 subnormal range), ``outlier_channel`` (one channel 100x),
    ``mixed_magnitudes`` (log-uniform over 8 decades, random signs), ``random_normal``.
    """
    g = torch.Generator().manual_seed(seed)
    t, h, d = shape
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    one = torch.zeros(shape)
    if one.numel():
        one.view(-1)[one.numel() // 2] = 1.0
    tiny = 1e-30 if dtype != torch.float16 else 1e-6
    normal = torch.randn(shape, generator=g)
    outlier = normal.clone()
    if d:
        outlier[:, :, d // 2] *= 100
    mags = torch.pow(10.0, torch.rand(shape, generator=g) * 8 - 4)
    cases = {
        "all_zero": torch.zeros(shape),
        "all_neg_zero": torch.full(shape, -0.0),
        "one_nonzero": one,
        "constant": torch.full(shape, 3.5),
        "source_subnormal": sign * SOURCE_SUBNORMAL[dtype],
        "source_max": sign * SOURCE_MAX[dtype],
        "tiny": normal * tiny,
        "outlier_channel": outlier,
        "mixed_magnitudes": sign * mags,
        "random_normal": normal,
    }
    out = {}
    for k, v in cases.items():
        x = v.to(dtype)
        assert bool(torch.isfinite(x).all()), k
        out[k] = x
    return out




def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors have the same dtype, shape and bits (so -0 != 0 and NaNs compare by bits).

    Example:
        >>> bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
        False
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        iv = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(iv), b.contiguous().view(iv))
    return torch.equal(a, b)


__all__ = [
    "FORMATS",
    "FORMAT_EDGES",
    "NONFINITE",
    "SHAPES",
    "SOURCE_DTYPES",
    "SOURCE_MAX",
    "SOURCE_SUBNORMAL",
    "SPECIAL_VALUES",
    "bits_equal",
    "rounding_ties",
    "value_cases",
]


def spelled_out(name_or_config: Any) -> Any:
    """The codec of a preset name or config with every setting spelled out under its codec id.

    It writes the same bitstream as the preset but carries none of the preset's requirements: the
    kvc ``-cal`` presets refuse to encode without a calibration file (their quality promise needs
    one), while tests that only check bitstreams code their steps on random caches without one.

    Example:
        >>> spelled_out("kvc-near-cal").get_config()["id"]
        'kvc'
    """
    from .codec import get_codec

    return get_codec(get_codec(name_or_config).get_config())


def load_file_module(name: str, path: Any) -> Any:
    """The module in the Python file ``path`` (a script or helper outside the package: eval/,
    tests/, formats/kvc_min_reader.py), loaded once under ``name`` and kept in ``sys.modules``, so
    every test and script that asks shares one module object. No ``sys.path`` change.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "helper.py")
        >>> from pathlib import Path
        >>> _ = Path(path).write_text("ANSWER = 42")
        >>> m = load_file_module("kvcodec_doc_helper", path)
        >>> m.ANSWER, load_file_module("kvcodec_doc_helper", "ignored: already loaded") is m
        (42, True)
    """
    import importlib.util
    import sys

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
