"""One sweep trial: the Tune driver function that trains with a ``TorchTrainer``.

This is the Ray Train V2 + Tune pattern: Tune runs :func:`sweep_trial` (a light
function, its own resources ``search.trial_resources``); it launches a
``TorchTrainer`` (through :func:`~splitvit.train.ray_trainer.run_training`, the
same fit as ``splitvit train``) whose workers ask for the config's ``scaling`` resources and whose
per-epoch reports reach Tune through ``TuneReportCallback`` (so an early-stopping
scheduler can act on them). After training, stage two runs a threshold sweep on the
trial's checkpoint (on a GPU where training had them, see :func:`~splitvit.train.trial.run_evaluation`),
and the trial reports once more: its stage-one objectives, its checkpoint and its
threshold points.

Trials never write to MLflow (docs/design.md §3.4: only the Tune driver writes to the local
SQLite store); the driver logs a child run per trial from what the trial reports.

A trial that Tune starts again after a driver restart (its last state may predate
its completion) does no work twice: training resumes from the run's latest
checkpoint (the Train run name is the trial id), and a trial whose final report was
already written (``sweep_trial.json`` in its run folder) reports it again at once.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from ..config import ExperimentConfig
from ..jsontypes import JsonObject
from ..storage import exists, join_uri, read_bytes, write_bytes
from ..train.points import EvaluatedPoint
from ..train.trial import TrialFailed, fit_trial, run_evaluation
from .space import ConfigValue, SearchSpace

log = logging.getLogger(__name__)

TRIAL_RESULT_FILE = "sweep_trial.json"
#: Keys of the final report that only the final report has.
FINAL_KEY = "splitvit_final"
#: A baseline trial's Tune config: ``{BASELINE_KEY: "entropy"}`` (not a searched point).
BASELINE_KEY = "baseline"


class TrialDiverged(RuntimeError):
    """Training stopped on a non-finite loss, gradient or split probability: the trial has no valid point."""


#: a threshold point's keys besides its quality (under the metric's name) and companions
_POINT_KEYS = ("tokens_per_image", "token_ratio", "images_per_s", "images", "thresholds", "target_ratio")


@dataclass(frozen=True)
class ThresholdPoint:
    """One of a trial's stage-two points (or a fine-tuned baseline's at one of its
    ratios): its checkpoint evaluated at other thresholds. In the trial's report its
    quality is keyed by the metric's name (:meth:`to_dict`)."""

    quality: float
    tokens_per_image: float
    token_ratio: float
    thresholds: list[float]
    images_per_s: float | None = None  # None: not measured (left out of the JSON)
    companions: dict[str, float] = field(default_factory=dict)  # e.g. a detector's mask_ap
    target_ratio: float | None = None  # the ratio its thresholds were calibrated to (a baseline's, stage two's ratios)
    images: int | None = None  # the validation images it was measured on (None: not recorded, older sweeps)

    @classmethod
    def of_evaluation(cls, point: EvaluatedPoint, companions: tuple[str, ...] = ()) -> ThresholdPoint:
        """The point of an evaluation's figures (quality, tokens, images/s, thresholds,
        the ``companions`` among its metrics, and its ``target_ratio``)."""
        return cls(
            quality=point.quality,
            tokens_per_image=point.tokens_per_image,
            token_ratio=point.token_ratio,
            thresholds=[float(t) for t in point.thresholds or []],
            images_per_s=point.images_per_s,
            companions={c: float(point.metrics[c]) for c in companions if c in point.metrics},
            target_ratio=point.target_ratio,
            images=point.images,
        )

    def to_dict(self, metric: str) -> JsonObject:
        """The report's row: the quality under ``metric``, the companions, then the figures
        (``images_per_s``, ``target_ratio`` and ``images`` where known)."""
        row: JsonObject = {
            metric: self.quality,
            **self.companions,
            "tokens_per_image": self.tokens_per_image,
            "token_ratio": self.token_ratio,
        }
        if self.images_per_s is not None:
            row["images_per_s"] = self.images_per_s
        row["thresholds"] = list(self.thresholds)
        if self.target_ratio is not None:
            row["target_ratio"] = self.target_ratio
        if self.images is not None:
            row["images"] = self.images
        return row

    @classmethod
    def from_dict(cls, data: JsonObject, metric: str) -> ThresholdPoint:
        """The inverse of :meth:`to_dict` (every key besides the figures is a companion)."""
        return cls(
            quality=data[metric],
            tokens_per_image=data["tokens_per_image"],
            token_ratio=data["token_ratio"],
            thresholds=list(data["thresholds"]),
            images_per_s=data.get("images_per_s"),
            companions={k: v for k, v in data.items() if k != metric and k not in _POINT_KEYS},
            target_ratio=data.get("target_ratio"),
            images=data.get("images"),
        )


@dataclass
class SweepPlan:
    """Everything a trial needs, fixed for the whole sweep (and saved with it).

    Attributes:
        space: the validated search space.
        train_storage: where the trials' Train runs go: ``<sweep dir>/train``.
        name: the sweep's name.
        reference: the checkpoint every trial fine-tunes from (``None``: trials start
            from the base config's own initialisation).
    """

    space: SearchSpace
    train_storage: str
    name: str
    reference: str | None = None

    def trial_config(self, sampled: dict[str, Any], trial_id: str) -> ExperimentConfig:
        """The experiment config of one trial: the space's point (a baseline trial's:
        :meth:`baseline_params`), with MLflow off (the driver records the trial), the
        Train run under the sweep, and the reference's weights to start from."""
        if sampled.get(BASELINE_KEY):
            params = self.baseline_params(str(sampled[BASELINE_KEY]))
        else:
            params = self.space.decode({k: v for k, v in sampled.items() if k in self.space.parameters})
        # set as values, not key=value text: a storage path is not parsed as YAML
        params.update({"tracking.enabled": False, "storage.path": self.train_storage, "storage.name": trial_id})
        if self.reference is not None:
            # a new run starts from the reference; a resumed one from its own checkpoint
            params["model.init_from"] = self.reference
        return self.space.config(params, name=trial_id)

    def baseline_params(self, policy: str) -> dict[str, ConfigValue]:
        """A fine-tuned baseline's settings: the config's own point (the first initial
        point, else the base config's values) with ``policy``; entropy and random
        splitting fine-tune at ``baselines.target_ratio`` (thresholds calibrated to it)."""
        space = self.space
        first = space.search.initial_points[0] if space.search.initial_points else {}
        params = space.decode({k: space.parameters[k].encode(v) for k, v in first.items()})
        params["model.policy.kind"] = policy
        if policy != "full":
            params.update({"train.budget.target_ratio": space.baselines.target_ratio, "model.thresholds": "auto"})
        return params

    def run_uri(self, trial_id: str) -> str:
        """The trial's Train run folder (local path or URI)."""
        return join_uri(self.train_storage, trial_id)


def sweep_trial(sampled: dict[str, Any], plan: SweepPlan) -> None:
    """The Tune trial function (see the module docstring).

    Reports per-epoch metrics (through ``TuneReportCallback``) and a final result
    with the objectives (``accuracy``/``miou`` and ``tokens_per_image``), the
    checkpoint, the thresholds and ``threshold_points`` (see :func:`threshold_points`). Raises
    :class:`TrialDiverged` or :class:`TrialFailed`: Tune records the trial as
    failed, the sweep goes on, and the trial never reaches the frontier.
    """
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    run_uri = plan.run_uri(trial_id)
    result_uri = join_uri(run_uri, TRIAL_RESULT_FILE)
    if exists(result_uri):
        # finished before the driver restarted: report the same result, do no work
        log.info("trial %s already finished; reporting its stored result", trial_id)
        tune.report(json.loads(read_bytes(result_uri)))
        return

    config = plan.trial_config(sampled, trial_id)
    space = plan.space
    metric = space.quality_metric
    baseline = sampled.get(BASELINE_KEY)
    started = time.time()
    trained = fit_trial(config)
    if trained.status != "completed":
        raise TrialDiverged(f"diverged: {trained.message} (last good checkpoint {trained.checkpoint})")
    metrics = trained.metrics
    quality, tokens = metrics.get(metric), metrics.get("tokens_per_image")
    if quality is None or tokens is None or not (math.isfinite(quality) and math.isfinite(tokens)):
        raise TrialDiverged(f"diverged: non-finite objectives {metric}={quality}, tokens_per_image={tokens}")
    if trained.checkpoint is None:
        raise TrialFailed("training reported no checkpoint")
    thresholds = trained_thresholds(config, trained.checkpoint)
    train_seconds = time.time() - started

    points: list[EvaluatedPoint] = []
    images = metrics.get("val_images")  # what its last validation measured
    stage = space.stage_two
    if baseline:
        points = _baseline_points(plan, config, str(baseline), trained.checkpoint)
    elif stage.points > 0 or stage.ratios or stage.samples is not None:
        # a seed per trial that a rerun of the sweep repeats (trial ids are random; the
        # sampled values are not, for a seeded sampler)
        seed = space.search.seed * 100_003 + (
            zlib.crc32(json.dumps(sampled, sort_keys=True, default=str).encode()) & 0xFFFF
        )
        own, points = _stage_two_points(plan, seed, config, trained.checkpoint, thresholds, quality, tokens)
        if own is not None:  # the trial's point on stage two's images: one validation base for the frontier
            quality, tokens, images = own.quality, own.tokens_per_image, own.images
            metrics = {**metrics, **own.metrics, "tokens_per_image": tokens, "token_ratio": own.token_ratio}

    companions = space.companion_metrics
    final = {
        metric: float(quality),
        **{c: float(metrics[c]) for c in companions if c in metrics},  # a detector's mask_ap
        "tokens_per_image": float(tokens),
        "token_ratio": float(metrics.get("token_ratio", float("nan"))),
        "images_per_s": float(metrics.get("images_per_s", 0.0)),
        "train_loss": float(metrics.get("train_loss", float("nan"))),
        "epochs": int(metrics.get("epoch", config.train.total_epochs - 1)) + 1,
        "thresholds": thresholds,
        # the validation images its figures were measured on (the frontier's noise)
        **({"images": int(images)} if images is not None else {}),
        "checkpoint": trained.checkpoint,
        "run_uri": run_uri,
        # JSON text, not a list of mappings: Tune's TensorBoard logger would try to
        # draw a list as a histogram
        "threshold_points": json.dumps([ThresholdPoint.of_evaluation(p, companions).to_dict(metric) for p in points]),
        "train_seconds": train_seconds,
        "trial_seconds": time.time() - started,
        BASELINE_KEY: str(baseline or ""),
        FINAL_KEY: True,
    }
    write_bytes(result_uri, json.dumps(final, sort_keys=True).encode())
    tune.report(final)


@dataclass(frozen=True)
class TrialFinal:
    """A trial's figures as the sweep's driver records them: a finished trial's final
    report (:meth:`from_report`; there its quality is under the metric's name), or a
    trial stopped early with what its last epoch reported."""

    quality: float
    tokens_per_image: float
    token_ratio: float | None
    thresholds: list[float] | None  # what it was evaluated at (None: unknown)
    checkpoint: str | None
    epochs: int = 1
    images_per_s: float | None = None
    train_seconds: float | None = None
    trial_seconds: float | None = None
    companions: dict[str, float] = field(default_factory=dict)  # e.g. a detector's mask_ap
    threshold_points: list[ThresholdPoint] = field(default_factory=list)  # stage two's
    images: int | None = None  # the validation images its figures were measured on (None: not reported)

    @classmethod
    def from_report(cls, report: JsonObject, metric: str, companions: tuple[str, ...] = ()) -> TrialFinal:
        """A trial's final report (what :func:`sweep_trial` reported to Tune) read back."""
        return cls(
            quality=report[metric],
            tokens_per_image=report["tokens_per_image"],
            token_ratio=report.get("token_ratio"),
            thresholds=report.get("thresholds"),
            checkpoint=report.get("checkpoint"),
            epochs=int(report.get("epochs", 1)),
            images_per_s=report.get("images_per_s"),
            train_seconds=report.get("train_seconds"),
            trial_seconds=report.get("trial_seconds"),
            companions={c: float(report[c]) for c in companions if c in report},
            threshold_points=threshold_points(report, metric),
            images=None if report.get("images") is None else int(report["images"]),
        )

    def figures(self, metric: str) -> dict[str, float | None]:
        """The figures its run records (``None``: not reported), the quality under ``metric``."""
        return {
            metric: self.quality,
            "tokens_per_image": self.tokens_per_image,
            "token_ratio": self.token_ratio,
            "images_per_s": self.images_per_s,
            "train_seconds": self.train_seconds,
            "trial_seconds": self.trial_seconds,
        }


def threshold_points(final: JsonObject, metric: str) -> list[ThresholdPoint]:
    """The stage-two points of a trial's final result (stored as JSON text), its quality ``metric``'s."""
    points = final.get("threshold_points") or []
    rows = json.loads(points) if isinstance(points, str) else list(points)
    return [ThresholdPoint.from_dict(row, metric) for row in rows]


def _stage_two_points(
    plan: SweepPlan,
    seed: int,
    config: ExperimentConfig,
    checkpoint: str,
    thresholds: list[float],
    quality: float,
    tokens: float,
) -> tuple[EvaluatedPoint | None, list[EvaluatedPoint]]:
    """Stage two on a finished trial's checkpoint, its sampler seeded with ``seed``: its
    own point measured again on stage two's images (``None`` where ``stage_two.samples``
    is unset: its training's last validation is on the same images then), and stage two's
    points.

    With ``stage_two.samples`` set, the points are evaluated on that many validation
    images, where the trial's last validation used the data's own count; choosing the
    frontier among figures of two image counts would favour the noisier ones."""
    stage = plan.space.stage_two
    rescore = stage.samples is not None
    points = run_evaluation(
        config,
        _stage_two_task,
        checkpoint,
        points=stage.points,
        low=stage.low,
        high=stage.high,
        sampler=stage.sampler,
        seed=seed,
        samples=stage.samples,
        known=[] if rescore else [(thresholds, float(quality), float(tokens))],
        own=thresholds if rescore else None,
        ratios=list(stage.ratios),
        calibration_samples=calibration_samples(plan.space, config),
    )
    return (points[0], points[1:]) if rescore else (None, points)


def _baseline_points(plan: SweepPlan, config: ExperimentConfig, policy: str, checkpoint: str) -> list[EvaluatedPoint]:
    """A fine-tuned entropy or random baseline at each of ``baselines.ratios``, its
    thresholds calibrated on validation images and evaluated there, like the searched
    points (full resolution has one point: its training's last validation)."""
    if policy == "full":
        return []
    from ..train.evaluation import evaluate_points

    b = plan.space.baselines
    return run_evaluation(
        config,
        evaluate_points,
        checkpoint,
        policy=policy,
        ratios=list(b.ratios),
        split="val",
        samples=b.samples,
        calibration_samples=calibration_samples(plan.space, config),
        seed=plan.space.search.seed,
    )


def calibration_samples(space: SearchSpace, config: ExperimentConfig) -> int:
    """The validation images stage two's and the baselines' thresholds are calibrated on:
    ``stage_two.calibration_samples``, else the data's evaluation batch."""
    return space.stage_two.calibration_samples or config.data.eval_batch_size or config.data.batch_size


def _stage_two_task(checkpoint: str, **kwargs: Any) -> list[EvaluatedPoint]:
    from .stage_two import stage_two

    return stage_two(checkpoint, **kwargs)


def trained_thresholds(config: ExperimentConfig, checkpoint: str | None) -> list[float]:
    """The per-level thresholds a trial's checkpoint evaluates with: the config's, or
    for ``model.thresholds: auto`` the calibrated ones the checkpoint holds."""
    t = config.model.thresholds
    if isinstance(t, str):
        from ..train.checkpoints import load_payload

        if checkpoint is None:
            raise TrialFailed("thresholds are calibrated (auto) but training left no checkpoint to read them from")
        state = load_payload(checkpoint)["state_dict"]
        # a detector's backbone holds them under its prefix
        return [float(x) for x in state.get("thresholds", state.get("backbone.thresholds")).tolist()]
    return [float(t)] * (config.model.levels - 1) if isinstance(t, (int, float)) else [float(x) for x in t]
