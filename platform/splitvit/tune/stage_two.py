"""Evaluation-only work on a sweep's trained checkpoints: stage two (Optuna over
the split thresholds) and the baselines on the best point's backbone.

Both evaluate a :class:`~splitvit.train.evaluation.CheckpointEvaluator` many times
over data it loads once: cheap next to training, which is why the threshold sweep
is the cheap half of a sweep.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from ..train.evaluation import CheckpointEvaluator, calibrated_points
from ..train.points import EvaluatedPoint
from .pareto import Baseline, quiet_optuna

log = logging.getLogger(__name__)


def stage_two(
    checkpoint: str,
    *,
    points: int,
    low: float,
    high: float,
    sampler: str,
    seed: int,
    samples: int | None,
    known: list[tuple[list[float], float, float]] | None = None,
    own: list[float] | None = None,
    ratios: list[float] | None = None,
    calibration_samples: int = 256,
    device: str = "cpu",
) -> list[EvaluatedPoint]:
    """Optuna over ``checkpoint``'s per-level thresholds, evaluation only.

    First, one point per token ratio in ``ratios``: thresholds calibrated to it on the
    first ``calibration_samples`` validation images, as a study's method and a sweep's
    baselines are evaluated, so that every trial has a point at each ratio a user asks
    about (a few quasi-random thresholds leave gaps). Then each of ``points`` Optuna
    trials picks one threshold per non-finest level in ``[low, high]`` and evaluates the
    checkpoint with them on ``samples`` validation images; the study maximises quality
    and minimises tokens per image. ``known`` results (thresholds, quality, tokens),
    e.g. the trial's own stage-one point, and the calibrated points seed the study.
    ``own`` thresholds (the trial's own) are evaluated first on the same images, so that
    its point and stage two's are measured alike; their point leads the returned list
    and seeds the study. Returns one point per evaluation. A plain function, so a trial
    can run it as a Ray task on the training resources.
    """
    import optuna
    from optuna.distributions import FloatDistribution

    if points <= 0 and not ratios and own is None:
        return []
    evaluator = CheckpointEvaluator(checkpoint, samples=samples, device=device)
    names = [f"t{level}" for level in range(evaluator.levels - 1)]
    dist = {n: FloatDistribution(low, high) for n in names}
    results = [evaluator.evaluate(own)] if own is not None else []
    if ratios:
        results += calibrated_points(evaluator, ratios, calibration_samples, seed=seed)
    known = [*(known or []), *((r.thresholds or [], r.quality, r.tokens_per_image) for r in results)]
    with quiet_optuna():
        study = optuna.create_study(
            directions=["maximize", "minimize"], sampler=_stage_two_sampler(sampler, seed, points)
        )
        for thresholds, quality, tokens in known:
            if all(low <= t <= high for t in thresholds) and math.isfinite(quality) and math.isfinite(tokens):
                study.add_trial(
                    optuna.trial.create_trial(
                        params=dict(zip(names, thresholds)), distributions=dist, values=[quality, tokens]
                    )
                )
        for i in range(points):
            trial = study.ask(dist)
            thresholds = [float(trial.params[n]) for n in names]
            result = evaluator.evaluate(thresholds)
            study.tell(trial, [result.quality, result.tokens_per_image])
            results.append(result)
            log.info(
                "threshold point %d/%d: thresholds %s -> quality %.4f, %.1f tokens/image",
                i + 1,
                points,
                [round(t, 3) for t in thresholds],
                result.quality,
                result.tokens_per_image,
            )
    return results


def baselines(
    checkpoint: str,
    *,
    entropy_thresholds: list[float],
    random_ratios: list[float],
    samples: int | None,
    trial_id: str,
    seed: int = 0,
    device: str = "cpu",
) -> list[Baseline]:
    """``checkpoint``'s backbone (trial ``trial_id``'s) and validation data under other
    split policies.

    * ``full``: every node splits (a plain ViT at the finest patch size);
    * ``entropy``: APT-style pixel-entropy splitting, one point per threshold;
    * ``random``: uniform random scores, thresholds calibrated (on the first
      evaluation batch) so the token ratio matches each of ``random_ratios``.
    """
    evaluator = CheckpointEvaluator(checkpoint, samples=samples, device=device)
    rows: list[Baseline] = []
    full = evaluator.build("full")
    rows.append(Baseline.of_evaluation("full", "full resolution", evaluator.evaluate(None, model=full), trial_id))
    entropy = evaluator.build("entropy")
    for t in entropy_thresholds:
        point = evaluator.evaluate([float(t)] * (evaluator.levels - 1), model=entropy)
        rows.append(Baseline.of_evaluation("entropy", f"entropy t={t:g}", point, trial_id))
    if random_ratios:
        random_model = evaluator.build("random")
        calibration = evaluator.first_images(evaluator.batch_size)
        for ratio in random_ratios:
            ratio = min(max(float(ratio), 1e-3), 1.0)
            # fresh draws for every batch from torch's global generator, seeded so
            # that a rerun (or a resumed sweep) gets the same figures
            torch.manual_seed(seed)
            thresholds = evaluator.calibrate(calibration, ratio, model=random_model)
            torch.manual_seed(seed + 1)
            point = dataclasses.replace(evaluator.evaluate(thresholds, model=random_model), target_ratio=ratio)
            rows.append(Baseline.of_evaluation("random", f"random @ {ratio:.2f}", point, trial_id))
    for row in rows:
        log.info("baseline %s: quality %.4f at %.1f tokens/image", row.label, row.quality, row.tokens_per_image)
    return rows


def held_out(
    checkpoint: str,
    evaluations: list[tuple[str | None, list[float] | None]],
    *,
    split: str,
    samples: int | None,
    seed: int = 0,
    device: str = "cpu",
) -> list[EvaluatedPoint]:
    """``checkpoint`` on the held-out ``split`` once per ``(policy, thresholds)`` in
    ``evaluations`` (policy ``None``: the checkpoint's own; thresholds ``None``: its
    own), its data loaded once. A random policy's draws are seeded, so a rerun repeats
    its figures."""
    evaluator = CheckpointEvaluator(checkpoint, samples=samples, device=device, split=split)
    models: dict[str | None, Any] = {}
    rows: list[EvaluatedPoint] = []
    for policy, thresholds in evaluations:
        if policy not in models:
            models[policy] = None if policy is None else evaluator.build(policy)
        torch.manual_seed(seed + 1)
        rows.append(evaluator.evaluate(thresholds, model=models[policy]))
    return rows


def _stage_two_sampler(name: str, seed: int, points: int):
    import optuna

    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(2, min(points, 50)))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "qmc":
        import warnings

        with warnings.catch_warnings():
            # QMCSampler is marked experimental; its interface is all we need here
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.QMCSampler(seed=seed, scramble=True, warn_independent_sampling=False)
    # TPE needs a few random points before it models anything; with few points, half
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, min(10, points // 2)))
