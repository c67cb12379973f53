"""The query-statistics file the ``kvc`` encoder calibrates with, as a value.

A calibration file (``kvcodec calibrate``; recorded by :mod:`kvcodec.harness.calibration`) holds,
per layer, the mean squared query per K channel, a sample of late queries and optionally Fisher
sensitivities (the layout is documented in :mod:`kvcodec.harness.calibration`). This module is the
file format and the encoder-side arithmetic on it (query re-rotation, attention estimates); it
runs no model. :class:`Calibration` is what reaches the encoder: the statistics, read once, and the
SHA-256 of exactly the bytes they were read from.

Example:
    >>> import numpy as np, os, tempfile
    >>> st = QueryStats([np.ones((1, 4), np.float32)], [np.ones((2, 3, 4), np.float32)], q_position=9)
    >>> p = os.path.join(tempfile.mkdtemp(), "q.safetensors")
    >>> save_query_statistics(st, p)
    >>> cal = Calibration.load(p)
    >>> cal.stats.num_layers, len(cal.sha256)
    (1, 64)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...errors import FormatError, InputError
from ...format import safetensors_io as sio

QSTATS_FORMAT = "kvcodec.qstats/3"
#: /1: no sensitivities; /2: no profile (``profile`` metadata, kvcodec.codecs.kvc.profile)
QSTATS_FORMATS = ("kvcodec.qstats/1", "kvcodec.qstats/2", QSTATS_FORMAT)


@dataclass
class QueryStats:
    """Per-layer query statistics (see the module docstring).

    Attributes:
        q_energy: per layer ``[Hkv, D]`` float32 (None for layers without K, e.g. MLA latents).
        q_sample: per layer ``[Hq, N, D]`` float32 queries times the attention scaling.
        q_position: RoPE position of the first sampled query (the others follow it).
        rope_theta: RoPE base when the default RoPE was applied (queries can be re-rotated), else 0.
        meta: free-form identity strings.
        k_sens, v_sens: per layer ``[Hkv, D]`` float32 sensitivities (see the module docstring),
            or None (not measured, or a layer without K/V).
        profile: the closed-loop profile (a JSON object, :mod:`kvcodec.codecs.kvc.profile`) that
            maps quality targets to this model's steps, or None (a statistics-only file).
    """

    q_energy: list[np.ndarray | None]
    q_sample: list[np.ndarray | None]
    q_position: int
    rope_theta: float = 0.0
    meta: dict[str, str] = field(default_factory=dict)
    k_sens: list[np.ndarray | None] | None = None
    v_sens: list[np.ndarray | None] | None = None
    profile: dict | None = None

    def sensitivity(self, role: str) -> list[np.ndarray | None]:
        """``k_sens`` or ``v_sens`` as a list with one entry per layer (None where missing)."""
        got = self.k_sens if role == "k" else self.v_sens
        return list(got) if got is not None else [None] * self.num_layers

    @property
    def num_layers(self) -> int:
        return len(self.q_energy)


def save_query_statistics(stats: QueryStats, path: str | os.PathLike[str]) -> None:
    """Write :class:`QueryStats` as a safetensors file (atomically)."""
    from safetensors.numpy import save_file

    tensors = {}
    for i, (e, s) in enumerate(zip(stats.q_energy, stats.q_sample)):
        if e is not None:
            tensors[f"layers.{i}.q_energy"] = np.ascontiguousarray(e, dtype=np.float32)
        if s is not None:
            tensors[f"layers.{i}.q_sample"] = np.ascontiguousarray(s, dtype=np.float32)
    for role in ("k", "v"):
        for i, a in enumerate(stats.sensitivity(role)):
            if a is not None:
                tensors[f"layers.{i}.{role}_sens"] = np.ascontiguousarray(a, dtype=np.float32)
    meta = {"format": QSTATS_FORMAT, "num_layers": str(stats.num_layers),
            "q_position": str(stats.q_position), "rope_theta": repr(float(stats.rope_theta)),
            "identity": json.dumps(stats.meta, sort_keys=True)}
    if stats.profile is not None:
        meta["profile"] = json.dumps(stats.profile, sort_keys=True)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_query_statistics(path: str | os.PathLike[str]) -> QueryStats:
    """Read a file written by :func:`save_query_statistics`.

    Raises:
        InputError: the file cannot be read.
        FormatError: it is not a ``kvcodec.qstats`` file or its tensors are malformed.
    """
    return Calibration.load(path).stats


def parse_query_statistics(data: bytes, name: str) -> QueryStats:
    """Parse the bytes of a query-statistics file (``name`` is used in error messages).

    Raises:
        FormatError: not a ``kvcodec.qstats`` file, or its tensors are malformed.
    """
    from safetensors.numpy import load

    try:
        # the header through the container's generic reader (safetensors' numpy loader drops
        # __metadata__), then the tensors through safetensors
        meta = sio.read_raw_header(sio.as_source(bytes(data))).metadata
        tensors = load(bytes(data))
    except Exception as e:  # noqa: BLE001 - ours (FormatError) or safetensors' own types
        raise FormatError(f"{name}: not a safetensors file ({e})") from None
    if meta.get("format") not in QSTATS_FORMATS:
        raise FormatError(f"{name}: not a {QSTATS_FORMAT} file")
    try:
        n = int(meta["num_layers"])
        pos = int(meta["q_position"])
        theta = float(meta["rope_theta"])
        ident = json.loads(meta.get("identity", "{}"))
        profile = json.loads(meta["profile"]) if "profile" in meta else None
    except (KeyError, ValueError) as e:
        raise FormatError(f"{name}: bad metadata ({e})") from None
    if profile is not None and not isinstance(profile, dict):
        raise FormatError(f"{name}: profile metadata must be a JSON object")
    if not 0 < n <= 100000 or pos < 0 or not theta >= 0:
        raise FormatError(f"{name}: bad metadata {meta!r}")
    energy: list[np.ndarray | None] = [None] * n
    sample: list[np.ndarray | None] = [None] * n
    sens: dict[str, list[np.ndarray | None]] = {"k": [None] * n, "v": [None] * n}
    for k, v in tensors.items():
        parts = k.split(".")
        if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) >= n:
            raise FormatError(f"{name}: unexpected tensor {k!r}")
        i = int(parts[1])
        if v.dtype != np.float32 or not np.all(np.isfinite(v)):
            raise FormatError(f"{name}: {k} must be finite float32")
        if parts[2] == "q_energy" and v.ndim == 2 and np.all(v >= 0):
            energy[i] = v
        elif parts[2] == "q_sample" and v.ndim == 3:
            sample[i] = v
        elif parts[2] in ("k_sens", "v_sens") and v.ndim == 2 and np.all(v >= 0):
            sens[parts[2][0]][i] = v
        else:
            raise FormatError(f"{name}: unexpected tensor {k!r} {v.shape}")
    out = QueryStats(energy, sample, pos, theta, {str(a): str(b) for a, b in ident.items()},
                     sens["k"] if any(a is not None for a in sens["k"]) else None,
                     sens["v"] if any(a is not None for a in sens["v"]) else None, profile)
    return out


@dataclass(frozen=True)
class Calibration:
    """A calibration file as the encoder uses it: where it came from, the SHA-256 of its bytes and
    the statistics parsed from those same bytes (so the hash names exactly what was used).

    Attributes:
        path: the path it was read from (as given).
        sha256: lowercase hex SHA-256 of the file's bytes.
        stats: the parsed :class:`QueryStats`.
    """

    path: str
    sha256: str
    stats: QueryStats = field(repr=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Calibration":
        """Read ``path`` once, hash it and parse it.

        Raises:
            InputError: the file cannot be read (missing, a directory, no permission).
            FormatError: it is not a query-statistics file.
        """
        name = os.fspath(path)
        try:
            data = Path(name).read_bytes()
        except OSError as e:
            raise InputError(f"kvc calibration file {name!r} cannot be read: {e.strerror or e}") from None
        return cls(name, hashlib.sha256(data).hexdigest(), parse_query_statistics(data, name))


def rotate_queries(q: np.ndarray, delta: float, theta: float) -> np.ndarray:
    """Apply the default (Llama, rotate-half) RoPE rotation by ``delta`` positions to ``q [..., D]``.

    Rotations compose, so a query recorded at position ``p`` becomes the query the same content
    would have at ``p + delta``.

    Example:
        >>> q = np.array([[1.0, 0.0, 0.0, 1.0]])
        >>> np.allclose(rotate_queries(rotate_queries(q, 5, 1e4), -5, 1e4), q)
        True
    """
    d = q.shape[-1]
    if theta <= 0 or d % 2 or delta == 0:
        return q
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = delta * inv
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = q[..., : d // 2].astype(np.float64), q[..., d // 2:].astype(np.float64)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def attention_estimate(stats: QueryStats, layer: int, k: np.ndarray, power: float = 1.0) -> np.ndarray | None:
    """Estimated attention each cached token will receive: ``[T, Hkv]``, the mean over the
    calibration queries (rotated to just after the cache) and the query heads of each KV head of
    their softmax over the ``T`` cached keys ``k [T, Hkv, D]``; ``None`` when the statistics
    have nothing for this layer or the shapes differ."""
    if layer >= stats.num_layers or stats.q_sample[layer] is None:
        return None
    qs = stats.q_sample[layer]
    t, hkv, d = k.shape
    hq = qs.shape[0]
    if qs.shape[2] != d or hq % hkv or t == 0:
        return None
    q = rotate_queries(qs, float(t - stats.q_position), stats.rope_theta)  # [Hq, N, D] at t..t+N-1
    g = hq // hkv
    # float32 and one batched softmax: this runs on every calibrated encode
    qt = torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32)).reshape(hkv, g * q.shape[1], d)
    kt = torch.from_numpy(np.ascontiguousarray(k, dtype=np.float32)).transpose(0, 1)  # [Hkv, T, D]
    p = torch.softmax(torch.bmm(qt, kt.transpose(1, 2)), dim=-1)  # [Hkv, g*N, T]
    if power != 1.0:
        p = p.pow(power)
    return p.mean(dim=1).transpose(0, 1).double().numpy()


__all__ = ["QSTATS_FORMAT", "QSTATS_FORMATS", "Calibration", "QueryStats", "attention_estimate",
           "load_query_statistics", "parse_query_statistics", "rotate_queries", "save_query_statistics"]
