"""Run codecs against a real model: bits per element, per-layer attention errors, next-token KL.

The protocol (one :class:`Evaluator` per model, text and lengths):

1. Tokenize ``context + continuation + 1`` tokens of the text.
2. Prefill the context and keep its KV cache in ``cache_dtype`` (fp16 by default, as engines
   store it): the **reference cache**.
3. Run the continuation with the reference cache injected; record its logits and, through a
   recording attention function, every layer's real queries (teacher forcing).
4. For each codec: ``blob = codec.encode(reference)``, bits per element
   ``= 8 * len(blob) / num_elements`` (exact, all-in), ``decoded = codec.decode(blob)``; run the
   same continuation with the decoded cache; compare logits (next-token KL, top-1, ΔPPL) and,
   per layer and head, attention over reference vs decoded K/V with the recorded queries.

The reference and the codec runs go through the same code path (cache injected, then the
continuation), so a lossless codec gives exactly KL 0 and ΔPPL 0.

Example:
    >>> from kvcodec.harness.evaluate import Evaluator          # doctest: +SKIP
    >>> ev = Evaluator.default(context=512, continuation=128)    # doctest: +SKIP
    >>> ev.evaluate("fp8-e4m3")["next_token"]["kl_mean"] < 0.01  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from typing import Any, Iterator

import torch

from ..cache import DTYPE_NAMES, KVCache
from ..codec import Codec, get_codec
from ..errors import InputError, KVCodecError
from ..metrics import (
    ATTENTION_METRICS,
    RECONSTRUCTION_METRICS,
    attention_errors,
    attention_reference,
    next_token_kl,
    next_token_metrics,
    reconstruction_errors,
)

_RECORD_IMPL = "kvcodec_record_queries"


def _round(x: float, digits: int = 6) -> float | None:
    """Round to significant digits for compact JSON; NaN becomes None (JSON has no NaN)."""
    if x != x:  # NaN
        return None
    if x == 0 or x in (float("inf"), float("-inf")):
        return float(x) if x == 0 else None
    return float(f"{x:.{digits}g}")


def _attention_chunk(module: Any) -> int:
    """The chunk size of a layer whose attention is chunked (its config's ``layer_types`` entry
    is ``"chunked_attention"``: Llama 4's RoPE layers), else 0."""
    cfg = getattr(module, "config", None)
    types = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is None or idx is None or not 0 <= int(idx) < len(types) or types[int(idx)] != "chunked_attention":
        return 0
    return int(getattr(cfg, "attention_chunk_size", 0) or 0)


@contextlib.contextmanager
def record_queries(model: Any) -> Iterator[dict[int, dict[str, Any]]]:
    """Record each attention layer's queries (``[Tq, Hq, D]``, batch 0) and scaling while the
    model runs, by routing attention through a recording wrapper of its own implementation.

    The wrapper sees exactly the query the model uses (after RoPE, query norms and any
    pre-attention scaling folded into ``scaling``), for every architecture that dispatches through
    transformers' ``AttentionInterface`` (Llama, Qwen2, Gemma3, GPT-2, ...). Layers are keyed by
    their index in the model's KV cache: a hybrid model's attention layers count among
    themselves (:func:`~kvcodec.integrations.transformers.kv_layer_map`).

    Raises:
        InputError: the model does not dispatch attention through ``AttentionInterface``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..integrations.transformers import kv_layer_map

    store: dict[int, dict[str, Any]] = {}
    orig = model.config._attn_implementation or "eager"
    impl = f"{_RECORD_IMPL}_{orig}"
    kv_map = kv_layer_map(model)
    # a hybrid model's attention layers are recorded by their place among the cache's layers
    where = None if kv_map is None else {m: j for j, m in enumerate(kv_map)}

    def recording(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001
        idx = getattr(module, "layer_idx", None)
        if idx is not None and where is not None:
            idx = where.get(int(idx))
        if idx is not None:
            scaling = kwargs.get("scaling")
            if scaling is None:
                scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
            store[int(idx)] = {
                "q": query[0].transpose(0, 1).detach().float().cpu().contiguous(),
                "scaling": float(scaling),
                "softcap": kwargs.get("softcap"),
                "sliding_window": kwargs.get("sliding_window", getattr(module, "sliding_window", None)),
                # GPT-OSS's learned sinks: one more logit per query head in the softmax
                "sinks": (None if kwargs.get("s_aux") is None
                          else kwargs["s_aux"].detach().float().cpu().reshape(-1).numpy().copy()),
                # chunked attention (Llama 4): a query sees the keys of its own chunk only
                "chunk": _attention_chunk(module),
            }
        if orig == "eager":
            fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if fn is None:
                raise InputError(f"{type(module).__name__}: cannot find its eager attention")
        else:
            fn = ALL_ATTENTION_FUNCTIONS[orig]
        return fn(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(impl, recording)
    # The model builds its attention mask by implementation name: give ours the mask of the
    # implementation it wraps (without one, sdpa would fall back to a wrongly aligned causal mask
    # when queries follow a cache).
    if orig in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(impl, ALL_MASK_ATTENTION_FUNCTIONS[orig])
    model.set_attn_implementation(impl)
    try:
        yield store
    finally:
        model.set_attn_implementation(orig)


class Evaluator:
    """Holds a model, the reference cache and the reference run; scores codecs against them.

    Args:
        model, tokenizer: a transformers causal LM and its tokenizer.
        text: the evaluation text.
        context: prefill length (tokens whose cache is compressed).
        continuation: number of scored next-token predictions after the context.
        cache_dtype: dtype the reference cache is stored in (codecs see this dtype).
        attn_queries: at most this many continuation queries (evenly spaced) for the per-layer
            attention metrics; ``None`` for all.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        text: str,
        context: int = 2048,
        continuation: int = 512,
        cache_dtype: torch.dtype = torch.float16,
        attn_queries: int | None = 64,
        text_name: str = "custom",
        token_ids: torch.Tensor | None = None,
    ) -> None:
        from .capture import capture_with_state, tokenize

        if context < 1 or continuation < 1:
            raise InputError(f"context and continuation must be >= 1 (got {context}, {continuation})")
        self.model, self.tokenizer = model, tokenizer
        self.context, self.continuation = int(context), int(continuation)
        self.cache_dtype = cache_dtype
        self.text_info = {"name": text_name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                          "chars": len(text)}
        if token_ids is None:
            ids = tokenize(tokenizer, text, context + continuation + 1)
        else:  # a window the caller cut (calibration windows): used as given
            if token_ids.ndim != 1 or token_ids.numel() < context + continuation + 1:
                raise InputError(f"token_ids must be 1-D with >= {context + continuation + 1} ids")
            ids = token_ids[: context + continuation + 1].to(torch.int64)
        self.token_ids = ids
        t0 = time.perf_counter()
        # a hybrid model's recurrent layers, as the prefill left them (None: every layer is attention)
        self.reference, self.state = capture_with_state(model, tokenizer, token_ids=ids[:context], dtype=cache_dtype)
        self.prefill_seconds = time.perf_counter() - t0
        self.cont_ids = ids[context : context + continuation]
        self.targets = ids[context + 1 : context + continuation + 1]
        with record_queries(model) as store:
            self.ref_logits = self._continue(self.reference)
        n = self.reference.num_layers
        missing = [i for i in range(n) if i not in store]
        if missing:
            raise InputError(f"no queries recorded for layers {missing[:5]}")
        sel = torch.arange(continuation)
        if attn_queries is not None and continuation > attn_queries:
            sel = torch.linspace(0, continuation - 1, attn_queries).round().to(torch.int64)
        self.q_positions = context + sel
        self.queries = [store[i]["q"][sel] for i in range(n)]
        self.scalings = [store[i]["scaling"] for i in range(n)]
        self.ref_float = [{r: t.float() for r, t in layer.items()} for layer in self.reference.layers]
        self._att_refs: list[Any] | None = None
        self._ref_probs: torch.Tensor | None = None
        self.reference_metrics = next_token_metrics(self.ref_logits, self.ref_logits, self.targets)

    @classmethod
    def default(cls, context: int = 2048, continuation: int = 512, **kwargs: Any) -> "Evaluator":
        """An evaluator on the built-in model and the built-in text."""
        from .capture import default_text
        from .models import load_model

        model, tok = load_model()
        return cls(model, tok, default_text(), context, continuation,
                   text_name="jargon-4.4.7-excerpt", **kwargs)

    # ------------------------------------------------------------------ model runs
    @torch.no_grad()
    def _continue(self, cache: KVCache) -> torch.Tensor:
        """Logits ``[continuation, vocab]`` of the continuation run on top of ``cache``."""
        from ..integrations.transformers import cache_kwargs, to_dynamic_cache

        device = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype
        dc = to_dynamic_cache(cache, device=device, dtype=dtype, state=self.state)
        out = self.model(self.cont_ids[None].to(device), use_cache=True, **cache_kwargs(self.model, dc))
        return out.logits[0].float().cpu()

    # ------------------------------------------------------------------ scoring
    def layer_metrics(self, decoded: KVCache) -> list[dict[str, list[float | None]]]:
        """Per layer: per-query-head attention metrics and per-KV-head reconstruction errors."""
        if self._att_refs is None:
            # The reference side of attention is the same for every codec: compute it once.
            self._att_refs = []
            for i, ref in enumerate(self.ref_float):
                info = self.reference.layer_info[i]
                self._att_refs.append(None if "kv" in ref else attention_reference(
                    self.queries[i], ref["k"], ref["v"], scaling=self.scalings[i],
                    q_positions=self.q_positions,
                    window=info.window if info.kind == "sliding" else 0,
                ))
        out = []
        for i, (ref, dec) in enumerate(zip(self.ref_float, decoded.layers)):
            if "kv" in ref:
                out.append({})
                continue
            kd, vd = dec["k"].float(), dec["v"].float()
            att = attention_errors(self.queries[i], ref["k"], ref["v"], kd, vd,
                                   reference=self._att_refs[i])
            rec = reconstruction_errors(ref["k"], ref["v"], kd, vd)
            row = {name: [_round(float(x)) for x in att[name]] for name in ATTENTION_METRICS}
            row.update({name: [_round(float(x)) for x in rec[name]] for name in RECONSTRUCTION_METRICS})
            out.append(row)
        return out

    def evaluate(self, codec: str | dict[str, Any] | Codec, name: str | None = None) -> dict[str, Any]:
        """Encode, decode and score one codec; return one result record (see :mod:`.report`)."""
        codec = get_codec(codec)
        cfg = codec.get_config()
        rec: dict[str, Any] = {"name": name or _config_name(cfg), "family": family_of(codec),
                               "config": cfg}
        try:
            self._score(codec, rec)
        except Exception as e:  # noqa: BLE001
            # One broken codec must not sink a 20-minute suite: record the failure and go on.
            # (Codecs should raise KVCodecError; anything else is reported with its type.)
            for key in ("next_token", "attention", "per_layer"):
                rec.pop(key, None)
            rec["error"] = f"{type(e).__name__}: {e}"
            return rec
        rec["error"] = None
        return rec

    def _warm_up(self, codec: Codec) -> None:
        """One untimed encode and decode of the first 32 tokens, so that ``encode_seconds`` and
        ``decode_seconds`` leave out first-use costs (building or loading the native library,
        tables a codec makes once). A failure here is left to the timed run to report."""
        try:
            codec.decode(codec.encode(self.reference.tokens(0, min(32, self.reference.num_tokens))))
        except Exception:  # noqa: BLE001 - the real encode below raises what matters
            pass

    def _score(self, codec: Codec, rec: dict[str, Any]) -> None:
        self._warm_up(codec)
        t0 = time.perf_counter()
        blob = codec.encode(self.reference)
        t1 = time.perf_counter()
        decoded = codec.decode(blob)
        t2 = time.perf_counter()
        if decoded.dtype != self.cache_dtype:
            decoded = decoded.to(self.cache_dtype)
        n = self.reference.num_elements
        rec.update(
            bytes=len(blob),
            bits_per_element=8.0 * len(blob) / n,
            ratio_vs_fp16=self.reference.fp16_bytes() / len(blob),
            lossless=bool(decoded.equal(self.reference)),
            encode_seconds=t1 - t0,
            decode_seconds=t2 - t1,
        )
        logits = self._continue(decoded)
        nt = next_token_metrics(self.ref_logits, logits, self.targets)
        rec["next_token"] = {k: _round(v) for k, v in nt.items()}
        per_layer = self.layer_metrics(decoded)
        rec["attention"] = _mean_over_layers(per_layer)
        rec["per_layer"] = per_layer

    def score_next_token(self, codec: str | dict[str, Any] | Codec, kl_only: bool = False) -> dict[str, Any]:
        """Encode, decode and score only the next-token distributions (no per-layer attention
        metrics): ``{"bits_per_element", "bytes", "next_token": {...}}``. The closed-loop
        calibration (:mod:`kvcodec.harness.profile`) calls this many times, with ``kl_only``:
        then ``next_token`` holds only ``kl_mean``, from :func:`~kvcodec.metrics.next_token_kl`
        against the reference's cached probabilities (3.5 of 15 s less per call on a 0.5B model).

        Raises:
            KVCodecError: the codec cannot encode this cache.
        """
        codec = get_codec(codec)
        blob = codec.encode(self.reference)
        return {"bytes": len(blob), "bits_per_element": 8.0 * len(blob) / self.reference.num_elements,
                "next_token": self.score_cache(codec.decode(blob), kl_only=kl_only)}

    def score_cache(self, decoded: KVCache, kl_only: bool = False) -> dict[str, float]:
        """Next-token metrics of the continuation on top of ``decoded`` (a cache of the reference's
        geometry, however it was coded: whole, in chunks, through a store) against the reference
        (``kl_only``: only ``kl_mean``, see :meth:`score_next_token`)."""
        if decoded.num_layers != self.reference.num_layers or decoded.num_tokens != self.reference.num_tokens:
            raise InputError(f"a cache of {decoded.num_layers} layers x {decoded.num_tokens} tokens, the reference "
                             f"has {self.reference.num_layers} x {self.reference.num_tokens}")
        if decoded.dtype != self.cache_dtype:
            decoded = decoded.to(self.cache_dtype)
        logits = self._continue(decoded)
        if kl_only:
            if self._ref_probs is None:
                self._ref_probs = torch.softmax(self.ref_logits.float(), dim=-1)
            return {"kl_mean": float(next_token_kl(self.ref_logits, logits, self._ref_probs).mean())}
        nt = next_token_metrics(self.ref_logits, logits, self.targets)
        return {k: float(v) for k, v in nt.items()}

    def describe(self) -> dict[str, Any]:
        """The run's fixed facts: model identity, text, lengths, reference perplexity."""
        ref = self.reference
        return {
            "model": ref.model.to_dict(),
            "geometry": {
                "layers": ref.num_layers,
                "kv_heads": [int(layer["k"].shape[1]) for layer in ref.layers if "k" in layer][:1] or [0],
                "head_dim": int(ref.layers[0]["k"].shape[2]) if "k" in ref.layers[0] else 0,
                "layer_kinds": sorted({li.kind for li in ref.layer_info}),
            },
            "text": self.text_info,
            "context": self.context,
            "continuation": self.continuation,
            "attention_queries": int(self.q_positions.numel()),
            "cache_dtype": DTYPE_NAMES[self.cache_dtype],
            "num_elements": ref.num_elements,
            "reference": {"ppl": _round(self.reference_metrics["ppl_ref"]),
                          "nll": _round(self.reference_metrics["nll_ref"])},
        }


def _config_name(cfg: dict[str, Any]) -> str:
    """A preset's name when ``cfg`` equals a registered preset, else a compact ``id(k=v,...)``."""
    from ..codec import _PRESETS

    for name, preset in _PRESETS.items():
        try:
            if get_codec(preset.config).get_config() == cfg:
                return name
        except KVCodecError:
            continue
    from ..codec import _CODECS

    defaults = _CODECS[cfg["id"]].defaults if cfg["id"] in _CODECS else {}
    extra = ",".join(f"{k}={v}" for k, v in cfg.items() if k != "id" and defaults.get(k) != v)
    return f"{cfg['id']}({extra})" if extra else cfg["id"]


def _mean_over_layers(per_layer: list[dict[str, list[float | None]]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in ATTENTION_METRICS + RECONSTRUCTION_METRICS:
        vals = [x for row in per_layer for x in row.get(name, []) if x is not None]
        out[name] = _round(sum(vals) / len(vals)) if vals else None
    return out





# ---------------------------------------------------------------------- families, suites, sweeps
#: Parameters that move a codec along its rate–distortion curve. Settings that differ only in
#: these belong to one family (one curve in the RD plot); any other non-default parameter
#: starts a family of its own (for example ``kivi-ans(delta=8)``). Ids not listed: ``bits``.
FAMILY_KNOBS: dict[str, set[str]] = {
    "kivi": {"bits"},
    "kivi-ans": {"bits"},
    "fp8": {"format"},
    "kvc": {"k_step", "v_step", "rho", "k_gamma", "target_kl", "fallback"},
    "cachegen": {"levels", "anchor_levels"},
    "cachegen-lmcache": {"early_bins", "late_bins"},
}


def family_of(codec: Codec) -> str:
    """The RD-curve family of a codec: its id, plus any non-default parameter that is not one of
    the id's knobs (:data:`FAMILY_KNOBS`).

    Example:
        >>> import kvcodec
        >>> family_of(kvcodec.get_codec("kivi-2")), family_of(kvcodec.get_codec("kivi-2-delta-ans"))
        ('kivi', 'kivi-ans(delta=8)')
    """
    cid = codec.codec_id
    knobs = FAMILY_KNOBS.get(cid, {"bits"})
    cfg = codec.get_config()  # plain JSON values (params hold lists as tuples)
    extra = [f"{k}={v}" for k, v in sorted(cfg.items())
             if k != "id" and k not in knobs and v != type(codec).defaults.get(k)]
    return f"{cid}({','.join(extra)})" if extra else cid



#: Sweep knobs per codec id: parameter overrides tried with ``--sweep`` on top of each preset's
#: config. Ids not listed run at their preset only. Invalid combinations are skipped.
SWEEPS: dict[str, list[dict[str, Any]]] = {
    "kivi": [{"bits": b} for b in (2, 3, 4, 5, 6, 8)],
    "kivi-ans": [{"bits": b} for b in (2, 3, 4, 6)],
    "fp8": [{"format": "e4m3"}, {"format": "e5m2"}],
    "kvc": [{"k_step": s, "v_step": s} for s in (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5)],
    "cachegen": [{"levels": [63, 31, 31]}, {"levels": [31, 15, 15]}, {"levels": [15, 7, 7]}],
}


def expand_settings(
    codecs: list[str | dict[str, Any]], sweep: bool = False,
    sweeps: dict[str, list[dict[str, Any]]] | None = None,
) -> list[tuple[str, Codec]]:
    """``[(name, codec)]`` for the given presets/configs, plus the sweep variants when asked.

    Duplicates (equal configs) are dropped, keeping the first name.

    Raises:
        UnknownCodecError / ConfigError: a named codec does not exist or its config is invalid.
    """
    sweeps = SWEEPS if sweeps is None else sweeps
    out: list[tuple[str, Codec]] = []
    seen: set[str] = set()

    def add(name: str, codec: Codec) -> None:
        key = json_key(codec.get_config())
        if key not in seen:
            seen.add(key)
            out.append((name, codec))

    for c in codecs:
        codec = get_codec(c)
        add(c if isinstance(c, str) and not c.strip().startswith("{") else _config_name(codec.get_config()), codec)
    if sweep:
        for base_name, base in list(out):
            cfg = base.get_config()
            for override in sweeps.get(cfg["id"], []):
                try:
                    variant = get_codec({**cfg, **override})
                except KVCodecError:
                    continue
                # A registered preset keeps its name; otherwise the base name plus the change.
                name = _config_name(variant.get_config())
                if "(" in name:
                    changed = ",".join(f"{k}={v}" for k, v in override.items() if cfg.get(k) != v)
                    name = f"{base_name}[{changed}]"
                add(name, variant)
    return out


def with_calibration(
    settings: list[tuple[str, Codec]], calibration: str | None, skip_uncalibrated: bool = False
) -> tuple[list[tuple[str, Codec]], list[str]]:
    """Give the presets that require a calibration file (kvc's ``-cal`` presets) that file:
    ``(settings, skipped)``; when the file holds a profile (``kvcodec calibrate``), each level
    preset (``target_kl``) is scored twice: as named (its fixed steps) and ``<name> +profile``. They are renamed ``<name> +calibration``. Without a file and with
    ``skip_uncalibrated`` they are left out (their steps assume the calibrated encoder: plain,
    they miss their bars) and their names returned in ``skipped``; without either, ConfigError.

    Example:
        >>> s, skipped = with_calibration(expand_settings(["kvc-near", "kvc-near-cal"]), None, True)
        >>> [n for n, _ in s], skipped
        (['kvc-near'], ['kvc-near-cal'])
    """
    out: list[tuple[str, Codec]] = []
    skipped: list[str] = []
    profile = False
    if calibration:
        from ..codecs.kvc.calibration import Calibration

        try:
            profile = Calibration.load(calibration).stats.profile is not None
        except KVCodecError:
            profile = False  # an unreadable file: the codecs given it report that when they encode
    for name, codec in settings:
        if (profile and codec.params.get("target_kl") and not codec.params.get("calibration")
                and "calibration" not in codec.requires):
            # a level preset: as it codes without a profile, and with the model's profile
            out.append((name, codec))
            out.append((name + " +profile", get_codec({**codec.get_config(), "calibration": calibration})))
        elif "calibration" not in codec.requires or codec.params["calibration"]:
            out.append((name, codec))
        elif calibration:
            out.append((name + " +calibration", get_codec({**codec.get_config(), "calibration": calibration})))
        elif skip_uncalibrated:
            skipped.append(name)
        else:
            codec.check_requirements()  # raises: a named -cal preset without a file
    return out, skipped


def json_key(cfg: dict[str, Any]) -> str:
    import json

    return json.dumps(cfg, sort_keys=True)


def run_suite(
    evaluator: Evaluator,
    settings: list[tuple[str, Codec]],
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Evaluate every ``(name, codec)``; tqdm progress on stderr. Failures are recorded, not raised."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the [eval] extra
        tqdm = None
    bar = tqdm(total=len(settings), file=sys.stderr, unit="codec", disable=not progress,
               dynamic_ncols=True) if tqdm else None
    results = []
    for name, codec in settings:
        if bar is not None:
            bar.set_postfix_str(name)
        results.append(evaluator.evaluate(codec, name=name))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results
__all__ = ["FAMILY_KNOBS", "SWEEPS", "Evaluator", "family_of", "expand_settings", "record_queries", "run_suite"]
