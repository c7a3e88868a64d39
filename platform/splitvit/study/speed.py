"""The study's speed step, on trained checkpoints: the matched SPLIT point against
full resolution (:func:`matched_speed`, timed by :func:`speed_comparison`) and every
method's evaluated points side by side (:func:`points_speed`, timed by
:func:`~splitvit.tune.speed.time_operating_points`, the timing routine sweeps use too).
"""

from __future__ import annotations

import statistics
from typing import Any

from .goals import matched_point
from .spec import StudySpec


def speed_comparison(
    split_checkpoint: str,
    full_checkpoint: str,
    *,
    target_ratio: float,
    split: str,
    batch_size: int,
    rounds: int,
    calibration_samples: int,
    seed: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """Forward images/s of a trained SPLIT checkpoint at ``target_ratio`` against the
    trained full-resolution checkpoint, timed interleaved on the same batch."""
    import torch

    from ..bench.timing import time_interleaved
    from ..train.evaluation import CheckpointEvaluator

    split_eval = CheckpointEvaluator(split_checkpoint, samples=batch_size, device=device, split=split)
    full_eval = CheckpointEvaluator(full_checkpoint, samples=batch_size, device=device, split=split)
    calibration = split_eval.first_images(calibration_samples, split="val")
    torch.manual_seed(seed)
    thresholds = split_eval.calibrate(calibration, target_ratio)
    images = split_eval.first_images(batch_size)
    sync = torch.cuda.synchronize if images.device.type == "cuda" else (lambda: None)
    with torch.no_grad(), split_eval.autocast():  # the precision the study evaluated in
        tokens = split_eval.model(images, thresholds=thresholds)
        fns = {
            "split": lambda: split_eval.model(images, thresholds=thresholds),
            "full": lambda: full_eval.model(images),
        }
        times = time_interleaved(fns, repeats=rounds, warmup=2, sync=sync)
    fraction = float(tokens.tokens.float().mean()) / tokens.full_tokens
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "batch_size": batch_size,
        "rounds": rounds,
        "device": str(images.device),
        "thresholds": thresholds,
        "token_fraction": fraction,
        "ideal_ratio": 1.0 / fraction,
        "split_images_per_s": batch_size / median["split"],
        "full_images_per_s": batch_size / median["full"],
        "ratio": median["full"] / median["split"],
        "ratio_fastest_round": min(times["full"]) / min(times["split"]),
    }


def matched_speed(
    spec: StudySpec, rows: list[dict[str, Any]], runs: list[dict[str, Any]], metric: str, run=None
) -> dict[str, Any] | None:
    """:func:`speed_comparison` of the :func:`~splitvit.study.goals.matched_point` against full resolution,
    on the lowest seed that trained both (``None`` when there is no such pair).
    ``run(fn, *args, **kwargs)`` runs it where the checkpoints' device is (default:
    here, on the CPU)."""
    point = matched_point(rows, spec.goals, metric)
    if point is None:
        return None
    seed = min(int(s) for s in point["per_seed"])
    checkpoints = {(r["method"], r["seed"]): r["checkpoint"] for r in runs}
    full = next(m for m in spec.methods if spec.policy(m) == "full")
    if (full, seed) not in checkpoints:
        return None
    run = run or (lambda fn, *args, **kw: fn(*args, **kw))
    speed = run(
        speed_comparison,
        checkpoints[(point["method"], seed)],
        checkpoints[(full, seed)],
        target_ratio=point["target_ratio"],
        split=spec.split,
        batch_size=spec.speed_batch,
        rounds=spec.speed_rounds,
        calibration_samples=spec.calibration_samples,
        seed=seed,
    )
    speed.update(
        {
            "method": point["method"],
            "target_ratio": point["target_ratio"],
            "seed": seed,
            "matches_full": point["matches_full"],
            metric: point[metric],
        }
    )
    return speed


def points_speed(spec: StudySpec, runs: list[dict[str, Any]], run=None) -> dict[str, Any] | None:
    """Every method's evaluated operating points timed against full resolution, side
    by side in one interleaved run (:func:`~splitvit.tune.speed.time_operating_points`).

    What is timed, to stay within a bounded time: one seed (the lowest that trained
    the ``full`` method); the ``full`` method's checkpoint is the full-resolution
    model; every other method's points of that seed at the evaluation ratios (one
    point for ``coarse``), each with the thresholds its evaluation calibrated (as
    stored with the point), so the timed point is the evaluated one. At most
    ``speed.max_points`` points: each method gets an equal share, spread over its
    ratios (both ends kept). The cost is ``(warmup + rounds) x (points + 1)``
    forward passes of ``speed.batch_size`` images. ``run(fn, *args, **kwargs)`` runs
    it where the checkpoints' device is (default: here, on the CPU).

    Returns the timing record, its points labelled with ``method``, ``target_ratio``
    and ``seed`` (``None`` when there is no full-resolution run or nothing to time).
    """
    from ..tune.speed import spread, time_operating_points

    full = next(m for m in spec.methods if spec.policy(m) == "full")
    seeds = sorted(int(r["seed"]) for r in runs if r["method"] == full)
    if not seeds:
        return None
    seed = seeds[0]
    by_method = {r["method"]: r for r in runs if int(r["seed"]) == seed}
    others = [m for m in spec.methods if m != full and m in by_method]
    if not others:
        return None
    share = None if spec.speed_max_points is None else max(1, spec.speed_max_points // len(others))
    chosen = []
    for method in others:
        stored = sorted(
            by_method[method]["points"], key=lambda p: (p["target_ratio"] is None, p["target_ratio"] or 0.0)
        )
        for point in spread(stored, share):
            chosen.append(
                {
                    "checkpoint": by_method[method]["checkpoint"],
                    "thresholds": point.get("thresholds"),
                    "budget": point["target_ratio"],  # what a budget-conditioned policy was told
                    "label": f"{method}@{point['target_ratio']}",
                    "method": method,
                    "target_ratio": point["target_ratio"],
                }
            )
    run = run or (lambda fn, *args, **kw: fn(*args, **kw))
    record = run(
        time_operating_points,
        [{k: p[k] for k in ("checkpoint", "thresholds", "budget", "label")} for p in chosen],
        full_checkpoint=by_method[full]["checkpoint"],
        split=spec.split,
        batch_size=spec.speed_batch,
        rounds=spec.speed_rounds,
        warmup=spec.speed_warmup,
    ).to_dict()
    for point, row in zip(chosen, record["points"]):
        row.update({"method": point["method"], "target_ratio": point["target_ratio"], "seed": seed})
    record["full"][0].update({"method": full, "seed": seed})
    record["seed"] = seed
    return record


def timed_points(record: dict[str, Any] | None) -> dict[tuple[str, float | None], dict[str, Any]]:
    """(method, target ratio) -> the timed point of :func:`points_speed` (the full
    method's entry at 1.0x included)."""
    if not record:
        return {}
    out = {(p["method"], p["target_ratio"]): p for p in record["points"]}
    full = record["full"][0]
    out[(full["method"], None)] = {**full, "target_ratio": None}
    return out
