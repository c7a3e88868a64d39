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
