"""Evaluation-only work on a trained checkpoint: stage-two threshold sweeps, baselines
and split maps.

A :class:`CheckpointEvaluator` loads a checkpoint and its experiment's evaluation
data once, then evaluates as many (policy, thresholds) settings as asked — cheap
next to training, which is why the threshold sweep is the cheap half of a sweep.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..model import SplitViT, validate_thresholds
from ..train.checkpoints import load_payload
from ..train.steps import calibrate_thresholds, evaluate
from .pareto import quiet_optuna

log = logging.getLogger(__name__)

#: Evaluation sets up to this many images are kept in memory between evaluations.
CACHE_LIMIT = 4096


class CheckpointEvaluator:
    """A checkpoint's model and its validation data, loaded once.

    Args:
        checkpoint: a checkpoint folder or its ``model.pt`` (local or ``s3://``).
        samples: evaluate on this many images (default: the experiment's split).
        device: torch device.
        cache: keep the evaluation batches in memory (sets up to ``CACHE_LIMIT`` images).
        split: the data split to evaluate on (default: the experiment's validation split).
    """

    def __init__(
        self,
        checkpoint: str,
        *,
        samples: int | None = None,
        device: str = "cpu",
        cache: bool = True,
        split: str | None = None,
    ) -> None:
        self.checkpoint = str(checkpoint)
        self.device = torch.device(device)
        self.payload = load_payload(checkpoint)
        config = self.payload.get("config") or {}
        data = config.get("data") or {}
        if not data.get("name"):
            raise ValueError(
                f"checkpoint {checkpoint} holds no experiment config; it was not written by splitvit train"
            )
        self.num_classes = (config.get("model") or {}).get("num_classes")
        self.model = self._build(None)
        self.levels = self.model.levels
        self.split = split or data.get("val_split") or "val"
        self.dataset = self._dataset(self.split, samples)
        self.batch_size = int(data.get("eval_batch_size") or data.get("batch_size") or 64)
        self.num_workers = int(data.get("num_workers") or 0)
        self._cache: list | None = None
        if cache and len(self.dataset) <= CACHE_LIMIT:
            self._cache = list(self._loader())

    def _build(self, policy: str | None) -> SplitViT:
        overrides = {"policy": policy} if policy else {}
        return SplitViT.from_checkpoint(self.payload, **overrides).to(self.device).eval()

    def _loader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def batches(self):
        """The evaluation batches (cached for small sets)."""
        return self._cache if self._cache is not None else self._loader()

    def autocast(self):
        """The precision every evaluation runs in: bf16 autocast on CUDA, float32 elsewhere."""
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def calibrate(self, images: torch.Tensor, target_ratio: float, model: SplitViT | None = None) -> list[float]:
        """Thresholds that meet ``target_ratio`` on ``images``, scored in the precision
        :meth:`evaluate` runs in (so the evaluated budget is the calibrated one)."""
        with self.autocast():
            return calibrate_thresholds(model or self.model, images, target_ratio)

    def evaluate(self, thresholds: list[float] | None = None, model: SplitViT | None = None) -> dict[str, Any]:
        """Quality, tokens per image, token ratio and images/s at ``thresholds`` (and,
        on data with object masks, ``fine_on_object`` and ``object_coverage``)."""
        model = model or self.model
        if thresholds is not None:
            validate_thresholds(thresholds, model.levels)
        with self.autocast():
            result = evaluate(
                model, self.batches(), thresholds=thresholds, num_classes=self.num_classes, object_masks=True
            )
        used = thresholds if thresholds is not None else model.thresholds.tolist()
        result["thresholds"] = [float(t) for t in used]
        result["quality"] = result.get("miou", result.get("accuracy"))
        return result

    def _dataset(self, split: str, samples: int | None):
        """The checkpoint's experiment data, split ``split`` (``samples`` images)."""
        from ..data import build_dataset

        data = self.payload["config"]["data"]
        options = dict(data.get("options") or {})
        if samples is not None:
            options.pop("num_samples", None)  # it would win over the split's own count
            options[f"{split}_samples"] = samples
        return build_dataset(
            data["name"],
            split,
            image_size=self.model.geometry.image_size[0],
            interpolation=self.model.data_config["interpolation"],
            seed=int(data.get("seed", 0)),
            **options,
        )

    def first_images(self, count: int, split: str | None = None) -> torch.Tensor:
        """The first ``count`` images of the evaluation split, or of ``split`` (e.g.
        validation images to calibrate thresholds on, never the evaluated ones)."""
        from ..data import first_images

        dataset = self.dataset if split in (None, self.split) else self._dataset(split, count)
        return first_images(dataset, count).to(self.device)

    @torch.no_grad()
    def split_map(self, thresholds: list[float] | None, count: int = 8):
        """A PIL grid of the quadtree the model chooses on the first ``count`` images."""
        from ..tracking.split_maps import split_map_grid

        images = self.first_images(count)
        out = self.model(images, thresholds=thresholds)
        captions = [f"{int(t)}/{out.full_tokens} tok" for t in out.tokens]
        return split_map_grid(images.cpu(), [d.cpu() for d in out.decisions], self.model.geometry, captions)

    # ------------------------------------------------------------------ stage two
    def threshold_sweep(
        self,
        points: int,
        *,
        low: float = 0.0,
        high: float = 1.0,
        sampler: str = "tpe",
        seed: int = 0,
        known: list[tuple[list[float], float, float]] | None = None,
    ) -> list[dict[str, Any]]:
        """Optuna over the per-level thresholds, evaluation only.

        Each of ``points`` Optuna trials picks one threshold per non-finest level in
        ``[low, high]`` and evaluates the checkpoint with them; the study maximises
        quality and minimises tokens per image. ``known`` results (thresholds,
        quality, tokens), e.g. the trial's own stage-one point, seed the study.
        Returns one result dict per evaluated point.
        """
        import optuna
        from optuna.distributions import FloatDistribution

        if points <= 0:
            return []
        names = [f"t{level}" for level in range(self.levels - 1)]
        dist = {n: FloatDistribution(low, high) for n in names}
        with quiet_optuna():
            study = optuna.create_study(
                directions=["maximize", "minimize"], sampler=_stage_two_sampler(sampler, seed, points)
            )
            for thresholds, quality, tokens in known or []:
                if all(low <= t <= high for t in thresholds) and math.isfinite(quality) and math.isfinite(tokens):
                    study.add_trial(
                        optuna.trial.create_trial(
                            params=dict(zip(names, thresholds)), distributions=dist, values=[quality, tokens]
                        )
                    )
            results = []
            for i in range(points):
                trial = study.ask(dist)
                thresholds = [float(trial.params[n]) for n in names]
                result = self.evaluate(thresholds)
                study.tell(trial, [result["quality"], result["tokens_per_image"]])
                results.append(result)
                log.info(
                    "threshold point %d/%d: thresholds %s -> quality %.4f, %.1f tokens/image",
                    i + 1,
                    points,
                    [round(t, 3) for t in thresholds],
                    result["quality"],
                    result["tokens_per_image"],
                )
        return results

    # ------------------------------------------------------------------ baselines
    def baselines(
        self, *, entropy_thresholds: list[float], random_ratios: list[float], seed: int = 0
    ) -> list[dict[str, Any]]:
        """The same backbone and data under other split policies.

        * ``full``: every node splits (a plain ViT at the finest patch size);
        * ``entropy``: APT-style pixel-entropy splitting, one point per threshold;
        * ``random``: uniform random scores, thresholds calibrated (on the first
          evaluation batch) so the token ratio matches each of ``random_ratios``.
        """
        rows: list[dict[str, Any]] = []
        full = self._build("full")
        rows.append({"baseline": "full", "label": "full resolution", **self.evaluate(None, model=full)})
        entropy = self._build("entropy")
        for t in entropy_thresholds:
            rows.append(
                {
                    "baseline": "entropy",
                    "label": f"entropy t={t:g}",
                    **self.evaluate([float(t)] * (self.levels - 1), model=entropy),
                }
            )
        if random_ratios:
            random_model = self._build("random")
            calibration = self.first_images(self.batch_size)
            for ratio in random_ratios:
                ratio = min(max(float(ratio), 1e-3), 1.0)
                # fresh draws for every batch from torch's global generator, seeded so
                # that a rerun (or a resumed sweep) gets the same figures
                torch.manual_seed(seed)
                thresholds = self.calibrate(calibration, ratio, model=random_model)
                torch.manual_seed(seed + 1)
                row = self.evaluate(thresholds, model=random_model)
                rows.append({"baseline": "random", "label": f"random @ {ratio:.2f}", "target_ratio": ratio, **row})
        for row in rows:
            log.info(
                "baseline %s: quality %.4f at %.1f tokens/image", row["label"], row["quality"], row["tokens_per_image"]
            )
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
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Run a threshold sweep on ``checkpoint`` (see :meth:`CheckpointEvaluator.threshold_sweep`).

    A plain function, so a trial can run it as a Ray task on the training resources.
    """
    evaluator = CheckpointEvaluator(checkpoint, samples=samples, device=device)
    return evaluator.threshold_sweep(points, low=low, high=high, sampler=sampler, seed=seed, known=known)


def baselines(
    checkpoint: str,
    *,
    entropy_thresholds: list[float],
    random_ratios: list[float],
    samples: int | None,
    seed: int = 0,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Baselines on ``checkpoint``'s backbone (see :meth:`CheckpointEvaluator.baselines`)."""
    evaluator = CheckpointEvaluator(checkpoint, samples=samples, device=device)
    return evaluator.baselines(entropy_thresholds=entropy_thresholds, random_ratios=random_ratios, seed=seed)
