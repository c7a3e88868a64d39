"""Where a study's figures and goal lines are computed: the aggregation over seeds
(:func:`aggregate`), the goals measured on it (:func:`check_goals`: parity with full
resolution, the margins over the baselines), the gaps to the control
(:func:`gap_spread`), the point the speed comparison times (:func:`matched_point`), the
reference's convergence (:func:`reference_convergence`), the study's time
(:func:`study_time`) and the recipe ablation (:func:`lever_table`).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

from .spec import Goals

EPS = 1e-9  # points: means of seeds' accuracies are not exact in binary


def aggregate(results: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """One row per (method, target ratio): mean, standard deviation, min and max over
    seeds of the quality, and the means of tokens per image, token ratio and images/s."""
    groups: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    policies: dict[str, str] = {}
    for result in results:
        policies[result["method"]] = result["policy"]
        for point in result["points"]:
            groups.setdefault((result["method"], point["target_ratio"]), []).append({**point, "seed": result["seed"]})
    rows = []
    for (method, ratio), points in groups.items():
        q = [float(p["quality"]) for p in points]
        rows.append(
            {
                "method": method,
                "policy": policies[method],
                "target_ratio": ratio,
                "seeds": len(points),
                metric: statistics.fmean(q),
                f"{metric}_std": statistics.stdev(q) if len(q) > 1 else 0.0,
                f"{metric}_min": min(q),
                f"{metric}_max": max(q),
                "tokens_per_image": statistics.fmean(float(p["tokens_per_image"]) for p in points),
                "token_ratio": statistics.fmean(float(p["token_ratio"]) for p in points),
                "images_per_s": statistics.fmean(float(p["images_per_s"]) for p in points),
                "per_seed": {str(p["seed"]): float(p["quality"]) for p in points},
            }
        )
    rows.sort(key=lambda r: (r["policy"] != "full", r["policy"] != "learned", r["method"], r["target_ratio"] or 0.0))
    return rows


def check_goals(rows: list[dict[str, Any]], goals: Goals, metric: str) -> dict[str, Any]:
    """The goals, measured on the aggregated rows (means over seeds; points)."""
    pts = 100.0
    full = next((r for r in rows if r["policy"] == "full"), None)
    if full is None:
        return {}

    def best(policy: str, ratio: float) -> dict[str, Any] | None:
        found = [
            r
            for r in rows
            if r["policy"] == policy and r["target_ratio"] is not None and math.isclose(r["target_ratio"], ratio)
        ]
        return max(found, key=lambda r: r[metric]) if found else None

    out: dict[str, Any] = {"full_" + metric: full[metric]}
    match = _match(rows, full, goals.match_ratio, goals, metric)
    if match:
        out["match"] = match
    also = [_match(rows, full, ratio, goals, metric) for ratio in goals.also_match_at]
    if any(also):
        out["match_also"] = [m for m in also if m]
    if goals.beat_range:
        lo, hi = goals.beat_range
        margins = []
        for ratio in sorted({r["target_ratio"] for r in rows if r["target_ratio"] is not None}):
            if not lo - 1e-9 <= ratio <= hi + 1e-9:
                continue
            split = best("learned", ratio)
            for other in ("entropy", "random"):
                rival = best(other, ratio)
                if split and rival:
                    margins.append(
                        {"target_ratio": ratio, "versus": other, "margin_points": (split[metric] - rival[metric]) * pts}
                    )
        if margins:
            worst = min(margins, key=lambda m: m["margin_points"])
            out["above_baselines"] = {
                "range": [lo, hi],
                "margins": margins,
                "worst": worst,
                "met": worst["margin_points"] > 0,
            }
    if goals.margin_at is not None:
        split, rival = best("learned", goals.margin_at), best("entropy", goals.margin_at)
        if split and rival:
            margin = (split[metric] - rival[metric]) * pts
            out["margin_over_entropy"] = {
                "target_ratio": goals.margin_at,
                "margin_points": margin,
                "goal_points": goals.margin,
                "met": margin >= goals.margin - EPS,
            }
    return out


def gap_spread(full: dict[str, Any], row: dict[str, Any]) -> float | None:
    """The standard deviation over seeds, in points, of ``row``'s gap to ``full`` taken
    seed by seed (each method starts from its seed's reference, so a seed's reference
    lifts or lowers both): how much of a mean gap is more than noise. ``None`` with
    fewer than two seeds in common."""
    seeds = sorted(set(full.get("per_seed", {})) & set(row.get("per_seed", {})))
    if len(seeds) < 2:
        return None
    return statistics.stdev((full["per_seed"][s] - row["per_seed"][s]) * 100.0 for s in seeds)


def _match(
    rows: list[dict[str, Any]], full: dict[str, Any], max_ratio: float, goals: Goals, metric: str
) -> dict[str, Any] | None:
    """The most accurate SPLIT row at no more than ``max_ratio`` of the tokens (measured,
    within ``goals.ratio_tolerance``), and its gap to full resolution in points (``met``:
    at most ``goals.match_points``)."""
    goal_points = goals.match_points
    within = [
        r for r in rows if r["policy"] == "learned" and r["token_ratio"] <= max_ratio + goals.ratio_tolerance + 1e-9
    ]
    if not within:
        return None
    top = max(within, key=lambda r: r[metric])
    gap = (full[metric] - top[metric]) * 100.0
    return {
        "method": top["method"],
        "target_ratio": top["target_ratio"],
        "token_ratio": top["token_ratio"],
        metric: top[metric],
        "gap_points": gap,
        "gap_std_points": gap_spread(full, top),
        "goal_points": goal_points,
        "max_token_ratio": max_ratio,
        "ratio_tolerance": goals.ratio_tolerance,
        "met": gap <= goal_points + EPS,
    }


def reference_convergence(backbones: list[dict[str, Any]], goals: Goals, metric: str) -> dict[str, Any] | None:
    """Whether each seed's backbone (the reference every method starts from) had
    converged: its validation ``metric`` gained less than ``goals.converge_points``
    over its last ``goals.converge_epochs`` epochs. Each seed's curve comes along
    (``curve``: the metric per epoch). None when the study sets no such goal."""
    if goals.converge_points is None:
        return None
    k = goals.converge_epochs
    seeds: dict[str, dict[str, Any]] = {}
    for backbone in backbones:
        curve = [float(h[metric]) for h in backbone.get("history") or [] if metric in h]
        record: dict[str, Any] = {"curve": curve, "epochs": len(curve)}
        if len(curve) > k:
            record["gain_points"] = (curve[-1] - curve[-1 - k]) * 100.0
            record["met"] = record["gain_points"] < goals.converge_points
        else:  # too short a curve to tell (or one stored before curves were kept)
            record["gain_points"] = None
            record["met"] = False
        seeds[str(backbone["seed"])] = record
    if not seeds:
        return None
    return {
        "over_epochs": k,
        "goal_points": goals.converge_points,
        "seeds": seeds,
        "met": all(s["met"] for s in seeds.values()),
    }


def study_time(
    seconds: float,
    backbones: list[dict[str, Any]],
    runs: int,
    goals: Goals,
    *,
    begun: Sequence[str] = (),
    failed: int = 0,
    borrowed_references: bool = False,
) -> dict[str, Any] | None:
    """How long this invocation of a study of ``runs`` runs took, against
    ``goals.max_minutes``; None when the study sets no such goal.

    The verdict (``met``) is given only for an invocation that ran the whole study
    from the start, every run finishing: runs an earlier invocation had started or
    finished (``begun``, by name: :func:`~splitvit.study.runs.begun_runs`), references borrowed from another
    study, or failed runs would make the time a part of the study's. The machine comes
    along, as the time is as much its as the study's: its CPU count and the references'
    training throughput (``backbones``' last epoch, images/s per run, the mean over seeds),
    of the references this invocation trained: a ``reused`` one's (borrowed, or finished
    earlier) is another invocation's, maybe another machine's.
    """
    if goals.max_minutes is None:
        return None
    speeds = [
        b["metrics"]["train_images_per_s"]
        for b in backbones
        if not b.get("reused") and "train_images_per_s" in b.get("metrics", {})
    ]
    record: dict[str, Any] = {
        "minutes": seconds / 60.0,
        "goal_minutes": goals.max_minutes,
        "runs": runs,
        "begun_earlier": list(begun),
        "failed_runs": failed,
        "borrowed_references": borrowed_references,
        "cpus": os.cpu_count(),
        "reference_images_per_s": sum(map(float, speeds)) / len(speeds) if speeds else None,
    }
    if not begun and not failed and not borrowed_references:
        record["met"] = record["minutes"] <= goals.max_minutes
    return record


def matched_point(rows: list[dict[str, Any]], goals: Goals, metric: str) -> dict[str, Any] | None:
    """The SPLIT point for the speed comparison: the fewest tokens among those within
    ``goals.match_points`` of full resolution; failing that, the most accurate one at
    or under ``goals.match_ratio``."""
    full = next((r for r in rows if r["policy"] == "full"), None)
    learned = [r for r in rows if r["policy"] == "learned"]
    if full is None or not learned:
        return None
    close = [r for r in learned if (full[metric] - r[metric]) * 100.0 <= goals.match_points + EPS]
    if close:
        return {**min(close, key=lambda r: r["token_ratio"]), "matches_full": True}
    capped = [r for r in learned if r["token_ratio"] <= goals.match_ratio + goals.ratio_tolerance + 1e-9] or learned
    return {**max(capped, key=lambda r: r[metric]), "matches_full": False}


def lever_table(rows: list[dict[str, Any]], metric: str, ratios: list[float]) -> list[dict[str, Any]]:
    """The recipe ablation: every SPLIT method's quality at each of ``ratios`` (mean and
    standard deviation over seeds) and its gap to the full-resolution control in
    points; one row per method, ``None`` where the method was not evaluated there."""
    full = next((r for r in rows if r["policy"] == "full"), None)
    table = []
    for method in dict.fromkeys(r["method"] for r in rows if r["policy"] == "learned"):
        entry: dict[str, Any] = {"method": method}
        for ratio in ratios:
            row = next(
                (
                    r
                    for r in rows
                    if r["method"] == method
                    and r["target_ratio"] is not None
                    and math.isclose(r["target_ratio"], ratio)
                ),
                None,
            )
            entry[f"r{ratio:g}"] = (
                None
                if row is None
                else {
                    metric: row[metric],
                    "std": row[f"{metric}_std"],
                    "seeds": row["seeds"],
                    "token_ratio": row["token_ratio"],
                    "gap_points": None if full is None else (full[metric] - row[metric]) * 100.0,
                    "gap_std_points": None if full is None else gap_spread(full, row),
                }
            )
        table.append(entry)
    return table
