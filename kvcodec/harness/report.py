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
    ("family", ("family",), "id"),
    ("bits/elem", ("bits_per_element",), ".3f"),
    ("× vs fp16", ("ratio_vs_fp16",), ".2f"),
    ("KL mean", ("next_token", "kl_mean"), ".2e"),
    ("KL p99", ("next_token", "kl_p99"), ".2e"),
    ("top-1", ("next_token", "top1_agreement"), ".4f"),
    ("ΔPPL %", ("next_token", "delta_ppl"), "pct"),
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


def _cell(r: dict[str, Any], path: tuple[str, ...], fmt: str) -> str:
    """A table cell: ``id`` is the codec family up to its parameters (they are in the JSON's
    ``family`` and ``config``), ``pct`` ΔPPL relative to the reference perplexity, in percent."""
    v = _get(r, path)
    if fmt == "id":
        return str(v).split("(")[0] if v is not None else "—"
    if fmt == "pct":
        ref = _get(r, ("next_token", "ppl_ref"))
        return "—" if v is None or not ref else f"{100.0 * float(v) / float(ref):+.2f}"
    return _fmt(v, fmt)


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per result, sorted as given; failed codecs show their error."""
    head = "| " + " | ".join(c[0] for c in _COLUMNS) + " |"
    sep = "|" + "|".join("---" if c[2] in ("s", "id") else "---:" for c in _COLUMNS) + "|"
    rows = [head, sep]
    for r in results:
        if r.get("error"):
            cells = [str(r.get("name")), _cell(r, ("family",), "id"), f"error: {r['error']}"]
            cells += [""] * (len(_COLUMNS) - len(cells))
        else:
            cells = [_cell(r, path, fmt) for _, path, fmt in _COLUMNS]
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
    """Rate–distortion PNG: bits per element against next-token KL (left) and against attention
    output error (right), log y, one colour and marker per codec id, the same in every plot (a
    line per family), the Pareto front over all points dashed grey, a "lower left is better"
    note, the legend below the panels. Each preset and each point on the front is labelled with
    its name (a parameter point with its parameters, :func:`kvcodec.harness.rdplot.short_label`);
    a parameter point off the front is labelled only where its label fits right beside it (its
    row is in the table). Labels never overlap each other, a marker or the front
    (:func:`kvcodec.harness.rdplot.place_labels`). Exact zeros (lossless rows) are drawn hollow at
    a floor a decade under the smallest non-zero value, and only then does the title say so.
    Needs matplotlib (the ``[eval]`` extra).

    Example:
        >>> import tempfile, os
        >>> doc = {"run": {"model": {"model_id": "demo"}, "context": 8, "continuation": 4},
        ...        "results": [{"name": n, "family": "kivi", "bits_per_element": b,
        ...                     "next_token": {"kl_mean": k}, "attention": {"out_rel_l2": k}}
        ...                    for n, b, k in (("kivi-2", 3.0, 0.2), ("kivi-4", 5.0, 0.003))]}
        >>> p = os.path.join(tempfile.mkdtemp(), "rd.png"); rd_plot(doc, p); os.path.getsize(p) > 0
        True
    """
    from . import rdplot

    plt = rdplot.pyplot()
    fig = _rd_figure(doc, plt)
    fig.savefig(os.fspath(path), dpi=rdplot.DPI)
    plt.close(fig)


def _rd_figure(doc: dict[str, Any], plt: Any) -> Any:
    """The figure :func:`rd_plot` saves (tests inspect it before it is written)."""
    from . import rdplot

    results = [r for r in doc.get("results", []) if not r.get("error") and r.get("bits_per_element") is not None]
    # one colour and legend entry per codec id (the family up to its parameters); one line per
    # family inside it (kivi-ans and kivi-ans(delta=8) are two curves of one colour)
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        fam = r.get("family") or r["name"]
        groups.setdefault(fam.split("(")[0], {}).setdefault(fam, []).append(r)
    panels = [("next_token", "kl_mean", "next-token KL (nats, mean)"),
              ("attention", "out_rel_l2", "attention output rel. L2 error")]
    fig, axes = plt.subplots(1, 2, figsize=(rdplot.FIG_WIDTH_IN, 6.4), dpi=rdplot.DPI)
    handles: dict[str, Any] = {}
    any_zero = False
    per_axes = []
    for ax, (group, key, label) in zip(axes, panels):
        pos = [v for r in results if (v := _get(r, (group, key)))]
        floor = min(pos) / 10 if pos else 1e-6
        xy: list[tuple[float, float]] = []
        names: list[str] = []
        colors: list[Any] = []
        for cid, fams in sorted(groups.items()):
            color, marker = _family_style(cid, sorted(groups), plt)
            for j, (fam, rs) in enumerate(sorted(fams.items(), key=lambda f: (f[0] != cid, f[0]))):
                rs = sorted(rs, key=lambda r: r["bits_per_element"])
                xs = [r["bits_per_element"] for r in rs]
                ys = [(_get(r, (group, key)) or 0.0) for r in rs]
                shown = [max(y, floor) for y in ys]
                (h,) = ax.plot(xs, shown, ls="-" if j == 0 else ":", marker=marker, color=color, lw=1.5,
                               ms=6.5, zorder=3, label=cid)
                for x, y, y_shown in zip(xs, ys, shown):
                    if y <= 0:
                        any_zero = True
                        ax.plot(x, y_shown, marker, color=color, mfc="white", ms=6.5, zorder=3.5)
                handles.setdefault(cid, h)
                xy += list(zip(xs, shown))
                names += [r["name"] for r in rs]
                colors += [color] * len(rs)
        front = rdplot.draw_front(ax, [p[0] for p in xy], [p[1] for p in xy])
        if front is not None:
            handles.setdefault(rdplot.FRONT_LABEL, front)
        ax.set_yscale("log")
        ax.set_xlabel("bits per element (all-in)", fontsize=rdplot.AXIS_PT)
        ax.set_ylabel(label, fontsize=rdplot.AXIS_PT)
        ax.tick_params(labelsize=rdplot.LABEL_PT + 0.5)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
        ax.margins(x=0.08, y=0.12)
        per_axes.append((ax, xy, names, colors))
    run = doc.get("run", {})
    title = (f"{run.get('model', {}).get('model_id', '')}: context {run.get('context')}, "
             f"continuation {run.get('continuation')}")
    if any_zero:
        title += " — hollow marker: exactly 0, drawn at the floor"
    fig.suptitle(title, fontsize=rdplot.TITLE_PT)
    legend = fig.legend(list(handles.values()), list(handles.keys()), loc="lower center",
                        bbox_to_anchor=(0.5, 0.005), ncol=min(5, len(handles)), fontsize=rdplot.LABEL_PT,
                        frameon=False, columnspacing=1.6, handlelength=2.6)
    fig.canvas.draw()
    legend_h = legend.get_window_extent().height / fig.bbox.height
    fig.tight_layout(rect=(0, legend_h + 0.01, 1, 0.965))
    for ax, xy, names, colors in per_axes:
        hint = rdplot.better_hint(ax, xy)
        front = set(rdplot.pareto_front([p[0] for p in xy], [p[1] for p in xy]))
        # Pareto points and preset names first; parameter points take what room is left
        prio = [(0 if i in front else 1) + (2 if rdplot.has_params(n) else 0) for i, n in enumerate(names)]
        # a parameter point's label is its parameters: colour and legend name the family; off the
        # front, it is labelled only where the label fits right beside it (no leader line)
        rdplot.place_labels(ax, xy, [rdplot.short_label(n, base=False) for n in names], priority=prio,
                            colors=[_darker(c) for c in colors], avoid=[hint],
                            near_only=[p >= 3 for p in prio])
    return fig


#: the built-in codec ids, each with a colour and marker of its own in every plot (the order of
#: matplotlib's tab10 hues and of the markers): a family looks the same whichever others share it
FAMILY_ORDER = ("cachegen", "cachegen-lmcache", "fp16", "fp8", "kivi", "kivi-ans", "kvc", "nvfp4", "raw")


def _family_style(cid: str, present: list[str], plt: Any) -> tuple[Any, str]:
    """The colour and marker of codec id ``cid``: its own (:data:`FAMILY_ORDER`), or for an id
    not built in (``present``: the sorted ids of the plot) the next of tab10's tenth hue and
    tab20's lighter shades."""
    if cid in FAMILY_ORDER:
        i = FAMILY_ORDER.index(cid)
    else:
        i = len(FAMILY_ORDER) + [c for c in present if c not in FAMILY_ORDER].index(cid)
    color = plt.cm.tab10(i) if i < 10 else plt.cm.tab20((2 * (i - 10) + 1) % 20)
    return color, "os^Dv<>ph*"[i % 10]


def _darker(color: Any) -> tuple[float, float, float]:
    """A label colour: the family's colour, darkened so thin text stays legible on white."""
    r, g, b = color[:3]
    return (0.6 * r, 0.6 * g, 0.6 * b)


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


def replot(json_path: str | os.PathLike[str]) -> Path:
    """Draw ``<stem>_rd.png`` again beside a results ``<stem>.json`` (no model runs; the JSON and
    the Markdown are not touched). Returns the PNG's path."""
    js = Path(json_path)
    png = js.with_name(f"{js.stem}_rd.png")
    rd_plot(json.loads(js.read_text(encoding="utf-8")), png)
    return png


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcodec.harness.report RESULTS.json ...``: redraw each run's rate–distortion PNG."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcodec.harness.report",
                                 description="Draw <stem>_rd.png again from kvcodec eval results <stem>.json "
                                 "(no model). Example: python -m kvcodec.harness.report eval/results/smollm2_*.json")
    ap.add_argument("json", nargs="+", help="results JSON files written by kvcodec eval")
    for p in ap.parse_args(argv).json:
        print(f"wrote {replot(p)}")
    return 0


__all__ = ["SCHEMA", "machine_info", "main", "markdown_report", "markdown_table", "rd_plot", "replot",
           "versions", "write_run"]


if __name__ == "__main__":
    raise SystemExit(main())
