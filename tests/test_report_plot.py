"""The rate–distortion plots (kvcodec.harness.report.rd_plot, eval/studies/kvc_rd.py): Pareto
front, preset-name labels that do not collide, legend outside the data, readable text, the
hollow-marker note only when a value is exactly 0. No model is loaded: the documents are made up."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvcodec.harness import rdplot
from kvcodec.harness.rdplot import has_params, pareto_front, short_label

ROOT = Path(__file__).resolve().parents[1]


# --- pure helpers --------------------------------------------------------------------------------

def test_pareto_front_is_exactly_the_non_dominated_points():
    xs = [1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 0.5, 5.0, 2.5]
    ys = [0.9, 0.2, 0.3, 0.2, 0.05, 0.05, 1.0, 0.0, 0.2]
    # (2, .3) loses to (2, .2); (3, .2) and (2.5, .2) lose to (2, .2); (4, .05) loses to (3, .05)
    assert pareto_front(xs, ys) == [6, 0, 1, 4, 7]
    # brute force agrees on every point
    for i in range(len(xs)):
        dominated = any(xs[j] <= xs[i] and ys[j] <= ys[i] and (xs[j] < xs[i] or ys[j] < ys[i])
                        for j in range(len(xs)))
        assert (i in pareto_front(xs, ys)) is (not dominated)


def test_pareto_front_keeps_ties_and_skips_missing():
    assert pareto_front([1.0, 1.0, 2.0], [0.5, 0.5, 0.1]) == [0, 1, 2]  # equal points: both kept
    assert pareto_front([16.0, 16.0], [0.0, 0.0]) == [0, 1]  # raw and fp16, both exact
    assert pareto_front([1.0, float("nan"), 0.5], [0.1, 0.01, math.nan]) == [0]
    assert pareto_front([], []) == []


def test_short_labels_name_presets_and_shorten_parameter_points():
    assert short_label("kvc-near") == "kvc-near"
    assert short_label("kvc-near-cal (+calibration)") == "kvc-near-cal"
    assert short_label("kivi-4[bits=3]") == "kivi-4 bits 3"
    assert short_label("kivi-4[bits=3]", base=False) == "bits 3"
    assert short_label("kvc[k_step=0.7,v_step=0.7]", base=False) == "k,v 0.7"
    assert short_label("kvc(k_step=0.35, v_step=1.05)", base=False) == "k 0.35 v 1.05"
    assert short_label("cachegen[levels=[63, 31, 31]]") == "cachegen levels 63/31/31"
    assert short_label("kvc-near-cal {'pack': 0} (+calibration)", base=False) == "pack 0"
    # an ablation step is prose: left alone (and never cut mid-word below the limit)
    assert short_label("kvc: centring only (V per head, no sinks)", max_len=60) == \
        "kvc: centring only (V per head, no sinks)"
    assert len(short_label("x" * 80)) == 28
    assert not has_params("kvc-transparent-cal (+calibration)") and has_params("kivi-4[bits=3]")


# --- the kvcodec eval plot ------------------------------------------------------------------------

def _row(name, family, bits, kl, err=None):
    return {"name": name, "family": family, "bits_per_element": bits, "error": None,
            "next_token": {"kl_mean": kl}, "attention": {"out_rel_l2": err if err is not None else kl ** 0.5}}


def _doc(rows):
    return {"run": {"model": {"model_id": "demo/model"}, "context": 64, "continuation": 16}, "results": rows}


KVC_NEAR_FAMILY = "kvc(precision=14,recent_fine=4.0,recent_ramp=128)"
CROWDED = [
    # three kivi-2 variants at nearly the same spot (issue #22: their labels merged into one word)
    _row("kivi-2", "kivi", 3.02, 0.199), _row("kivi-2-ans", "kivi-ans", 2.77, 0.199),
    _row("kivi-2-delta-ans", "kivi-ans(delta=8)", 3.22, 0.199),
    _row("kivi-4", "kivi", 5.03, 0.0034), _row("kivi-4-ans", "kivi-ans", 4.90, 0.0034),
    _row("kivi-4-delta-ans", "kivi-ans(delta=8)", 5.42, 0.0034),
    _row("kivi-4[bits=3]", "kivi", 4.03, 0.0176), _row("kivi-4-ans[bits=3]", "kivi-ans", 3.86, 0.0176),
    _row("cachegen", "cachegen", 4.04, 0.0092), _row("nvfp4", "nvfp4", 4.53, 0.0122),
    _row("kvc-near", KVC_NEAR_FAMILY, 2.34, 0.0043),
    _row("kvc-transparent", "kvc(max_level=48,precision=14,recent_fine=4.0,recent_ramp=128)", 3.03, 0.0015),
    _row("kvc-aggressive", "kvc(max_level=16,precision=14,recent_fine=4.0,recent_ramp=128)", 1.25, 0.043),
    _row("fp8-e4m3", "fp8", 8.02, 0.0015), _row("fp8-e5m2", "fp8", 8.02, 0.0067),
]


@pytest.fixture
def plt():
    pytest.importorskip("matplotlib")
    p = rdplot.pyplot()
    yield p
    p.close("all")


def _point_labels(ax):
    from matplotlib.text import Annotation

    return [t for t in ax.texts if isinstance(t, Annotation) and "lower left is better" not in t.get_text()]


def _text_box(t, renderer):
    """The text's own box (an Annotation's extent would include its leader line)."""
    from matplotlib.text import Text

    return Text.get_window_extent(t, renderer)


def _all_texts(fig):
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _leaders(ax, renderer):
    """(label, point, text centre) in display px for each label drawn with a leader line: the
    leader runs from the text's centre towards the point (matplotlib's default relpos)."""
    import numpy as np

    out = []
    for t in _point_labels(ax):
        if t.arrow_patch is not None:
            b = _text_box(t, renderer)
            out.append((t, ax.transData.transform(np.asarray(t.xy, dtype=float)),
                        np.array([(b.x0 + b.x1) / 2, (b.y0 + b.y1) / 2])))
    return out


def _segment_enters(a, b, box, steps=400):
    """Whether the straight segment a-b passes through the inside of ``box`` (sampled, 1 px in)."""
    import numpy as np

    t = np.linspace(0, 1, steps)[:, None]
    p = a + (b - a) * t
    inside = (p[:, 0] > box.x0 + 1) & (p[:, 0] < box.x1 - 1) & (p[:, 1] > box.y0 + 1) & (p[:, 1] < box.y1 - 1)
    return bool(np.any(inside))


def assert_leaders_cross_no_label(ax, renderer):
    labels = _point_labels(ax)
    boxes = {id(t): _text_box(t, renderer) for t in labels}
    for t, a, c in _leaders(ax, renderer):
        for u in labels:
            if u is not t:
                assert not _segment_enters(a, c, boxes[id(u)]), \
                    f"the leader of {t.get_text()!r} crosses the label {u.get_text()!r}"


def assert_front_crosses_no_label(ax, renderer):
    """The Pareto front (its staircase as drawn) passes through no label's text."""
    import numpy as np

    (front,) = [ln for ln in ax.get_lines() if ln.get_label() == rdplot.FRONT_LABEL]
    xy = front.get_xydata()
    stair = [xy[0]]
    for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:]):  # steps-post: across, then down
        stair += [(x1, y0), (x1, y1)]
    v = ax.transData.transform(np.asarray(stair))
    for t in _point_labels(ax):
        b = _text_box(t, renderer)
        for a, c in zip(v[:-1], v[1:]):
            assert not _segment_enters(a, c, b), f"the Pareto front runs through the label {t.get_text()!r}"


def test_rd_plot_labels_are_preset_names_and_never_overlap(plt):
    from kvcodec.harness.report import _rd_figure

    fig = _rd_figure(_doc(CROWDED), plt)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = _point_labels(ax)
        texts = [t.get_text() for t in labels]
        for name in ("kivi-2", "kivi-2-ans", "kivi-2-delta-ans", "kvc-near", "kvc-transparent", "kvc-aggressive"):
            assert name in texts, f"{name} not labelled: {texts}"
        assert "bits 3" in texts  # a parameter point: its parameters, the colour names the codec
        assert not any("precision=" in t or "max_level" in t for t in texts)
        assert len(labels) == len(CROWDED), f"a label was left out: {texts}"
        boxes = [_text_box(t, renderer) for t in labels]
        hint = next(t for t in ax.texts if "lower left is better" in t.get_text())
        for i, a in enumerate(boxes):
            assert not a.overlaps(_text_box(hint, renderer)), f"{texts[i]!r} covers the hint"
            assert ax.get_window_extent(renderer).contains(a.x0, a.y0) and \
                ax.get_window_extent(renderer).contains(a.x1, a.y1), f"{texts[i]!r} outside the axes"
            for j in range(i + 1, len(boxes)):
                assert not a.overlaps(boxes[j]), f"labels {texts[i]!r} and {texts[j]!r} overlap"
        assert_leaders_cross_no_label(ax, renderer)
        assert_front_crosses_no_label(ax, renderer)


def _nearest_marker_is_own(ax, renderer, xy_all):
    """Each label without a leader is nearer its own marker than any other (markers on top of
    its own, closer than a marker's size, aside): it cannot be read as a neighbour's."""
    import numpy as np

    pts = ax.transData.transform(np.asarray(xy_all, dtype=float))
    px = ax.figure.dpi / 72
    for t in _point_labels(ax):
        if t.arrow_patch is not None:
            continue
        b = _text_box(t, renderer)
        own = ax.transData.transform(np.asarray(t.xy, dtype=float))
        others = pts[np.hypot(*(pts - own).T) > 4.5 * px]

        def dist(p):
            return np.hypot(np.maximum(np.maximum(b.x0 - p[..., 0], p[..., 0] - b.x1), 0),
                            np.maximum(np.maximum(b.y0 - p[..., 1], p[..., 1] - b.y1), 0))

        if len(others):
            assert dist(others).min() > dist(own), f"{t.get_text()!r} sits nearer another marker than its own"


def test_rd_plot_labels_read_as_their_own_points(plt):
    from kvcodec.harness.report import _rd_figure

    fig = _rd_figure(_doc(CROWDED), plt)
    fig.canvas.draw()
    for k, ax in enumerate(fig.axes):
        key = ("next_token", "kl_mean") if k == 0 else ("attention", "out_rel_l2")
        _nearest_marker_is_own(ax, fig.canvas.get_renderer(),
                               [(r["bits_per_element"], r[key[0]][key[1]]) for r in CROWDED])


def test_rd_plot_off_front_parameter_points_get_no_leader(plt):
    """In a crowded sweep, a parameter point off the Pareto front is labelled only right beside
    its marker (or not at all: its row is in the table); presets and front points may use leaders."""
    from kvcodec.harness.report import _rd_figure

    sweep = [_row(f"kivi-4[bits={b}]", "kivi", b + 0.03, 0.2 / 4 ** (b - 2)) for b in range(2, 9)]
    sweep += [_row(f"kivi-4-ans[bits={b}]", "kivi-ans", b - 0.1, 0.2 / 4 ** (b - 2)) for b in range(2, 9)]
    sweep += [_row(f"kvc[k_step={s},v_step={s}]", "kvc", 1 + 2 * s, 0.05 * s) for s in (0.1, 0.2, 0.3, 0.5, 0.7)]
    fig = _rd_figure(_doc(CROWDED + sweep), plt)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for k, ax in enumerate(fig.axes):
        rows = CROWDED + sweep
        key = ("next_token", "kl_mean") if k == 0 else ("attention", "out_rel_l2")
        xs = [r["bits_per_element"] for r in rows]
        ys = [r[key[0]][key[1]] for r in rows]
        front = {rows[i]["name"] for i in pareto_front(xs, ys)}
        by_text = {}
        for r in rows:
            by_text.setdefault(short_label(r["name"], base=False), []).append(r["name"])
        for t, _a, _c in _leaders(ax, renderer):
            names = by_text[t.get_text()]
            assert any(not has_params(n) or n in front for n in names), \
                f"{t.get_text()!r} (off the front) got a leader line"
        assert_leaders_cross_no_label(ax, renderer)


def test_rd_plot_legend_outside_the_axes_with_codec_names_and_the_front(plt):
    from kvcodec.harness.report import _rd_figure

    fig = _rd_figure(_doc(CROWDED), plt)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    lb = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not lb.overlaps(ax.get_window_extent(renderer)), "the legend covers a panel"
    entries = [t.get_text() for t in legend.get_texts()]
    assert entries.count("kvc") == 1 and "kivi-ans" in entries
    assert not any("(" in e and "=" in e for e in entries if e != rdplot.FRONT_LABEL), entries
    assert rdplot.FRONT_LABEL in entries
    # the front is drawn in each panel as the staircase through the non-dominated points
    for ax in fig.axes:
        (front,) = [ln for ln in ax.get_lines() if ln.get_label() == rdplot.FRONT_LABEL]
        assert front.get_drawstyle() == "steps-post"
    xs = [front.get_xdata() for ax in fig.axes[:1] for front in ax.get_lines()
          if front.get_label() == rdplot.FRONT_LABEL][0]
    assert list(xs) == [1.25, 2.34, 3.03]  # kvc-aggressive, kvc-near, kvc-transparent (KL panel)


def test_rd_plot_text_is_readable_at_the_saved_size(plt):
    from kvcodec.harness.report import _rd_figure

    fig = _rd_figure(_doc(CROWDED), plt)
    fig.canvas.draw()
    for t in _all_texts(fig):
        assert t.get_fontsize() >= 8, f"{t.get_text()!r} at {t.get_fontsize()} pt"
    for ax in fig.axes:
        for t in ax.get_xticklabels() + ax.get_yticklabels():
            assert t.get_fontsize() >= 8
    assert fig.get_figwidth() * rdplot.DPI >= 1000  # shown ~1000 px wide: not scaled up


def test_hollow_note_only_when_a_value_is_exactly_zero(plt):
    from kvcodec.harness.report import _rd_figure

    fig = _rd_figure(_doc(CROWDED), plt)
    assert "hollow" not in fig._suptitle.get_text()
    plt.close(fig)
    fig = _rd_figure(_doc(CROWDED + [_row("raw", "raw", 16.0, 0.0, 0.0)]), plt)
    assert "hollow" in fig._suptitle.get_text()


def test_rd_plot_writes_a_png(plt, tmp_path):
    from kvcodec.harness.report import rd_plot

    rd_plot(_doc(CROWDED + [_row("kvc", "kvc", 2.0, 0.009), {"name": "bad", "family": "x", "error": "E: no"}]),
            tmp_path / "rd.png")
    assert (tmp_path / "rd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_main_redraws_the_png_beside_the_json(plt, tmp_path):
    from kvcodec.harness.report import main

    js = tmp_path / "run.json"
    js.write_text(json.dumps(_doc(CROWDED)))
    before = js.read_bytes()
    assert main([str(js)]) == 0
    assert (tmp_path / "run_rd.png").read_bytes()[:4] == b"\x89PNG"
    assert js.read_bytes() == before


# --- eval/studies/kvc_rd.py -----------------------------------------------------------------------

def _kvc_rd():
    spec = importlib.util.spec_from_file_location("kvc_rd_study", ROOT / "eval" / "studies" / "kvc_rd.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(kind, name, bits, kl, **extra):
    return {"kind": kind, "name": name, "bits_per_element": bits, "error": None,
            "next_token": {"kl_mean": kl}, **extra}


STUDY = {
    "setup": {"model": {"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "context": 64, "continuation": 16,
              "text": {"name": "demo text"}},
    "calibration": None,
    "records": [
        _rec("baseline", "kivi-2", 3.03, 0.15), _rec("baseline", "kivi-4", 5.03, 0.0036),
        _rec("baseline", "fp8-e4m3", 8.03, 0.0012),
        _rec("kvc-preset", "kvc-near", 2.39, 0.0035), _rec("kvc-preset", "kvc-transparent", 3.08, 0.0012),
        _rec("kvc-preset", "kvc-near-cal (+calibration)", 1.556, 0.0040),
        # search points crowded on the calibrated preset
        _rec("kvc-point", "kvc-near-cal {'k_recon': 0} (+calibration)", 1.556, 0.0043),
        _rec("kvc-point", "kvc-near-cal {'pack': 0} (+calibration)", 1.62, 0.0040),
        _rec("kvc-point", "kvc-near-cal {'pack': 1} (+calibration)", 1.58, 0.0040),
        _rec("kvc-sweep", "kvc(k_step=0.2, v_step=0.6)", 3.13, 0.0013),
        _rec("kvc-sweep", "kvc(k_step=1.0, v_step=3.0)", 1.08, 0.064),
        _rec("kvc-ablation", "kvc: + sink token 0 exact", 2.94, 0.0078),
    ],
}


def test_kvc_rd_figure_names_presets_legend_outside_no_overlap(plt):
    fig = _kvc_rd().figure(STUDY, plt)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    labels = _point_labels(ax)
    texts = [t.get_text() for t in labels]
    assert {"kvc-near", "kvc-transparent", "kvc-near-cal", "kivi-2", "pack 0", "pack 1", "k_recon 0",
            "k 0.2 v 0.6"} <= set(texts), texts
    assert not any("+calibration" in t or "{" in t for t in texts)
    assert not any(t.startswith("kvc:") for t in texts)  # ablation steps are named in the table
    boxes = [_text_box(t, renderer) for t in labels]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), f"{texts[i]!r} and {texts[j]!r} overlap"
    lb = ax.get_legend().get_window_extent(renderer)
    assert not lb.overlaps(ax.get_window_extent(renderer))
    assert rdplot.FRONT_LABEL in [t.get_text() for t in ax.get_legend().get_texts()]
    assert "hollow" not in ax.get_title()
    for t in _all_texts(fig):
        assert t.get_fontsize() >= 8, f"{t.get_text()!r} at {t.get_fontsize()} pt"


def test_kvc_rd_point_labels_give_both_steps():
    mod = _kvc_rd()
    assert mod.point_label({"name": "kvc(v_step=1.5)", "config": {"k_step": 0.45, "v_step": 1.5}}) == "k 0.45 v 1.5"
    assert mod.point_label({"name": "kvc(k_step=0.5)", "config": {"k_step": 0.5, "v_step": 1.35}}) == "k 0.5 v 1.35"
    assert mod.point_label({"name": "kvc(k_step=0.2, v_step=0.6)", "config": {}}) == "k 0.2 v 0.6"
    assert mod.point_label({"name": "kvc-near-cal {'pack': 0} (+calibration)", "config": {"k_step": 1}}) == "pack 0"
    assert mod.point_label({"name": "kvc-near", "config": {"k_step": 0.3, "v_step": 1}}) == "kvc-near"


# --- the committed results, drawn again (no model) ------------------------------------------------

@pytest.mark.parametrize("stem", ["kvc_presets", "kvc_presets_ctx2048_off16384", "kvc_rd"])
def test_committed_study_plots_label_every_point_cleanly(plt, stem):
    """The committed study results (a crowd of search points round kvc-near-cal): every point but
    the ablation steps labelled, no two labels overlapping, no leader across a label, the front
    through no label."""
    res = json.loads((ROOT / "eval" / "results" / f"{stem}.json").read_text())
    fig = _kvc_rd().figure(res, plt)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    labels = _point_labels(ax)
    want = [r for r in res["records"] if not r.get("error") and r["kind"] != "kvc-ablation"]
    assert len(labels) == len(want)
    boxes = [_text_box(t, renderer) for t in labels]
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    assert_leaders_cross_no_label(ax, renderer)
    assert_front_crosses_no_label(ax, renderer)


@pytest.mark.parametrize("stem", ["smollm2_default", "smollm2_sweep", "qwen_coder_baseline"])
def test_committed_eval_plots_label_every_preset_cleanly(plt, stem):
    """The committed ``kvcodec eval`` results: every preset and every Pareto point labelled (the
    three kivi-2 and three kivi-4 variants included), no overlaps, no leader across a label."""
    from kvcodec.harness.report import _rd_figure

    doc = json.loads((ROOT / "eval" / "results" / f"{stem}.json").read_text())
    rows = [r for r in doc["results"] if not r.get("error")]
    fig = _rd_figure(doc, plt)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for k, ax in enumerate(fig.axes):
        key = ("next_token", "kl_mean") if k == 0 else ("attention", "out_rel_l2")
        ys = [r[key[0]][key[1]] or 0.0 for r in rows]
        floor = min(y for y in ys if y) / 10
        front = pareto_front([r["bits_per_element"] for r in rows], [max(y, floor) for y in ys])
        texts = [t.get_text() for t in _point_labels(ax)]
        for i, r in enumerate(rows):
            if not has_params(r["name"]) or i in front:
                assert short_label(r["name"], base=False) in texts, f"{r['name']} not labelled"
        boxes = [_text_box(t, renderer) for t in _point_labels(ax)]
        assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
        assert_leaders_cross_no_label(ax, renderer)


def test_kvc_rd_replot_draws_the_png_and_leaves_the_json(plt, tmp_path):
    js = tmp_path / "study.json"
    js.write_text(json.dumps(STUDY))
    before = js.read_bytes()
    subprocess.run([sys.executable, "eval/studies/kvc_rd.py", "--replot", str(js)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    assert js.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert js.read_bytes() == before and not js.with_suffix(".md").exists()


def _family_styles(fig):
    """{codec id: (colour, marker)} of the KL panel's lines."""
    return {ln.get_label(): (tuple(ln.get_color()), ln.get_marker()) for ln in fig.axes[0].get_lines()
            if ln.get_label() != rdplot.FRONT_LABEL and not ln.get_label().startswith("_")}


def test_a_family_keeps_its_colour_and_marker_whichever_others_share_the_plot(plt):
    from kvcodec.harness.report import _rd_figure

    # Qwen's baseline run plots five families, the default run nine: kvc must not change colour
    few = _family_styles(_rd_figure(_doc([_row("kvc-near", "kvc", 3.3, 0.006), _row("fp8-e4m3", "fp8", 8.0, 0.008),
                                          _row("my-codec", "mine", 4.0, 0.01)]), plt))
    many = _family_styles(_rd_figure(_doc(CROWDED + [_row("raw", "raw", 16.0, 0.0, 0.0),
                                                     _row("my-codec", "mine", 4.0, 0.01)]), plt))
    assert few["kvc"] == many["kvc"] and few["fp8"] == many["fp8"] and few["mine"] == many["mine"]
    assert len(set(many.values())) == len(many), "two families share a colour and marker"


# --- eval/studies/kvc_profile.py ------------------------------------------------------------------

def _kvc_profile():
    spec = importlib.util.spec_from_file_location("kvc_profile_study", ROOT / "eval" / "studies" / "kvc_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kvc_profile_figure_of_the_committed_result_labels_every_point_cleanly(plt):
    """The README's headline (eval/results/kvc_profile.json) drawn: a panel per model and context,
    a point per codec and kind at its means over the texts, each labelled by name, no two labels
    overlapping, no leader or front across a label, the legend below every panel."""
    mod = _kvc_profile()
    doc = json.loads((ROOT / "eval" / "results" / "kvc_profile.json").read_text())
    fig = mod.figure(doc, plt)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pts = mod.points(doc)
    assert len(fig.axes) == len(doc["models"]) * len(doc["contexts"]) == len(pts)
    (legend,) = fig.legends
    for ax, ((model, ctx), here) in zip(fig.axes, sorted(pts.items(), key=lambda kv: (
            doc["models"].index(kv[0][0]), doc["contexts"].index(kv[0][1])))):
        assert ax.get_title() == f"{model}, context {ctx}"
        texts = sorted(t.get_text() for t in _point_labels(ax))
        assert texts == sorted(p["codec"] + (" fixed" if p["kind"] == "fixed" else "") for p in here)
        boxes = [_text_box(t, renderer) for t in _point_labels(ax)]
        assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
        assert_leaders_cross_no_label(ax, renderer)
        assert_front_crosses_no_label(ax, renderer)
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    # a point is the mean over the texts; its whisker ends at the worst text
    near = [p for p in pts[("smollm2-135m", 1536)] if p["codec"] == "kvc-near" and p["kind"] == "profile"][0]
    rows = [r for r in doc["rows"] if (r["model"], r["context"], r["codec"], r["kind"]) ==
            ("smollm2-135m", 1536, "kvc-near", "profile")]
    assert near["texts"] == len(rows) == 3
    assert near["kl_mean"] == pytest.approx(sum(r["kl_mean"] for r in rows) / 3)
    assert near["kl_worst"] == max(r["kl_mean"] for r in rows)
    for t in _all_texts(fig):
        assert t.get_fontsize() >= 8, f"{t.get_text()!r} at {t.get_fontsize()} pt"


def test_kvc_profile_rerender_draws_the_png_and_leaves_the_json(plt, tmp_path):
    js = tmp_path / "kvc_profile.json"
    js.write_bytes((ROOT / "eval" / "results" / "kvc_profile.json").read_bytes())
    before = js.read_bytes()
    subprocess.run([sys.executable, "eval/studies/kvc_profile.py", "--rerender", "--out", str(tmp_path / "kvc_profile")],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    assert js.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert js.read_bytes() == before
    assert js.with_suffix(".md").read_text() == (ROOT / "eval" / "results" / "kvc_profile.md").read_text()
