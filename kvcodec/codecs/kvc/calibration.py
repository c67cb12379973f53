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
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...errors import ConfigError, FormatError, InputError
from ...format import safetensors_io as sio

QSTATS_FORMAT = "kvcodec.qstats/5"
#: /1: no sensitivities; /2: no profile (``profile`` metadata, kvcodec.codecs.kvc.profile);
#: /3: no per-layer attention facts (``attention`` metadata, ``layers.<i>.rope_inv_freq``);
#: /4: no attention sinks (``"sinks": true`` in a layer's attention metadata,
#: ``layers.<i>.attn_sinks``) and no chunked attention (``"chunk"``)
QSTATS_FORMATS = ("kvcodec.qstats/1", "kvcodec.qstats/2", "kvcodec.qstats/3", "kvcodec.qstats/4", QSTATS_FORMAT)
#: the formats that carry per-layer attention facts
_ATTENTION_FORMATS = ("kvcodec.qstats/4", QSTATS_FORMAT)

#: ``LayerAttention.rope``: ``"rotary"`` (re-rotatable: angle linear in position, per-layer
#: frequencies), ``"none"`` (the queries carry no rotation: no RoPE, or a NoPE layer),
#: ``"unknown"`` (position-dependent in a way the encoder cannot reproduce: no estimate)
ROPE_KINDS = ("rotary", "none", "unknown")
#: rotation pair layouts: ``"half"`` pairs ``(o + c, o + R/2 + c)`` (Llama's rotate-half),
#: ``"interleaved"`` pairs ``(o + 2c, o + 2c + 1)`` (GPT-J, Cohere, GLM)
ROPE_STYLES = ("half", "interleaved")


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's future queries meet the cached keys (what :func:`attention_estimate`
    models; recorded per layer by :func:`kvcodec.harness.calibration.query_statistics`).

    Attributes:
        rope: one of :data:`ROPE_KINDS`.
        inv_freq: ``[R/2]`` float32, ``"rotary"`` only: pair ``c`` turns by ``p * inv_freq[c]``
            at position ``p`` (the model's own frequencies: any RoPE type whose angle is linear
            in position, base and scaling included).
        offset: first rotary channel (0; ``D - R`` for DeepSeek's MLA, whose rotary part is last).
        style: one of :data:`ROPE_STYLES`. Channels outside ``[offset, offset + R)`` never turn
            (partial rotary: Phi-3, GPT-NeoX ``rotary_pct``).
        window: sliding window, 0 for none: the query at position ``p`` sees keys ``j`` with
            ``p - window < j <= p`` (transformers' convention).
        softcap: logit soft-capping, 0 for none: ``logit -> softcap * tanh(logit / softcap)``
            (Gemma 2), applied to the scaled logits.
        sinks: ``[Hq]`` float32 learned attention sinks (GPT-OSS), or None: one more logit per
            query head that takes part in the softmax and whose probability is dropped, so the
            cached keys share less than 1.
        chunk: chunked attention, 0 for none: the query at position ``p`` sees keys ``j <= p``
            with ``j // chunk == p // chunk`` (Llama 4's RoPE layers).
    """

    rope: str = "none"
    inv_freq: np.ndarray | None = field(default=None, compare=False)
    offset: int = 0
    style: str = "half"
    window: int = 0
    softcap: float = 0.0
    sinks: np.ndarray | None = field(default=None, compare=False)
    chunk: int = 0

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Channel indices ``(first, second)`` ``[R/2]`` of each rotation pair (empty without RoPE).

        Example:
            >>> la = LayerAttention("rotary", np.ones(2, np.float32), offset=1, style="interleaved")
            >>> [x.tolist() for x in la.pairs()]
            [[1, 3], [2, 4]]
        """
        if self.rope != "rotary" or self.inv_freq is None:
            e = np.zeros(0, np.int64)
            return e, e
        h = int(self.inv_freq.shape[0])
        c = np.arange(h, dtype=np.int64)
        if self.style == "half":
            return self.offset + c, self.offset + h + c
        return self.offset + 2 * c, self.offset + 2 * c + 1

    def to_json(self) -> dict:
        d: dict = {"rope": self.rope, "window": int(self.window), "softcap": float(self.softcap)}
        if self.rope == "rotary":
            d.update(offset=int(self.offset), style=self.style)
        if self.sinks is not None:
            d["sinks"] = True  # the values: tensor layers.<i>.attn_sinks
        if self.chunk:
            d["chunk"] = int(self.chunk)
        return d


def default_inv_freq(d: int, theta: float) -> np.ndarray:
    """The default RoPE frequencies ``theta ** (-2c / d)`` over all ``d`` channels (float32, as
    transformers computes them)."""
    return (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))).numpy()


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
        attention: per layer :class:`LayerAttention` (rotation, window, softcap), or None (files
            before ``qstats/4``: every layer rotates with the default RoPE of ``rope_theta``
            over all channels, no window, no softcap).
        xpred: per layer the cross-layer predictor ``(W float16 [I, O], b float32 [O])`` or None
            (layer 0 never has one), or None (no predictors): :mod:`kvcodec.codecs.kvc.xpred`.
    """

    q_energy: list[np.ndarray | None]
    q_sample: list[np.ndarray | None]
    q_position: int
    rope_theta: float = 0.0
    meta: dict[str, str] = field(default_factory=dict)
    k_sens: list[np.ndarray | None] | None = None
    v_sens: list[np.ndarray | None] | None = None
    profile: dict | None = None
    attention: list[LayerAttention] | None = None
    xpred: list[tuple[np.ndarray, np.ndarray] | None] | None = None

    def layer_attention(self, layer: int) -> LayerAttention:
        """The :class:`LayerAttention` of ``layer`` (for files without per-layer facts, the one
        global ``rope_theta``: default RoPE over all channels when > 0 and ``D`` is even)."""
        if self.attention is not None:
            return self.attention[layer]
        src = self.q_sample[layer] if self.q_sample[layer] is not None else self.q_energy[layer]
        d = int(src.shape[-1]) if src is not None else 0
        if self.rope_theta > 0 and d and d % 2 == 0:
            return LayerAttention("rotary", default_inv_freq(d, self.rope_theta))
        return LayerAttention("none")

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
    if stats.attention is not None:
        if len(stats.attention) != stats.num_layers:
            raise InputError(f"{len(stats.attention)} layer attention entries for {stats.num_layers} layers")
        meta["attention"] = json.dumps([la.to_json() for la in stats.attention])
        for i, la in enumerate(stats.attention):
            if la.rope == "rotary":
                tensors[f"layers.{i}.rope_inv_freq"] = np.ascontiguousarray(la.inv_freq, dtype=np.float32)
            if la.sinks is not None:
                tensors[f"layers.{i}.attn_sinks"] = np.ascontiguousarray(la.sinks, dtype=np.float32)
    if stats.xpred is not None:
        if len(stats.xpred) != stats.num_layers or stats.xpred[0] is not None:
            raise InputError(f"xpred needs one entry per layer ({stats.num_layers}), None for layer 0")
        for i, p in enumerate(stats.xpred):
            if p is not None:
                w, b = np.ascontiguousarray(p[0], dtype=np.float16), np.ascontiguousarray(p[1], dtype=np.float32)
                if w.ndim != 2 or b.shape != (w.shape[1],) or not (np.all(np.isfinite(w)) and np.all(np.isfinite(b))):
                    raise InputError(f"layer {i} predictor must be finite float16 [I, O] and float32 [O]")
                tensors[f"layers.{i}.xpred_w"], tensors[f"layers.{i}.xpred_b"] = w, b
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
    if "attention" in meta and meta["format"] not in _ATTENTION_FORMATS:
        raise FormatError(f"{name}: per-layer attention metadata needs {' or '.join(_ATTENTION_FORMATS)}")
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
    freqs: list[np.ndarray | None] = [None] * n
    sinks: list[np.ndarray | None] = [None] * n
    sens: dict[str, list[np.ndarray | None]] = {"k": [None] * n, "v": [None] * n}
    xw: list[np.ndarray | None] = [None] * n
    xb: list[np.ndarray | None] = [None] * n
    for k, v in tensors.items():
        parts = k.split(".")
        if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) >= n:
            raise FormatError(f"{name}: unexpected tensor {k!r}")
        i = int(parts[1])
        if parts[2] == "xpred_w":
            if v.dtype != np.float16 or v.ndim != 2 or not v.size or not np.all(np.isfinite(v)) or i == 0:
                raise FormatError(f"{name}: {k} must be a finite float16 matrix (layers >= 1)")
            xw[i] = v
            continue
        if parts[2] == "xpred_b":
            if v.dtype != np.float32 or v.ndim != 1 or not np.all(np.isfinite(v)):
                raise FormatError(f"{name}: {k} must be a finite float32 vector")
            xb[i] = v
            continue
        if v.dtype != np.float32 or not np.all(np.isfinite(v)):
            raise FormatError(f"{name}: {k} must be finite float32")
        if parts[2] == "q_energy" and v.ndim == 2 and np.all(v >= 0):
            energy[i] = v
        elif parts[2] == "q_sample" and v.ndim == 3:
            sample[i] = v
        elif parts[2] in ("k_sens", "v_sens") and v.ndim == 2 and np.all(v >= 0):
            sens[parts[2][0]][i] = v
        elif parts[2] == "rope_inv_freq" and "attention" in meta and v.ndim == 1 and v.size and np.all(v >= 0):
            freqs[i] = v
        elif parts[2] == "attn_sinks" and meta["format"] == QSTATS_FORMAT and "attention" in meta and v.ndim == 1 \
                and v.size:
            sinks[i] = v
        else:
            raise FormatError(f"{name}: unexpected tensor {k!r} {v.shape}")
    out = QueryStats(energy, sample, pos, theta, {str(a): str(b) for a, b in ident.items()},
                     sens["k"] if any(a is not None for a in sens["k"]) else None,
                     sens["v"] if any(a is not None for a in sens["v"]) else None, profile)
    if "attention" in meta:
        out.attention = _parse_attention(meta["attention"], freqs, sinks, out, name,
                                         newest=meta["format"] == QSTATS_FORMAT)
    for i in range(n):
        if (xw[i] is None) != (xb[i] is None) or (xw[i] is not None and xb[i].shape != (xw[i].shape[1],)):
            raise FormatError(f"{name}: layer {i} predictor needs xpred_w [I, O] and xpred_b [O]")
    if any(w is not None for w in xw):
        out.xpred = [None if w is None else (w, b) for w, b in zip(xw, xb)]
    return out


def _parse_attention(text: str, freqs: list[np.ndarray | None], sinks: list[np.ndarray | None], st: QueryStats,
                     name: str, newest: bool = True) -> list[LayerAttention]:
    """The ``attention`` metadata (a JSON list, one object per layer) with the ``rope_inv_freq``
    and ``attn_sinks`` tensors, checked strictly: a ``"rotary"`` layer has its frequencies and
    they fit its width; a layer marked ``"sinks": true`` has one sink per query head; ``chunk``
    (``/5`` only) is a positive integer.

    Raises:
        FormatError: anything else.
    """
    try:
        items = json.loads(text)
    except ValueError as e:
        raise FormatError(f"{name}: bad attention metadata ({e})") from None
    if not isinstance(items, list) or len(items) != st.num_layers:
        raise FormatError(f"{name}: attention metadata must list {st.num_layers} layers")

    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 2**31

    out = []
    for i, d in enumerate(items):
        rotary = isinstance(d, dict) and d.get("rope") == "rotary"
        chunked = newest and isinstance(d, dict) and "chunk" in d
        keys = {"rope", "window", "softcap"} | ({"offset", "style"} if rotary else set()) \
            | ({"sinks"} if sinks[i] is not None else set()) | ({"chunk"} if chunked else set())
        if not isinstance(d, dict) or set(d) != keys or d["rope"] not in ROPE_KINDS or d.get("sinks", True) is not True:
            raise FormatError(f"{name}: layer {i} attention metadata {d!r} is malformed (or its attn_sinks "
                              f"{'present' if sinks[i] is not None else 'missing'})")
        if sinks[i] is not None and st.q_sample[i] is not None and sinks[i].shape != (st.q_sample[i].shape[0],):
            raise FormatError(f"{name}: layer {i} has {sinks[i].size} attention sinks for "
                              f"{st.q_sample[i].shape[0]} query heads")
        cap = d["softcap"]
        if not is_int(d["window"]) or isinstance(cap, bool) or not isinstance(cap, (int, float)) \
                or not (0 <= cap < float("inf")) or (chunked and not (is_int(d["chunk"]) and d["chunk"] >= 1)):
            raise FormatError(f"{name}: layer {i} window / softcap / chunk {d!r} out of range")
        chunk = int(d["chunk"]) if chunked else 0
        f = freqs[i]
        if rotary != (f is not None):
            raise FormatError(f"{name}: layer {i} rope {d['rope']!r} and its rope_inv_freq disagree")
        la = LayerAttention(d["rope"], f, window=d["window"], softcap=float(cap), sinks=sinks[i], chunk=chunk)
        if rotary:
            if not is_int(d["offset"]) or d["style"] not in ROPE_STYLES:
                raise FormatError(f"{name}: layer {i} rotary offset / style {d!r} malformed")
            src = st.q_sample[i] if st.q_sample[i] is not None else st.q_energy[i]
            if src is not None and d["offset"] + 2 * f.shape[0] > src.shape[-1]:
                raise FormatError(f"{name}: layer {i} rotary channels exceed the query width")
            la = LayerAttention("rotary", f, d["offset"], d["style"], d["window"], float(cap), sinks[i], chunk)
        out.append(la)
    return out


_KEPT: dict[tuple[str, int, int], "Calibration"] = {}
_KEPT_LOCK = threading.Lock()


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

    @classmethod
    def load_kept(cls, path: str | os.PathLike[str]) -> "Calibration":
        """:meth:`load`, kept for the next calls while the file keeps its size and modification
        time (the encoder reads the same profile for every cache; reading and hashing a profile
        with predictors took 50 ms of a 1536-token SmolLM2 encode). The statistics are shared:
        callers must not change them."""
        name = os.fspath(path)
        try:
            st = os.stat(name)
            key = (os.path.realpath(name), st.st_size, st.st_mtime_ns)
        except OSError:
            return cls.load(path)
        with _KEPT_LOCK:
            got = _KEPT.get(key)
        if got is not None:
            return got if got.path == name else cls(name, got.sha256, got.stats)
        got = cls.load(path)
        with _KEPT_LOCK:
            _KEPT[key] = got
            while len(_KEPT) > 4:
                _KEPT.pop(next(iter(_KEPT)))
        return got


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


def rotate_layer(q: np.ndarray, delta: float, la: LayerAttention) -> np.ndarray:
    """Turn queries ``q [..., D]`` by ``delta`` positions with the layer's own rotation
    (:meth:`LayerAttention.pairs`, its frequencies; channels outside the rotary part unchanged).
    Returns ``q`` itself when nothing turns, else a new float64 array.

    Example:
        >>> la = LayerAttention("rotary", default_inv_freq(4, 1e4))
        >>> q = np.array([[1.0, 0.0, 0.0, 1.0]])
        >>> np.allclose(rotate_layer(q, 5, la), rotate_queries(q, 5, 1e4))
        True
    """
    if la.rope != "rotary" or delta == 0:
        return q
    a, b = la.pairs()
    ang = float(delta) * la.inv_freq.astype(np.float64)
    cos, sin = np.cos(ang), np.sin(ang)
    out = q.astype(np.float64)  # a copy
    qa, qb = out[..., a], out[..., b]  # fancy indexing: copies
    out[..., a] = qa * cos - qb * sin
    out[..., b] = qb * cos + qa * sin
    return out


#: exp_neg's constants (csrc/attention.c): the cut, log2(e), 1.5 * 2^23 (adding and subtracting
#: it rounds to an integer, half to even), ln 2 in two parts, Cephes' expf polynomial
_SM_LO, _SM_LOG2E, _SM_MAGIC = np.float32(-86.0), np.float32(1.44269504088896341), np.float32(12582912.0)
_SM_C1, _SM_C2 = np.float32(0.693359375), np.float32(-2.12194440e-4)
_SM_P = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                      1.6666665459e-1, 5.0000001201e-1))


def exp_neg(d: np.ndarray) -> np.ndarray:
    """``exp(d)`` for float32 ``d <= 0`` (or -inf), as :func:`softmax_mean` takes it: 0 below
    -86, else Cephes' expf (``n = round(d log2 e)``, ``r = (d - n C1) - n C2``, its degree-5
    polynomial ``P`` by Estrin's scheme, ``(P z + r) + 1`` with ``z = r^2``, times ``2^n``), every
    operation a separately rounded float32 one. Within 2 ulp of the true value (tests).

    Example:
        >>> float(exp_neg(np.array([0.0], np.float32))[0]), float(exp_neg(np.array([-90.0], np.float32))[0])
        (1.0, 0.0)
    """
    d = np.asarray(d, dtype=np.float32)
    under = d < _SM_LO
    d = np.where(under, _SM_LO, d).astype(np.float32)
    n = (d * _SM_LOG2E + _SM_MAGIC) - _SM_MAGIC
    r = (d - n * _SM_C1) - n * _SM_C2
    z = r * r
    p0, p1, p2, p3, p4, p5 = _SM_P  # by Estrin's scheme
    y = ((r * p0 + p1) * (z * z) + (r * p2 + p3) * z) + (r * p4 + p5)
    y = (y * z + r) + np.float32(1.0)
    scale = ((n.astype(np.int32) + np.int32(127)) << np.int32(23)).view(np.float32)
    return np.where(under, np.float32(0.0), y * scale).astype(np.float32)


def softmax_mean(logits: np.ndarray, sinks: np.ndarray | None = None) -> np.ndarray | None:
    """Per KV head, the mean over its query rows of each row's softmax: ``logits`` float32
    ``[B, R, T]`` (finite or -inf: masked keys), ``sinks`` float32 ``[B, R]`` (each row's sink
    logit: it takes part in the row's softmax and its share is dropped) or None. Returns float64
    ``[T, B]``, or None when a logit is NaN or +inf. The reference of csrc/attention.c, bit for
    bit: per row, ``m`` its largest logit (or sink), ``e = exp_neg(x - m)``, ``Z`` the sum of
    ``e`` in eight lanes (element ``j`` into lane ``j % 8``, in order; the lanes added 0 to 7;
    then the sink's ``e``), ``p = e * (1 / Z)`` in float32; per head the float64 sum of ``p``
    over its rows in order, over the number of rows. A row that sees no key and has no sink
    adds 0.

    Example:
        >>> softmax_mean(np.log(np.array([[[1.0, 3.0]]], np.float32))).round(6).tolist()
        [[0.25], [0.75]]
    """
    x = np.asarray(logits, dtype=np.float32)
    b, r, t = x.shape
    sk = None if sinks is None else np.asarray(sinks, dtype=np.float32).reshape(b, r)
    if np.isnan(x).any() or np.isposinf(x).any() or (sk is not None and (np.isnan(sk).any() or np.isposinf(sk).any())):
        return None
    out = np.zeros((t, b), dtype=np.float64)
    t8 = -(-t // 8) * 8
    for h in range(b):
        m = x[h].max(axis=1) if t else np.full(r, -np.inf, np.float32)
        if sk is not None:
            m = np.maximum(m, sk[h])
        live = m != -np.inf
        m = np.where(live, m, np.float32(0.0)).astype(np.float32)
        e = exp_neg(x[h] - m[:, None])
        lanes = np.zeros((r, 8), dtype=np.float32)
        padded = np.zeros((r, t8), dtype=np.float32)
        padded[:, :t] = e
        for j in range(0, t8, 8):
            lanes = lanes + padded[:, j:j + 8]
        z = lanes[:, 0]
        for lane in range(1, 8):
            z = z + lanes[:, lane]
        if sk is not None:
            z = z + exp_neg(sk[h] - m)
        z = np.where(live, z, np.float32(1.0))  # (a row that adds 0)
        p = e * (np.float32(1.0) / z)[:, None]
        acc = np.zeros(t, dtype=np.float64)
        for row in np.flatnonzero(live):
            acc = acc + p[row].astype(np.float64)
        out[:, h] = acc / r
    return out


#: turned queries kept per statistics object: at most this many (layer, delta) entries
_TURNED_KEPT = 96
_TURNED_LOCK = threading.Lock()


def _turned_queries(stats: QueryStats, layer: int, delta: float, la: LayerAttention) -> torch.Tensor:
    """``stats.q_sample[layer]`` turned by ``delta`` positions (:func:`rotate_layer`, or
    :func:`rotate_queries` for files before ``qstats/4``) as a float32 tensor, kept on the
    statistics object: an encode turns every layer's queries by the same delta, and the next
    encode of a cache as long does it again (a profile's sampled queries are not changed in
    place). Not to be written to."""
    key = (layer, delta)
    with _TURNED_LOCK:
        kept = stats.__dict__.setdefault("_turned", {})
        q = kept.get(key)
    if q is None:
        qs = stats.q_sample[layer]
        q = rotate_queries(qs, delta, stats.rope_theta) if stats.attention is None else rotate_layer(qs, delta, la)
        q = torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
        with _TURNED_LOCK:
            while len(kept) >= _TURNED_KEPT:
                kept.pop(next(iter(kept)))
            kept[key] = q
    return q


def attention_estimate(stats: QueryStats, layer: int, k: np.ndarray, power: float = 1.0,
                       query_pos: int = 0) -> np.ndarray | None:
    """Estimated attention each cached token will receive: ``[T, Hkv]``.

    The model of the future: the ``N`` sampled calibration queries stand for the next ``N``
    queries, at positions ``T .. T+N-1`` just after the cache (keys at ``0 .. T-1``), or at
    ``query_pos .. query_pos+N-1`` when ``query_pos > 0``: a cache cut from a longer sequence
    holds keys rotated at their own absolute positions, and the queries that will read it stand
    at the sequence's end (the sliding-window mask still takes the keys as the ``T`` tokens just
    before ``T``, i.e. measures distances from the cache's end). Each is
    turned there with the layer's rotation (:func:`rotate_layer`; queries without RoPE are used as
    recorded), its logits against the cached keys ``k [T, Hkv, D]`` are soft-capped when the
    layer caps them, keys outside its sliding window are masked (and, with chunked attention, those
    outside each query's chunk, the cache's last token at the position before the first query),
    and the softmax is taken over
    the cached keys it sees and the layer's attention sink, if it has one (whose share is dropped;
    the queries' attention to each other is left out). The result is the
    mean over the queries and the query heads of each KV head; with a window, tokens no query
    sees get exactly 0 (and a query that sees no cached token adds 0 to every token).
    ``None`` when the statistics have nothing for this layer, the shapes differ (e.g. an MLA
    latent) or the layer's queries cannot be turned (``rope == "unknown"``).
    """
    if layer >= stats.num_layers or stats.q_sample[layer] is None:
        return None
    qs = stats.q_sample[layer]
    t, hkv, d = k.shape
    hq, n = qs.shape[0], qs.shape[1]
    if qs.shape[2] != d or hq % hkv or t == 0:
        return None
    la = stats.layer_attention(layer)
    if la.rope == "unknown":
        return None
    if 0 < query_pos < t:
        raise ConfigError(f"kvc query_pos {query_pos} lies inside the cache's {t} tokens; the next queries "
                          "come after its last token")
    delta = float((query_pos or t) - stats.q_position)
    g = hq // hkv
    qt = _turned_queries(stats, layer, delta, la).reshape(hkv, g * n, d)  # float32 at t..t+N-1
    # keys some query sees: the query at t sees j > t - window
    lo = max(0, t - la.window + 1) if la.window > 0 else 0
    # float32, one batched product: this runs on every calibrated encode
    kt = torch.from_numpy(np.ascontiguousarray(k[lo:], dtype=np.float32)).transpose(0, 1)  # [Hkv, T', D]
    logits = torch.bmm(qt, kt.transpose(1, 2))  # [Hkv, g*N, T']
    if la.softcap > 0:  # in place: the logits are the big tensor here
        logits.div_(la.softcap).tanh_().mul_(la.softcap)
    if la.window > 0 or la.chunk > 0:
        qpos = torch.arange(t, t + n).repeat(g)[:, None]  # row r = head r // N, query r % N
        kpos = torch.arange(lo, t)[None, :]
        if la.window > 0:
            logits.masked_fill_(qpos - kpos >= la.window, float("-inf"))
        if la.chunk > 0:  # a query sees its own chunk; the cache's tokens end just before the queries
            shift = (query_pos or t) - t  # absolute position minus the cache index
            logits.masked_fill_((qpos + shift) // la.chunk != (kpos + shift) // la.chunk, float("-inf"))
    sinks = la.sinks
    s = None
    if sinks is not None and sinks.shape == (hq,):
        # the sink logit of each row's query head takes part in the softmax; its share is dropped
        s = torch.from_numpy(np.ascontiguousarray(sinks, dtype=np.float32)).reshape(hkv, g, 1)
        s = s.expand(hkv, g, n).reshape(hkv, g * n, 1)
    est = None
    if power == 1.0 and n and t > lo:
        from ... import native
        from ...native.attention import softmax_mean as native_softmax_mean

        sk = None if s is None else s.reshape(hkv, g * n).numpy()
        try:  # the softmax and the mean in one pass per row, in C; else its reference
            est = native_softmax_mean(logits.numpy(), sk)
        except native.Unsupported:
            est = softmax_mean(logits.numpy(), sk)
    if est is None:  # a NaN or +inf logit, or a power: torch, as before
        if s is not None:
            p = torch.softmax(torch.cat([logits, s], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(logits, dim=-1)
        if la.window > 0 or la.chunk > 0:
            p.nan_to_num_(nan=0.0)  # a query that sees no cached key (and no sink)
        if power != 1.0:
            p = p.pow(power)
        est = p.mean(dim=1).transpose(0, 1).double().numpy()
    if lo == 0:
        return est
    full = np.zeros((t, hkv), np.float64)
    full[lo:] = est
    return full


__all__ = ["QSTATS_FORMAT", "QSTATS_FORMATS", "ROPE_KINDS", "ROPE_STYLES", "Calibration", "LayerAttention",
           "QueryStats", "attention_estimate", "default_inv_freq", "exp_neg", "load_query_statistics",
           "parse_query_statistics", "rotate_layer", "rotate_queries", "save_query_statistics", "softmax_mean"]
