"""Reports of an evaluation run: one JSON schema, a Markdown table and a rate–distortion plot.

The results JSON (``schema = "kvcodec.eval/1"``)::

    {
      "schema": "kvcodec.eval/1",
      "provenance": {"command", "commit", "dirty", "machine", "python", "torch", "kvcodec", "date"},
      "command": "kvcodec eval ...", "date": "2026-...Z", "wall_seconds": 812.4,
      "cpu_seconds": 530.2,
      "machine": {"platform": ..., "processor": ..., "cpus": 2, "torch_threads": 2},
      "versions": {"kvcodec": ..., "torch": ..., "transformers": ...},
      "run": {"model": {...identity...}, "geometry": {...}, "text": {...}, "context": 2048,
              "continuation": 512, "attention_queries": 64, "cache_dtype": "float16",
              "num_elements": ..., "reference": {"ppl": ..., "nll": ...}},
      "results": [
        {"name": "kivi-4", "family": "kivi", "config": {...},
         "bytes": ..., "bits_per_element": ..., "ratio_vs_fp16": ..., "lossless": false,
         "encode_seconds": ..., "decode_seconds": ...,
         "next_token": {"kl_mean", "kl_p99", "kl_max", "top1_agreement", "nll_ref", "nll_test",
                        "ppl_ref", "ppl_test", "delta_ppl"},
         "attention": {"out_rel_l2", "out_cosine", "attn_kl", "k_logit_rmse", "k_rel_l2",
                       "v_rel_l2"},             # means over layers and heads
         "per_layer": [{"out_rel_l2": [per query head], ..., "k_rel_l2": [per KV head], ...}],
         "error": null}                         # or "ErrorType: message" (other fields absent)
      ]
    }

Example:
    >>> from kvcodec.harness.report import markdown_table
    >>> r = {"name": "raw", "family": "raw", "bits_per_element": 16.0, "ratio_vs_fp16": 1.0,
    ...      "next_token": {"kl_mean": 0.0}, "attention": {"out_rel_l2": 0.0}, "error": None}
    >>> "| raw | raw | 16.000 |" in markdown_table([r])
    True
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Any

SCHEMA = "kvcodec.eval/1"

#: Markdown columns: (header, getter path, format).
_COLUMNS: list[tuple[str, tuple[str, ...], str]] = [
    ("codec", ("name",), "s"),
    ("family", ("family",), "s"),
    ("bits/elem", ("bits_per_element",), ".3f"),
    ("× vs fp16", ("ratio_vs_fp16",), ".2f"),
    ("KL mean", ("next_token", "kl_mean"), ".2e"),
    ("KL p99", ("next_token", "kl_p99"), ".2e"),
    ("top-1", ("next_token", "top1_agreement"), ".4f"),
    ("ΔPPL", ("next_token", "delta_ppl"), "+.4f"),
    ("attn out rel L2", ("attention", "out_rel_l2"), ".2e"),
    ("attn cos", ("attention", "out_cosine"), ".6f"),
    ("attn KL", ("attention", "attn_kl"), ".2e"),
    ("K logit RMSE", ("attention", "k_logit_rmse"), ".2e"),
    ("K rel L2", ("attention", "k_rel_l2"), ".2e"),
    ("V rel L2", ("attention", "v_rel_l2"), ".2e"),
    ("enc s", ("encode_seconds",), ".2f"),
    ("dec s", ("decode_seconds",), ".2f"),
]


def _get(rec: dict[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(rec, dict):
            return None
        rec = rec.get(p)  # type: ignore[assignment]
    return rec


def _fmt(v: Any, fmt: str) -> str:
    if v is None:
        return "—"
    if fmt == "s":
        return str(v)
    try:
        return format(float(v), fmt)
    except (TypeError, ValueError):
        return str(v)


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per result, sorted as given; failed codecs show their error."""
    head = "| " + " | ".join(c[0] for c in _COLUMNS) + " |"
    sep = "|" + "|".join("---" if c[2] == "s" else "---:" for c in _COLUMNS) + "|"
    rows = [head, sep]
    for r in results:
        if r.get("error"):
            cells = [str(r.get("name")), str(r.get("family")), f"error: {r['error']}"]
            cells += [""] * (len(_COLUMNS) - len(cells))
        else:
            cells = [_fmt(_get(r, path), fmt) for _, path, fmt in _COLUMNS]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def machine_info() -> dict[str, Any]:
    """Where the run happened: platform, processor, CPU count, torch threads."""
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": "cpu",
    }


def versions() -> dict[str, str]:
    import torch

    from .. import __version__

    out = {"kvcodec": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return out


def markdown_report(doc: dict[str, Any]) -> str:
    """The full Markdown report: how the run was made, then the table."""
    run = doc.get("run", {})
    model = run.get("model", {})
    times = (f"wall time {doc.get('wall_seconds', 0):.0f} s, CPU time {doc.get('cpu_seconds', 0):.0f} s "
             "(all threads)")
    lines = [f"# kvcodec eval — {model.get('model_id', '?')}", ""]
    if doc.get("provenance"):  # the uniform header (kvcodec.harness.results) replaces the three lines
        from .results import provenance_markdown

        lines += [provenance_markdown(doc["provenance"]).rstrip("\n"), f"- {times}"]
    else:
        lines += [
            f"- command: `{doc.get('command', '')}`",
            f"- date: {doc.get('date', '')}; {times}",
            f"- machine: {doc.get('machine', {}).get('cpus')} CPUs, {doc.get('machine', {}).get('platform')}",
        ]
    lines += [
        f"- model: {model.get('model_id')} ({model.get('revision')}), config {model.get('config_hash')}",
        f"- text: {run.get('text', {}).get('name')}; context {run.get('context')} tokens, "
        f"{run.get('continuation')} scored continuation tokens; cache dtype {run.get('cache_dtype')}",
        f"- reference perplexity (uncompressed cache): {run.get('reference', {}).get('ppl')}",
        "- bits/elem: exact all-in size of `codec.encode(cache)` (headers, scales, tables "
        "included) × 8 / number of cached values; KL = KL(reference ‖ codec) in nats per scored "
        f"token; attention metrics: means over layers and heads with {run.get('attention_queries')} "
        "real continuation queries per layer (teacher forced).",
    ]
    if run.get("left_out"):
        lines.append(f"- left out: {', '.join(run['left_out'])} (kvc presets tuned for a calibration file; "
                     "run with `--calibration FILE` from `kvcodec calibrate` to include them)")
    if run.get("calibration"):
        lines.append(f"- calibration file for the `-cal` presets: {run['calibration']}")
    lines += ["", markdown_table(doc.get("results", []))]
    return "\n".join(lines)


def rd_plot(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Rate–distortion PNG: bits per element against next-token KL and against attention
    output error, one curve per codec family (log y; exact zeros drawn at the floor, hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in doc.get("results", []) if not r.get("error")]
    fams: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        fams.setdefault(r["family"], []).append(r)
    panels = [("next_token", "kl_mean", "next-token KL (nats, mean)"),
              ("attention", "out_rel_l2", "attention output rel. L2 error")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, (group, key, label) in zip(axes, panels):
        vals = [_get(r, (group, key)) for r in results]
        pos = [v for v in vals if v]
        floor = min(pos) / 10 if pos else 1e-6
        for i, (fam, rs) in enumerate(sorted(fams.items())):
            rs = sorted(rs, key=lambda r: r["bits_per_element"])
            xs = [r["bits_per_element"] for r in rs]
            ys = [(_get(r, (group, key)) or 0.0) for r in rs]
            # tab10 first (ten distinct hues), then the lighter tab20 shades.
            color = plt.cm.tab10(i % 10) if i < 10 else plt.cm.tab20((2 * (i - 10) + 1) % 20)
            marker = "os^Dv<>ph*"[i % 10]
            ax.plot(xs, [max(y, floor) for y in ys], "-", color=color, label=fam, lw=1.5)
            for r, x, y in zip(rs, xs, ys):
                ax.plot(x, max(y, floor), marker, color=color, mfc=color if y > 0 else "white", ms=6)
                ax.annotate(r["name"], (x, max(y, floor)), fontsize=6.5, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per element (all-in)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    run = doc.get("run", {})
    fig.suptitle(f"{run.get('model', {}).get('model_id', '')}: context {run.get('context')}, "
                 f"continuation {run.get('continuation')} (hollow = exactly 0)", fontsize=10)
    axes[1].legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)


def _clean(obj: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_run(doc: dict[str, Any], out_dir: str | os.PathLike[str], stem: str = "results",
              plot: bool = True) -> dict[str, str]:
    """Write ``{stem}.json``, ``{stem}.md`` and ``{stem}_rd.png`` into ``out_dir``; return paths."""
    from ..format.atomic import atomic_write_bytes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / f"{stem}.json"), "markdown": str(out / f"{stem}.md")}
    atomic_write_bytes(paths["json"], (json.dumps(_clean(doc), indent=1) + "\n").encode())
    atomic_write_bytes(paths["markdown"], markdown_report(doc).encode())
    if plot:
        paths["plot"] = str(out / f"{stem}_rd.png")
        rd_plot(doc, paths["plot"])
    return paths


__all__ = ["SCHEMA", "machine_info", "markdown_report", "markdown_table", "rd_plot", "versions",
           "write_run"]
