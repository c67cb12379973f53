#!/usr/bin/env python
"""How many bits would predicting each layer's K and V from the layer before save? A measurement
before any format change (issue 20, item 5: "prediction across layers").

K and V of one layer are linear maps of the residual stream, and the residual stream changes little
from one layer to the next, so layer ``l``'s K/V is partly a linear function of layer ``l-1``'s.
This study measures what that is worth *at the rates kvc codes at*, on both real models, in a
simplified coder that stands for kvc's (so the numbers are a guide, not kvc's bits):

* K before RoPE (the ``k_proj`` output: a predictor would un-rotate with the cache's positions),
  each channel scaled by the root of its query energy (``--kweight query``, the default: then
  K's squared error is the logit error's, as kvc's ``k_qgamma`` 1 weights it)
  and V, per layer; each channel centred by its mean, one uniform step per KV head,
  ``step = s x`` the head's RMS after centring (kvc's K step is such a fraction; V here too);
* rate: the zeroth-order entropy of each channel's integer codes (or of their token deltas,
  whichever is smaller, as kvc's ``delta`` rows), summed; no table or side costs;
* distortion: squared error over the centred signal's energy, per role (NMSE);
* **predicted**: layer ``l >= 1`` codes ``x_l - W_l [k_{l-1}, v_{l-1}, 1]`` with the same
  quantiser, closed loop: the prediction uses the previous layer's *reconstruction* at the same
  step (what a decoder has), and ``W_l`` (ridge least squares) is fitted on the reconstructions
  of the four built-in calibration texts at that step, never on the text it is measured on.
  ``--sources same`` predicts K from K and V from V only.

Each step ``s`` gives a point (bits, NMSE) for plain and predicted coding; the report gives, at
each plain point, the predicted coding's bits at the same NMSE (log-log interpolation between its
points) and the saving. Texts: the built-in evaluation texts (prose, code, docs), 1536 tokens
each. The predictors' size is stated: they would live in the model's profile, not in each file.

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_xlayer``).

Usage:
    python eval/studies/kvc_xlayer.py
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from kvcodec.harness.results import provenance, write_result
from kvcodec.harness.studies import ridge_fit as fit, ridge_predict, rope_rotate as rotate


def grab(model: Any, ids: Any) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per layer, the ``k_proj`` and ``v_proj`` outputs ``[T, Dkv]`` (K before RoPE, V) of
    ``ids``, and the query energy per K channel ``[Dkv]``: the mean over tokens and the KV head's
    query heads of ``q^2``, averaged over each RoPE pair (channels ``c`` and ``c + head_dim / 2``
    turn together, so a K error's logit cost spreads over the pair)."""
    import torch

    ks: dict[int, np.ndarray] = {}
    vs: dict[int, np.ndarray] = {}
    qs: dict[int, np.ndarray] = {}
    cfg = model.config
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def q_energy(out: Any) -> np.ndarray:
        q = out[0].double().numpy() ** 2  # [T, Hq * hd]
        e = q.reshape(q.shape[0], cfg.num_key_value_heads, group, hd).mean(axis=(0, 2))  # [Hkv, hd]
        e = (e[:, : hd // 2] + e[:, hd // 2:]) / 2
        return np.concatenate([e, e], axis=1).reshape(-1)

    hooks = []
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        hooks.append(a.q_proj.register_forward_hook(lambda m, inp, out, i=i: qs.__setitem__(i, q_energy(out))))
        hooks.append(a.k_proj.register_forward_hook(
            lambda m, inp, out, i=i: ks.__setitem__(i, out[0].double().numpy())))
        hooks.append(a.v_proj.register_forward_hook(
            lambda m, inp, out, i=i: vs.__setitem__(i, out[0].double().numpy())))
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    n = len(model.model.layers)
    return [ks[i] for i in range(n)], [vs[i] for i in range(n)], [qs[i] for i in range(n)]


def entropy_bits(codes: np.ndarray) -> float:
    """Sum over channels (columns) of the zeroth-order entropy of the integer codes, or of their
    token deltas where smaller (the first row kept), in bits."""
    def col_entropy(c: np.ndarray) -> np.ndarray:
        c = c - c.min(axis=0, keepdims=True)
        span = int(c.max()) + 1
        idx = c + np.arange(c.shape[1])[None] * span
        counts = np.bincount(idx.T.ravel(), minlength=span * c.shape[1]).reshape(c.shape[1], span)
        p = counts / c.shape[0]
        with np.errstate(divide="ignore", invalid="ignore"):
            return -(np.where(p > 0, p * np.log2(p), 0.0)).sum(axis=1) * c.shape[0]
    plain = col_entropy(codes)
    delta = col_entropy(np.vstack([codes[:1], np.diff(codes, axis=0)]))
    return float(np.minimum(plain, delta).sum())


def quantise(x: np.ndarray, heads: int, s: float, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes and reconstruction of ``x`` (centred per channel) with one step per head,
    ``s x`` the RMS of ``ref`` (the signal itself, centred) over that head's channels."""
    t, d = x.shape
    hd = d // heads
    mean = x.mean(axis=0, keepdims=True)
    rc = ref - ref.mean(axis=0, keepdims=True)
    step = np.repeat(s * np.sqrt((rc.reshape(t, heads, hd) ** 2).mean(axis=(0, 2))), hd)[None]
    codes = np.rint((x - mean) / step).astype(np.int64)
    return codes, codes * step + mean


def predictor_input(prev: dict[str, np.ndarray], role: str, sources: str) -> np.ndarray:
    """What predicts ``role`` from the layer before's reconstruction ``prev``: its K and V side
    by side (``sources`` "kv"), or the same role alone ("same")."""
    return np.hstack([prev["k"], prev["v"]]) if sources == "kv" else prev[role]


def code_layer(kx: np.ndarray, vx: np.ndarray, heads: int, s: float, prev: dict[str, np.ndarray] | None,
               w: dict[str, np.ndarray] | None, sources: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One layer's K and V at step ``s``, each after ``w``'s prediction from ``prev`` when ``w``
    is given: per role, the codes and the reconstruction."""
    out = {}
    for role, x in (("k", kx), ("v", vx)):
        p = 0.0 if w is None else ridge_predict(predictor_input(prev, role, sources), w[role])
        codes, r = quantise(x - p, heads, s, x)
        out[role] = (codes, r + p)
    return out


def code_text(k: list[np.ndarray], v: list[np.ndarray], heads: int, s: float,
              preds: list[dict[str, np.ndarray]] | None, sources: str,
              ) -> tuple[dict[str, float], dict[str, float], dict[str, float], list[dict[str, np.ndarray]]]:
    """Code every layer at step ``s``: plain when ``preds`` is None, else layer ``l >= 1`` from
    ``preds[l]``. Returns per role bits, squared error and energy, and the reconstructions."""
    bits = {"k": 0.0, "v": 0.0}
    err = {"k": 0.0, "v": 0.0}
    energy = {"k": 0.0, "v": 0.0}
    recon: list[dict[str, np.ndarray]] = []
    for layer in range(len(k)):
        coded = code_layer(k[layer], v[layer], heads, s, recon[layer - 1] if layer else None,
                           preds[layer] if preds is not None and layer >= 1 else None, sources)
        for role, x in (("k", k[layer]), ("v", v[layer])):
            codes, r = coded[role]
            bits[role] += entropy_bits(codes)
            err[role] += float(((r - x) ** 2).sum())
            energy[role] += float(((x - x.mean(axis=0)) ** 2).sum())
        recon.append({role: coded[role][1] for role in coded})
    return bits, err, energy, recon


def kl_points(model: Any, tok: Any, text: str, heads: int, steps: list[float],
              preds: dict[float, list[dict[str, np.ndarray]]], wq: list[np.ndarray], sources: str,
              context: int, continuation: int) -> list[dict[str, Any]]:
    """Real next-token KL of the simplified coder, plain and predicted, on one evaluation text:
    the fp16 cache's K un-rotated (positions from 0) and weighted, V, coded at each step with
    the first token kept exact (as kvc keeps it), decoded back into a cache and scored."""
    import dataclasses

    import torch

    from kvcodec.harness.capture import rope_info
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.texts import eval_text
    from kvcodec.metrics import next_token_metrics

    _, rope = rope_info(model.config)
    theta = float(rope.get("rope_theta", 10000.0))
    ev = Evaluator(model, tok, eval_text(text), context, continuation, attn_queries=1, text_name=text)
    ref = ev.reference
    shape = ref.layers[0]["k"].shape  # [T, H, D]
    ks = [rotate(l["k"].double().reshape(shape[0], -1).numpy(), heads, theta, -1) * w
          for l, w in zip(ref.layers, wq)]
    vs = [l["v"].double().reshape(shape[0], -1).numpy() for l in ref.layers]
    out = []
    for s in steps:
        for method, pr in (("plain", None), ("predicted", preds[s])):
            bits, _, _, recon = code_text([k[1:] for k in ks], [v[1:] for v in vs], heads, s, pr, sources)
            layers = []
            for layer, rec in enumerate(recon):
                k = rotate(np.vstack([ks[layer][:1], rec["k"]]) / wq[layer], heads, theta, 1)
                v = np.vstack([vs[layer][:1], rec["v"]])
                layers.append({"k": torch.from_numpy(k.reshape(shape)).to(ref.dtype),
                               "v": torch.from_numpy(v.reshape(ref.layers[layer]["v"].shape)).to(ref.dtype)})
            dec = dataclasses.replace(ref, layers=layers)
            kl = next_token_metrics(ev.ref_logits, ev._continue(dec), ev.targets)["kl_mean"]
            elems = 2 * (shape[0] - 1) * shape[1] * shape[2] * len(recon)
            out.append({"text": text, "step": s, "method": method, "bits": (bits["k"] + bits["v"]) / elems,
                        "kl": float(kl)})
            print(f"  {text} step {s} {method}: {out[-1]['bits']:.3f} b, KL {kl:.5f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--steps", default="0.25,0.35,0.5,0.7,1.0,1.4,2.0,2.8,4.0",
                    help="steps as fractions of each head's RMS")
    ap.add_argument("--sources", default="kv", choices=("kv", "same"))
    ap.add_argument("--kweight", default="query", choices=("query", "none"),
                    help="weight K channels by the query energy (the logit error's weight) or not")
    ap.add_argument("--tokens", type=int, default=1536, help="tokens of each evaluation text")
    ap.add_argument("--fit-tokens", type=int, default=1024, help="tokens of each calibration text")
    ap.add_argument("--kl-steps", default="0.5,0.7,1.0,1.4,2.0,2.8",
                    help="steps (of --steps) also scored for real next-token KL ('' for none)")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens of the KL windows")
    ap.add_argument("--continuation", type=int, default=512, help="scored tokens of the KL windows")
    ap.add_argument("--out", default="eval/results/kvc_xlayer")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import torch

    from kvcodec.harness.capture import tokenize
    from kvcodec.harness.models import load_model
    from kvcodec.harness.texts import CALIBRATION_DOMAINS, calibration_text, eval_text

    torch.set_num_threads(2)
    steps = [float(x) for x in args.steps.split(",")]
    texts = ("prose", "code", "docs")
    rows: list[dict[str, Any]] = []
    kl_rows: list[dict[str, Any]] = []
    curves: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for name in args.models.split(","):
        model, tok = load_model(name)
        heads = int(model.config.num_key_value_heads)
        fit_g = [grab(model, tokenize(tok, calibration_text(d), None)[:args.fit_tokens]) for d in CALIBRATION_DOMAINS]
        test_g = {t: grab(model, tokenize(tok, eval_text(t), None)[:args.tokens]) for t in texts}
        # K channels weighted by the query energy (measured on the calibration texts): the
        # squared error of weighted K is the logit error's (kvc's k_qgamma 1)
        if args.kweight == "query":
            wq = [np.sqrt(np.mean([g[2][i] for g in fit_g], axis=0))[None] for i in range(len(fit_g[0][2]))]
        else:
            wq = [np.ones((1, g.shape[0])) for g in fit_g[0][2]]
        fit_kv = [([k * w for k, w in zip(g[0], wq)], g[1]) for g in fit_g]
        test_kv = {t: ([k * w for k, w in zip(g[0], wq)], g[1]) for t, g in test_g.items()}
        n_layers = len(fit_kv[0][0])
        d_kv = fit_kv[0][0][0].shape[1]
        n_in = (2 * d_kv if args.sources == "kv" else d_kv) + 1
        models[name] = {"layers": n_layers, "kv_heads": heads, "kv_dim": d_kv,
                        "predictor_params": 2 * (n_layers - 1) * n_in * d_kv}
        preds_at: dict[float, list[dict[str, np.ndarray]]] = {}
        for s in steps:
            # fit the predictors closed loop on the calibration texts at this step, layer by layer
            preds: list[dict[str, np.ndarray]] = [{}]
            recons = [[{r: c[1] for r, c in code_layer(k[0], v[0], heads, s, None, None, args.sources).items()}]
                      for k, v in fit_kv]  # per fit text, the reconstructions so far
            for layer in range(1, n_layers):
                w: dict[str, np.ndarray] = {}
                for role in ("k", "v"):
                    xs = np.vstack([predictor_input(r[layer - 1], role, args.sources) for r in recons])
                    ys = np.vstack([(kv[0] if role == "k" else kv[1])[layer] for kv in fit_kv])
                    w[role] = fit(xs, ys)
                preds.append(w)
                for i, (k, v) in enumerate(fit_kv):
                    coded = code_layer(k[layer], v[layer], heads, s, recons[i][layer - 1], w, args.sources)
                    recons[i].append({r: c[1] for r, c in coded.items()})
            preds_at[s] = preds
            for t in texts:
                k, v = test_kv[t]
                elems = k[0].size * n_layers
                for method, pr in (("plain", None), ("predicted", preds)):
                    bits, err, energy, _ = code_text(k, v, heads, s, pr, args.sources)
                    for role in ("k", "v"):
                        curves.setdefault(f"{name}|{t}|{role}|{method}", []).append(
                            (s, bits[role] / elems, err[role] / energy[role]))
            print(f"{name}: step {s} done", flush=True)
        if args.kl_steps:
            kl_steps = [float(x) for x in args.kl_steps.split(",")]
            missing = [x for x in kl_steps if x not in preds_at]
            if missing:
                raise SystemExit(f"--kl-steps {missing} are not in --steps")
            for t in texts:
                for r in kl_points(model, tok, t, heads, kl_steps, preds_at, wq, args.sources,
                                   args.context, args.continuation):
                    kl_rows.append({"model": name, **r})
        del model
    # bits of the predicted coding at each plain point's NMSE (log-log interpolation)
    for key, plain in curves.items():
        name, t, role, method = key.split("|")
        if method != "plain":
            continue
        pred = sorted(curves[f"{name}|{t}|{role}|predicted"], key=lambda p: p[2])
        px = np.log([p[2] for p in pred])
        py = np.log([max(p[1], 1e-6) for p in pred])
        for s, b, e in plain:
            if not px[0] <= np.log(e) <= px[-1]:
                continue
            bp = float(np.exp(np.interp(np.log(e), px, py)))
            rows.append({"model": name, "text": t, "role": role, "step": s, "plain_bits": b, "nmse": e,
                         "predicted_bits": bp, "saving": 1.0 - bp / b})
    doc = {"steps": steps, "sources": args.sources, "kweight": args.kweight, "texts": list(texts), "tokens": args.tokens,
           "fit_texts": list(CALIBRATION_DOMAINS), "fit_tokens": args.fit_tokens, "models": models,
           "curves": {k: [list(p) for p in v] for k, v in curves.items()}, "rows": rows}
    lines = ["# Predicting each layer's K and V from the layer before: bits saved at equal error", "",
             "A simplified coder standing for kvc's (per-channel centring, one uniform step per KV head, "
             "zeroth-order entropy of each channel's codes or token deltas; no side costs): **plain** codes every "
             "layer alone (K channels weighted by the query energy where `kweight` is query, so K's squared error "
             "is the logit error's), **predicted** codes layer l's residual after a linear prediction from layer l-1's "
             f"reconstruction ({'K and V' if args.sources == 'kv' else 'the same role'}), fitted on the four "
             "calibration texts at the same step, closed loop. Bits per element of the role; `saving` compares "
             "at equal NMSE (squared error over the centred signal's energy). Texts: the evaluation texts, "
             f"{args.tokens} tokens each.", ""]
    for name, m in models.items():
        lines.append(f"- {name}: {m['layers']} layers, {m['kv_heads']} KV heads, {m['kv_dim']} K values a token; "
                     f"predictors {m['predictor_params']:,} parameters ({2 * m['predictor_params'] / 2**20:.1f} MiB "
                     "in float16), in the profile, not in files")
    lines += ["", "| model | text | role | step | plain b | NMSE | predicted b | saving |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['text']} | {r['role']} | {r['step']:g} | {r['plain_bits']:.3f} | "
                     f"{r['nmse']:.4f} | {r['predicted_bits']:.3f} | {100 * r['saving']:.1f} % |")
    # K and V together near the rates kvc's levels code at (per model, text: the plain step whose
    # K+V bits are nearest 1, 1.5, 2 and 3 bits per element)
    lines += ["", "## K and V together, near kvc's rates", "",
              "Per model and text, the plain step whose mean K+V bits are nearest each rate; the predicted coding's "
              "bits at each role's NMSE there.", "",
              "| model | text | rate | step | plain b (K+V mean) | predicted b | saving |", "|---|---|---|---|---|---|---|"]
    summary = []
    for name in models:
        for t in texts:
            by_step: dict[float, dict[str, dict[str, Any]]] = {}
            for r in rows:
                if r["model"] == name and r["text"] == t:
                    by_step.setdefault(r["step"], {})[r["role"]] = r
            both = {s: d for s, d in by_step.items() if len(d) == 2}
            for rate in (1.0, 1.5, 2.0, 3.0):
                if not both:
                    break
                s = min(both, key=lambda x: abs((both[x]["k"]["plain_bits"] + both[x]["v"]["plain_bits"]) / 2 - rate))
                pb = (both[s]["k"]["plain_bits"] + both[s]["v"]["plain_bits"]) / 2
                qb = (both[s]["k"]["predicted_bits"] + both[s]["v"]["predicted_bits"]) / 2
                summary.append({"model": name, "text": t, "rate": rate, "step": s, "plain": pb, "predicted": qb})
                lines.append(f"| {name} | {t} | ~{rate:g} | {s:g} | {pb:.3f} | {qb:.3f} | {100 * (1 - qb / pb):.1f} % |")
    doc["summary"] = summary
    doc["kl_rows"] = kl_rows
    if kl_rows:
        lines += ["", "## Real next-token KL", "",
                  f"The same coder on each evaluation text's fp16 cache ({args.context} cached tokens, the first kept "
                  f"exact; {args.continuation} scored), decoded back into the cache and scored against it: K and V "
                  "bits per element (mean) and KL at each step, and the bits each coding needs at a KL (log-log "
                  "interpolation between its points; '-' where its points do not reach it).", "",
                  "| model | text | step | plain b | plain KL | predicted b | predicted KL |", "|---|---|---|---|---|---|---|"]
        for name in models:
            for t in texts:
                pts = {(r["step"], r["method"]): r for r in kl_rows if r["model"] == name and r["text"] == t}
                for st in sorted({k[0] for k in pts}):
                    a, b = pts[(st, "plain")], pts[(st, "predicted")]
                    lines.append(f"| {name} | {t} | {st:g} | {a['bits']:.3f} | {a['kl']:.5f} | {b['bits']:.3f} | "
                                 f"{b['kl']:.5f} |")
        lines += ["", "| model | text | KL | plain b | predicted b | saving |", "|---|---|---|---|---|---|"]
        at_kl = []
        for name in models:
            for t in texts:
                def bits_at(method: str, kl: float) -> float | None:
                    p = sorted((r["kl"], r["bits"]) for r in kl_rows
                               if r["model"] == name and r["text"] == t and r["method"] == method and r["kl"] > 0)
                    x = np.log([q[0] for q in p])
                    if not p or not x[0] <= np.log(kl) <= x[-1]:
                        return None
                    return float(np.exp(np.interp(np.log(kl), x, np.log([q[1] for q in p]))))
                for kl in (0.01, 0.02, 0.05):
                    a, b = bits_at("plain", kl), bits_at("predicted", kl)
                    at_kl.append({"model": name, "text": t, "kl": kl, "plain": a, "predicted": b})
                    sav = f"{100 * (1 - b / a):.1f} %" if a and b else "-"
                    lines.append(f"| {name} | {t} | {kl:g} | {'-' if a is None else f'{a:.3f}'} | "
                                 f"{'-' if b is None else f'{b:.3f}'} | {sav} |")
        doc["at_kl"] = at_kl
    write_result(args.out, doc, "\n".join(lines) + "\n", prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
