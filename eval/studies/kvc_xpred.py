#!/usr/bin/env python
"""Does kvc itself keep the bits that predicting a layer from the one before saves? Closed loop,
inside kvc's own coder, before any format change (issue 20, item 5).

eval/studies/kvc_xlayer.py measured the gain in a simplified coder. Here kvc codes the residual
itself, tensor by tensor through its own ``encode_tensor`` / ``decode_tensor`` (the planes a file
would hold), with each model's profile at each level:

* **plain**: every tensor of the cache as kvc codes it (the same per-tensor path, so both sides
  count the same: the tensors' planes, not the container's header and token ids);
* **predicted**: layer 0 as plain; layer ``l >= 1`` codes ``x_l - P_l`` where ``P_l`` is a
  ridge prediction from layer ``l-1``'s *decoded* K (un-rotated to before RoPE, the prediction
  rotated back) and V, as a decoder would have them; the predictors are fitted on the four
  calibration texts coded the same way at the same level (so they learn from reconstructions,
  never from the text measured). kvc's calibrated state (attention estimates) comes from the
  cache itself, as in a real encode; its steps are fractions of the coded signal's RMS, so the
  residual gets finer steps at the same level: compare the two at equal KL, not at equal level.

Scored: the decoded cache's next-token KL against the fp16 cache (1024 cached tokens, 512
scored) on the evaluation texts. The report gives each level's (bits, KL) both ways and the
predicted coding's saving at its own KL, the plain bits there interpolated (log-log) between the
plain points of the finer and coarser levels.

Needs the profiles that eval/studies/kvc_profile.py makes (``kvcodec calibrate``'s cache).

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_xpred``).

Usage:
    python eval/studies/kvc_xpred.py
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Any

import numpy as np

from kvcodec.harness.results import provenance, write_result
from kvcodec.harness.studies import ridge_fit as fit, ridge_predict, rope_rotate as rotate

#: level presets by target, the preset that codes it (the profile picks the steps)
LEVEL_PRESETS = {0.002: "kvc-transparent", 0.005: "kvc-near", 0.01: "kvc-near", 0.02: "kvc-near",
                 0.05: "kvc-aggressive"}


def low_rank(w: np.ndarray, rank: int) -> np.ndarray:
    """``w`` (weights, then the bias row) with its weight part cut to ``rank`` by a truncated SVD
    (0: unchanged): a predictor of ``rank * (inputs + outputs) + outputs`` numbers."""
    if rank <= 0 or rank >= min(w.shape[0] - 1, w.shape[1]):
        return w
    u, sv, vt = np.linalg.svd(w[:-1], full_matrices=False)
    return np.vstack([(u[:, :rank] * sv[:rank]) @ vt[:rank], w[-1:]])


def flat(t: Any) -> np.ndarray:
    """``[T, H, D]`` tensor -> float64 ``[T, H * D]``."""
    return t.double().reshape(t.shape[0], -1).numpy()


class LayerCoder:
    """Codes one cache tensor by tensor with one codec, optionally predicting each layer from
    the decoded layer before (closed loop)."""

    def __init__(self, codec: Any, cache: Any, heads: int, theta: float, roles: str = "kv") -> None:
        self.codec, self.cache, self.heads, self.theta, self.roles = codec, cache, heads, theta, roles
        self.plan = codec.plan(cache)
        if isinstance(self.plan.state, dict):  # this study predicts by itself: profiles made since
            self.plan.state.pop("xpred", None)  # kvc's own xpred must not predict a second time
        self.decoded: list[dict[str, np.ndarray]] = []  # per layer: K before RoPE, K, V (float64, flat)
        self.nbytes = 0

    def close(self) -> None:
        self.plan.__exit__(None, None, None)

    def source(self, layer: int) -> np.ndarray:
        """Predictor input for layer ``layer + 1``: ``[K before RoPE, V]`` decoded."""
        d = self.decoded[layer]
        return np.hstack([d["kpre"], d["v"]])

    def code_layer(self, layer: int, w: dict[str, np.ndarray] | None) -> None:
        """Code layer ``layer`` (its residual after ``w``'s prediction when given)."""
        import torch

        from kvcodec.planes import TensorContext

        out: dict[str, np.ndarray] = {}
        for role in ("k", "v"):
            x = self.cache.layers[layer][role]
            p = 0.0
            if w is not None and role in self.roles:
                src = self.source(layer - 1)
                p = ridge_predict(src, w[role])
                if role == "k":
                    p = rotate(p, self.heads, self.theta, 1)
            res = torch.from_numpy(flat(x) - p).reshape(x.shape).to(x.dtype)
            ctx = TensorContext(layer=layer, role=role, shape=tuple(x.shape), dtype=x.dtype,
                                layer_kind=self.cache.layer_info[layer].kind, globals=self.plan.globals,
                                state=self.plan.state)
            enc = self.codec.encode_tensor(res, ctx)
            self.nbytes += enc.nbytes
            dec = self.codec.decode_tensor(enc, dataclasses.replace(ctx, state=None))
            out[role] = flat(dec) + p
        out["kpre"] = rotate(out["k"], self.heads, self.theta, -1)
        self.decoded.append(out)

    def to_cache(self) -> Any:
        import torch

        layers = []
        for layer, d in zip(self.cache.layers, self.decoded):
            layers.append({r: torch.from_numpy(d[r]).reshape(layer[r].shape).to(layer[r].dtype) for r in ("k", "v")})
        return dataclasses.replace(self.cache, layers=layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--texts", default="prose,code,docs")
    ap.add_argument("--targets", default="0.002,0.005,0.01,0.02,0.05",
                    help=f"levels (target_kl) to code at, of {sorted(LEVEL_PRESETS)}")
    ap.add_argument("--scales", default="1.25,1.5,1.75,2.0",
                    help="also code predicted at each --scale-targets level's steps times these ('' for none)")
    ap.add_argument("--scale-targets", default="0.01,0.05", help="levels whose steps --scales multiplies")
    ap.add_argument("--predict", default="kv", choices=("kv", "k", "v"),
                    help="which roles are predicted (the others coded as plain; the predictors read K and V)")
    ap.add_argument("--fit-on", default="level",
                    help="fit the predictors on the calibration texts coded at each level and scale ('level'), "
                         "once on their uncoded K and V ('clean'), or once coded at one level (e.g. 0.01)")
    ap.add_argument("--rank", type=int, default=0,
                    help="cut each predictor's weights to this rank (truncated SVD; 0: full)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--out", default="eval/results/kvc_xpred")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import torch

    import kvcodec
    from kvcodec.codecs.kvc.calibration import load_query_statistics
    from kvcodec.codecs.kvc.profile import parse_profile, steps_for_target
    from kvcodec.harness.capture import capture, tokenize
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.studies import profile_dir
    from kvcodec.harness.texts import CALIBRATION_DOMAINS, calibration_text, eval_text
    from kvcodec.integrations.transformers import rope_info
    from kvcodec.metrics import next_token_metrics

    torch.set_num_threads(2)
    targets = [float(x) for x in args.targets.split(",")]
    if not set(targets) <= set(LEVEL_PRESETS):
        raise SystemExit(f"--targets must be among {sorted(LEVEL_PRESETS)}")
    texts = args.texts.split(",")
    if args.fit_on not in ("level", "clean") and not (args.fit_on.replace(".", "", 1).isdigit()
                                                       and float(args.fit_on) in LEVEL_PRESETS):
        raise SystemExit(f"--fit-on is 'level', 'clean' or one of {sorted(LEVEL_PRESETS)}")
    scales = [float(x) for x in args.scales.split(",") if x]
    scale_targets = [float(x) for x in args.scale_targets.split(",") if x] if scales else []
    if not set(scale_targets) <= set(LEVEL_PRESETS):
        raise SystemExit(f"--scale-targets must be among {sorted(LEVEL_PRESETS)}")
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        prof = profile_dir() / f"{name}.profile.safetensors"
        if not prof.exists():
            raise SystemExit(f"no profile at {prof}: run eval/studies/kvc_profile.py first")
        model, tok = load_model(name)
        theta = float(rope_info(model.config)[1].get("rope_theta", 10000.0))
        heads = int(model.config.num_key_value_heads)
        fits = [capture(model, tok, token_ids=tokenize(tok, calibration_text(d), None)[:args.context],
                        dtype=torch.float16) for d in CALIBRATION_DOMAINS]
        evs = {t: Evaluator(model, tok, eval_text(t), args.context, args.continuation, attn_queries=1, text_name=t)
               for t in texts}
        n_layers = fits[0].num_layers

        def fit_predictors(codec: Any | None) -> list[dict[str, np.ndarray] | None]:
            """Predictors fitted on the calibration texts' own reconstructions with ``codec``
            (closed loop, layer by layer), or on their uncoded K and V (``codec`` None)."""
            ws: list[dict[str, np.ndarray] | None] = [None]
            with contextlib.ExitStack() as stack:
                coders = [LayerCoder(codec, c, heads, theta, args.predict) for c in fits] if codec is not None else []
                for c in coders:
                    stack.callback(c.close)
                    c.code_layer(0, None)

                def source(i: int, layer: int) -> np.ndarray:
                    if codec is not None:
                        return coders[i].source(layer)
                    c = fits[i].layers[layer]
                    return np.hstack([rotate(flat(c["k"]), heads, theta, -1), flat(c["v"])])

                for layer in range(1, n_layers):
                    xs = np.vstack([source(i, layer - 1) for i in range(len(fits))])
                    w = {"k": fit(xs, np.vstack([rotate(flat(c.layers[layer]["k"]), heads, theta, -1) for c in fits])),
                         "v": fit(xs, np.vstack([flat(c.layers[layer]["v"]) for c in fits]))}
                    w = {r: low_rank(m, args.rank) for r, m in w.items()}
                    ws.append(w)
                    for c in coders:
                        c.code_layer(layer, w)
            return ws

        fixed: dict[str, list[dict[str, np.ndarray] | None]] = {}  # --fit-on clean / a level: fitted once

        def measure(target: float, scale: float, codec: Any, methods: tuple[str, ...]) -> None:
            ws: list[dict[str, np.ndarray] | None] = []
            if "predicted" in methods:
                if args.fit_on == "level":
                    ws = fit_predictors(codec)
                else:
                    if args.fit_on not in fixed:
                        fixed[args.fit_on] = fit_predictors(None if args.fit_on == "clean" else kvcodec.get_codec(
                            {"id": LEVEL_PRESETS[float(args.fit_on)], "calibration": str(prof),
                             "target_kl": float(args.fit_on)}))
                    ws = fixed[args.fit_on]
            for t, ev in evs.items():
                for method in methods:
                    coder = LayerCoder(codec, ev.reference, heads, theta, args.predict)
                    try:
                        for layer in range(n_layers):
                            coder.code_layer(layer, ws[layer] if method == "predicted" else None)
                    finally:
                        coder.close()
                    dec = coder.to_cache()
                    kl = float(next_token_metrics(ev.ref_logits, ev._continue(dec), ev.targets)["kl_mean"])
                    bits = 8.0 * coder.nbytes / ev.reference.num_elements
                    rows.append({"model": name, "text": t, "target": target, "scale": scale, "method": method,
                                 "bits": bits, "kl": kl})
                    print(f"{name} {t} level {target} x{scale:g} {method}: {bits:.3f} b, KL {kl:.5f}", flush=True)

        for target in targets:
            measure(target, 1.0, kvcodec.get_codec({"id": LEVEL_PRESETS[target], "calibration": str(prof),
                                                    "target_kl": target}), ("plain", "predicted"))
        profile = parse_profile(load_query_statistics(prof).profile, str(prof))
        for target in scale_targets:
            over = steps_for_target(profile, target)
            base = {**kvcodec.get_codec(LEVEL_PRESETS[target]).get_config(), **over, "calibration": str(prof),
                    "target_kl": 0.0}
            for f in scales:
                measure(target, f, kvcodec.get_codec({**base, "k_step": over["k_step"] * f,
                                                       "v_step": over["v_step"] * f}), ("predicted",))
        del model, evs, fits
    # the predicted coding's saving at its own KL (plain bits there interpolated, log-log)
    savings = []
    for r in rows:
        if r["method"] != "predicted":
            continue
        plain = sorted((q["kl"], q["bits"]) for q in rows if q["method"] == "plain" and q["model"] == r["model"]
                       and q["text"] == r["text"])
        x = np.log([p[0] for p in plain])
        if not x[0] <= np.log(r["kl"]) <= x[-1]:
            savings.append({**r, "plain_bits_at_kl": None, "saving": None})
            continue
        b = float(np.exp(np.interp(np.log(r["kl"]), x, np.log([p[1] for p in plain]))))
        savings.append({**r, "plain_bits_at_kl": b, "saving": 1.0 - r["bits"] / b})
    doc = {"predict": args.predict, "rank": args.rank, "fit_on": args.fit_on, "targets": targets, "texts": texts, "context": args.context, "continuation": args.continuation,
           "level_presets": {str(k): v for k, v in LEVEL_PRESETS.items()}, "rows": rows, "savings": savings}
    lines = ["# kvc on the residual of a prediction from the layer before: closed loop, real KL", "",
             "kvc codes each tensor through its own encode_tensor / decode_tensor with each model's profile at each "
             "level. **plain**: the cache as kvc codes it. **predicted**: layer l >= 1 codes its residual after a ridge "
             f"prediction from layer l-1's decoded K (before RoPE) and V ({ {'kv': 'K and V', 'k': 'K only', 'v': 'V only'}[args.predict]} "
             "predicted" + (f"; weights cut to rank {args.rank}" if args.rank else "")
             + {"level": "", "clean": "; predictors fitted once on the uncoded K and V"}.get(
                 args.fit_on, f"; predictors fitted once at level {args.fit_on}") + "); the predictors are fitted on the four "
             "calibration texts coded the same way. Bits: the tensors' planes per cached value (no container "
             f"header or token ids, the same for both). KL: next-token, {args.context} cached tokens, "
             f"{args.continuation} scored, against the fp16 cache. kvc's steps follow the coded signal's RMS, "
             "so at one level the residual gets finer steps: the saving compares at the predicted point's own KL, "
             "the plain bits there interpolated (log-log) between the plain levels ('-' outside them).", "",
             "| model | text | level | plain b | plain KL | predicted b | predicted KL | plain b at that KL | saving |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in savings:
        if s["scale"] != 1.0:
            continue
        p = next(q for q in rows if q["method"] == "plain" and q["model"] == s["model"] and q["text"] == s["text"]
                 and q["target"] == s["target"])
        pb = "-" if s["plain_bits_at_kl"] is None else f"{s['plain_bits_at_kl']:.3f}"
        sv = "-" if s["saving"] is None else f"{100 * s['saving']:.1f} %"
        lines.append(f"| {s['model']} | {s['text']} | {s['target']:g} | {p['bits']:.3f} | {p['kl']:.5f} | "
                     f"{s['bits']:.3f} | {s['kl']:.5f} | {pb} | {sv} |")
    if scale_targets:
        lines += ["", "## Coarser steps with the prediction on", "",
                  "The predicted coding at a level's profile steps times a scale (the same settings, the predictors "
                  "refitted at those steps): what a search with the prediction on could pick. Beside each, the plain "
                  "coding at the level itself (scale 1), the point today's profile codes at.", "",
                  "| model | text | level | scale | predicted b | predicted KL | plain b at the level | plain KL | "
                  "bits vs plain |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["scale"] == 1.0 or r["method"] != "predicted":
                continue
            p = next(q for q in rows if q["method"] == "plain" and q["model"] == r["model"] and q["text"] == r["text"]
                     and q["target"] == r["target"])
            lines.append(f"| {r['model']} | {r['text']} | {r['target']:g} | {r['scale']:g} | {r['bits']:.3f} | "
                         f"{r['kl']:.5f} | {p['bits']:.3f} | {p['kl']:.5f} | {100 * (r['bits'] / p['bits'] - 1):+.1f} % |")
    doc["scales"], doc["scale_targets"] = scales, scale_targets
    write_result(args.out, doc, "\n".join(lines) + "\n", prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
