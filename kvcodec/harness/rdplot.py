"""Pieces of a rate–distortion plot a person can read: the Pareto front, short point labels that
do not collide, a "lower left is better" hint, and a legend outside the data.

Used by :func:`kvcodec.harness.report.rd_plot` (the ``kvcodec eval`` plot) and by
``eval/studies/kvc_rd.py`` and ``kvc_profile.py``. The pure helpers (:func:`pareto_front`,
:func:`short_label`, :func:`has_params`) need nothing; the drawing helpers take matplotlib
objects, and matplotlib (the ``[eval]`` extra) is imported only by :func:`pyplot`.

Sizes are chosen for a figure shown about 1000 px wide: :data:`FIG_WIDTH_IN` inches at
:data:`DPI`, no text under :data:`LABEL_PT` points.

Example:
    >>> from kvcodec.harness.rdplot import pareto_front, short_label
    >>> pareto_front([1.0, 2.0, 2.0, 3.0], [0.5, 0.1, 0.3, 0.1])
    [0, 1]
    >>> short_label("kvc-near-cal {'k_step': 0.5152, 'v_step': 1.8515} (+calibration)")
    'kvc-near-cal k 0.515 v 1.85'
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Sequence
from typing import Any

#: Point labels, legend entries and in-axes notes (points at the saved size); axis labels are larger.
LABEL_PT = 8.5
AXIS_PT = 10.5
TITLE_PT = 11.0
#: A figure this wide at this dpi is 1100 px: shown at ~1000 px, 8.5 pt text is ~11 px tall.
FIG_WIDTH_IN = 11.0
DPI = 100
#: The Pareto front's look (shared so both plots and their legends agree).
FRONT_STYLE = {"color": "0.35", "ls": (0, (5, 3)), "lw": 1.4, "zorder": 1.5}
FRONT_LABEL = "Pareto front (no point beats it on both axes)"

#: Parameter names shortened in point labels.
_ABBREV = {"k_step": "k", "v_step": "v"}
_PARAMS = re.compile(r"^(?P<base>[^\[({]+?)\s*(?P<open>[\[({])(?P<body>.*)[\])}]$")


def pareto_front(xs: Sequence[float], ys: Sequence[float]) -> list[int]:
    """Indices of the points no other point dominates, sorted by x (then y).

    A point dominates another when it is no worse on both axes (lower is better on both) and
    strictly better on one. Equal points do not dominate each other, so ties are all kept. Points
    with a missing or NaN coordinate are never on the front.

    Example:
        >>> pareto_front([1, 2, 2, 3, 3], [3, 1, 2, 1, 1])  # (2, 1) beats (2, 2) and both (3, 1)
        [0, 1]
        >>> pareto_front([1, 1], [0.5, 0.5])
        [0, 1]
    """
    pts = [(float(x), float(y), i) for i, (x, y) in enumerate(zip(xs, ys))
           if x is not None and y is not None and not (math.isnan(x) or math.isnan(y))]
    front = [i for x, y, i in pts
             if not any(x2 <= x and y2 <= y and (x2 < x or y2 < y) for x2, y2, _ in pts)]
    return sorted(front, key=lambda i: (float(xs[i]), float(ys[i]), i))


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return "/".join(_fmt_value(x) for x in v)
    return str(v)


def _parse_params(body: str, open_: str) -> list[tuple[str, Any]] | None:
    """``k=v, ...`` or a Python dict literal, as (key, value) pairs; None when it is neither."""
    if open_ == "{":
        try:
            d = ast.literal_eval("{" + body + "}")
        except (ValueError, SyntaxError):
            return None
        return list(d.items()) if isinstance(d, dict) else None
    out: list[tuple[str, Any]] = []
    # split on commas outside brackets: levels=[63, 31, 31], k_step=0.1
    depth, cur, parts = 0, "", []
    for ch in body:
        depth += 1 if ch in "[(" else -1 if ch in "])" else 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for p in parts:
        if "=" not in p:
            return None
        k, v = p.split("=", 1)
        try:
            val: Any = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            val = v.strip()
        out.append((k.strip(), val))
    return out


def short_label(name: str, max_len: int = 28, *, base: bool = True) -> str:
    """A point's label: the preset name as is; a parameter point as its base name and the
    parameters, short (``kvc[k_step=0.1,v_step=0.1]`` → ``kvc k,v 0.1``).

    ``" (+calibration)"`` is dropped (the ``-cal`` presets say it already); step sizes are written
    ``k``/``v``; equal values share one number; lists are joined with ``/``; anything longer than
    ``max_len`` is cut with an ellipsis. ``base=False`` leaves the base name out of a parameter
    point's label (where colour and legend say it already).

    Example:
        >>> short_label("kivi-2"), short_label("kivi-4[bits=3]"), short_label("cachegen[levels=[15, 7, 7]]")
        ('kivi-2', 'kivi-4 bits 3', 'cachegen levels 15/7/7')
        >>> short_label("kvc(k_step=0.2, v_step=0.6)"), short_label("kvc[k_step=0.1,v_step=0.1]")
        ('kvc k 0.2 v 0.6', 'kvc k,v 0.1')
        >>> short_label("kvc-transparent-cal (+calibration)"), short_label("kivi-4[bits=3]", base=False)
        ('kvc-transparent-cal', 'bits 3')
    """
    s = name.replace(" (+calibration)", "").strip()
    m = _PARAMS.match(s)
    params = _parse_params(m["body"], m["open"]) if m else None
    if m and params is not None:
        head = m["base"].strip() if base else ""
        keys = [_ABBREV.get(k, k) for k, _ in params]
        vals = [_fmt_value(v) for _, v in params]
        if len(params) > 1 and len(set(vals)) == 1 and all(k in _ABBREV.values() for k in keys):
            body = ",".join(keys) + " " + vals[0]
        else:
            body = " ".join(f"{k} {v}" for k, v in zip(keys, vals))
        s = " ".join(p for p in (head, body) if p) or m["base"].strip()
    return s if len(s) <= max_len else s[: max_len - 1] + "…"


def has_params(name: str) -> bool:
    """Whether a row's name carries parameters (``kivi-4[bits=3]``, ``kvc-near-cal {'pack': 0}``)
    rather than being a preset name as is.

    Example:
        >>> has_params("kvc-near-cal (+calibration)"), has_params("kivi-4[bits=3]")
        (False, True)
    """
    return short_label(name, max_len=1000, base=False) != short_label(name, max_len=1000)


def params(name: str) -> list[tuple[str, Any]] | None:
    """The parameters a row's name carries, as (key, value) pairs; None for a plain name.

    Example:
        >>> params("kvc(v_step=1.5)"), params("kvc-near-cal {'pack': 0} (+calibration)"), params("kvc-near")
        ([('v_step', 1.5)], [('pack', 0)], None)
    """
    m = _PARAMS.match(name.replace(" (+calibration)", "").strip())
    return _parse_params(m["body"], m["open"]) if m else None


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed); ImportError names the extra."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the rate–distortion plot needs matplotlib: pip install 'kvcodec[eval]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_png(figure: Any, doc: Any, path: Any) -> bool:
    """Save ``figure(doc, plt)`` to ``path`` as a PNG at the figure's own dpi and close it; without
    matplotlib print why and write nothing (False).

    Example:
        >>> import os, tempfile
        >>> def one_point(doc, plt):
        ...     fig, ax = plt.subplots(figsize=(2, 2)); ax.plot([doc], [doc], "o"); return fig
        >>> p = os.path.join(tempfile.mkdtemp(), "p.png"); write_png(one_point, 1.0, p)
        True
    """
    try:
        plt = pyplot()
    except ImportError:
        print("matplotlib missing: no plot (pip install 'kvcodec[eval]')")
        return False
    fig = figure(doc, plt)
    try:
        fig.savefig(path, dpi=fig.dpi)
    finally:
        plt.close(fig)
    return True


#: kvc's quality levels (mean next-token KL), as the plots name them
TARGETS = ((0.002, "transparent ≤ 0.002"), (0.01, "near-lossless ≤ 0.01"), (0.05, "aggressive ≤ 0.05"))


def draw_targets(ax: Any, named: bool = True) -> None:
    """A dotted line across ``ax`` at each of :data:`TARGETS`, named (``named``) in the margin
    right of the axes, where no point can be."""
    for kl, name in TARGETS:
        ax.axhline(kl, ls=":", color="0.5", lw=0.9, zorder=1)
        if named:
            ax.text(1.01, kl, name.replace(" ≤", "\n≤"), fontsize=LABEL_PT, color="0.35", ha="left",
                    va="center", transform=ax.get_yaxis_transform(), linespacing=1.1)


def draw_front(ax: Any, xs: Sequence[float], ys: Sequence[float]) -> Any:
    """Draw the Pareto front of the points (``ys`` as plotted, zeros already at their floor) as a
    dashed grey staircase: at each rate, the lowest distortion any point reaches with no more bits.
    Returns the line (for the legend), or None for fewer than one point."""
    idx = pareto_front(xs, ys)
    if not idx:
        return None
    fx = [xs[i] for i in idx]
    fy = [ys[i] for i in idx]
    (line,) = ax.plot(fx, fy, drawstyle="steps-post", label=FRONT_LABEL, **FRONT_STYLE)
    return line


#: Where the "lower left is better" note may go, in axes fractions, tried in order: (text
#: position, alignment, arrow head or None). The first spot clear of markers and lines wins.
_HINT_SPOTS = (
    ((0.075, 0.085), ("left", "bottom"), (0.015, 0.02)),
    ((0.985, 0.975), ("right", "top"), None),
    ((0.985, 0.03), ("right", "bottom"), None),
    ((0.015, 0.975), ("left", "top"), None),
)


def better_hint(ax: Any, xy: Sequence[tuple[float, float]] = ()) -> Any:
    """The "lower left is better" note: in the lower-left corner with an arrow into it when that
    corner is clear of the points ``xy`` (data coordinates) and of the plotted lines, else as
    "↙ lower left is better" in the first clear other corner. Call it once the layout is final;
    returns the annotation so labels can avoid it."""
    import numpy as np

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    pts = ax.transData.transform(np.asarray(xy, dtype=float).reshape(-1, 2)) if len(xy) else np.zeros((0, 2))
    obstacles = np.concatenate([pts, _line_samples(ax, px_per_pt)])
    margin = 5 * px_per_pt
    ann = None
    for pos, (ha, va), head in _HINT_SPOTS:
        if ann is not None:
            ann.remove()
        text = "lower left is better" if head else "\u2199 lower left is better"
        arrow = ({"arrowstyle": "->", "color": "0.3", "lw": 1.0, "shrinkA": 0, "shrinkB": 0}
                 if head else None)
        ann = ax.annotate(text, xy=head or pos, xycoords="axes fraction", xytext=pos,
                          textcoords="axes fraction", fontsize=LABEL_PT, color="0.3", ha=ha, va=va,
                          zorder=4, arrowprops=arrow)
        boxes = [ann.get_window_extent(renderer)]
        if ann.arrow_patch is not None:
            boxes.append(ann.arrow_patch.get_window_extent(renderer))
        if not any(np.any((obstacles[:, 0] > b.x0 - margin) & (obstacles[:, 0] < b.x1 + margin)
                          & (obstacles[:, 1] > b.y0 - margin) & (obstacles[:, 1] < b.y1 + margin))
                   for b in boxes):
            return ann
    # nowhere clear: back to the corner with the arrow (labels still keep off it)
    ann.remove()
    pos, (ha, va), head = _HINT_SPOTS[0]
    return ax.annotate("lower left is better", xy=head, xycoords="axes fraction", xytext=pos,
                       textcoords="axes fraction", fontsize=LABEL_PT, color="0.3", ha=ha, va=va, zorder=4,
                       arrowprops={"arrowstyle": "->", "color": "0.3", "lw": 1.0, "shrinkA": 0, "shrinkB": 0})


def _line_samples(ax: Any, px_per_pt: float, *, front: bool | None = None) -> Any:
    """Points every 3 pt along each plotted line of ``ax``, in display coordinates (``front``:
    True for the Pareto front's only, False for all but it)."""
    import numpy as np
    from matplotlib.cbook import STEP_LOOKUP_MAP

    samples = [np.zeros((0, 2))]
    for line in ax.get_lines():
        if line.get_linestyle() in ("None", "", " ") or len(line.get_xdata()) < 2:
            continue
        if front is not None and (line.get_label() == FRONT_LABEL) != front:
            continue
        xy = line.get_xydata()
        if line.get_drawstyle() != "default":  # the staircase as drawn, not just its corners
            xy = np.column_stack(STEP_LOOKUP_MAP[line.get_drawstyle()](xy[:, 0], xy[:, 1]))
        v = line.get_transform().transform(xy)
        for a, b in zip(v[:-1], v[1:]):
            n = max(2, int(np.hypot(*(b - a)) / (3 * px_per_pt)))
            samples.append(a + (b - a) * np.linspace(0, 1, n)[:, None])
    return np.concatenate(samples)


#: Label offsets tried, in points from the marker (nearest first) and unit directions (right first).
_RADII_PT = (5, 9, 14, 20, 28, 38, 50, 65, 85, 110)
_DIRS = ((1, 0), (1, 0.6), (1, -0.6), (-1, 0), (-1, 0.6), (-1, -0.6), (0, 1), (0, -1),
         (1, 1.5), (1, -1.5), (-1, 1.5), (-1, -1.5), (0.5, 1), (0.5, -1), (-0.5, 1), (-0.5, -1))
#: Beyond this offset the label gets a thin leader line to its point.
_LEADER_PT = 12
#: Costs of a spot, in points of offset: per sample (:func:`_line_samples`) of a line under the text
#: (a line through a label strikes it out; half that per sample a leader crosses), for a label
#: not clearly nearest its own marker (:func:`_closeness` of another under 1.2 times its own; with
#: a leader, another marker under a third as far: it reads as that point's), for a leader line,
#: and for one that crosses or runs into another leader.
_LINE_COST = 2.0
_AMBIGUOUS_COST = 30.0
_LEADER_COST = 8.0
_LEADER_CROSS_COST = 30.0
_LEADER_OVER_MARKER_COST = 80.0


def place_labels(ax: Any, xy: Sequence[tuple[float, float]], texts: Sequence[str | None], *,
                 priority: Sequence[float] | None = None, fontsize: float = LABEL_PT,
                 colors: Sequence[Any] | None = None, avoid: Sequence[Any] = (),
                 marker_pt: float = 4.5, bold: Sequence[bool] | None = None,
                 near_only: Sequence[bool] | None = None) -> list[Any]:
    """Label points so that no two labels overlap, no label covers a marker or the Pareto front,
    and no leader line crosses a label.

    Call it last, once the figure's layout is final (it measures in display space). Each label,
    in ``priority`` order (lowest first), takes the cheapest free spot of a ring of offsets around
    its point: inside the axes, off every marker in ``xy``, off the Pareto front's line, off
    ``avoid`` artists, off labels and leader lines already placed. Nearer is cheaper; another
    plotted line under the text costs, and so does a spot that reads as another marker's label.
    Spots further than ``_LEADER_PT`` get a leader line (from the text's centre, as matplotlib
    draws it), which may not cross a label or an ``avoid`` artist; a leader over another marker
    or another leader costs. A label boxed in by its neighbours' labels moves one of them (of the
    nearest ten, the one whose move costs least, if it still finds a spot); one with no free spot
    even then is left out (its row is in the table beside the plot).

    Args:
        ax: the axes (log or linear).
        xy: the points in data coordinates, as plotted.
        texts: one label per point; None or "" for none.
        priority: lower places first (default: the given order).
        colors: text colour per label (default black).
        avoid: artists (texts, annotations, legends) labels must not cover.
        marker_pt: half the size of a marker in points (the area kept clear round each point).
        bold: per label, bold text (e.g. the Pareto points).
        near_only: per label, place it only right beside its point (no leader line), or not at
            all: for points a reader can miss in a crowd (their rows are in the table).

    Returns:
        The annotation per point, None where none was placed.
    """
    import numpy as np
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    axbox = ax.get_window_extent(renderer)
    pts = ax.transData.transform(np.asarray(xy, dtype=float).reshape(-1, 2))
    m = marker_pt * px_per_pt
    pad = 1.5 * px_per_pt
    marks = [Bbox.from_extents(x - m, y - m, x + m, y + m) for x, y in pts]
    blocks = [a.get_window_extent(renderer) for a in avoid]
    for a in avoid:  # an annotation's arrow too
        patch = getattr(a, "arrow_patch", None)
        if patch is not None:
            blocks.append(patch.get_window_extent(renderer))
    # the plotted lines, sampled every few pixels: labels prefer not to sit on them, and never
    # on the Pareto front (the line the plot is read by)
    line_pts = _line_samples(ax, px_per_pt, front=False)
    front_pts = _line_samples(ax, px_per_pt / 3, front=True)
    sizes: dict[int, tuple[float, float]] = {}
    weights: dict[int, str] = {}
    for i, text in enumerate(texts):
        if text and np.all(np.isfinite(pts[i])):
            weights[i] = "bold" if bold is not None and bold[i] else "normal"
            probe = ax.text(0, 0, text, fontsize=fontsize, fontweight=weights[i], transform=None)
            tb = probe.get_window_extent(renderer)
            probe.remove()
            sizes[i] = (tb.width, tb.height)

    # label index -> (cost, r, dx, dy, box, leader or None); leader = (point, text centre), px
    placed: dict[int, tuple[float, float, float, float, Any, Any]] = {}

    def spot(i: int) -> tuple[float, float, float, float, Any, Any] | None:
        """The cheapest free spot for label ``i`` given the labels placed so far, or None."""
        tw, th = sizes[i]
        boxes = [v[4] for v in placed.values()]
        leaders = [v[5] for v in placed.values() if v[5] is not None]
        others = np.delete(pts, i, axis=0)
        others = others[np.hypot(*(others - pts[i]).T) > m]  # not those on top of this one
        best = None
        for r in _RADII_PT:
            if r > _LEADER_PT and near_only is not None and near_only[i]:
                break
            for dx, dy in _DIRS:
                # the text's anchor and its alignment, as annotate() will draw it
                x_a, y_a = pts[i][0] + dx * r * px_per_pt, pts[i][1] + dy * r * px_per_pt
                x0 = x_a if dx > 0 else (x_a - tw if dx < 0 else x_a - tw / 2)
                y0 = y_a if dy > 0 else (y_a - th if dy < 0 else y_a - th / 2)
                box = Bbox.from_extents(x0 - pad, y0 - pad, x0 + tw + pad, y0 + th + pad)
                if (box.x0 < axbox.x0 or box.x1 > axbox.x1 or box.y0 < axbox.y0 or box.y1 > axbox.y1):
                    continue
                if any(box.overlaps(o) for o in marks) or any(box.overlaps(o) for o in blocks) \
                        or any(box.overlaps(o) for o in boxes) \
                        or any(_segment_hits_box(a, b, box) for a, b in leaders):
                    continue
                if np.any((front_pts[:, 0] > box.x0) & (front_pts[:, 0] < box.x1)
                          & (front_pts[:, 1] > box.y0) & (front_pts[:, 1] < box.y1)):
                    continue
                hits = int(np.sum((line_pts[:, 0] > box.x0) & (line_pts[:, 0] < box.x1)
                                  & (line_pts[:, 1] > box.y0) & (line_pts[:, 1] < box.y1)))
                cost = r + _LINE_COST * hits + (0 if dy == 0 else 1.5)
                nearest_other = _box_dist(box, others).min() if len(others) else np.inf
                own = _box_dist(box, pts[i:i + 1])[0]
                leader = None
                if r > _LEADER_PT:  # a leader line: dearer; never across a label
                    centre = np.array([(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2])
                    if any(_segment_hits_box(pts[i], centre, o) for o in boxes + blocks):
                        continue
                    leader = (pts[i], centre)
                    cost += _LEADER_COST + (_LEADER_OVER_MARKER_COST if _crosses(pts, i, centre, m) else 0)
                    cost += _LINE_COST / 2 * _near_leader(np.concatenate([line_pts, front_pts]), pts[i], box,
                                                          2 * px_per_pt)
                    cost += _LEADER_CROSS_COST * sum(_leaders_clash(pts[i], centre, a, b, 2 * m)
                                                     for a, b in leaders)
                    if nearest_other < max(4 * px_per_pt, own / 3):  # by another marker: the leader
                        cost += _AMBIGUOUS_COST                       # alone would tell them apart
                elif len(others) and _closeness(box, others).min() < 1.2 * _closeness(box, pts[i:i + 1])[0]:
                    cost += _AMBIGUOUS_COST  # it would read as a neighbour's label
                if best is None or cost < best[0]:
                    best = (cost, r, dx, dy, box, leader)
            if best is not None and best[0] <= r + (_LEADER_COST if r > _LEADER_PT else 0):
                break  # no spot further out can be cheaper
        return best

    order = sorted(sizes, key=lambda i: (priority[i] if priority is not None else 0, i))
    for i in order:
        found = spot(i)
        if found is not None:
            placed[i] = found
            continue
        # boxed in: move one neighbour's label (of the nearest ten) out of the way, the one whose
        # move adds least cost, if both then find a spot
        best_move = None
        for j in sorted(placed, key=lambda j: float(np.hypot(*(pts[j] - pts[i]))))[:10]:
            held = placed.pop(j)
            mine = spot(i)
            if mine is not None:
                placed[i] = mine
                theirs = spot(j)
                if theirs is not None and (best_move is None or mine[0] + theirs[0] - held[0] < best_move[0]):
                    best_move = (mine[0] + theirs[0] - held[0], j, mine, theirs)
                del placed[i]
            placed[j] = held
        if best_move is not None:
            _, j, mine, theirs = best_move
            placed[i], placed[j] = mine, theirs

    out: list[Any] = [None] * len(pts)
    for i, (_cost, r, dx, dy, _box, leader) in placed.items():
        ha = "left" if dx > 0 else ("right" if dx < 0 else "center")
        va = "bottom" if dy > 0 else ("top" if dy < 0 else "center")
        arrow = ({"arrowstyle": "-", "color": "0.5", "lw": 0.6, "shrinkA": 1, "shrinkB": marker_pt}
                 if leader is not None else None)
        out[i] = ax.annotate(texts[i], xy=tuple(xy[i]), xytext=(dx * r, dy * r),
                             textcoords="offset points", ha=ha, va=va, fontsize=fontsize, fontweight=weights[i],
                             color=colors[i] if colors is not None else "black", arrowprops=arrow,
                             annotation_clip=False, zorder=5,
                             bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.75})
    return out


def _closeness(box: Any, pts: Any) -> Any:
    """How near each point is to a label ``box`` as a reader sees it: the distance to the box's
    edge plus a quarter of that to its centre (a label centred under a marker reads as that
    marker's even when its end is as near another)."""
    import numpy as np

    centre = np.array([(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2])
    return _box_dist(box, pts) + 0.25 * np.hypot(*(pts - centre).T)


def _box_dist(box: Any, pts: Any) -> Any:
    """Distance from each point (display px, shape (n, 2)) to the nearest point of ``box``."""
    import numpy as np

    dx = np.maximum(np.maximum(box.x0 - pts[:, 0], pts[:, 0] - box.x1), 0)
    dy = np.maximum(np.maximum(box.y0 - pts[:, 1], pts[:, 1] - box.y1), 0)
    return np.hypot(dx, dy)


def _segment_hits_box(a: Any, b: Any, box: Any) -> bool:
    """Whether the segment a–b (display px) passes through ``box`` (Liang–Barsky clipping)."""
    t0, t1 = 0.0, 1.0
    d = (b[0] - a[0], b[1] - a[1])
    for p, q in ((-d[0], a[0] - box.x0), (d[0], box.x1 - a[0]), (-d[1], a[1] - box.y0), (d[1], box.y1 - a[1])):
        if p == 0:
            if q < 0:
                return False
            continue
        t = q / p
        if p < 0:
            t0 = max(t0, t)
        else:
            t1 = min(t1, t)
        if t0 > t1:
            return False
    return True


def _segments_cross(a: Any, b: Any, c: Any, d: Any) -> bool:
    """Whether segments a–b and c–d cross (touching at an end point does not count)."""
    def orient(p: Any, q: Any, r: Any) -> float:
        return float((q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0]))

    return (orient(a, b, c) * orient(a, b, d) < 0) and (orient(c, d, a) * orient(c, d, b) < 0)


def _leaders_clash(a: Any, b: Any, c: Any, d: Any, near: float) -> bool:
    """Whether leader a–b (point a, text centre b) would be confused with leader c–d: they cross,
    one runs into the other's point, or from (nearly) one point they leave (nearly) along one
    line, the same way or opposite ways (two leaders that read as one line through a cluster)."""
    import numpy as np

    if _segments_cross(a, b, c, d):
        return True
    if float(np.hypot(*(np.asarray(a, dtype=float) - c))) < near:
        u, v = np.asarray(b, dtype=float) - a, np.asarray(d, dtype=float) - c
        cos = float(u @ v) / (float(np.hypot(*u) * np.hypot(*v)) or 1.0)
        return abs(cos) > 0.9  # within ~25 degrees of one line
    return _seg_dist(c, a, b) < near or _seg_dist(a, c, d) < near


def _near_leader(samples: Any, a: Any, box: Any, tol: float) -> int:
    """How many line samples (display px) lie within ``tol`` of the leader from point ``a`` to the
    edge of the label ``box`` (aimed at its centre, as drawn): the plotted lines it crosses."""
    import numpy as np

    a = np.asarray(a, dtype=float)
    c = np.array([(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2])
    d = c - a
    if not len(samples) or not np.any(d):
        return 0
    # where the segment enters the box: the leader is drawn up to there
    enter = max((1 - (box.x1 - box.x0) / 2 / abs(d[0])) if abs(d[0]) > 0 else 0.0,
                (1 - (box.y1 - box.y0) / 2 / abs(d[1])) if abs(d[1]) > 0 else 0.0, 0.0)
    t = np.clip(((samples - a) @ d) / (d @ d), 0.0, enter)
    return int(np.sum(np.hypot(*(samples - (a + t[:, None] * d)).T) < tol))


def _seg_dist(p: Any, a: Any, b: Any) -> float:
    """Distance from point ``p`` to the segment a–b (display px)."""
    import numpy as np

    p, a, b = (np.asarray(v, dtype=float) for v in (p, a, b))
    d = b - a
    t = 0.0 if not np.any(d) else float(np.clip((p - a) @ d / (d @ d), 0.0, 1.0))
    return float(np.hypot(*(p - (a + t * d))))


def _crosses(pts: Any, i: int, end: Any, m: float) -> bool:
    """Whether a leader from point ``i`` to ``end`` (display px) passes over another marker
    (one that overlaps the point's own marker does not count: every leader leaves through it)."""
    import numpy as np

    a = pts[i]
    d = np.asarray(end, dtype=float) - a
    others = np.delete(pts, i, axis=0)
    others = others[np.hypot(*(others - a).T) > m]
    if not len(others) or not np.any(d):
        return False
    t = np.clip(((others - a) @ d) / (d @ d), 0.0, 1.0)
    dist = np.hypot(*(others - (a + t[:, None] * d)).T)
    return bool(np.any(dist < m))


__all__ = ["AXIS_PT", "DPI", "FIG_WIDTH_IN", "FRONT_LABEL", "FRONT_STYLE", "LABEL_PT", "TARGETS", "TITLE_PT",
           "better_hint", "draw_front", "draw_targets", "has_params", "params", "pareto_front", "place_labels",
           "pyplot", "short_label", "write_png"]
