"""The frontier's records on the sweep's parent run (and beside its JSON): the frontier
points' models (logged with their signatures, registered in the Model Registry), the
best point's split maps, the Pareto plot and the interactive chart, the measured
speed-ups, and the frontier tables.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..jsontypes import JsonObject
from ..tracking.runs import SPEED_DEVICE_TAG, SPEED_TIMING_TAG
from .mlflow_records import CHART_ARTIFACT, PLOT_ARTIFACT, SweepRecorder
from .pareto import Point, frontier, round_figures
from .space import ConfigValue, SearchSpace
from .state import RegisteredModels, Sweep, SweepResult

if TYPE_CHECKING:
    from ..model.spec import CheckpointPayload
    from .frontier_eval import FrontierSpeed

log = logging.getLogger(__name__)


def log_sweep_artifacts(
    sweep: Sweep,
    result: SweepResult,
    *,
    front: list[Point],
    best: Point | None,
    speed: FrontierSpeed | None,
    local_dir: Path,
) -> dict[str, float]:
    """The frontier models, the best point's split maps, the Pareto plot, the measured
    speed-ups and the tables: on the parent run and in ``local_dir``, their paths in
    ``result``. Returns the parent's speed metrics (none without a timing)."""
    space, recorder = sweep.space, sweep.recorder
    full_tokens = next((b.tokens_per_image for b in result.baselines if b.baseline == "full"), None)
    recorder.mark_frontier(result.points)
    if best is not None:
        _log_models(space, recorder, front, best)
        _register_frontier(sweep, result, front, best)
        result.split_map = _log_best_split_map(space, recorder, best, local_dir)
    result.plot = _plot(result, recorder, local_dir, full_tokens)
    result.chart = _interactive_chart(sweep, result, local_dir)
    speed_metrics: dict[str, float] = {}
    if speed is not None:
        result.frontier_speed = speed
        speed_metrics = _record_speed(result, recorder, speed, best, local_dir)
    result.frontier_csv = _tables(result, recorder, local_dir)
    return speed_metrics


def _record_speed(
    result: SweepResult, recorder: SweepRecorder, speed: FrontierSpeed, best: Point | None, local_dir: Path
) -> dict[str, float]:
    """The measured speed-ups in MLflow: a metric on each timed point's run, the
    accuracy-vs-speed-up figure and the timing record on the parent; returns the
    parent's speed metrics."""
    from .plot import speed_figure

    timed = [p for p in result.frontier() if "speedup_vs_full" in p.extras]
    for point in timed:
        if point.run_id:
            try:
                recorder.log_run_metrics(
                    point.run_id,
                    {
                        "speedup_vs_full": point.extras["speedup_vs_full"],
                        "timed_images_per_s": point.extras["timed_images_per_s"],
                        "timed_token_ratio": point.extras["timed_token_ratio"],
                    },
                )
            except Exception as exc:  # noqa: BLE001 - MLflow trouble must not lose the frontier
                log.warning("could not record the speed-up of point %s: %s", point.run_id, exc)
    full = next((b for b in result.baselines if b.baseline == "full"), None)
    fig = speed_figure(
        result.points,
        metric=result.metric,
        full_quality=full.quality if full else None,
        title=f"sweep {result.name}: {result.metric} vs measured speed-up ({speed.device}, batch {speed.batch_size})",
    )
    result.speed_plot = _save_figure(fig, local_dir / "pareto_speed.png", recorder)
    recorder.parent.log_dict(json.loads(json.dumps(speed.to_dict(), default=str)), "frontier_speed.json")
    recorder.parent.set_tags(
        {
            SPEED_DEVICE_TAG: speed.device,
            SPEED_TIMING_TAG: f"batch {speed.batch_size}, {speed.rounds} interleaved rounds "
            f"after {speed.warmup} warm-up, {speed.precision}",
        }
    )
    metrics: dict[str, float] = {}
    if timed:
        metrics["speedup_max"] = max(p.extras["speedup_vs_full"] for p in timed)
        metrics["speed_full_images_per_s"] = float(speed.full[0].images_per_s)
    if best is not None and "speedup_vs_full" in best.extras:
        metrics["speedup_best_point"] = best.extras["speedup_vs_full"]
    if full is not None:
        # the fastest frontier point within one point of full resolution's quality
        close = [p for p in timed if p.quality >= full.quality - 0.01]
        if close:
            metrics["speedup_within_1pt_of_full"] = max(p.extras["speedup_vs_full"] for p in close)
    return metrics


def model_name(point: Point, best: Point | None = None) -> str:
    """A logged model's name, read as its point: ``best-<trial>-tr42pct`` or
    ``frontier-<trial>-tr42pct`` (token ratio in percent: MLflow 3 allows no ``.`` in
    a logged model's name)."""
    role = "best" if point is best else "frontier"
    ratio = f"tr{point.token_ratio * 100:.0f}pct" if math.isfinite(point.token_ratio) else "tr-unknown"
    return f"{role}-{point.trial_id}-{ratio}"


def _log_models(space: SearchSpace, recorder: SweepRecorder, front: list[Point], best: Point | None = None) -> None:
    """Log the models of the frontier points (largest hypervolume contribution first),
    each on its own point run, with the point's thresholds set, named by its point
    (:func:`model_name`)."""
    from ..model.detection import split_backbone
    from ..tracking import RunTracker
    from ..train.checkpoints import load_payload, model_from_payload

    limit = space.mlflow.log_models
    # the best point first, so its model is logged whatever the limit (ties in
    # contribution would otherwise pick by list order)
    chosen = sorted(front, key=lambda p: (p is not best, -p.hv_contribution))
    chosen = chosen if limit is None else chosen[:limit]
    payloads: dict[str, CheckpointPayload] = {}
    for i, point in enumerate(chosen):
        if not point.checkpoint or not point.run_id:
            continue
        try:
            if point.checkpoint not in payloads:
                payloads[point.checkpoint] = load_payload(point.checkpoint)
            model = model_from_payload(payloads[point.checkpoint], point.checkpoint).eval()  # or a detector
            backbone = split_backbone(model)
            backbone.set_thresholds(point.thresholds)
            tracker = RunTracker(recorder.tracking_uri, recorder.experiment_id, point.run_id)
            point.model_uri = tracker.log_model(
                model,
                name=model_name(point, best),
                params={
                    "thresholds": json.dumps(point.thresholds),
                    "levels": backbone.levels,
                    "policy": backbone.policy.name,
                },
            )
            _set_signature(point.model_uri, model)
            log.info(
                "logged frontier model %d/%d: %s (%s %.4f at %.1f tokens/image)",
                i + 1,
                len(chosen),
                point.model_uri,
                space.quality_metric,
                point.quality,
                point.tokens_per_image,
            )
        except Exception as exc:  # noqa: BLE001 - a model that will not log must not lose the frontier
            log.warning("could not log the model of point %s: %s", point.run_id, exc)


def model_signature(model: Any) -> Any:
    """The MLflow signature of a SPLIT model (or a detector on one), inferred from a
    forward pass over two blank images of its input size: ``images`` float32
    ``(-1, C, H, W)`` in; ``logits`` and ``tokens`` (a detector: its first image's
    detections) out."""
    import torch
    from mlflow.models import infer_signature

    from ..model.detection import split_backbone

    channels, height, width = split_backbone(model).data_config["input_size"]
    images = torch.zeros(2, channels, height, width)
    with torch.no_grad():
        out = model.eval()(images)
    if hasattr(out, "logits"):
        produced = {"logits": out.logits, "tokens": out.tokens}
    else:  # a detector: per image, its boxes, labels, scores (and masks)
        produced = dict(out.detections[0])
    outputs = {  # each output's own dtype (numpy has no bfloat16: those as float32)
        k: (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
        for k, v in produced.items()
        if isinstance(v, torch.Tensor)
    }
    return infer_signature({"images": images.numpy()}, outputs)


def _set_signature(model_uri: str, model: Any) -> None:
    """Write ``model``'s signature (:func:`model_signature`) into its logged model, whose
    page then shows its inputs and outputs. The store is the global tracking URI that
    :meth:`~splitvit.tracking.RunTracker.log_model` set."""
    from mlflow.models import set_signature

    try:
        set_signature(model_uri, model_signature(model))
    except Exception as exc:  # noqa: BLE001 - a model without its signature still loads
        log.warning("could not set the signature of %s: %s", model_uri, exc)


def _alias_prefix(sweep_name: str) -> str:
    from .mlflow_records import sweep_alias

    return sweep_alias(sweep_name, "").rstrip("-")


def _register_frontier(sweep: Sweep, result: SweepResult, front: list[Point], best: Point) -> None:
    """The frontier's models in the Model Registry (one name per search space, aliases
    per budget: the sweep's own and the newest sweep's bare ones); the name and the
    aliases' ``models:/`` URIs in ``result.registered_models``."""
    try:
        registered = sweep.recorder.register_frontier(Path(sweep.space.source).stem, result.name, front, best)
    except Exception as exc:  # noqa: BLE001 - a registry that refuses must not lose the frontier
        log.warning("could not register the frontier's models: %s", exc)
        return
    if registered is not None:
        own = f"{_alias_prefix(result.name)}-"
        result.registered_models = RegisteredModels(
            name=registered.name,
            # the newest sweep's (best, tokens-42pct) and this sweep's own, which never move
            aliases={a: u for a, u in registered.aliases.items() if not a.startswith(own)},
            sweep_aliases={a: u for a, u in registered.aliases.items() if a.startswith(own)},
        )
        sweep.registered = registered
        log.info(
            "frontier models registered as %s (aliases: %s; this sweep's own: %s*)",
            registered.name,
            ", ".join(result.registered_models.aliases),
            own,
        )


def _log_best_split_map(space: SearchSpace, recorder: SweepRecorder, best: Point, local_dir: Path) -> str | None:
    """Draw the best point's split maps over ``mlflow.split_map_images`` images: saved in
    ``local_dir`` and logged on the parent run; returns the file (``None`` when off or
    the point has no checkpoint)."""
    from ..train.evaluation import CheckpointEvaluator

    count = space.mlflow.split_map_images
    if count <= 0 or not best.checkpoint:
        return None
    evaluator = CheckpointEvaluator(best.checkpoint, samples=count, cache=False)
    image = evaluator.split_map(best.thresholds, count)
    path = local_dir / "split_maps_best_point.png"
    image.save(path)
    recorder.log_image(image, "split_maps/best_point.png")
    return str(path)


def _plot(result: SweepResult, recorder: SweepRecorder, local_dir: Path, full_tokens: float | None) -> str:
    from .plot import pareto_figure

    fig = pareto_figure(
        result.points,
        result.baselines,
        metric=result.metric,
        hypervolume=result.hypervolume,
        title=f"sweep {result.name}: {result.metric} vs tokens per image",
        full_tokens=full_tokens,
    )
    return _save_figure(fig, local_dir / PLOT_ARTIFACT, recorder)


def _interactive_chart(sweep: Sweep, result: SweepResult, local_dir: Path) -> str:
    """``pareto.html``: the frontier as a page MLflow's artifact view shows with no
    set-up (hover a point: its trial, thresholds, run, registry alias); beside the
    sweep's JSON and on the parent run."""
    from .plot import pareto_html

    path = local_dir / CHART_ARTIFACT
    path.write_text(
        pareto_html(
            result.points,
            result.baselines,
            metric=result.metric,
            title=f"sweep {result.name}: {result.metric} vs tokens per image",
            model_uris=sweep.registered.by_run if sweep.registered else None,
        )
    )
    sweep.recorder.log_artifact(str(path))
    return str(path)


def _save_figure(fig, path: Path, recorder: SweepRecorder) -> str:
    """Write ``fig`` beside the sweep's JSON and to the parent run (under its file name); close it."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path)
        recorder.log_figure(fig, path.name)
    finally:
        plt.close(fig)
    return str(path)


@dataclass
class FrontierRow:
    """A row of the frontier table (``frontier.csv``, the parent run's ``frontier.json``):
    a frontier point with its rank by tokens per image.

    Attributes:
        rank: 0 for the fewest tokens per image.
        tokens_per_image, quality, token_ratio, kind, trial_id, thresholds,
            hv_contribution, run_id, model_uri: the point's (:class:`~splitvit.tune.pareto.Point`).
        params: the trial's searched parameters, one column each.
        timed: the sweep timed its frontier, so the table has the measured columns
            (``speedup_vs_full``, ``timed_images_per_s``, ``timed_token_ratio``: a
            timed point's ``extras``; ``None`` for a point left untimed).
        held_out: its figures on the held-out split (``test_<metric>``,
            ``test_tokens_per_image``, ``test_token_ratio``), where evaluated there.
    """

    rank: int
    tokens_per_image: float
    quality: float
    token_ratio: float
    kind: str
    trial_id: str
    thresholds: list[float]
    hv_contribution: float
    run_id: str | None
    model_uri: str | None
    params: dict[str, ConfigValue]
    timed: bool = False
    speedup_vs_full: float | None = None
    timed_images_per_s: float | None = None
    timed_token_ratio: float | None = None
    held_out: dict[str, float] = field(default_factory=dict)

    def to_dict(self, metric: str) -> JsonObject:
        """The table row: the quality named ``metric``, the thresholds and list or dict
        parameters as JSON text (one cell each), the parameters last."""
        return {
            "rank": self.rank,
            "tokens_per_image": self.tokens_per_image,
            metric: self.quality,
            "token_ratio": self.token_ratio,
            **self.held_out,
            "kind": self.kind,
            "trial_id": self.trial_id,
            "thresholds": json.dumps([round(t, 4) for t in self.thresholds]),
            "hv_contribution": self.hv_contribution,
            "run_id": self.run_id,
            "model_uri": self.model_uri,
            **(
                {
                    "speedup_vs_full": self.speedup_vs_full,
                    "timed_images_per_s": self.timed_images_per_s,
                    "timed_token_ratio": self.timed_token_ratio,
                }
                if self.timed
                else {}
            ),
            **{k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in self.params.items()},
        }


def frontier_rows(points: list[Point]) -> list[FrontierRow]:
    """The frontier as table rows, by tokens per image."""
    timed = any("speedup_vs_full" in p.extras for p in points)  # measured speed-up columns
    return [
        FrontierRow(
            rank=rank,
            tokens_per_image=p.tokens_per_image,
            quality=p.quality,
            token_ratio=p.token_ratio,
            kind=p.kind,
            trial_id=p.trial_id,
            thresholds=p.thresholds,
            hv_contribution=p.hv_contribution,
            run_id=p.run_id,
            model_uri=p.model_uri,
            params=p.params,
            timed=timed,
            speedup_vs_full=p.extras.get("speedup_vs_full"),
            timed_images_per_s=p.extras.get("timed_images_per_s"),
            timed_token_ratio=p.extras.get("timed_token_ratio"),
            held_out={k: v for k, v in p.extras.items() if k.startswith("test_")},
        )
        for rank, p in enumerate(frontier(points))
    ]


def _csv(rows: list[JsonObject]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    return out.getvalue()


def _tables(result: SweepResult, recorder: SweepRecorder, local_dir: Path) -> str:
    rows = [row.to_dict(result.metric) for row in frontier_rows(result.points)]
    all_rows = [
        {
            **{k: v for k, v in p.to_dict(result.metric).items() if k not in ("params", "extras")},
            **{f"param:{k}": v for k, v in p.params.items()},
        }
        for p in result.points
    ]
    # the frontier tables are read by people: rounded (sweep.json and points.csv keep full precision)
    rows = [round_figures(r) for r in rows]
    frontier_csv = local_dir / "frontier.csv"
    frontier_csv.write_text(_csv(rows) if rows else "")
    (local_dir / "points.csv").write_text(_csv(all_rows) if all_rows else "")
    baselines = [b.to_dict(result.metric) for b in result.baselines]
    (local_dir / "baselines.json").write_text(json.dumps(baselines, indent=2, default=str) + "\n")
    recorder.log_table(rows, "frontier.json")
    for file in ("frontier.csv", "points.csv", "baselines.json"):
        recorder.log_artifact(str(local_dir / file))
    return str(frontier_csv)
