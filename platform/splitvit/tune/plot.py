"""The sweep's plots: quality versus tokens per image (frontier and baselines on one set
of axes) and quality versus measured speed-up over full resolution.

Legends sit to the right of the axes, never on them: a frontier reaches every corner
of the plot (the knee top left, full resolution top right), so any legend placed
inside covers some of its points.

``pareto.png`` (:func:`pareto_figure`) and ``pareto.html`` (:func:`pareto_html`) draw
one set of markers (:data:`MARKERS`) and say so in one legend; both mark the best point
with its registry alias (``@best``), round their ticks, and keep a quality axis inside
the metric's range (never above 1.0). Only ``@best`` and full resolution are labelled on
the axes (labels placed clear of each other); every other mark is named by the legend
and, in the HTML, by its tooltip.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .pareto import Baseline, Point, best_point, frontier

if TYPE_CHECKING:
    from .read_back import FrontierReadBack

#: What each mark is, in both figures: key -> (matplotlib marker, colour, size in
#: points², legend text). The HTML draws the same shapes in the same colours.
MARKERS: dict[str, tuple[str, str, float, str]] = {
    "frontier": ("D", "#d62728", 70, "Pareto frontier (the step line joins it)"),
    "trial": ("o", "#3182bd", 40, "trial (stage one)"),
    "threshold": ("o", "#9ecae1", 18, "other thresholds of a trial (stage two)"),
    "best": ("o", "none", 260, "@best: largest hypervolume share"),
    "full": ("*", "black", 160, "full resolution"),
    "entropy": ("s", "#2ca02c", 36, "entropy splitting (APT-style)"),
    "random": ("x", "#7f7f7f", 36, "random splitting, matched budgets"),
}
#: Qualities that are fractions: their axis never runs past 1.0 (nor below 0).
BOUNDED_METRICS = frozenset({"accuracy", "miou", "box_ap", "mask_ap", "map", "ap"})
BEST_ALIAS = "@best"
#: Tick steps: 1, 2, 2.5 or 5 times a power of ten (0.2, 0.25, 0.5, not 0.15 or 0.196).
_NICE_STEPS = [1, 2, 2.5, 5, 10]

#: A legend to the right of the axes, its top at the axes' top.
_LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0, "fontsize": 8}


def pareto_figure(
    points: list[Point],
    baselines: list[Baseline],
    *,
    metric: str = "accuracy",
    hypervolume: float | None = None,
    title: str = "",
    full_tokens: float | None = None,
):
    """A matplotlib figure: every trial and threshold point, the frontier as a step
    line, the best point ringed and labelled ``@best``, and the baselines (full
    resolution, entropy, random) on the same axes, in the markers of :data:`MARKERS`.

    ``full_tokens`` (tokens per image at full resolution) adds a secondary axis in
    token ratio. The caller owns the figure (``matplotlib.pyplot.close`` it).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display on a cluster driver
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)  # wide: the legend sits on the right
    front = frontier(points)
    on_front = {id(p) for p in front}
    groups = {
        "threshold": [p for p in points if p.kind == "threshold" and p.finite and id(p) not in on_front],
        "trial": [p for p in points if p.kind == "trial" and p.finite and id(p) not in on_front],
    }
    for key, group in groups.items():
        if group:
            _scatter(ax, key, [p.tokens_per_image for p in group], [p.quality for p in group], zorder=2)
    if front:
        xs, ys = [front[0].tokens_per_image], [front[0].quality]
        for p in front[1:]:
            xs += [p.tokens_per_image, p.tokens_per_image]
            ys += [ys[-1], p.quality]
        ax.plot(xs, ys, "-", color=MARKERS["frontier"][1], lw=1.8, zorder=4)
        label = MARKERS["frontier"][3] + (f"\nhypervolume {hypervolume:.3f}" if hypervolume is not None else "")
        _scatter(ax, "frontier", [p.tokens_per_image for p in front], [p.quality for p in front], zorder=5, label=label)
    for kind, style in (("entropy", "--"), ("random", ":")):
        rows = sorted((b for b in baselines if b.baseline == kind and _drawable(b)), key=lambda b: b.tokens_per_image)
        if rows:
            marker, colour, size, label = MARKERS[kind]
            ax.plot(
                [b.tokens_per_image for b in rows],
                [b.quality for b in rows],
                style,
                marker=marker,
                color=colour,
                ms=size**0.5,
                label=label,
                zorder=3,
                clip_on=False,
            )
    labels: list[tuple[float, float, str]] = []
    full = next((b for b in baselines if b.baseline == "full" and _drawable(b)), None)
    if full is not None:
        _scatter(ax, "full", [full.tokens_per_image], [full.quality], zorder=6)
        labels.append((full.tokens_per_image, full.quality, "full resolution"))
    best = best_point(points)
    if best is not None and best.finite:
        _scatter(ax, "best", [best.tokens_per_image], [best.quality], zorder=7)
        labels.append((best.tokens_per_image, best.quality, BEST_ALIAS))
    ax.set_xlabel("tokens per image")
    ax.set_ylabel(metric)
    ax.grid(True, alpha=0.3)
    xs = [p.tokens_per_image for p in points if p.finite] + [b.tokens_per_image for b in baselines if _drawable(b)]
    ys = [p.quality for p in points if p.finite] + [b.quality for b in baselines if _drawable(b)]
    if xs:
        ax.set_xlim(*axis_range(xs, low=0.0))
        ax.set_ylim(*axis_range(ys, **_bounds(metric, ys)))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, steps=_NICE_STEPS))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=8, steps=_NICE_STEPS))
    if full_tokens:
        top = ax.secondary_xaxis("top", functions=(lambda x: x / full_tokens, lambda r: r * full_tokens))
        top.set_xlabel("token ratio (of full resolution)")
        top.xaxis.set_major_locator(MaxNLocator(nbins=8, steps=_NICE_STEPS))
    ax.set_title(title or f"{metric} vs tokens per image")
    handles, texts = ax.get_legend_handles_labels()
    order = [next((i for i, m in enumerate(MARKERS.values()) if t.startswith(m[3])), len(MARKERS)) for t in texts]
    ranked = sorted(zip(order, range(len(texts))))  # MARKERS' order: the HTML legend's
    ax.legend([handles[i] for _, i in ranked], [texts[i] for _, i in ranked], **_LEGEND_OUTSIDE)
    fig.tight_layout()  # makes room on the right for the legend
    _label_clear(ax, labels)  # placed in the final layout: the pixel boxes it compares are the drawn ones
    return fig


def _scatter(ax, key: str, xs: list[float], ys: list[float], *, zorder: int, label: str | None = None) -> None:
    """One group of marks in its :data:`MARKERS` style (drawn whole at an axis' edge)."""
    marker, colour, size, text = MARKERS[key]
    style: dict[str, str | float | bool] = {
        "marker": marker,
        "s": size,
        "zorder": zorder,
        "clip_on": False,
        "label": label or text,
    }
    if key == "best":
        style.update(facecolors="none", edgecolors="#e6a700", linewidths=2.2)
    elif key == "frontier":
        style.update(c=colour, edgecolors="black", linewidths=0.6)
    elif key == "trial":
        style.update(c=colour, edgecolors="white", linewidths=0.5)
    else:
        style.update(c=colour, edgecolors="none")
    ax.scatter(xs, ys, **style)


def _label_clear(ax, labels: list[tuple[float, float, str]]) -> None:
    """Write each label beside its point, inside the axes and off the labels already
    placed (tried above right, below right, above left, below left, then further out)."""
    placed = []
    renderer = ax.figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    offsets = [(8, 8), (8, -14), (-8, 8), (-8, -14), (8, 22), (8, -28), (-8, 22), (-8, -28)]
    for x, y, text in labels:
        for dx, dy in offsets:
            note = ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                ha="left" if dx > 0 else "right",
                fontsize=8,
                fontweight="bold" if text == BEST_ALIAS else "normal",
                zorder=8,
                annotation_clip=False,
            )
            box = note.get_window_extent(renderer)
            within = inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1)
            if (within and not any(box.overlaps(other) for other in placed)) or (dx, dy) == offsets[-1]:
                placed.append(box)
                break
            note.remove()


def _bounds(metric: str, values: list[float]) -> dict[str, float]:
    """The range a quality cannot leave: ``[0, 1]`` for a fraction (:data:`BOUNDED_METRICS`;
    not for figures recorded in percent, which run past 1)."""
    fraction = metric.lower() in BOUNDED_METRICS and all(0.0 <= v <= 1.0 for v in values)
    return {"low": 0.0, "high": 1.0} if fraction else {}


def axis_range(
    values: list[float], *, low: float | None = None, high: float | None = None, margin: float = 0.05
) -> tuple[float, float]:
    """An axis range around ``values`` with a ``margin`` share on each side, never past
    ``low`` or ``high`` (an accuracy axis stops at 1.0), never empty."""
    lo, hi = min(values), max(values)
    pad = (hi - lo) * margin or max(abs(hi) * margin, 1e-3)
    lo, hi = lo - pad, hi + pad
    if low is not None:
        lo = max(lo, low)
    if high is not None:
        hi = min(hi, high)
    if hi <= lo:
        lo, hi = (lo - 1e-3, lo + 1e-3) if high is None else (hi - 2e-3, hi)
    return lo, hi


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round tick values inside ``[low, high]``: steps of 1, 2, 2.5 or 5 times a power
    of ten, about ``count`` of them (``0.2, 0.4, ...`` rather than ``0.196, 0.407``)."""
    span = high - low
    if not (math.isfinite(span) and span > 0):
        return [low]
    raw = span / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    return ticks


def tick_text(value: float, step: float) -> str:
    """A tick's label with the decimals its step needs (``0.25``, ``10``)."""
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    if step > 0 and abs(round(step, decimals) - step) > 1e-9:
        decimals += 1
    return f"{value:.{decimals}f}"


def speed_figure(points: list[Point], *, metric: str = "accuracy", full_quality: float | None = None, title: str = ""):
    """Quality against measured speed-up over the full-resolution model: the frontier
    points that were timed (``extras["speedup_vs_full"]``), each labelled with its
    measured token ratio, and full resolution at 1.0x (its quality from the
    baselines, when known). The caller owns the figure."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)  # wide: the legend sits on the right
    timed = sorted(
        (p for p in frontier(points) if "speedup_vs_full" in p.extras), key=lambda p: p.extras["speedup_vs_full"]
    )
    if timed:
        xs = [p.extras["speedup_vs_full"] for p in timed]
        ys = [p.quality for p in timed]
        ax.plot(xs, ys, "-", color="#d62728", lw=1.2, alpha=0.6, zorder=3)
        ax.scatter(
            xs,
            ys,
            s=70,
            marker="D",
            c="#d62728",
            edgecolors="black",
            linewidths=0.6,
            label="SPLIT frontier points (timed)",
            zorder=5,
            clip_on=False,  # whole at an axis' edge (accuracy 1.0)
        )
        for p, x, y in zip(timed, xs, ys):
            ratio = p.extras.get("timed_token_ratio", p.token_ratio)
            ax.annotate(f"{ratio:.0%} tok", (x, y), textcoords="offset points", xytext=(5, -11), fontsize=7)
    if full_quality is not None:
        ax.scatter(
            [1.0], [full_quality], s=160, marker="*", c="black", label="full resolution (1.0x)", zorder=6, clip_on=False
        )
    ax.axvline(1.0, color="black", lw=0.8, ls=":", zorder=1)
    qualities = [p.quality for p in timed] + ([full_quality] if full_quality is not None else [])
    if qualities:  # a fraction's axis stops at 1.0, as the Pareto plot's does
        ax.set_ylim(*axis_range(qualities, **_bounds(metric, qualities)))
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(nbins=8, steps=_NICE_STEPS))
    ax.set_xlabel("measured speed-up vs full resolution (median images/s ratio, same run)")
    ax.set_ylabel(metric)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or f"{metric} vs measured speed-up")
    ax.legend(**_LEGEND_OUTSIDE)
    fig.tight_layout()
    return fig


def save_frontier_plot(read: FrontierReadBack, path: str | Path) -> Path:
    """Draw a frontier read back from MLflow
    (:func:`~splitvit.tune.read_back.frontier_from_mlflow`) to the PNG ``path``: every
    point, the frontier, its hypervolume and the sweep's baselines when it carries
    them. Returns the path written (its folder is made)."""
    import matplotlib.pyplot as plt

    full = next((b.tokens_per_image for b in read.baselines if b.baseline == "full"), None)
    sweeps = read.sweeps
    which = (read.sweep_names.get(sweeps[0]) or sweeps[0]) if len(sweeps) == 1 else f"{len(sweeps)} sweeps"
    fig = pareto_figure(
        read.points,
        read.baselines,
        metric=read.metric,
        hypervolume=read.hypervolume,
        title=f"{read.experiment} ({which}): {read.metric} vs tokens per image",
        full_tokens=full or _full_tokens(read.points),
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, bbox_inches="tight")
    finally:
        plt.close(fig)
    return out


def _full_tokens(points: list[Point]) -> float | None:
    """Full-resolution tokens per image as the points imply it (tokens over token
    ratio, the median over points: each is the same number up to rounding)."""
    implied = [p.tokens_per_image / p.token_ratio for p in points if p.finite and p.token_ratio > 0]
    implied = [v for v in implied if math.isfinite(v)]
    return statistics.median(implied) if implied else None


def pareto_html(
    points: list[Point],
    baselines: list[Baseline],
    *,
    metric: str = "accuracy",
    title: str = "",
    model_uris: dict[str, str | list[str]] | None = None,
) -> str:
    """The frontier as a self-contained HTML page (inline SVG, no scripts or network):
    MLflow's artifact viewer shows it as it is, and hovering a point shows its trial,
    thresholds, token share, run and, from ``model_uris`` (run id -> the ``models:/``
    URIs that load its model, first the one to quote), how to load its model.

    Axes: tokens per image (x) against ``metric`` (y), round ticks, a fraction's axis
    inside ``[0, 1]``; the marks and the legend are :func:`pareto_figure`'s
    (:data:`MARKERS`), the best point ringed and labelled ``@best``.
    """
    from html import escape

    usable = [p for p in points if p.finite]
    rows = [b for b in baselines if _drawable(b)]
    xs = [p.tokens_per_image for p in usable] + [b.tokens_per_image for b in rows]
    ys = [p.quality for p in usable] + [b.quality for b in rows]
    if not xs:
        return f"<!doctype html><meta charset='utf-8'><title>{escape(title)}</title><p>No finished point to draw.</p>"
    frame = _SvgFrame(axis_range(xs, low=0.0), axis_range(ys, **_bounds(metric, ys)))
    uris = {run: [u] if isinstance(u, str) else list(u) for run, u in (model_uris or {}).items()}
    best = best_point(points)
    if best is not None and best.run_id in uris:  # @best first in its tooltip
        uris[best.run_id] = sorted(uris[best.run_id], key=lambda u: not u.endswith(BEST_ALIAS))
    front = frontier(points)
    labels = [(b.tokens_per_image, b.quality, "full resolution") for b in rows if b.baseline == "full"]
    if best is not None and best.finite:
        labels.append((best.tokens_per_image, best.quality, BEST_ALIAS))
    svg = [
        *frame.axes(metric),
        *_svg_step_line(frame, front),
        *_svg_baseline_lines(frame, rows),
        *(_svg_point(frame, p, _point_tip(p, metric, uris, p is best)) for p in sorted(usable, key=_drawn_last)),
        *(_svg_baseline(frame, b, metric) for b in rows),
        *([_svg_best(frame, best)] if best is not None and best.finite else []),
        *_svg_labels(frame, labels),
    ]
    drawn = {p.kind for p in usable if not p.on_frontier} | ({"frontier"} if front else set())
    drawn |= {b.baseline for b in rows} | ({"best"} if best is not None and best.finite else set())
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title></head><body>"
        f"<h3 style='font-family:sans-serif'>{escape(title)}</h3>"
        f"{frame.open()}{''.join(svg)}</svg>{_html_legend(drawn, bool(uris))}</body></html>"
    )


def _drawn_last(p: Point) -> bool:
    """Frontier points on top of the rest."""
    return p.on_frontier


def _html_legend(drawn: set[str], models: bool) -> str:
    """The marks drawn, in :data:`MARKERS`' words (the PNG's legend), and what hovering shows."""
    from html import escape

    items = "".join(f"<li>{_legend_swatch(key)} {escape(MARKERS[key][3])}</li>" for key in MARKERS if key in drawn)
    hover = "Hover a mark for its figures; a point's also names its trial, thresholds, run" + (
        " and the registry alias that loads its model." if models else "."
    )
    return (
        "<ul style='font:13px sans-serif;list-style:none;padding-left:0'>"
        f"{items}</ul><p style='font:13px sans-serif'>{hover}</p>"
    )


def _legend_swatch(key: str) -> str:
    """A 14-pixel SVG of a mark, as the chart draws it."""
    shape = _closed(_mark(key, 7.0, 7.0, small=True))
    return f"<svg width='14' height='14' style='vertical-align:middle'>{shape}</svg>"


def _mark(key: str, x: float, y: float, *, small: bool = False) -> str:
    """The SVG shape of a :data:`MARKERS` entry centred on ``(x, y)``, its tag left open
    for :func:`_closed`."""
    colour = MARKERS[key][1]
    r = {"frontier": 6.5, "trial": 4.5, "threshold": 3.0, "best": 11.0, "full": 8.0, "entropy": 4.0, "random": 4.5}[key]
    if small:
        r = min(r, 6.0)
    if key == "frontier":
        pts = f"{x:.1f},{y - r:.1f} {x + r:.1f},{y:.1f} {x:.1f},{y + r:.1f} {x - r:.1f},{y:.1f}"
        return f"<polygon class='point' points='{pts}' fill='{colour}' stroke='black' stroke-width='0.7'"
    if key in ("trial", "threshold"):
        stroke = "white" if key == "trial" else "none"
        return f"<circle class='point' cx='{x:.1f}' cy='{y:.1f}' r='{r}' fill='{colour}' stroke='{stroke}'"
    if key == "best":
        return f"<circle cx='{x:.1f}' cy='{y:.1f}' r='{r}' fill='none' stroke='#e6a700' stroke-width='2.5'"
    if key == "entropy":
        return f"<rect x='{x - r:.1f}' y='{y - r:.1f}' width='{2 * r}' height='{2 * r}' fill='{colour}'"
    if key == "random":
        return (
            f"<path d='M{x - r:.1f},{y - r:.1f}L{x + r:.1f},{y + r:.1f}"
            f"M{x - r:.1f},{y + r:.1f}L{x + r:.1f},{y - r:.1f}' stroke='{colour}' stroke-width='2'"
        )
    # full resolution: a five-pointed star
    star = []
    for i in range(10):
        radius = r if i % 2 == 0 else r * 0.45
        angle = math.pi / 2 + i * math.pi / 5
        star.append(f"{x + radius * math.cos(angle):.1f},{y - radius * math.sin(angle):.1f}")
    return f"<polygon points='{' '.join(star)}' fill='{colour}'"


def _closed(tag: str, tip: str | None = None) -> str:
    """Close a :func:`_mark` shape, with its hover title when it has one."""
    if tip is None:
        return f"{tag}/>"
    name = tag.split(" ", 1)[0].lstrip("<")
    return f"{tag}><title>{tip}</title></{name}>"


class _SvgFrame:
    """Data to SVG coordinates in a fixed-size plot with a margin for the axes' labels."""

    width, height, pad = 760, 440, 60

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
        (self.x0, self.x1), (self.y0, self.y1) = x_range, y_range

    def x(self, value: float) -> float:
        return self.pad + (value - self.x0) / (self.x1 - self.x0) * (self.width - 2 * self.pad)

    def y(self, value: float) -> float:
        return self.height - self.pad - (value - self.y0) / (self.y1 - self.y0) * (self.height - 2 * self.pad)

    def open(self) -> str:
        size = f"width='{self.width}' height='{self.height}'"
        return f"<svg xmlns='http://www.w3.org/2000/svg' {size} font-family='sans-serif' overflow='visible'>"

    def axes(self, metric: str) -> list[str]:
        """The plot's box, round ticks with light grid lines on both axes, the axes' names."""
        from html import escape

        w, h, pad = self.width, self.height, self.pad
        out = [f"<rect x='{pad}' y='{pad}' width='{w - 2 * pad}' height='{h - 2 * pad}' fill='none' stroke='#888'/>"]
        xt, yt = nice_ticks(self.x0, self.x1, 8), nice_ticks(self.y0, self.y1, 8)
        xstep, ystep = (xt[1] - xt[0]) if len(xt) > 1 else 1.0, (yt[1] - yt[0]) if len(yt) > 1 else 1.0
        for gx in xt:
            x = self.x(gx)
            out.append(f"<line x1='{x:.1f}' y1='{pad}' x2='{x:.1f}' y2='{h - pad}' stroke='#eee'/>")
            label = tick_text(gx, xstep)
            out.append(f"<text x='{x:.1f}' y='{h - pad + 16}' font-size='11' text-anchor='middle'>{label}</text>")
        for gy in yt:
            y = self.y(gy)
            out.append(f"<line x1='{pad}' y1='{y:.1f}' x2='{w - pad}' y2='{y:.1f}' stroke='#eee'/>")
            out.append(
                f"<text x='{pad - 6}' y='{y + 4:.1f}' font-size='11' text-anchor='end'>{tick_text(gy, ystep)}</text>"
            )
        out.append(f"<text x='{w / 2}' y='{h - 18}' font-size='12' text-anchor='middle'>tokens per image</text>")
        out.append(
            f"<text x='16' y='{h / 2}' font-size='12' transform='rotate(-90 16 {h / 2})' text-anchor='middle'>"
            f"{escape(metric)}</text>"
        )
        return out


def _point_tip(p: Point, metric: str, model_uris: dict[str, list[str]], best: bool = False) -> str:
    """A point's hover text: its figures, trial and thresholds, run, ties and model."""
    from html import escape

    lines = [
        f"{metric} {p.quality:.4f} at {p.tokens_per_image:.1f} tokens/image ({p.token_ratio:.0%} of full)",
        f"trial {p.trial_id} ({p.kind}), thresholds {', '.join(f'{t:.3f}' for t in p.thresholds) or '-'}",
        f"run {p.run_id or '-'}",
    ]
    if best:
        lines.insert(0, f"{BEST_ALIAS}: the largest hypervolume contribution")
    if p.ties:
        lines.append(f"ties: {', '.join(p.ties)}")
    uris = model_uris.get(p.run_id or "", [])
    if uris:
        also = ", ".join("@" + u.rsplit("@", 1)[-1] for u in uris[1:])
        lines.append(f"load: {uris[0]}" + (f" (also {also})" if also else ""))
    return escape("\n".join(lines))


def _svg_step_line(frame: _SvgFrame, front: list[Point]) -> list[str]:
    """The frontier's step line (as ``pareto_figure`` draws it), when it has two points."""
    if len(front) < 2:
        return []
    path = [f"M{frame.x(front[0].tokens_per_image):.1f},{frame.y(front[0].quality):.1f}"]
    path += [f"H{frame.x(p.tokens_per_image):.1f}V{frame.y(p.quality):.1f}" for p in front[1:]]
    return [f"<path d='{''.join(path)}' fill='none' stroke='{MARKERS['frontier'][1]}' stroke-width='1.5'/>"]


def _svg_baseline_lines(frame: _SvgFrame, rows: list[Baseline]) -> list[str]:
    """Entropy's dashed and random's dotted lines through their marks, as the PNG draws them."""
    out = []
    for kind, dash in (("entropy", "6,4"), ("random", "2,3")):
        line = sorted((b for b in rows if b.baseline == kind), key=lambda b: b.tokens_per_image)
        if len(line) > 1:
            xy = " ".join(f"{frame.x(b.tokens_per_image):.1f},{frame.y(b.quality):.1f}" for b in line)
            colour = MARKERS[kind][1]
            out.append(f"<polyline points='{xy}' fill='none' stroke='{colour}' stroke-dasharray='{dash}'/>")
    return out


def _svg_point(frame: _SvgFrame, p: Point, tip: str) -> str:
    key = "frontier" if p.on_frontier else ("trial" if p.kind == "trial" else "threshold")
    return _closed(_mark(key, frame.x(p.tokens_per_image), frame.y(p.quality)), tip)


def _svg_best(frame: _SvgFrame, p: Point) -> str:
    return _closed(_mark("best", frame.x(p.tokens_per_image), frame.y(p.quality)))


def _svg_baseline(frame: _SvgFrame, b: Baseline, metric: str) -> str:
    from html import escape

    key = b.baseline if b.baseline in ("full", "entropy", "random") else "random"
    tip = escape(f"{b.label}: {metric} {b.quality:.4f} at {b.tokens_per_image:.1f} tokens")
    return _closed(_mark(key, frame.x(b.tokens_per_image), frame.y(b.quality)), tip)


def _svg_labels(frame: _SvgFrame, labels: list[tuple[float, float, str]]) -> list[str]:
    """Labels beside their marks, inside the plot and off the ones already placed (the
    same tries as :func:`_label_clear`; text boxes estimated at 6.5 pixels a character)."""
    from html import escape

    placed: list[tuple[float, float, float, float]] = []
    out = []
    offsets = [(12, -10), (12, 16), (-12, -10), (-12, 16), (12, -26), (12, 32), (-12, -26), (-12, 32)]
    for x, y, text in labels:
        px, py = frame.x(x), frame.y(y)
        width = 6.5 * len(text)
        for dx, dy in offsets:
            left = px + dx if dx > 0 else px + dx - width
            box = (left, py + dy - 11, left + width, py + dy + 2)
            clear = all(box[2] < o[0] or box[0] > o[2] or box[3] < o[1] or box[1] > o[3] for o in placed)
            pad, w, h = frame.pad, frame.width, frame.height
            clear = clear and pad < box[0] and box[2] < w - pad and pad < box[1] and box[3] < h - pad
            if clear or (dx, dy) == offsets[-1]:
                placed.append(box)
                weight = "bold" if text == BEST_ALIAS else "normal"
                at = f"x='{box[0]:.1f}' y='{py + dy:.1f}'"
                out.append(f"<text {at} font-size='12' font-weight='{weight}'>{escape(text)}</text>")
                break
    return out


def _drawable(b: Baseline) -> bool:
    return _finite(b.tokens_per_image) and _finite(b.quality)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
