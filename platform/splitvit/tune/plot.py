"""The sweep's plots: quality versus tokens per image (frontier and baselines on one set
of axes) and quality versus measured speed-up over full resolution.

Legends sit to the right of the axes, never on them: a frontier reaches every corner
of the plot (the knee top left, full resolution top right), so any legend placed
inside covers some of its points.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .pareto import Baseline, Point, frontier

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
    line, and the baselines (full resolution, entropy, random) on the same axes.

    ``full_tokens`` (tokens per image at full resolution) adds a secondary axis in
    token ratio. The caller owns the figure (``matplotlib.pyplot.close`` it).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display on a cluster driver
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)  # wide: the legend sits on the right
    trials = [p for p in points if p.kind == "trial" and p.finite]
    thresholds = [p for p in points if p.kind == "threshold" and p.finite]
    if thresholds:
        ax.scatter(
            [p.tokens_per_image for p in thresholds],
            [p.quality for p in thresholds],
            s=18,
            c="#9ecae1",
            edgecolors="none",
            label="threshold points (stage two)",
            zorder=2,
        )
    if trials:
        ax.scatter(
            [p.tokens_per_image for p in trials],
            [p.quality for p in trials],
            s=40,
            c="#3182bd",
            edgecolors="white",
            linewidths=0.5,
            label="trials (stage one)",
            zorder=3,
        )
    front = frontier(points)
    if front:
        xs, ys = [front[0].tokens_per_image], [front[0].quality]
        for p in front[1:]:
            xs += [p.tokens_per_image, p.tokens_per_image]
            ys += [ys[-1], p.quality]
        label = "SPLIT Pareto frontier" + (f" (HV {hypervolume:.3f})" if hypervolume is not None else "")
        ax.plot(xs, ys, "-", color="#d62728", lw=1.8, zorder=4)
        ax.scatter(
            [p.tokens_per_image for p in front],
            [p.quality for p in front],
            s=70,
            marker="D",
            c="#d62728",
            edgecolors="black",
            linewidths=0.6,
            label=label,
            zorder=5,
        )
    styles = {
        "entropy": ("s--", "#2ca02c", "entropy splitting (APT-style)"),
        "random": ("x:", "#7f7f7f", "random splitting, matched budgets"),
    }
    for kind, (fmt, colour, label) in styles.items():
        rows = sorted((b for b in baselines if b.baseline == kind), key=lambda b: b.tokens_per_image)
        if rows:
            ax.plot(
                [b.tokens_per_image for b in rows],
                [b.quality for b in rows],
                fmt,
                color=colour,
                ms=6,
                label=label,
                zorder=3,
            )
    for b in baselines:
        if b.baseline == "full":
            ax.scatter(
                [b.tokens_per_image], [b.quality], s=160, marker="*", c="black", label="full resolution", zorder=6
            )
    ax.set_xlabel("tokens per image")
    ax.set_ylabel(metric)
    ax.grid(True, alpha=0.3)
    if full_tokens:
        top = ax.secondary_xaxis("top", functions=(lambda x: x / full_tokens, lambda r: r * full_tokens))
        top.set_xlabel("token ratio (of full resolution)")
    ax.set_title(title or f"{metric} vs tokens per image")
    ax.legend(**_LEGEND_OUTSIDE)
    fig.tight_layout()  # makes room on the right for the legend
    return fig


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
        )
        for p, x, y in zip(timed, xs, ys):
            ratio = p.extras.get("timed_token_ratio", p.token_ratio)
            ax.annotate(f"{ratio:.0%} tok", (x, y), textcoords="offset points", xytext=(5, -11), fontsize=7)
    if full_quality is not None:
        ax.scatter([1.0], [full_quality], s=160, marker="*", c="black", label="full resolution (1.0x)", zorder=6)
    ax.axvline(1.0, color="black", lw=0.8, ls=":", zorder=1)
    ax.set_xlabel("measured speed-up vs full resolution (median images/s ratio, same run)")
    ax.set_ylabel(metric)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or f"{metric} vs measured speed-up")
    ax.legend(**_LEGEND_OUTSIDE)
    fig.tight_layout()
    return fig


def save_frontier_plot(frontier: dict[str, Any], path: str | Path) -> Path:
    """Draw a frontier read back from MLflow (the dict
    :func:`~splitvit.tune.sweep.frontier_from_mlflow` returns) to the PNG ``path``:
    every point, the frontier, its hypervolume and the sweep's baselines when it
    carries them. Returns the path written (its folder is made)."""
    import matplotlib.pyplot as plt

    metric = frontier["metric"]
    points = [Point.from_dict(p, metric) for p in frontier["points"]]
    baselines = [Baseline.from_dict(b) for b in frontier.get("baselines") or []]
    full = next((b.tokens_per_image for b in baselines if b.baseline == "full"), None)
    sweeps = frontier.get("sweeps") or []
    names = frontier.get("sweep_names") or {}
    which = (names.get(sweeps[0]) or sweeps[0]) if len(sweeps) == 1 else f"{len(sweeps)} sweeps"
    fig = pareto_figure(
        points,
        baselines,
        metric=metric,
        hypervolume=frontier.get("hypervolume"),
        title=f"{frontier.get('experiment', '')} ({which}): {metric} vs tokens per image",
        full_tokens=full or _full_tokens(points),
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
    model_uris: dict[str, str] | None = None,
) -> str:
    """The frontier as a self-contained HTML page (inline SVG, no scripts or network):
    MLflow's artifact viewer shows it as it is, and hovering a point shows its trial,
    thresholds, token share, run and, from ``model_uris`` (run id -> ``models:/`` URI),
    the registry alias that loads its model.

    Axes: tokens per image (x) against ``metric`` (y); the frontier red with its step
    line, the other points blue, baselines as labelled crosses.
    """
    from html import escape

    usable = [p for p in points if p.finite]
    rows = [b for b in baselines if _finite(b.tokens_per_image) and _finite(b.quality)]
    xs = [p.tokens_per_image for p in usable] + [b.tokens_per_image for b in rows]
    ys = [p.quality for p in usable] + [b.quality for b in rows]
    if not xs:
        return f"<!doctype html><meta charset='utf-8'><title>{escape(title)}</title><p>No finished point to draw.</p>"
    frame = _SvgFrame(_span(xs), _span(ys))
    model_uris = model_uris or {}
    svg = [
        *frame.axes(metric),
        *_svg_step_line(frame, frontier(points)),
        *(_svg_point(frame, p, _point_tip(p, metric, model_uris)) for p in sorted(usable, key=lambda p: p.on_frontier)),
        *(_svg_baseline(frame, b, metric) for b in rows),
    ]
    legend = (
        "<p style='font:13px sans-serif'>Red: the Pareto frontier (the step line joins it); blue: trials; light blue: "
        "other thresholds on a trial's checkpoint; crosses: baselines. Hover a point for its trial, thresholds, run"
        + (" and the registry alias that loads its model." if model_uris else ".")
        + "</p>"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title></head><body>"
        f"<h3 style='font-family:sans-serif'>{escape(title)}</h3>"
        f"{frame.open()}{''.join(svg)}</svg>{legend}</body></html>"
    )


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
        return f"<svg xmlns='http://www.w3.org/2000/svg' {size} font-family='sans-serif'>"

    def axes(self, metric: str) -> list[str]:
        """The plot's box, five ticks on each axis and the axes' names."""
        from html import escape

        w, h, pad = self.width, self.height, self.pad
        out = [f"<rect x='{pad}' y='{pad}' width='{w - 2 * pad}' height='{h - 2 * pad}' fill='none' stroke='#888'/>"]
        for i in range(5):
            gx, gy = self.x0 + (self.x1 - self.x0) * i / 4, self.y0 + (self.y1 - self.y0) * i / 4
            out.append(
                f"<text x='{self.x(gx):.1f}' y='{h - pad + 16}' font-size='11' text-anchor='middle'>{gx:.1f}</text>"
            )
            out.append(f"<text x='{pad - 6}' y='{self.y(gy) + 4:.1f}' font-size='11' text-anchor='end'>{gy:.3f}</text>")
        out.append(f"<text x='{w / 2}' y='{h - 18}' font-size='12' text-anchor='middle'>tokens per image</text>")
        out.append(
            f"<text x='16' y='{h / 2}' font-size='12' transform='rotate(-90 16 {h / 2})' text-anchor='middle'>"
            f"{escape(metric)}</text>"
        )
        return out


def _point_tip(p: Point, metric: str, model_uris: dict[str, str]) -> str:
    """A point's hover text: its figures, trial and thresholds, run, ties and model."""
    from html import escape

    lines = [
        f"{metric} {p.quality:.4f} at {p.tokens_per_image:.1f} tokens/image ({p.token_ratio:.0%} of full)",
        f"trial {p.trial_id} ({p.kind}), thresholds {', '.join(f'{t:.3f}' for t in p.thresholds) or '-'}",
        f"run {p.run_id or '-'}",
    ]
    if p.ties:
        lines.append(f"ties: {', '.join(p.ties)}")
    if p.run_id in model_uris:
        lines.append(f"load: {model_uris[p.run_id]}")
    return escape("\n".join(lines))


def _svg_step_line(frame: _SvgFrame, front: list[Point]) -> list[str]:
    """The frontier's step line (as ``pareto_figure`` draws it), when it has two points."""
    if len(front) < 2:
        return []
    path = [f"M{frame.x(front[0].tokens_per_image):.1f},{frame.y(front[0].quality):.1f}"]
    path += [f"H{frame.x(p.tokens_per_image):.1f}V{frame.y(p.quality):.1f}" for p in front[1:]]
    return [f"<path d='{''.join(path)}' fill='none' stroke='#d62728' stroke-width='1.5'/>"]


def _svg_point(frame: _SvgFrame, p: Point, tip: str) -> str:
    colour = "#d62728" if p.on_frontier else ("#3182bd" if p.kind == "trial" else "#9ecae1")
    return (
        f"<circle cx='{frame.x(p.tokens_per_image):.1f}' cy='{frame.y(p.quality):.1f}' "
        f"r='{6 if p.on_frontier else 4}' fill='{colour}' stroke='white'><title>{tip}</title></circle>"
    )


def _svg_baseline(frame: _SvgFrame, b: Baseline, metric: str) -> str:
    from html import escape

    bx, by, name = frame.x(b.tokens_per_image), frame.y(b.quality), escape(b.label)
    return (
        f"<g stroke='#333'><line x1='{bx - 5:.1f}' y1='{by - 5:.1f}' x2='{bx + 5:.1f}' y2='{by + 5:.1f}'/>"
        f"<line x1='{bx - 5:.1f}' y1='{by + 5:.1f}' x2='{bx + 5:.1f}' y2='{by - 5:.1f}'/>"
        f"<title>{name}: {metric} {b.quality:.4f} at {b.tokens_per_image:.1f} tokens</title></g>"
        f"<text x='{bx + 7:.1f}' y='{by - 6:.1f}' font-size='10'>{name}</text>"
    )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _span(values: list[float]) -> tuple[float, float]:
    """An axis range around ``values`` with a 5% margin (never empty)."""
    low, high = min(values), max(values)
    margin = (high - low) * 0.05 or max(abs(high) * 0.05, 1e-3)
    return low - margin, high + margin
