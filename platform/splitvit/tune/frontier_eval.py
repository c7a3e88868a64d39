"""Evaluation-only work the sweep's driver runs on the frontier once the trials are done
(each where training ran, :func:`~splitvit.train.trial.run_evaluation`): the baselines
on the best point's backbone (when no baseline was fine-tuned), the frontier and the
baselines on the held-out split, and the frontier timed against full resolution
(:func:`~splitvit.bench.speed.time_operating_points`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from ..bench.speed import SpeedRecord, TimedPoint
from ..train.trial import run_evaluation
from .pareto import Baseline, Point
from .space import SearchSpace
from .state import Sweep, fine_tuned_baselines
from .trial import SweepPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontierTimedPoint(TimedPoint):
    """A frontier point timed against full resolution, labelled with its run and trial."""

    run_id: str | None  # its MLflow run (None: not recorded)
    trial_id: str
    kind: str  # "trial" or "threshold" (a stage-two point)


@dataclass(frozen=True)
class FrontierSpeed(SpeedRecord):
    """The frontier's timing (the sweep's ``frontier_speed``): the record, each point labelled."""

    points: list[FrontierTimedPoint]


def run_baselines(space: SearchSpace, plan: SweepPlan, best: Point, front: list[Point]) -> list[Baseline]:
    """Baselines on the best point's backbone (on a GPU where training had them)."""
    from .stage_two import baselines as evaluate_baselines

    ratios = sorted({round(p.token_ratio, 4) for p in front if 0 < p.token_ratio < 0.999})
    k = space.baselines.random_budgets
    if len(ratios) > k:
        # spread over the frontier: its ends and evenly in between
        ratios = [ratios[round(i * (len(ratios) - 1) / max(k - 1, 1))] for i in range(k)] if k > 0 else []
    log.info(
        "baselines on trial %s's backbone: full, entropy at %s, random at token ratios %s",
        best.trial_id,
        list(space.baselines.entropy_thresholds),
        ratios,
    )
    return run_evaluation(
        plan.trial_config({}, best.trial_id),
        evaluate_baselines,
        best.checkpoint,
        entropy_thresholds=list(space.baselines.entropy_thresholds),
        random_ratios=ratios,
        samples=space.baselines.samples,
        trial_id=best.trial_id,
        seed=space.search.seed,
    )


def evaluate_held_out(sweep: Sweep, front: list[Point], baselines: list[Baseline], checkpoints: dict[str, str]) -> None:
    """The frontier points and the baselines, evaluated once on the held-out split
    (``evaluation.split``) at the thresholds they were chosen with on validation: each
    gets ``test_<metric>``, ``test_tokens_per_image`` and ``test_token_ratio`` (in a
    point's ``extras``, a baseline's ``held_out``), and each point's MLflow run the same
    metrics."""
    from .stage_two import held_out

    e, metric = sweep.space.evaluation, sweep.metric
    jobs: dict[str, list[tuple[Any, str | None, list[float] | None]]] = {}
    for p in front:
        if p.checkpoint:
            jobs.setdefault(p.checkpoint, []).append((p, None, p.thresholds or None))
    # a fine-tuned baseline runs on its own checkpoint; else on the best point's backbone under its policy
    own = bool(fine_tuned_baselines(sweep.space))
    for b in baselines:
        checkpoint = checkpoints.get(b.trial_id)
        if checkpoint:
            jobs.setdefault(checkpoint, []).append((b, None if own else b.baseline, b.thresholds or None))
    log.info("evaluating %d frontier points and %d baselines on the %s split", len(front), len(baselines), e.split)
    for checkpoint, items in jobs.items():
        try:
            rows = run_evaluation(
                sweep.plan.trial_config({}, "held-out"),
                held_out,
                checkpoint,
                [(policy, thresholds) for _, policy, thresholds in items],
                split=e.split,
                samples=e.samples,
                seed=sweep.space.search.seed,
            )
        except Exception as exc:  # noqa: BLE001 - a split the data lacks must not lose the finished sweep
            log.warning("could not evaluate %s on the %s split (evaluation.split): %s", checkpoint, e.split, exc)
            continue
        for (item, _, _), row in zip(items, rows):
            figures = {
                f"test_{metric}": row.quality,
                "test_tokens_per_image": row.tokens_per_image,
                "test_token_ratio": row.token_ratio,
            }
            if isinstance(item, Point):
                item.extras.update(figures)
                if item.run_id:
                    sweep.recorder.log_run_metrics(item.run_id, figures)
            else:
                item.held_out = figures


def time_frontier(space: SearchSpace, plan: SweepPlan, front: list[Point], best: Point | None) -> FrontierSpeed | None:
    """Time the frontier points (at most ``speed.max_points``, spread by tokens) against
    the full-resolution model in one interleaved run, on the device the sweep
    evaluated on (:func:`~splitvit.bench.speed.time_operating_points`). Each timed
    point gets ``speedup_vs_full``, ``timed_images_per_s`` and ``timed_token_ratio``
    in its ``extras``. The full-resolution model is the reference backbone (the best
    point's checkpoint, on which the baselines ran) with the ``full`` policy.
    Returns the timing record, each point labelled with its ``run_id``, ``trial_id`` and
    ``kind``, or ``None`` when nothing could be timed (logged)."""
    from ..bench.speed import OperatingPoint, spread, time_operating_points

    s = space.speed
    chosen = spread([p for p in front if p.checkpoint], s.max_points)
    if not chosen:
        return None
    reference = best if best is not None and best.checkpoint else chosen[0]
    try:
        record = run_evaluation(
            plan.trial_config({}, reference.trial_id),
            time_operating_points,
            [OperatingPoint(p.checkpoint, p.thresholds, label=p.run_id or p.trial_id) for p in chosen],
            full_checkpoint=reference.checkpoint,
            batch_size=s.batch_size,
            rounds=s.rounds,
            warmup=s.warmup,
        )
    except Exception as exc:  # noqa: BLE001 - a timing that fails must not lose the frontier
        log.warning("could not time the frontier: %s", exc)
        return None
    labelled = []
    for point, timed in zip(chosen, record.points):
        point.extras.update(
            {
                "speedup_vs_full": timed.speedup_vs_full,
                "timed_images_per_s": timed.images_per_s,
                "timed_token_ratio": timed.token_ratio,
            }
        )
        values = {f.name: getattr(timed, f.name) for f in fields(timed)}
        labelled.append(FrontierTimedPoint(**values, run_id=point.run_id, trial_id=point.trial_id, kind=point.kind))
    log.info(
        "frontier timed on %s (batch %d, %d rounds): speed-ups vs full resolution %s",
        record.device,
        record.batch_size,
        record.rounds,
        ", ".join(f"{r.speedup_vs_full:.2f}x@{r.token_ratio:.2f}" for r in record.points),
    )
    return FrontierSpeed(**{**{f.name: getattr(record, f.name) for f in fields(record)}, "points": labelled})
