"""What a person reads of a study: the lines printed under its table
(:func:`summary_lines`, :func:`lever_lines`, :func:`point_speed_lines`,
:func:`training_pace_line`, :func:`reuse_phrase`; the pace itself,
:func:`fine_tune_pace`) and its figures (:func:`study_figure`,
:func:`study_speed_figure`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..bench.speed import FullTiming
from .goals import GoalVerdicts, LeverRow, ParityVerdict, ReferenceConvergence, StudyRow, StudyTime
from .runs import MethodRun
from .speed import POINTS_TIMING, MatchedSpeed, PointSpeed, StudyTimedPoint


def _gap_text(gap: float, spread: float | None) -> str:
    return f"{-gap:+.2f}" + ("" if spread is None else f" ± {spread:.2f}")


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def point_speed_lines(record: PointSpeed | None) -> list[str]:
    """The operating points' measured speed-ups, one line per method."""
    if not record:
        return []
    full = record.full_timing
    lines = [
        f"measured speed-up vs {record.full_method} ({full.images_per_s:.0f} images/s; seed "
        f"{record.seed}, batch {record.batch_size}, "
        f"{record.rounds} interleaved rounds on {record.device}):"
    ]
    if full.backbone_images_per_s is not None:  # before the line's closing colon
        lines[0] = (
            lines[0][:-1] + f"; a detector: whole, then its backbone alone ({full.backbone_images_per_s:.0f} images/s):"
        )
    for method in dict.fromkeys(p.method for p in record.points):
        points = [p for p in record.points if p.method == method]
        lines.append(
            f"  {method}: "
            + ", ".join(
                (f"@{p.target_ratio:g}" if p.target_ratio is not None else "")
                + f" {p.speedup_vs_full:.2f}x"
                + (f" (backbone {p.backbone_speedup_vs_full:.2f}x)" if p.backbone_speedup_vs_full is not None else "")
                + f" ({p.token_ratio:.0%} tokens)"
                for p in points
            ).strip()
        )
    return lines


def lever_lines(table: list[LeverRow], metric: str) -> list[str]:
    """:func:`~splitvit.study.goals.lever_table` as text: a column per ratio, ``mean ± std
    (points vs full)``."""
    if not table:
        return []
    ratios = list(table[0].cells)
    width = max(len("method"), *(len(row.method) for row in table))
    head = "  ".join(f"{metric} @ {ratio:.0%} tokens".ljust(34) for ratio in ratios)
    lines = [f"{'method'.ljust(width)}  {head}"]
    for row in table:
        cells = []
        for ratio in ratios:
            cell = row.cells.get(ratio)
            if cell is None:
                text = "-"
            else:
                gap = cell.gap_points
                versus = "" if gap is None else f" ({_gap_text(gap, cell.gap_std_points)} vs full)"
                text = f"{cell.quality:.4f} ± {cell.std:.4f}{versus}"
            cells.append(text.ljust(34))
        lines.append(f"{row.method.ljust(width)}  {'  '.join(cells)}")
    return lines


def reuse_phrase(runs: list[MethodRun]) -> str:
    """How many of a study's runs an earlier invocation finished, and how many of those
    were evaluated again (other evaluation settings), for the study's first printed line."""
    reused = sum(bool(r.reused) for r in runs)
    again = sum(bool(r.reevaluated) for r in runs)
    if not reused:
        return ""
    return f" ({reused} finished earlier, reused{f'; {again} evaluated again' if again else ''})"


def _reference_line(g: ReferenceConvergence) -> str:
    seeds = ", ".join(
        f"seed {seed} " + (f"{s.gain_points:+.2f}" if s.gain_points is not None else f"n/a ({s.epochs} epochs)")
        for seed, s in g.seeds.items()
    )
    return (
        f"reference converged (gain over its last {g.over_epochs} epochs < {g.goal_points} points): "
        f"{seeds}: {_verdict(g.met)}"
    )


def _parity_line(g: ParityVerdict) -> str:
    spread = "" if g.gap_std_points is None else f" (± {g.gap_std_points:.2f} over seeds)"
    over = g.token_ratio - g.max_token_ratio
    # a share over the goal's counts only within the tolerance: say so where it is used
    tolerated = f" (within the {g.ratio_tolerance:.1%} tolerance)" if over > 1e-9 else ""
    side = "below" if g.gap_points > 0 else "above"
    # a companion quality (a detector's mask AP) on the same point, held to the same goal
    also = "".join(
        f"; {c.metric} {abs(c.gap_points):.2f} points {'below' if c.gap_points > 0 else 'above'} full"
        + ("" if c.gap_std_points is None else f" (± {c.gap_std_points:.2f})")
        for c in g.companions
    )
    return (
        f"SPLIT vs full resolution: best SPLIT at <= {g.max_token_ratio:.0%} tokens is {g.method} @ "
        f"{g.token_ratio:.2%}{tolerated}: {abs(g.gap_points):.2f} points {side} "
        f"full{spread}{also} (goal: at most {g.goal_points} below"
        f"{' on each' if g.companions else ''}): "
        f"{_verdict(g.met)}"
    )


def _study_time_line(g: StudyTime) -> str:
    machine = f"{g.cpus} CPUs"
    if g.reference_images_per_s:
        machine += f", references training at {g.reference_images_per_s:.0f} images/s each"
    if g.met is not None:
        verdict = _verdict(g.met)
    else:
        why = []
        if g.begun_earlier:
            why.append(f"{len(g.begun_earlier)} of its {g.runs} runs begun by an earlier invocation")
        if g.borrowed_references:
            why.append("references from another study")
        if g.failed_runs:
            why.append(f"{g.failed_runs} failed")
        verdict = f"not timed ({'; '.join(why)})"
    return (
        f"study time: {g.minutes:.1f} minutes for {g.runs} runs on {machine} "
        f"(goal: at most {g.goal_minutes:g}): {verdict}"
    )


def _speed_line(s: MatchedSpeed) -> str:
    which = "matches full resolution" if s.matches_full else "best SPLIT point (none matches full resolution)"
    backbone = (
        ""
        if s.backbone_ratio is None
        else f"; backbone alone {s.backbone_split_images_per_s:.0f} vs {s.backbone_full_images_per_s:.0f} "
        f"images/s = {s.backbone_ratio:.2f}x"
    )
    # the speed table's own figure (below), or a timing of this point alone
    timing = ", as timed beside the other points" if s.timing == POINTS_TIMING else ""
    return (
        f"speed ({which}: {s.method} @ {s.target_ratio}, seed {s.seed}, batch {s.batch_size} "
        f"on {s.device}{timing}): {s.split_images_per_s:.0f} vs {s.full_images_per_s:.0f} images/s = "
        f"{s.ratio:.2f}x{backbone} (ideal {s.ideal_ratio:.2f}x at {s.token_fraction:.1%} tokens)"
    )


def fine_tune_epochs(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """The epochs of a run's history that trained the task: those with a task loss. The
    policy's own epochs (``train.policy.lead_epochs``, ``train.policy.epochs``: the policy
    alone, several times faster) are not the fine-tune's pace. A history whose epochs
    record no task loss (files written before they did) is taken whole."""
    tasks = [e for e in history if "train_task_loss" in e]
    return tasks or history


@dataclass(frozen=True)
class FineTunePace:
    """One method's fine-tuning pace against the control of the same seed: the median
    fine-tune epoch's training images/s (:func:`fine_tune_epochs`) over the control's.
    ``reused``: one of the two was trained by an earlier invocation, beside other runs."""

    method: str
    seed: int
    ratio: float
    reused: bool


def fine_tune_pace(runs: list[MethodRun]) -> list[FineTunePace]:
    """Every non-control method's :class:`FineTunePace`, method by method in the runs'
    order, then seed by seed; a run or a control with no epoch history is left out."""
    pace = {
        (r.method, r.seed): statistics.median(e["train_images_per_s"] for e in fine_tune_epochs(r.history))
        for r in runs
        if r.history and all("train_images_per_s" in e for e in r.history)
    }
    reused = {(r.method, r.seed) for r in runs if r.reused}
    control = {r.seed: (r.method, r.seed) for r in runs if r.policy == "full"}
    return [
        FineTunePace(
            method, seed, pace[(method, seed)] / pace[control[seed]], bool({(method, seed), control[seed]} & reused)
        )
        for method in dict.fromkeys(r.method for r in runs if r.policy != "full")
        for seed in sorted({r.seed for r in runs if r.method == method})
        if (method, seed) in pace and control.get(seed) in pace
    ]


def training_pace_line(runs: list[MethodRun]) -> str | None:
    """Each method's :func:`fine_tune_pace`, seed by seed, in one line. Runs trained by an
    earlier invocation (``reused``) are starred: their pace was measured beside other
    runs. ``None`` without a control or any other run with an epoch history."""
    paces = fine_tune_pace(runs)
    if not paces:
        return None
    parts = [
        f"{method} " + ", ".join(f"{p.ratio:.2f}x" + ("*" if p.reused else "") for p in paces if p.method == method)
        for method in dict.fromkeys(p.method for p in paces)
    ]
    note = " (* a run trained by an earlier invocation, beside other runs)" if any(p.reused for p in paces) else ""
    return "fine-tune pace vs full (median epoch's training images/s, seed by seed): " + "; ".join(parts) + note


def summary_lines(
    goals: GoalVerdicts,
    speed: MatchedSpeed | None,
    failed: list[str],
    point_speed: PointSpeed | None = None,
    runs: list[MethodRun] | None = None,
) -> list[str]:
    """The goals as measured, the speed comparison, the operating points' measured
    speed-ups (:func:`~splitvit.study.speed.points_speed`), each method's fine-tuning
    pace (:func:`training_pace_line`, given ``runs``) and the failed runs, one line
    each (``splitvit study`` and the single-GPU runner print these under their table)."""
    lines = []
    if goals.reference_converged is not None:
        lines.append(_reference_line(goals.reference_converged))
    for g in ([goals.match] if goals.match is not None else []) + goals.match_also:
        lines.append(_parity_line(g))
    if goals.above_baselines is not None:
        b, w = goals.above_baselines, goals.above_baselines.worst
        lines.append(
            f"SPLIT above entropy and random at every ratio in {list(b.ratio_range)}: smallest margin "
            f"{w.margin_points:+.2f} points (vs {w.versus} at {w.target_ratio:.2f}): "
            f"{_verdict(b.met)}"
        )
    if goals.margin_over_entropy is not None:
        m = goals.margin_over_entropy
        lines.append(
            f"SPLIT over entropy at {m.target_ratio:.0%} tokens: {m.margin_points:+.2f} points (goal >= "
            f"{m.goal_points}): {_verdict(m.met)}"
        )
    if goals.study_time is not None:
        lines.append(_study_time_line(goals.study_time))
    if speed:
        lines.append(_speed_line(speed))
    lines += point_speed_lines(point_speed)
    pace = training_pace_line(runs or [])
    if pace:
        lines.append(pace)
    lines += [f"failed: {failure}" for failure in failed]
    return lines


def study_speed_figure(
    rows: list[StudyRow],
    timed: dict[tuple[str, float | None], FullTiming | StudyTimedPoint],
    metric: str,
    title: str = "",
):
    """Mean quality (over seeds) against the speed-up measured on one seed, per method;
    full resolution at 1.0x."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    for method in dict.fromkeys(r.method for r in rows):
        points = sorted(
            (timed[(r.method, r.target_ratio)].speedup_vs_full, r.quality)
            for r in rows
            if r.method == method and (r.method, r.target_ratio) in timed
        )
        if not points:
            continue
        policy = next(r.policy for r in rows if r.method == method)
        fmt = {"full": "*", "coarse": "v"}.get(policy, "o-")
        ax.plot(
            [x for x, _ in points],
            [y for _, y in points],
            fmt,
            ms=10 if policy in ("full", "coarse") else 5,
            label=f"{method} ({policy})",
        )
    ax.axvline(1.0, color="black", lw=0.8, ls=":")
    ax.set_xlabel("measured speed-up vs full resolution (median images/s ratio, same run)")
    ax.set_ylabel(f"{metric} (mean over seeds)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    return fig


def study_figure(rows: list[StudyRow], metric: str, title: str = ""):
    """Mean quality versus tokens per image per method, error bars one standard
    deviation over seeds; full resolution and all-coarse as single points."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    styles = {"learned": ("o-", None), "entropy": ("s--", "#2ca02c"), "random": ("x:", "#7f7f7f")}
    for method in dict.fromkeys(r.method for r in rows):
        points = sorted((r for r in rows if r.method == method), key=lambda r: r.tokens_per_image)
        policy = points[0].policy
        xs = [r.tokens_per_image for r in points]
        ys = [r.quality for r in points]
        errs = [r.quality_std for r in points]
        if policy in styles:
            fmt, colour = styles[policy]
            label = f"SPLIT {method}" if policy == "learned" else method
            ax.errorbar(xs, ys, yerr=errs, fmt=fmt, color=colour, ms=5, capsize=3, label=label)
        else:
            marker = "*" if policy == "full" else "v"
            ax.errorbar(xs, ys, yerr=errs, fmt=marker, color="black", ms=12, capsize=3, label=f"{method} ({policy})")
    ax.set_xlabel("tokens per image")
    ax.set_ylabel(f"{metric} (mean ± std over seeds)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig
