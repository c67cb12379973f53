#!/usr/bin/env python
"""kvc's quality levels met by measurement: profiles on each model, scored on unseen text.

For each model (SmolLM2-135M, Qwen2.5-Coder-0.5B by default):

1. ``kvcodec calibrate`` (the closed loop of :mod:`kvcodec.harness.profile`) on the built-in
   calibration text, timed; or ``--profile-dir`` with profiles made before.
2. For each evaluation domain (texts that calibration never saw: :mod:`kvcodec.harness.texts`)
   and each context: the fp16 cache of the first ``context`` tokens, then next-token KL, top-1
   agreement and ΔPPL over the next ``--continuation`` tokens, bits all-in, for
   * the level presets with the profile (``{"id": "kvc-near", "calibration": profile}``),
   * the level presets without it (their fixed steps, issue 20 item 4),
   * the baselines fp8-e4m3, nvfp4, kivi-4-ans and cachegen.

The verdicts: each level's mean KL over the domains within its target and its worst window at
most 1.2x the target; near-lossless bits against the best baseline at equal or lower KL.

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default ``eval/results/kvc_profile``):
the plot has a panel per model and context, each level and baseline at its mean bits and mean
KL over the texts, a whisker up to its worst text, the targets, and the Pareto front.

Usage:
    python eval/studies/kvc_profile.py                                        # both models, ctx 1536 and 4096
    python eval/studies/kvc_profile.py --models smollm2-135m --contexts 1536  # a quick look
    python eval/studies/kvc_profile.py --rerender        # the .md and .png again from the .json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from kvcodec.harness.results import provenance, write_result

LEVELS = {"kvc-transparent": 0.002, "kvc-near": 0.01, "kvc-aggressive": 0.05}
BASELINES = ["fp8-e4m3", "nvfp4", "kivi-4-ans", "cachegen"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--contexts", default="1536,4096")
    ap.add_argument("--domains", default="prose,code,docs")
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--profile-dir", default=None,
                    help="profiles are read from here when present, else made and saved here (default: "
                    "the kvcodec cache dir's profiles/, kvcodec.harness.studies.profile_dir)")
    ap.add_argument("--no-fixed", dest="fixed", action="store_false",
                    help="do not score the presets without a profile (scored at the first context by default)")
    ap.add_argument("--baselines", default=",".join(BASELINES))
    ap.add_argument("--no-profile", dest="with_profile", action="store_false",
                    help="score no profile (nor make one): the fixed presets and baselines only")
    ap.add_argument("--out", default="eval/results/kvc_profile")
    ap.add_argument("--rerender", action="store_true",
                    help="only rewrite <out>.md and <out>.png from <out>.json (no model)")
    args = ap.parse_args(argv)
    if args.rerender:
        rerender(Path(args.out).with_suffix(".json"))
        return 0
    prov = provenance(argv)
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.studies import model_profile, profile_dir
    from kvcodec.harness.texts import eval_text

    torch.set_num_threads(2)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    baselines = [b for b in args.baselines.split(",") if b]

    def save(complete: bool) -> None:
        """Write what was measured so far (after each model and context: an interrupted run keeps it)."""
        doc = {"models": args.models.split(","), "contexts": [int(c) for c in args.contexts.split(",")],
               "domains": args.domains.split(","), "continuation": args.continuation, "profiles": profiles,
               "rows": rows, "verdicts": verdicts(rows), "complete": complete}
        write_result(args.out, doc, report(doc), prov=prov, echo=complete)
        if complete:
            plot(doc, Path(args.out).with_suffix(".png"))
    for model_name in args.models.split(","):
        model, tok = load_model(model_name)
        if args.with_profile:
            path, secs = model_profile(model_name, model, tok, Path(args.profile_dir) if args.profile_dir else profile_dir(),
                                  log)
            from kvcodec.codecs.kvc.calibration import Calibration

            prof = Calibration.load(path).stats.profile
            profiles[model_name] = {"path": str(path), "calibration_seconds": secs, "levels": prof["levels"],
                                    "kv_ratio": prof["kv_ratio"], "margin": prof.get("search_margin", prof["margin"]),
                                    "profile_seconds": prof.get("seconds")}
        for ctx in [int(c) for c in args.contexts.split(",")]:
            for domain in args.domains.split(","):
                t0 = time.perf_counter()
                ev = Evaluator(model, tok, eval_text(domain), ctx, args.continuation, attn_queries=1,
                               text_name=f"eval-{domain}")
                log(f"{model_name} ctx {ctx} {domain}: reference in {time.perf_counter() - t0:.0f} s")
                codecs: list[tuple[str, str, Any]] = [
                    (name, "profile", {"id": name, "calibration": str(path)}) for name in LEVELS if args.with_profile]
                if args.fixed and ctx == int(args.contexts.split(",")[0]):  # the first context only (time)
                    codecs += [(name, "fixed", name) for name in LEVELS]
                codecs += [(b, "baseline", b) for b in baselines]
                for name, kind, cfg in codecs:
                    t1 = time.perf_counter()
                    r = ev.score_next_token(cfg)
                    nt = r["next_token"]
                    row = {"model": model_name, "context": ctx, "domain": domain, "codec": name, "kind": kind,
                           "target_kl": LEVELS.get(name), "bits": r["bits_per_element"], "kl_mean": nt["kl_mean"],
                           "kl_p99": nt["kl_p99"], "top1": nt["top1_agreement"], "delta_ppl": nt["delta_ppl"],
                           "ppl_ref": nt["ppl_ref"], "seconds": time.perf_counter() - t1}
                    rows.append(row)
                    log(f"  {name:16s} {kind:8s} {row['bits']:.3f} b  KL {row['kl_mean']:.5f}  top1 {row['top1']:.4f}"
                        f"  dPPL {100 * row['delta_ppl'] / row['ppl_ref']:+.2f} %")
                del ev
            # partial results survive an interrupted run
            save(complete=False)
        del model, tok
    save(complete=True)
    return 0


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, context, codec with a target, kind): mean and worst KL over the domains against
    the target; for the profile levels also the bits against the best baseline at equal or lower KL."""
    out = []
    keys = sorted({(r["model"], r["context"], r["codec"], r["kind"]) for r in rows if r["target_kl"]})
    for model, ctx, codec, kind in keys:
        sel = [r for r in rows if (r["model"], r["context"], r["codec"], r["kind"]) == (model, ctx, codec, kind)]
        t = sel[0]["target_kl"]
        mean_kl = sum(r["kl_mean"] for r in sel) / len(sel)
        worst = max(r["kl_mean"] for r in sel)
        bits = sum(r["bits"] for r in sel) / len(sel)
        base = [r for r in rows if r["model"] == model and r["context"] == ctx and r["kind"] == "baseline"]
        # a baseline beats kvc only where it is at least as good on average over the same windows
        # ... and, beside it, the cheapest baseline that meets the level at all (mean KL within
        # the target): when kvc's KL is lower than every baseline's, the first finds none
        best = in_target = None
        for b in sorted({r["codec"] for r in base}):
            br = [r for r in base if r["codec"] == b]
            bkl = sum(r["kl_mean"] for r in br) / len(br)
            bb = sum(r["bits"] for r in br) / len(br)
            if bkl <= mean_kl and (best is None or bb < best[1]):
                best = (b, bb, bkl)
            if bkl <= t and (in_target is None or bb < in_target[1]):
                in_target = (b, bb, bkl)
        out.append({"model": model, "context": ctx, "codec": codec, "kind": kind, "target_kl": t,
                    "windows": len(sel), "kl_mean": mean_kl, "kl_worst": worst, "bits": bits,
                    "met": mean_kl <= t and worst <= 1.2 * t,
                    "best_baseline_at_equal_kl": None if best is None else
                    {"codec": best[0], "bits": best[1], "kl_mean": best[2], "ratio": best[1] / bits},
                    "best_baseline_in_target": None if in_target is None else
                    {"codec": in_target[0], "bits": in_target[1], "kl_mean": in_target[2],
                     "ratio": in_target[1] / bits}})
    return out


def report(doc: dict[str, Any]) -> str:
    lines = ["# kvc quality levels met by measurement (profiles), on unseen text", "",
             *([] if doc.get("complete", True) else ["**Partial: the run was interrupted; the rows below are all it measured.**", ""]),
             f"Models {', '.join(doc['models'])}; evaluation domains {', '.join(doc['domains'])} "
             f"(kvcodec.harness.texts, never used by calibration); contexts {doc['contexts']}; "
             f"{doc['continuation']} scored tokens; KL against the fp16 cache; bits all-in.", "",
             "## Profiles", "",
             "| model | calibration s | high-rate v/k | margin | level | k_step | level v/k | search KL | held-out KL | bits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    reused = False
    for m, p in doc["profiles"].items():
        secs, mark = p["calibration_seconds"], ""
        if secs is None and p.get("profile_seconds") is not None:  # made by an earlier run: its own time
            secs, mark, reused = p["profile_seconds"], "*", True
        for lv in p["levels"]:
            lines.append(f"| {m} | {'-' if secs is None else f'{secs:.0f}{mark}'} | {p['kv_ratio']:.2f} | {p['margin']} | "
                         f"{lv['name']} | {lv['k_step']:.4f} | {lv['v_step'] / lv['k_step']:.2f} | {lv['kl_search']:.5f} | "
                         f"{lv['kl_holdout']:.5f} | "
                         f"{lv['bits']:.3f} |")
    if reused:
        lines += ["", "\\* the profile was made by an earlier run of this study (same settings): the seconds it "
                  "recorded itself (`kvcodec calibrate` without the model load)."]
    lines += ["", "## Verdicts (mean over the domains; worst window at most 1.2x the target)", "",
              "| model | ctx | codec | kind | target | mean KL | worst KL | bits | met | best baseline at <= KL "
              "| best baseline within the target (its KL) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(b: dict[str, Any] | None, kl: bool = False) -> str:
        return "none" if b is None else (f"{b['codec']} {b['bits']:.2f} b ({b['ratio']:.2f}x" +
                                         (f", KL {b['kl_mean']:.5f})" if kl else ")"))
    for v in doc["verdicts"]:
        lines.append(f"| {v['model']} | {v['context']} | {v['codec']} | {v['kind']} | {v['target_kl']} | "
                     f"{v['kl_mean']:.5f} | {v['kl_worst']:.5f} | {v['bits']:.3f} | {'yes' if v['met'] else 'NO'} | "
                     f"{cell(v['best_baseline_at_equal_kl'])} | {cell(v.get('best_baseline_in_target'), True)} |")
    lines += ["", "## Every window", "",
              "| model | ctx | domain | codec | kind | bits | KL | KL p99 | top-1 | ΔPPL (relative) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['context']} | {r['domain']} | {r['codec']} | {r['kind']} | {r['bits']:.3f} | "
                     f"{r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {r['top1']:.4f} | {100 * r['delta_ppl'] / r['ppl_ref']:+.2f} % |")
    return "\n".join(lines) + "\n"


def rerender(js: Path) -> None:
    """Rewrite ``<stem>.md`` and ``<stem>.png`` from ``<stem>.json`` (its provenance kept): no
    model runs."""
    from kvcodec.harness.results import read_result, with_provenance_block

    doc = read_result(js)
    prov = doc.pop("provenance")
    doc.pop("schema", None)
    js.with_suffix(".md").write_text(with_provenance_block(report(doc), prov))
    plot(doc, js.with_suffix(".png"))


#: (kind, legend label, style, label priority) of the plotted series, in drawing order; labels
#: are placed lowest priority first: the profile's levels (the study's subject), the fixed steps,
#: the baselines
SERIES = (
    ("baseline", "baselines", {"marker": "s", "color": "C0", "ms": 7}, 2),
    ("fixed", "kvc levels without a profile (fixed steps)", {"marker": "D", "color": "C3", "ms": 7}, 1),
    ("profile", "kvc levels with the model's profile", {"marker": "*", "color": "C4", "ms": 12}, 0),
)


def points(doc: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Per (model, context): one point per (codec, kind), the means of its bits and KL over the
    texts and its worst text's KL."""
    groups: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    for r in doc["rows"]:
        groups.setdefault((r["model"], r["context"], r["codec"], r["kind"]), []).append(r)
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for (model, ctx, codec, kind), rs in groups.items():
        out.setdefault((model, ctx), []).append({
            "codec": codec, "kind": kind, "bits": sum(r["bits"] for r in rs) / len(rs),
            "kl_mean": sum(r["kl_mean"] for r in rs) / len(rs), "kl_worst": max(r["kl_mean"] for r in rs),
            "texts": len(rs)})
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """Write :func:`figure` as a PNG (nothing without matplotlib, the ``[eval]`` extra)."""
    from kvcodec.harness.rdplot import write_png

    if write_png(figure, doc, path):
        print(f"wrote {path}")


def figure(doc: dict[str, Any], plt: Any) -> Any:
    """The study's figure: a panel per model (rows) and context (columns), mean next-token KL
    over the texts against mean all-in bits, log KL; a whisker from each point up to its worst
    text; the targets; the Pareto front; labels by preset name (kvc levels without a profile
    marked "fixed"); the legend below the panels."""
    from kvcodec.harness import rdplot

    pts = points(doc)
    models = [m for m in doc["models"] if any(k[0] == m for k in pts)]
    contexts = [c for c in doc["contexts"] if any(k[1] == c for k in pts)]
    fig, axes = plt.subplots(len(models), len(contexts), squeeze=False, dpi=rdplot.DPI,
                             figsize=(rdplot.FIG_WIDTH_IN, 1.2 + 4.8 * len(models)))
    ys = [p[k] for ps in pts.values() for p in ps for k in ("kl_mean", "kl_worst")]
    lo, hi = min(ys + [t for t, _ in rdplot.TARGETS]) / 1.6, max(ys + [t for t, _ in rdplot.TARGETS]) * 1.6
    xmax = max(p["bits"] for ps in pts.values() for p in ps) * 1.1
    handles: dict[str, Any] = {}
    placed = []
    for i, model in enumerate(models):
        for j, ctx in enumerate(contexts):
            ax = axes[i][j]
            here = pts.get((model, ctx), [])
            xy, texts, colors, prio = [], [], [], []
            for kind, label, style, p_label in SERIES:
                rs = sorted((p for p in here if p["kind"] == kind), key=lambda p: p["bits"])
                if not rs:
                    continue
                (h,) = ax.plot([p["bits"] for p in rs], [p["kl_mean"] for p in rs], ls="none", zorder=3.4,
                               label=label, **style)
                handles.setdefault(label, h)
                for p in rs:
                    if p["texts"] > 1:
                        ax.plot([p["bits"]] * 2, [p["kl_mean"], p["kl_worst"]], color=style["color"], lw=1.0,
                                alpha=0.7, zorder=3)
                    xy.append((p["bits"], p["kl_mean"]))
                    texts.append(p["codec"] + (" fixed" if kind == "fixed" else ""))
                    colors.append(style["color"])
                    prio.append(p_label)
            if xy:
                front = rdplot.draw_front(ax, [p[0] for p in xy], [p[1] for p in xy])
                if front is not None:
                    handles.setdefault(rdplot.FRONT_LABEL, front)
            rdplot.draw_targets(ax, named=j == len(contexts) - 1)  # named in the right-hand margin
            ax.set_yscale("log")
            ax.set_ylim(lo, hi)
            ax.set_xlim(0, xmax)
            ax.set_title(f"{model}, context {ctx}", fontsize=rdplot.AXIS_PT)
            ax.set_xlabel("bits per element (all-in, mean over the texts)", fontsize=rdplot.AXIS_PT)
            ax.set_ylabel("next-token KL (nats, mean)", fontsize=rdplot.AXIS_PT)
            ax.tick_params(labelsize=rdplot.LABEL_PT + 0.5)
            ax.grid(True, which="major", alpha=0.35)
            ax.grid(True, which="minor", alpha=0.12)
            placed.append((ax, xy, texts, colors, prio))
    texts_of = ", ".join(doc.get("domains", []))
    fig.suptitle(f"kvc's quality levels on texts calibration never saw ({texts_of}; "
                 f"{doc.get('continuation')} scored tokens each)\n"
                 f"a point: the mean over the texts; its whisker: up to the worst text", fontsize=rdplot.TITLE_PT)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", bbox_to_anchor=(0.5, 0.005),
               ncol=2, fontsize=rdplot.LABEL_PT, frameon=False, columnspacing=1.6)
    fig.tight_layout(rect=(0, 0.06, 1, 0.98))
    for ax, xy, texts, colors, prio in placed:
        rdplot.place_labels(ax, xy, texts, priority=prio, colors=colors, avoid=[rdplot.better_hint(ax, xy)])
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
