"""Why kvc's calibrated encoder weights (layer, head)s and the latest tokens: the Fisher analysis.

On SmolLM2, for window A (calibration: tokens 8192–) and window B (evaluation: tokens 0–), ctx
1536 and 512 scored tokens each, this script

1. estimates the diagonal Fisher information ``F`` of the next-token distributions with respect
   to every cached value (:func:`kvcodec.harness.calibration.fisher_diagonal`, 4 draws);
2. checks it against a measurement: the KL predicted as ``0.5 * sum F_ii d_i**2`` for the
   errors ``d`` of ``kvc-near-cal`` (calibrated, per-head sensitivities off) on window B, against
   the measured mean next-token KL;
3. prints the high-rate theory's saving (bits per element at equal predicted KL) of giving each
   group a step ``∝ (F·d²)^(-1/2)``, with the weights fitted on A and applied to B ("transfer")
   and fitted on B itself ("oracle"), per (layer, role), (layer, role, head) and (…, channel);
4. prints how much of the sensitivity (F in kvc's step units) sits in the latest 10 % of tokens.

    python eval/studies/kvc_fisher.py --out eval/results/kvc_fisher

Theory overstates real gains (dead zones: coarsening saves less than refining costs); the
measured gains are in eval/results/kvc_rd.md and kvc_presets*.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvcodec.harness.results import provenance, write_result
from kvcodec.harness.studies import text_window


def _gain(a_fit: np.ndarray, a_true: np.ndarray, n: np.ndarray) -> float:
    """Bits per element saved at equal total weighted distortion by steps ∝ a_fit**-1/2."""
    a_fit, a_true = np.maximum(a_fit, 1e-30), np.maximum(a_true, 1e-30)
    k = (n * a_true).sum() / (n * a_true / a_fit).sum()
    return float(0.5 * (np.log2(k) - (n * np.log2(a_fit)).sum() / n.sum()))


def _groups(weighted: dict, gran: str, roles: str) -> dict:
    out = {}
    for (i, r), w in weighted.items():
        if r not in roles:
            continue
        if gran == "layer":
            out[(i, r)] = (w.sum(), w.size)
        elif gran == "head":
            for h in range(w.shape[1]):
                out[(i, r, h)] = (w[:, h].sum(), w[:, h].size)
        else:
            for h in range(w.shape[1]):
                for c in range(w.shape[2]):
                    out[(i, r, h, c)] = (w[:, h, c].sum(), w.shape[0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import kvcodec
    from kvcodec.harness import default_text, load_model
    from kvcodec.harness.calibration import fisher_diagonal, query_statistics, save_query_statistics
    from kvcodec.harness.evaluate import Evaluator

    model, tok = load_model()
    text = default_text()
    windows = {"A": 8192, "B": 0}
    evs = {w: Evaluator(model, tok, text_window(tok, text, off) if off else text, 1536, 512)
           for w, off in windows.items()}
    cal = Path("/tmp") / "kvc_fisher_calib.qstats.safetensors"
    save_query_statistics(query_statistics(model, tok, text, context=1536, skip_tokens=8192), cal)
    # kvc-near-cal as it was before the Fisher weights and the recency ramp existed
    codec = kvcodec.get_codec({"id": "kvc", "k_step": 0.32, "v_step": 1.15, "sink_v_ratio": 0.0, "attn_coarse": 1.0,
                               "calibration": str(cal), "sens": 0.0})
    weighted, measured, sens_b = {}, {}, {}
    for w, ev in evs.items():
        _, fisher = fisher_diagonal(model, ev.token_ids[:1536], ev.cont_ids, samples=4)
        dec = codec.decode(codec.encode(ev.reference))
        weighted[w] = {(i, r): 0.5 * f[r].numpy() * (dec.layers[i][r].double() - ev.reference.layers[i][r].double()).pow(2).numpy()
                       for i, f in enumerate(fisher) for r in ("k", "v")}
        measured[w] = ev.evaluate(codec)["next_token"]["kl_mean"]
        if w == "B":  # per-token sensitivity in kvc's step units (K: head RMS after centring; V: token RMS)
            for i, f in enumerate(fisher):
                k, v = (ev.reference.layers[i][r][1:].double() for r in ("k", "v"))
                uk = (k - k.mean(0)).pow(2).mean(dim=(0, 2))[None, :]
                sens_b[(i, "k")] = (f["k"][1:].mean(2) * uk).numpy()
                sens_b[(i, "v")] = (f["v"][1:].mean(2) * v.pow(2).mean(2)).numpy()
    rows = []
    for roles in ("k", "v", "kv"):
        for gran in ("layer", "head", "channel"):
            ga, gb = _groups(weighted["A"], gran, roles), _groups(weighted["B"], gran, roles)
            keys = sorted(gb)
            a = np.array([ga[k][0] / ga[k][1] for k in keys])
            b = np.array([gb[k][0] / gb[k][1] for k in keys])
            n = np.array([gb[k][1] for k in keys], dtype=float)
            # only the groups of `roles` move; the other role's error is unchanged, and the saving is per element of all
            frac = n.sum() / sum(x.size for x in weighted["B"].values())
            rows.append({"roles": roles, "groups": gran, "transfer_bits": round(frac * _gain(a, b, n), 3),
                         "oracle_bits": round(frac * _gain(b, b, n), 3)})
    tail = {}
    for (i, r), s in sens_b.items():  # [T-1, H], token 0 (stored exactly) left out
        tail[f"{i}.{r}"] = [round(float(v), 2) for v in s[-len(s) // 10:].sum(0) / np.maximum(s.sum(0), 1e-30)]
    shares = np.array([v for vals in tail.values() for v in vals])
    res = {
        "codec": "kvc-near-cal as before this analysis (k 0.32, v 1.15, no Fisher weights, no recency ramp), calibration file from window A",
        "predicted_kl_B": round(float(sum(x.sum() for x in weighted["B"].values())), 5),
        "measured_kl_B": round(measured["B"], 5),
        "predicted_kl_A": round(float(sum(x.sum() for x in weighted["A"].values())), 5),
        "measured_kl_A": round(measured["A"], 5),
        "allocation": rows,
        "latest_10pct_share": {"median": round(float(np.median(shares)), 2), "p25": round(float(np.percentile(shares, 25)), 2),
                               "p75": round(float(np.percentile(shares, 75)), 2), "per_layer_role_head": tail},
    }
    md = [f"# kvc: Fisher analysis on SmolLM2 (ctx 1536, 512 scored tokens; A = tokens 8192–, B = tokens 0–)", "",
          f"- codec: {res['codec']}",
          f"- predicted mean KL (0.5·Σ F·d²) vs measured: A {res['predicted_kl_A']} vs {res['measured_kl_A']}, "
          f"B {res['predicted_kl_B']} vs {res['measured_kl_B']}",
          f"- share of the sensitivity (F in kvc's step units) in the latest 10 % of tokens, per (layer, role, head) on B: median "
          f"{res['latest_10pct_share']['median']} (quartiles {res['latest_10pct_share']['p25']}–{res['latest_10pct_share']['p75']})",
          "", "High-rate saving (bits per element, all elements) of steps ∝ (F·d²)^-1/2 per group, fitted on A "
          "(transfer) or on B (oracle), applied to B:", "",
          "| roles | groups | transfer | oracle |", "|---|---|---|---|"]
    md += [f"| {r['roles']} | {r['groups']} | {r['transfer_bits']} | {r['oracle_bits']} |" for r in rows]
    print("\n".join(md))
    if args.out:
        write_result(args.out, res, "\n".join(md), prov=prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
