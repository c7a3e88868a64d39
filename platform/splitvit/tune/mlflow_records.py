"""A sweep in MLflow: one parent run, a child run per trial, a grandchild per
threshold point, and the frontier on the parent.

Only the Tune driver writes here (docs/design.md §3.4). Every run is keyed by a storage
location (the ``splitvit.run_uri`` tag of :class:`~splitvit.tracking.RunTracker`):
the sweep folder for the parent, the trial's Train run folder for a trial, that
folder plus ``#threshold<i>`` for a threshold point. Re-recording after a restart
finds the run that is there instead of making another, so a resumed sweep never
duplicates runs.

The parent reads at a glance: a handful of params (:func:`sweep_params`), the whole
space as ``search_space.yaml`` (:func:`search_space_yaml`), and when the sweep ends a
markdown description (:func:`sweep_note`, MLflow's ``mlflow.note.content`` tag).

Tags: ``splitvit.kind`` (``sweep``, ``trial``, ``threshold_point``),
``splitvit.sweep`` (the parent run id), ``splitvit.trial_id``, ``splitvit.metric``
and MLflow's ``mlflow.parentRunId`` (the UI nests children under it). When the sweep
ends every point run gets ``splitvit.frontier`` (``true``/``false``, so the runs table
filters to the frontier with ``tags.splitvit.frontier = 'true'``; only a point tied with
a frontier point carries ``splitvit.frontier_tie_of``, naming it), and the frontier's
models are registered in the Model Registry through ``mlflow.register_model`` (which
links each logged model to its version) under one name per search space
(:func:`registered_model_name`, stable across the space's sweeps) with aliases per
sweep (``<sweep>-best``, ``<sweep>-tokens-42pct``) and the newest sweep's bare ones
(``best``, ``tokens-42pct``): a budget is picked and loaded by alias,
``models:/<name>@tokens-42pct``.

Every link written here opens MLflow 3's *Model training* view
(``workflowType=machine_learning``); the frontier's link opens a saved runs view
(:func:`frontier_view`): the frontier's point runs as top-level rows, best first, with
their quality, token and speed-up columns.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import DataConfig, redact_uri
from ..jsontypes import JsonObject
from ..tracking import RunTracker
from ..tracking.runs import (
    KIND_TAG,
    METRIC_TAG,
    PARENT_TAG,
    RUN_URI_TAG,
    SPEED_DEVICE_TAG,
    SPEED_TIMING_TAG,
    STATUS_TAG,
    UI_VIEW_QUERY,
    describe_experiment,
    missing_store,
    mlflow_client,
    param_name,
)

if TYPE_CHECKING:
    from .pareto import Baseline, Point
    from .space import ConfigValue, SearchSpace
    from .trial import ThresholdPoint, TrialFinal

log = logging.getLogger(__name__)

SWEEP_TAG = "splitvit.sweep"
TRIAL_TAG = "splitvit.trial_id"
REFERENCE_TAG = "splitvit.reference_point"  # JSON [quality, token_ratio]
#: Metrics of a timed frontier point's run (see :mod:`splitvit.bench.speed`).
SPEED_METRICS = ("speedup_vs_full", "timed_images_per_s", "timed_token_ratio")
FRONTIER_TAG = "splitvit.frontier"  # "true" on a frontier point's run, "false" on the other points
TIE_TAG = "splitvit.frontier_tie_of"  # only on a point tied with a frontier point: that point's run id
ALIAS_TAG = "splitvit.model_alias"  # the registry alias of a frontier point's model (its sweep's, never moved)
#: MLflow's UI keeps a runs view (filter, order, columns) shared by link as an experiment
#: tag ``mlflow.sharedViewState.<key>``, opened by ``?viewStateShareKey=<key>``.
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."
SAMPLED_PREFIX = "sampled."
SAMPLED_TAG = "splitvit.sampled"  # the searched values under their exact names (JSON)
#: A threshold point's evaluation throughput (its evaluation loop, data loading
#: included): not the side-by-side timing's ``timed_images_per_s``.
EVAL_THROUGHPUT = "eval_images_per_s"
#: Where :meth:`SweepRecorder.describe` holds the frontier's link while the rest is masked.
NOTE_LINK = "\x00frontier-link\x00"
#: MLflow shows this tag as the run's markdown description (the run page's "Description").
NOTE_TAG = "mlflow.note.content"
#: The longest tag value MLflow's SQL stores keep (``mlflow.utils.validation.MAX_TAG_VAL_LENGTH``).
_MAX_TAG_VALUE = 8000
SPACE_ARTIFACT = "search_space.yaml"
PLOT_ARTIFACT = "pareto.png"
CHART_ARTIFACT = "pareto.html"  # the interactive frontier chart (plot.pareto_html)
#: Tune's bookkeeping keys, never logged as metrics.
_TUNE_KEYS = {
    "training_iteration",
    "time_total_s",
    "time_this_iter_s",
    "timestamp",
    "time_since_restore",
    "iterations_since_restore",
    "timesteps_since_restore",
    "timesteps_total",
    "episodes_total",
    "pid",
    "done",
    "warmup_time",
    "should_checkpoint",
    "epoch",
}


def _numbers(data: JsonObject) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in data.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _TUNE_KEYS and math.isfinite(float(v))
    }


def _sampled_params(sampled: dict[str, ConfigValue]) -> dict[str, ConfigValue]:
    return {f"{SAMPLED_PREFIX}{param_name(k)}": v for k, v in sampled.items()}


def point_run_name(trial_id: str, token_ratio: float | None, thresholds: list[float] | None) -> str:
    """A point run's name, read first by its budget: ``42% tokens · 3f2a1_00003 · τ 0.52/0.61``
    (the runs table cuts long names, so the token share leads)."""
    parts = []
    if token_ratio is not None and math.isfinite(token_ratio):
        parts.append(f"{token_ratio * 100:.0f}% tokens")
    parts.append(trial_id)
    if thresholds:
        parts.append("τ " + "/".join(f"{t:.2f}" for t in thresholds))
    return " · ".join(parts)


def point_note(metric: str, kind: str, trial_id: str, thresholds: list[float], points: int = 0) -> str:
    """A trial's or a threshold point's run description: what it is and which of its
    figures is which (figures of one name that mean different things, told apart)."""
    used = "/".join(f"{t:.3f}" for t in thresholds) or "-"
    if kind == "trial":
        head = (
            f"**Trial `{trial_id}`** of a sweep: trained with the values Optuna sampled (params `sampled.*`), "
            f"then evaluated at split thresholds {used} (param `thresholds`: as calibrated in training); "
            f"{points} more threshold points on its checkpoint are its child runs."
        )
        speed = (
            "`images_per_s`: validation throughput while training (per epoch, the training loop's "
            "evaluation with its data loading)."
        )
    else:
        head = (
            f"**Threshold point** of trial `{trial_id}`: its trained checkpoint evaluated at split thresholds "
            f"{used} (params `thresholds`, `threshold_level_<i>`), chosen by the sweep's second stage."
        )
        speed = f"`{EVAL_THROUGHPUT}`: this evaluation's throughput (its loop, data loading included)."
    return "\n".join(
        [
            head,
            "",
            f"- `{metric}`, `tokens_per_image`, `token_ratio`: on the validation images at these thresholds.",
            f"- {speed}",
            "- `timed_images_per_s`, `speedup_vs_full` (frontier points only): the side-by-side timing against "
            "full resolution (one fixed batch, interleaved rounds, medians): the figures to compare speed by.",
            "- `sampled.model.thresholds.*`: the thresholds Optuna sampled for the trial's training to start "
            "from, not the ones evaluated here (calibration and the threshold sweep move them).",
        ]
    )


def model_note(metric: str, sweep_name: str, point: Point, uris: list[str], version: str) -> str:
    """A frontier model's description on its logged-model page: its point, its
    registered version and the aliases that load it."""
    name = uris[0].removeprefix("models:/").split("@", 1)[0] if uris else ""
    thresholds = "/".join(f"{t:.3f}" for t in point.thresholds) or "-"
    return (
        f"Frontier point of sweep `{sweep_name}`: {metric} {point.quality:.4f} at {point.tokens_per_image:.1f} "
        f"tokens per image ({point.token_ratio:.0%} of full resolution), trial `{point.trial_id}`, split "
        f"thresholds {thresholds} (set in the model). Registered as `{name}` version {version}; load it with "
        + ", ".join(f"`{u}`" for u in uris)
        + "."
    )


def registered_model_name(space_name: str) -> str:
    """The Model Registry name of the frontier models of a search space's sweeps:
    ``splitvit-<space>`` (``search_spaces/smoke.yaml`` -> ``splitvit-smoke``), one name
    that every sweep of the space adds versions to."""
    return f"splitvit-{_alias_safe(space_name)}"


def _alias_safe(text: str) -> str:
    """``text`` as the registry takes it in a name or an alias (letters, digits, ``_``, ``-``)."""
    return re.sub(r"[^\w-]+", "-", text).strip("-") or "sweep"


def sweep_alias(sweep_name: str, alias: str) -> str:
    """A sweep's own alias of a frontier model (``<sweep>-best``, ``<sweep>-tokens-42pct``):
    it never moves, unlike the bare ``best`` that follows the newest sweep."""
    return f"{_alias_safe(sweep_name)}-{alias}"


def budget_aliases(points: list[Point]) -> list[str]:
    """One registry alias per frontier point, by its token share: ``tokens-42pct``
    (``-2``, ``-3``... where two points round to the same share)."""
    aliases: list[str] = []
    for p in points:
        base = f"tokens-{p.token_ratio * 100:.0f}pct" if math.isfinite(p.token_ratio) else "tokens-unknown"
        alias, n = base, 1
        while alias in aliases:
            n += 1
            alias = f"{base}-{n}"
        aliases.append(alias)
    return aliases


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


@dataclass
class RegisteredFrontier:
    """A sweep's frontier in the Model Registry.

    Attributes:
        name: the registered model (:func:`registered_model_name`).
        aliases: alias (``best``, ``tokens-42pct``, ``<sweep>-best``...) -> ``models:/<name>@<alias>``.
        by_run: a frontier point's run id -> the URIs that load its model: the bare
            aliases first (``@best`` on the best point), then the sweep's own.
    """

    name: str
    aliases: dict[str, str] = field(default_factory=dict)
    by_run: dict[str, list[str]] = field(default_factory=dict)


# ---------------------------------------------------------------------- links
def run_link(experiment_id: str, run_id: str) -> str:
    """A run's page, relative to the MLflow UI, in its *Model training* view."""
    return f"#/experiments/{experiment_id}/runs/{run_id}{UI_VIEW_QUERY}"


def artifact_link(experiment_id: str, run_id: str, path: str) -> str:
    """A run's artifact in the UI's artifact viewer, in its *Model training* view."""
    return f"#/experiments/{experiment_id}/runs/{run_id}/artifacts/{path}{UI_VIEW_QUERY}"


def frontier_view_key(sweep_run_id: str) -> str:
    """The shared-view key of a sweep's frontier (:func:`frontier_view`)."""
    return f"splitvit-frontier-{sweep_run_id}"


def frontier_filter(sweep_run_id: str | None = None) -> str:
    """The runs search that lists a sweep's frontier (every sweep's, without one)."""
    where = f"tags.`{FRONTIER_TAG}` = 'true'"
    return where + (f" and tags.`{SWEEP_TAG}` = '{sweep_run_id}'" if sweep_run_id else "")


def frontier_view(metric: str, sweep_run_id: str) -> JsonObject:
    """A runs view of a sweep's frontier as MLflow's UI saves a shared view (the state
    behind its *Share* button, kept in the experiment tag ``mlflow.sharedViewState.<key>``):
    the frontier filter, ordered by ``metric`` (a search not ordered by start time lists
    matching child runs as rows of their own instead of under their parents), and the
    quality, token, speed-up, thresholds and model columns shown in that order."""
    columns = [f"metrics.`{m}`" for m in (metric, "tokens_per_image", "token_ratio", "speedup_vs_full")]
    columns += ["params.`thresholds`", "attributes.`Models`", f"tags.`{ALIAS_TAG}`"]
    return {
        "searchFilter": frontier_filter(sweep_run_id),
        "orderByKey": f"metrics.`{metric}`",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": columns,
        "columnOrder": columns,  # the figures first, beside the run's name
        "runsExpanded": {},
    }


def frontier_link(experiment_id: str, sweep_run_id: str) -> str:
    """The frontier's runs view (:func:`frontier_view`, saved on the experiment by
    :meth:`SweepRecorder.describe_experiment`), relative to the MLflow UI."""
    from urllib.parse import quote

    return (
        f"#/experiments/{experiment_id}/runs{UI_VIEW_QUERY}&viewStateShareKey={quote(frontier_view_key(sweep_run_id))}"
    )


def frontier_search_link(experiment_id: str, sweep_run_id: str, metric: str) -> str:
    """The frontier's runs as a plain search URL (no saved columns): the filter and the
    order in the query, the frontier's runs listed as rows of their own."""
    from urllib.parse import quote

    return (
        f"#/experiments/{experiment_id}/runs{UI_VIEW_QUERY}&searchFilter={quote(frontier_filter(sweep_run_id))}"
        f"&orderByKey={quote(f'metrics.`{metric}`')}&orderByAsc=false"
    )


def registry_note(name: str, sweep_name: str, recorder: SweepRecorder, registered: RegisteredFrontier) -> str:
    """The registered model's description: what its versions are, the aliases, and links
    to the newest sweep and its frontier."""
    exp, parent = recorder.experiment_id, recorder.parent_run_id
    some = next((a for a in registered.aliases if a.startswith("tokens-")), "best")
    return (
        f"The Pareto frontiers ({recorder.metric} against tokens per image) of the sweeps of one search space: "
        "one version per frontier point. Aliases: `best` and `tokens-<pct>pct` are the newest sweep's points "
        f"(now [{sweep_name}]({run_link(exp, parent)})); `<sweep>-best` and `<sweep>-tokens-<pct>pct` keep each "
        f"sweep's own. Load one: `splitvit eval models:/{name}@best`, "
        f"`mlflow.pytorch.load_model('models:/{name}@{some}')`. "
        f"[The newest sweep's frontier runs]({frontier_link(exp, parent)}) "
        f"(or filter the runs: `{frontier_filter(parent)}`)."
    )


@dataclass
class SweepRecorder:
    """Writes a sweep to MLflow (picklable: ids and settings only, so it rides in the
    Tune callback that the restored Tuner brings back).

    Attributes:
        tracking_uri: the MLflow store.
        experiment: experiment name.
        experiment_id: its id.
        parent_run_id: the sweep's run.
        sweep_dir: the sweep folder (the parent's run key).
        metric: ``accuracy`` or ``miou``.
    """

    tracking_uri: str
    experiment: str
    experiment_id: str
    parent_run_id: str
    sweep_dir: str
    metric: str

    # ------------------------------------------------------------------ parent
    @classmethod
    def open(
        cls,
        tracking_uri: str,
        experiment: str,
        sweep_dir: str,
        name: str,
        metric: str,
        params: dict[str, Any],
        tags: dict[str, str],
    ) -> tuple[SweepRecorder, bool]:
        """Open the sweep's parent run (re-opened, not duplicated, on resume)."""
        tracker, resumed = RunTracker.open(
            tracking_uri,
            experiment,
            sweep_dir,
            name,
            params=params,
            tags={KIND_TAG: "sweep", METRIC_TAG: metric, **tags},
        )
        return cls(tracking_uri, experiment, tracker.experiment_id, tracker.run_id, sweep_dir, metric), resumed

    @property
    def parent(self) -> RunTracker:
        """The parent run's tracker."""
        return RunTracker(self.tracking_uri, self.experiment_id, self.parent_run_id)

    def find_run(self, run_uri: str) -> Any | None:
        """The run keyed by ``run_uri`` (see the module docstring), or None."""
        from ..config import redact_uri

        found = mlflow_client(self.tracking_uri).search_runs(
            [self.experiment_id], filter_string=f"tags.`{RUN_URI_TAG}` = '{_quote(redact_uri(run_uri))}'", max_results=1
        )
        return found[0] if found else None

    # ------------------------------------------------------------------ trials
    def _trial_tracker(
        self, trial_id: str, run_uri: str, sampled: dict[str, ConfigValue], config_params: dict[str, ConfigValue]
    ) -> RunTracker:
        params = {**config_params, **_sampled_params(sampled)}
        tracker, _ = RunTracker.open(
            self.tracking_uri,
            self.experiment,
            run_uri,
            f"trial-{trial_id}",
            params=params,
            tags={
                PARENT_TAG: self.parent_run_id,
                KIND_TAG: "trial",
                SWEEP_TAG: self.parent_run_id,
                TRIAL_TAG: trial_id,
                METRIC_TAG: self.metric,
                SAMPLED_TAG: json.dumps(sampled, sort_keys=True),
            },
        )
        return tracker

    def trial_started(
        self,
        trial_id: str,
        run_uri: str,
        sampled: dict[str, ConfigValue],
        config_params: dict[str, ConfigValue],
        live: set[str] | None = None,
        data: DataConfig | None = None,
    ) -> str:
        """Open (or re-open) the trial's child run, with the trial's ``data`` as its
        dataset inputs (the trial trains with tracking off: the sweep records them);
        returns its id.

        A driver killed between starting a trial and saving Tune's state leaves a run
        for a trial the restored Tuner never heard of; the restored searcher then
        proposes the same values again under a new trial id. That run is adopted
        (re-keyed to the new trial) rather than left beside a duplicate. ``live`` are
        the trial ids the Tuner knows.
        """
        if live is not None and self.find_run(run_uri) is None:
            orphan = self._orphan(sampled, live)
            if orphan is not None:
                old = orphan.data.tags.get(TRIAL_TAG, "")
                RunTracker(self.tracking_uri, self.experiment_id, orphan.info.run_id).set_tags(
                    {RUN_URI_TAG: run_uri, TRIAL_TAG: trial_id, "splitvit.adopted_from": old}
                )
                mlflow_client(self.tracking_uri).update_run(orphan.info.run_id, name=f"trial-{trial_id}")
                log.info("trial %s takes over the run of trial %s, lost when the driver stopped", trial_id, old)
        tracker = self._trial_tracker(trial_id, run_uri, sampled, config_params)
        if data is not None:
            tracker.log_datasets(data)
        return tracker.run_id

    def _orphans(self, live: set[str]) -> list:
        """Trial runs of this sweep, never finished, whose trials the Tuner does not know."""
        runs = mlflow_client(self.tracking_uri).search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{SWEEP_TAG}` = '{self.parent_run_id}' and tags.`{KIND_TAG}` = 'trial'",
            max_results=50_000,
        )
        return [
            r
            for r in runs
            if r.data.tags.get(TRIAL_TAG) not in live
            and r.data.tags.get(STATUS_TAG) not in ("completed", "failed", "diverged")
        ]

    def _orphan(self, sampled: dict[str, ConfigValue], live: set[str]) -> Any | None:
        key = json.dumps(sampled, sort_keys=True)
        return next((r for r in self._orphans(live) if r.data.tags.get(SAMPLED_TAG) == key), None)

    def close_orphans(self, live: set[str]) -> list[str]:
        """End the runs of trials that a driver restart lost and no trial took over
        (MLflow ``KILLED``, tag ``splitvit.status=superseded``); returns their ids."""
        closed = []
        for run in self._orphans(live):
            RunTracker(self.tracking_uri, self.experiment_id, run.info.run_id).close(
                "interrupted",
                tags={
                    STATUS_TAG: "superseded",
                    "splitvit.message": "started by a driver that stopped before Tune saved it; rerun as a new trial",
                },
            )
            closed.append(run.info.run_id)
        return closed

    def trial_epoch(self, trial_id: str, run_uri: str, result: JsonObject) -> None:
        """Log one reported epoch on the trial's run (each epoch once)."""
        run = self.find_run(run_uri)
        if run is None or "epoch" not in result:
            return
        RunTracker(self.tracking_uri, self.experiment_id, run.info.run_id).log_epoch(
            int(result["epoch"]), _numbers(result)
        )

    def trial_completed(
        self,
        trial_id: str,
        run_uri: str,
        sampled: dict[str, ConfigValue],
        config_params: dict[str, ConfigValue],
        final: TrialFinal,
        data: DataConfig | None = None,
    ) -> tuple[str, list[str]]:
        """Record a finished trial and its threshold points (each with ``data`` as its
        dataset inputs and a description of its figures); returns the run ids
        ``(trial run, [threshold point runs])``. Idempotent."""
        rows = final.threshold_points
        existing = self.find_run(run_uri)
        if existing is not None and existing.data.tags.get(STATUS_TAG) == "completed":
            points = self._point_runs(existing.info.run_id)
            if len(points) == len(rows):
                return existing.info.run_id, points
        tracker = self._trial_tracker(trial_id, run_uri, sampled, config_params)
        # the final figures belong to the last epoch's step: at step 0 they would sit on
        # top of epoch 0's values and draw a false spike in the metric's history
        step = max(final.epochs - 1, 0)
        figures = _numbers(final.figures(self.metric))
        self._log_metrics(tracker.run_id, {**figures, "threshold_points": float(len(rows))}, step)
        tracker.log_dict(
            {
                "thresholds": final.thresholds,
                "checkpoint": final.checkpoint,
                "threshold_points": [row.to_dict(self.metric) for row in rows],
            },
            "trial_result.json",
        )
        point_ids = []
        for i, point in enumerate(rows):
            point_ids.append(self._threshold_point(trial_id, run_uri, tracker.run_id, i, point, sampled, data))
        name = point_run_name(trial_id, final.token_ratio, final.thresholds)
        mlflow_client(self.tracking_uri).update_run(tracker.run_id, name=name)
        if data is not None:
            tracker.log_datasets(data)
        client = mlflow_client(self.tracking_uri)
        if final.thresholds is not None and "thresholds" not in client.get_run(tracker.run_id).data.params:
            # the thresholds it was evaluated at, under the threshold points' name: one column for the frontier
            client.log_param(tracker.run_id, "thresholds", json.dumps(final.thresholds))
        tags = {
            "splitvit.thresholds": json.dumps(final.thresholds),
            NOTE_TAG: point_note(self.metric, "trial", trial_id, final.thresholds or [], len(rows)),
        }
        if final.checkpoint:
            tags["splitvit.checkpoint"] = final.checkpoint
        tracker.close("completed", tags=tags)
        return tracker.run_id, point_ids

    def _point_runs(self, trial_run_id: str) -> list[str]:
        runs = mlflow_client(self.tracking_uri).search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{trial_run_id}' and tags.`{STATUS_TAG}` = 'completed'",
            max_results=10_000,
        )
        return [r.info.run_id for r in sorted(runs, key=lambda r: r.data.tags.get(RUN_URI_TAG, ""))]

    def _threshold_point(
        self,
        trial_id: str,
        run_uri: str,
        trial_run_id: str,
        index: int,
        point: ThresholdPoint,
        sampled: dict[str, ConfigValue],
        data: DataConfig | None = None,
    ) -> str:
        thresholds = point.thresholds or []
        params = {
            "thresholds": json.dumps(thresholds),
            "trial_id": trial_id,
            **{f"threshold_level_{i}": t for i, t in enumerate(thresholds)},
            **_sampled_params(sampled),
        }
        tracker, _ = RunTracker.open(
            self.tracking_uri,
            self.experiment,
            f"{run_uri}#threshold{index:03d}",
            point_run_name(trial_id, point.token_ratio, thresholds),
            params=params,
            tags={
                PARENT_TAG: trial_run_id,
                KIND_TAG: "threshold_point",
                SWEEP_TAG: self.parent_run_id,
                TRIAL_TAG: trial_id,
                METRIC_TAG: self.metric,
                SAMPLED_TAG: json.dumps(sampled, sort_keys=True),
                NOTE_TAG: point_note(self.metric, "threshold_point", trial_id, thresholds),
            },
        )
        figures = _numbers(point.to_dict(self.metric))
        if "images_per_s" in figures:  # not the side-by-side timing's timed_images_per_s: named apart
            figures[EVAL_THROUGHPUT] = figures.pop("images_per_s")
        self._log_metrics(tracker.run_id, figures, 0)
        if data is not None:
            tracker.log_datasets(data)
        tracker.close("completed")
        return tracker.run_id

    def trial_failed(
        self,
        trial_id: str,
        run_uri: str,
        sampled: dict[str, ConfigValue],
        config_params: dict[str, ConfigValue],
        message: str,
    ) -> str:
        """Record a failed trial (``diverged`` for a non-finite loss, else ``failed``)."""
        tracker = self._trial_tracker(trial_id, run_uri, sampled, config_params)
        status = "diverged" if "diverged:" in message or "TrialDiverged" in message else "failed"
        tracker.close(status, tags={"splitvit.error": message[-4000:]})
        return tracker.run_id

    def _log_metrics(self, run_id: str, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if not values:
            return
        now = int(time.time() * 1000)
        mlflow_client(self.tracking_uri).log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    # ------------------------------------------------------------------ the frontier
    def mark_frontier(self, points: list[Point]) -> None:
        """Tag every point run ``splitvit.frontier`` true or false, so the UI filters to
        the frontier; a point tied with a frontier point names it in ``splitvit.frontier_tie_of``
        (no other run carries that tag: one a resumed sweep's earlier frontier left is
        deleted). Runs the points of a resumed sweep again: the tags follow the frontier
        as it is now."""
        run_of = {p.label(): p.run_id for p in points}
        client = mlflow_client(self.tracking_uri)
        for p in points:
            if not p.run_id:
                continue
            tags = {FRONTIER_TAG: "true" if p.on_frontier else "false"}
            if p.tie_of:
                tags[TIE_TAG] = run_of.get(p.tie_of) or p.tie_of
            tracker = RunTracker(self.tracking_uri, self.experiment_id, p.run_id)
            tracker.set_tags(tags)
            if not p.tie_of and TIE_TAG in client.get_run(p.run_id).data.tags:
                client.delete_tag(p.run_id, TIE_TAG)

    def register_frontier(
        self, space_name: str, sweep_name: str, front: list[Point], best: Point | None
    ) -> RegisteredFrontier | None:
        """Register the frontier points' logged models as versions of the space's one
        registered model (:func:`registered_model_name`), through ``mlflow.register_model``:
        MLflow links each logged model to its version (the ``mlflow.modelVersions`` tag
        its page reads), as a tracking server would. Aliases: the sweep's own
        (``<sweep>-tokens-42pct``, ``<sweep>-best``) and the bare ones of the newest sweep
        (``tokens-42pct``, ``best``), moved here from an older sweep's points; a bare
        budget alias this sweep has no point for is removed, so the bare aliases are one
        sweep's frontier. A point already registered (a resumed sweep) keeps its version.
        ``None`` when no point has a logged model."""
        client = mlflow_client(self.tracking_uri)
        name = registered_model_name(space_name)
        logged = [p for p in front if p.model_uri and p.run_id]
        if not logged:
            return None
        if not client.search_registered_models(filter_string=f"name = '{_quote(name)}'"):
            client.create_registered_model(name, tags={METRIC_TAG: self.metric})
        versions = {v.run_id: v for v in client.search_model_versions(f"name = '{_quote(name)}'")}
        registered = RegisteredFrontier(name)
        for p, alias in zip(logged, budget_aliases(logged)):
            version = versions.get(p.run_id) or self._register(name, p, sweep_name)
            own = [sweep_alias(sweep_name, alias)] + ([sweep_alias(sweep_name, "best")] if p is best else [])
            bare = [alias] + (["best"] if p is best else [])
            for a in own + bare:
                client.set_registered_model_alias(name, a, version.version)
                registered.aliases[a] = f"models:/{name}@{a}"
            # the bare alias first (what people type), then the sweep's own (which never moves)
            registered.by_run[p.run_id] = [registered.aliases[a] for a in (bare[::-1] + own[::-1])]
            RunTracker(self.tracking_uri, self.experiment_id, p.run_id).set_tags(
                {ALIAS_TAG: registered.aliases[own[0]]}
            )
            self._link_model_metrics(p)
            # the logged model's page reads its description from this tag, as a run's does
            client.set_logged_model_tags(
                p.model_uri.removeprefix("models:/"),
                {NOTE_TAG: model_note(self.metric, sweep_name, p, registered.by_run[p.run_id], version.version)},
            )
        current = set(registered.aliases)
        for stale in client.get_registered_model(name).aliases:
            if re.fullmatch(r"tokens-[\w-]+", stale) and stale not in current:
                client.delete_registered_model_alias(name, stale)
        client.update_registered_model(name, description=registry_note(name, sweep_name, self, registered))
        return registered

    def _link_model_metrics(self, point: Point) -> None:
        """The point's quality and token figures on its logged model, tied to the data it
        was evaluated on (its run's ``evaluation`` dataset input), at the steps its run
        holds them: the model's page then lists the dataset under *Datasets used* and in
        its metrics table. Once: a model whose figures name a dataset is left as it is."""
        from mlflow.entities import Metric

        client = mlflow_client(self.tracking_uri)
        model_id = (point.model_uri or "").removeprefix("models:/")
        if not model_id or any(m.dataset_name for m in client.get_logged_model(model_id).metrics or []):
            return
        run = client.get_run(point.run_id or "")
        evaluated = next(
            (
                d.dataset
                for d in run.inputs.dataset_inputs
                if any(t.key == "mlflow.data.context" and t.value == "evaluation" for t in d.tags)
            ),
            None,
        )
        if evaluated is None:
            return
        now = int(time.time() * 1000)
        metrics = []
        for key in (self.metric, "tokens_per_image", "token_ratio"):
            history = client.get_metric_history(run.info.run_id, key)
            if history:
                last = max(history, key=lambda m: (m.step, m.timestamp))
                metrics.append(Metric(key, last.value, now, last.step, model_id, evaluated.name, evaluated.digest))
        if metrics:
            client.log_batch(run.info.run_id, metrics=metrics)

    def _register(self, name: str, point: Point, sweep_name: str) -> Any:
        """One frontier point's logged model as a new version of ``name``
        (``mlflow.register_model``, against this recorder's store)."""
        import contextlib
        import io

        import mlflow

        # mlflow.register_model resolves its store from the global tracking URI
        # (as mlflow.pytorch.log_model does, see RunTracker.log_model)
        mlflow.set_tracking_uri(self.tracking_uri)
        with contextlib.redirect_stderr(io.StringIO()):  # its "Created version ..." lines
            version = mlflow.register_model(
                point.model_uri,
                name,
                tags={
                    "token_ratio": f"{point.token_ratio:.4f}",
                    self.metric: f"{point.quality:.4f}",
                    "sweep": sweep_name,
                    SWEEP_TAG: self.parent_run_id,
                },
            )
        mlflow_client(self.tracking_uri).update_model_version(
            name,
            version.version,
            description=f"Sweep `{sweep_name}`: {point_run_name(point.trial_id, point.token_ratio, point.thresholds)}; "
            f"{self.metric} {point.quality:.4f} at {point.tokens_per_image:.1f} tokens per image. "
            f"[Its run]({run_link(self.experiment_id, point.run_id or '')}).",
        )
        return version

    def describe_experiment(
        self,
        sweep_name: str,
        hypervolume: float,
        frontier_size: int,
        points: int,
        best: Point | None,
        registered: RegisteredFrontier | None,
    ) -> None:
        """The experiment's description and tags: what it holds, its latest sweep, and
        how to read it in the UI (a link to the frontier's runs view, the chart, loading
        a budget). The frontier's view is saved as the experiment's shared view
        (:func:`frontier_view`), which the link opens."""
        client = mlflow_client(self.tracking_uri)
        client.set_experiment_tag(
            self.experiment_id,
            SHARED_VIEW_PREFIX + frontier_view_key(self.parent_run_id),
            json.dumps(frontier_view(self.metric, self.parent_run_id)),
        )
        view = frontier_link(self.experiment_id, self.parent_run_id)
        lines = [
            "**SPLIT sweeps**: multi-objective searches (Ray Tune + Optuna) of split thresholds and "
            f"token-budget penalties, {self.metric} up and tokens down, recorded by `splitvit sweep`.",
            "",
            f"**Latest sweep:** [{sweep_name}]({run_link(self.experiment_id, self.parent_run_id)}): "
            f"[{frontier_size} frontier points]({view}) of {points}, hypervolume {hypervolume:.4f}.",
        ]
        if best is not None:
            lines.append(
                f"Best point (largest hypervolume share): {self.metric} {best.quality:.4f} at "
                f"{best.tokens_per_image:.1f} tokens per image ({best.token_ratio:.0%} of full resolution)."
            )
        lines += [
            "",
            "**How to read it**",
            f"- The frontier: [its runs]({view}), best {self.metric} first, with their {self.metric}, "
            f"token and speed-up columns ([the plain search]"
            f"({frontier_search_link(self.experiment_id, self.parent_run_id, self.metric)}) where a UI keeps no "
            "shared views: the same rows, MLflow's default columns). By hand: filter the runs with "
            f"`{frontier_filter(self.parent_run_id)}` and sort by `{self.metric}` (sorted by start time, MLflow "
            "nests the points under their sweep: expand it); *Columns* adds "
            f"`{self.metric}`, `tokens_per_image`, `token_ratio`.",
            f"- The chart: the sweep run's artifacts [`{CHART_ARTIFACT}`]"
            f"({artifact_link(self.experiment_id, self.parent_run_id, CHART_ARTIFACT)}) (hover a point) and "
            f"`{PLOT_ARTIFACT}`; the table is `frontier.json`.",
        ]
        if registered is not None:
            some = next((a for a in registered.aliases if a.startswith("tokens-")), "best")
            lines.append(
                f"- Models: registered model `{registered.name}` (every sweep of this space), one version per "
                f"frontier point; `@best` and `@tokens-<pct>pct` are the latest sweep's: "
                f"`mlflow.pytorch.load_model('models:/{registered.name}@{some}')`, "
                f"or `splitvit eval models:/{registered.name}@best`."
            )
        tags = {
            "splitvit.latest_sweep": sweep_name,
            "splitvit.latest_sweep_run": self.parent_run_id,
            METRIC_TAG: self.metric,
        }
        if registered is not None:
            tags["splitvit.registered_model"] = registered.name
        describe_experiment(self.tracking_uri, self.experiment_id, "\n".join(lines), tags)

    # ------------------------------------------------------------------ parent artifacts
    def has_artifact(self, path: str, run_id: str | None = None) -> bool:
        """True when the run (default: the parent) already holds artifact ``path``."""
        folder, _, name = path.rpartition("/")
        entries = mlflow_client(self.tracking_uri).list_artifacts(run_id or self.parent_run_id, folder or None)
        return any(e.path == path or e.path.rsplit("/", 1)[-1] == name and not e.is_dir for e in entries)

    def tag_run(self, run_id: str, tags: dict[str, str]) -> None:
        """Tags on a run of the sweep (a fine-tuned baseline's ``splitvit.baseline``)."""
        client = mlflow_client(self.tracking_uri)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)

    def log_run_metrics(self, run_id: str, values: dict[str, float]) -> None:
        """Figures measured after a run ended (a frontier point's speed-up), at step 0."""
        self._log_metrics(run_id, _numbers(values), 0)

    def log_parent_metrics(self, values: dict[str, float]) -> None:
        """Sweep-level figures on the parent (hypervolume, frontier size...)."""
        self._log_metrics(self.parent_run_id, _numbers(values), 0)

    def log_table(self, rows: list[JsonObject], artifact_file: str) -> None:
        """``mlflow.log_table`` on the parent, once (MLflow appends to an existing table,
        which a resumed sweep must not do)."""
        if not rows or self.has_artifact(artifact_file):
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        table = {c: [_cell(row.get(c)) for row in rows] for c in columns}
        mlflow_client(self.tracking_uri).log_table(self.parent_run_id, data=table, artifact_file=artifact_file)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """A local file as a parent artifact."""
        mlflow_client(self.tracking_uri).log_artifact(self.parent_run_id, local_path, artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Text as a parent artifact (written again on resume: same content, one file)."""
        mlflow_client(self.tracking_uri).log_text(self.parent_run_id, text, artifact_file)

    def describe(self, markdown: str) -> None:
        """The parent run's description (tag ``mlflow.note.content``), secrets masked as
        in every tag, and cut to what the store keeps. The frontier's link is kept whole:
        MLflow names its query ``viewStateShareKey``, which the masking takes for a secret
        (a ``*key``), and would mask with the text after it."""
        link = frontier_link(self.experiment_id, self.parent_run_id)
        masked = NOTE_LINK.join(redact_uri(part) for part in markdown.split(link)).replace(NOTE_LINK, link)
        if len(masked) > _MAX_TAG_VALUE:
            masked = masked[: _MAX_TAG_VALUE - 40].rsplit("\n", 1)[0] + "\n\n*(cut to fit the store)*"
        mlflow_client(self.tracking_uri).set_tag(self.parent_run_id, NOTE_TAG, masked)

    def log_figure(self, figure, artifact_file: str) -> None:
        """A matplotlib figure on the parent."""
        mlflow_client(self.tracking_uri).log_figure(self.parent_run_id, figure, artifact_file)

    def log_image(self, image, artifact_file: str) -> None:
        """A PIL image on the parent."""
        self.parent.log_image(image, artifact_file)

    def close(self, status: str, tags: dict[str, str] | None = None) -> None:
        """End the parent run (``completed``, ``failed`` or ``interrupted``)."""
        self.parent.close(status, tags=tags)


def _cell(value: Any) -> Any:
    """A table cell MLflow's JSON table (and pandas) takes: numbers and text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


# ---------------------------------------------------------------------- reading back
@dataclass(frozen=True)
class RecordedTiming:
    """How a sweep timed its frontier, as its parent run records it: the device (tag
    ``splitvit.speed_device``), the timing settings and its speed metrics (those it has
    of ``speed_full_images_per_s``, ``speedup_max``, ``speedup_best_point``,
    ``speedup_within_1pt_of_full``)."""

    sweep: str  # the parent run id
    device: str
    timing: str
    figures: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, str | float]:
        """Its JSON entry (``speed`` of ``splitvit pareto --json``): the figures after the names."""
        return {"sweep": self.sweep, "device": self.device, "timing": self.timing, **self.figures}


@dataclass(frozen=True)
class RecordedSweeps:
    """The finished points of one sweep of an experiment, or of several, read from MLflow
    (:func:`points_from_mlflow`).

    Attributes:
        experiment_id: the experiment's id.
        sweeps: the sweeps' parent run ids, sorted.
        sweep_names: parent run id -> the sweep's run name.
        metric: the quality of the latest sweep read (``accuracy``, ``miou``...).
        reference: the latest sweep's hypervolume reference point ``(quality, token_ratio)``.
        points: every trial's and threshold point's run that completed.
        speed: how each sweep that timed its frontier timed it (none for the others).
    """

    experiment_id: str
    sweeps: list[str]
    sweep_names: dict[str, str]
    metric: str
    reference: tuple[float, float]
    points: list[Point]
    speed: list[RecordedTiming]


def points_from_mlflow(
    tracking_uri: str, experiment: str, sweep_run_id: str | None = None, *, all_sweeps: bool = False
) -> RecordedSweeps:
    """The finished points of one sweep of an experiment, or of all of them, from MLflow.

    Which sweep: ``sweep_run_id`` when given, else every sweep with ``all_sweeps``,
    else the latest started (its reference point and metric apply to the merge too).
    Raises ``ValueError`` when the store, the experiment or the sweep is not there
    (nothing is created).
    """
    from ..config import redact_uri
    from .pareto import Point

    missing = missing_store(tracking_uri)
    if missing:
        raise ValueError(missing)
    client = mlflow_client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ValueError(f"no MLflow experiment {experiment!r} in {redact_uri(tracking_uri)}")
    experiment_id = found.experiment_id
    parents = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{KIND_TAG}` = 'sweep'",
        max_results=50_000,
        order_by=["attributes.start_time DESC"],
    )
    if sweep_run_id is not None:
        parents = [p for p in parents if p.info.run_id == sweep_run_id]
        if not parents:
            raise ValueError(f"run {sweep_run_id} is not a sweep of experiment {experiment!r}")
    if not parents:
        raise ValueError(f"experiment {experiment!r} holds no sweep (no run tagged {KIND_TAG}=sweep)")
    if sweep_run_id is None and not all_sweeps:
        parents = parents[:1]  # the latest: sweeps of other spaces or settings do not mix unasked
    metric = parents[0].data.tags.get(METRIC_TAG, "accuracy")
    # a tag, not the pareto.* params: stores written before the redaction spared token
    # counts hold pareto.token_ratio as "***" (taken for a secret)
    quality, ratio = json.loads(parents[0].data.tags.get(REFERENCE_TAG) or "[0.0, 1.0]")
    sweep_ids = {p.info.run_id for p in parents}
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{STATUS_TAG}` = 'completed'", max_results=50_000)
    points = []
    for run in runs:
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        if tags.get(KIND_TAG) not in ("trial", "threshold_point") or tags.get(SWEEP_TAG) not in sweep_ids:
            continue
        if metric not in metrics or "tokens_per_image" not in metrics:
            continue
        if tags.get(KIND_TAG) == "trial":
            thresholds = json.loads(tags.get("splitvit.thresholds") or "[]")
        else:
            thresholds = json.loads(params.get("thresholds") or "[]")
        sampled = json.loads(tags.get(SAMPLED_TAG) or "{}")
        points.append(
            Point(
                quality=metrics[metric],
                tokens_per_image=metrics["tokens_per_image"],
                token_ratio=metrics.get("token_ratio", float("nan")),
                kind="trial" if tags.get(KIND_TAG) == "trial" else "threshold",
                trial_id=tags.get(TRIAL_TAG, ""),
                thresholds=thresholds,
                params=sampled,
                run_id=run.info.run_id,
                checkpoint=tags.get("splitvit.checkpoint") or None,
                extras={k: metrics[k] for k in SPEED_METRICS if k in metrics},
            )
        )
    # where and how each sweep timed its frontier (absent: a sweep that did not)
    speed = [
        RecordedTiming(
            sweep=p.info.run_id,
            device=p.data.tags[SPEED_DEVICE_TAG],
            timing=p.data.tags.get(SPEED_TIMING_TAG, ""),
            figures={
                k: p.data.metrics[k]
                for k in ("speed_full_images_per_s", "speedup_max", "speedup_best_point", "speedup_within_1pt_of_full")
                if k in p.data.metrics
            },
        )
        for p in parents
        if SPEED_DEVICE_TAG in p.data.tags
    ]
    return RecordedSweeps(
        experiment_id=experiment_id,
        sweeps=sorted(sweep_ids),
        sweep_names={p.info.run_id: p.info.run_name for p in parents},
        metric=metric,
        reference=(quality, ratio),
        points=points,
        speed=speed,
    )


# ---------------------------------------------------------------------- readable records
def sweep_params(space: SearchSpace) -> dict[str, str | int]:
    """The parent run's params: what a reader compares sweeps by, at a glance. The whole
    space, defaults and overrides included, is the ``search_space.yaml`` artifact."""
    return {
        # with their folders: search_spaces/smoke.yaml and jobs/configs/smoke.yaml share a name
        "space_file": _short_path(space.source),
        "base_config": _short_path(space.base),
        "num_samples": space.search.num_samples,
        # auto as the sampler it resolved to (``gp (auto)``): what a reader compares
        "sampler": _sampler_name(space),
        "metric": space.quality_metric,
        "reference_point": f"{space.quality_metric} {space.pareto.quality:g}, token ratio {space.pareto.token_ratio:g}",
        "searched": ", ".join(space.parameters),
    }


def _sampler_name(space: SearchSpace) -> str:
    """``search.sampler``, ``auto`` with the sampler it picked: ``gp (auto)``."""
    from .space import resolve_sampler

    resolved = resolve_sampler(space)
    return f"{resolved} (auto)" if space.search.sampler == "auto" else resolved


def _short_path(path: str) -> str:
    """A file as ``folder/name``: enough to tell files of one name apart, stable
    wherever the sweep is resumed from."""
    p = Path(path)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


def search_space_document(space: SearchSpace) -> JsonObject:
    """The space as its YAML file writes it, with every default and ``--set`` override
    filled in: :func:`~splitvit.tune.space.space_from_dict` loads it back to the same
    space (``base`` is the resolved path of the base config)."""
    data = json.loads(json.dumps(space.to_dict(), default=str))  # tuples -> lists: plain YAML
    # to_dict keeps ``low`` even when None (a bound of 0 would read as unset): not a setting here
    parameters = {
        name: {k: v for k, v in spec.items() if k != "name" and v is not None}
        for name, spec in data.pop("parameters").items()
    }
    # fixed values live under ``parameters`` in a space file, as plain values
    document = {"description": data.pop("description"), "base": data.pop("base")}
    data.pop("source")
    document["parameters"] = {**parameters, **data.pop("fixed")}
    data["pareto"] = {"reference_point": data["pareto"]}  # the file nests the point one level down
    return {**document, **data}


def _redacted(value: Any, key: str = "") -> Any:
    """``value`` with secret-named entries masked and passwords cut from URIs, at any
    depth (the rule of :func:`~splitvit.tracking.runs.safe_params`, for a document
    that a run's readers can download)."""
    from ..config import REDACTED, is_secret_key, redact_uri

    if key and is_secret_key(key) and value is not None and not isinstance(value, dict):
        return REDACTED
    if isinstance(value, dict):
        return {k: _redacted(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v, key) for v in value]
    return redact_uri(value) if isinstance(value, str) else value


def search_space_yaml(space: SearchSpace) -> str:
    """:func:`search_space_document` as YAML (secrets masked), headed by where it came from."""
    import yaml

    header = f"# search space of this sweep: {space.source}, with defaults and --set overrides applied\n"
    document = _redacted(search_space_document(space))
    return header + yaml.safe_dump(document, sort_keys=False, allow_unicode=True)


def _md(value: Any) -> str:
    """A markdown table cell: rounded floats, pipes escaped."""
    if isinstance(value, float):
        value = "-" if not math.isfinite(value) else value
    return str(value).replace("|", "\\|")


def _md_table(rows: list[dict[str, str | float]]) -> list[str]:
    from .pareto import round_figures

    if not rows:
        return []
    rows = [round_figures(r) for r in rows]
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_md(r.get(c, "")) for c in columns) + " |" for r in rows]
    return lines


def sweep_note(
    *,
    name: str,
    metric: str,
    hypervolume: float,
    reference: tuple[float, float],
    points: list[Point],
    best: Point | None,
    baselines: list[Baseline],
    trial_status: dict[str, int],
    experiment_id: str,
    parent_run_id: str,
    plot: str | None = PLOT_ARTIFACT,
    top: int = 5,
    best_uris: list[str] | None = None,
    reference_note: str | None = None,
) -> str:
    """The parent run's markdown description: the hypervolume, the best points, the
    baselines at matched budgets, links to the plot and the best model, the trials by
    status. ``best_uris``: the registry URIs that load the best point's model
    (``models:/<name>@best`` first). ``reference_note``: a markdown line on the reference
    every trial fine-tuned from (with a link to its run where it has one). Links are
    relative to the MLflow UI (``#/experiments/...``, in its *Model training* view), so
    they work on any host that serves the store. The table of the largest hypervolume
    contributions is sorted by contribution, as its heading says."""
    from .pareto import frontier

    front = frontier(points)
    lines = [f"## Sweep `{name}`: {metric} vs tokens per image", ""]
    lines.append(
        f"**Hypervolume {hypervolume:.4g}** (reference point: {metric} {reference[0]:g}, token ratio "
        f"{reference[1]:g}); [{len(front)} of {len(points)} points on the frontier]"
        f"({frontier_link(experiment_id, parent_run_id)})."
    )
    trials = ", ".join(f"{n} {status}" for status, n in sorted(trial_status.items()))
    lines += ["", f"Trials: {sum(trial_status.values())} ({trials or 'none'})."]
    if reference_note:
        lines += ["", reference_note]
    links = []
    if plot:
        links.append(f"[the frontier plot]({artifact_link(experiment_id, parent_run_id, plot)}) (`{plot}`)")
        links.append(
            f"[the interactive chart]({artifact_link(experiment_id, parent_run_id, CHART_ARTIFACT)}) "
            f"(`{CHART_ARTIFACT}`)"
        )
    if best is not None and best.model_uri and best.model_uri.startswith("models:/"):
        model_id = best.model_uri.split("/", 1)[1].strip("/")
        links.append(
            f"[the best point's model](#/experiments/{experiment_id}/models/{model_id}{UI_VIEW_QUERY}) "
            f"(`{best.model_uri}`)"
        )
    if best is not None and best.run_id:
        links.append(f"[the best point's run]({run_link(experiment_id, best.run_id)})")
    links.append(f"[the frontier table]({artifact_link(experiment_id, parent_run_id, 'frontier.json')})")
    lines += ["", "See " + ", ".join(links) + "."]
    # MLflow keeps chart layouts in the browser, not in the store: say how, in three clicks
    lines += [
        "",
        f"Every trial and threshold-point run carries `{metric}` and `tokens_per_image`: in the experiment's "
        f"chart view, *Add chart → Scatter*, X `tokens_per_image`, Y `{metric}` draws every point.",
    ]
    if best is not None:
        lines += [
            "",
            f"**Best point** (largest hypervolume contribution): {metric} {best.quality:.4g} at "
            f"{best.tokens_per_image:.1f} tokens per image (token ratio {best.token_ratio:.3g}), trial "
            f"`{best.trial_id}`, thresholds {[float(f'{t:.3g}') for t in best.thresholds]}"
            + _held_out_text(best.extras, metric)
            + (f"; load it as `{best_uris[0]}` (also `{'`, `'.join(best_uris[1:])}`)." if best_uris else "."),
        ]
    chosen = sorted(front, key=lambda p: -p.hv_contribution)[:top]
    if chosen:
        lines += [
            "",
            f"### Frontier points with the largest hypervolume contributions (top {len(chosen)}, largest first)",
            "",
        ]
        lines += _md_table(
            [
                {
                    "tokens/image": p.tokens_per_image,
                    metric: p.quality,
                    "token ratio": p.token_ratio,
                    **_held_out_cells(p.extras, metric),
                    "HV contribution": p.hv_contribution,
                    "trial": p.trial_id,
                    "kind": p.kind,
                    "best": "@best" if p is best else "",
                    "model logged": "yes" if p.model_uri else "",
                }
                for p in chosen  # by contribution, largest first: the heading's order
            ]
        )
    matched = _matched_baselines(baselines, front, metric)
    if matched:
        tuned = any(b.label.endswith("(fine-tuned)") for b in baselines)
        where = "fine-tuned from the same reference" if tuned else "same backbone as the best point"
        lines += ["", f"### Baselines at matched budgets ({where}; choices on validation)", ""]
        lines += _md_table(matched)
    return "\n".join(lines) + "\n"


def _matched_baselines(baselines: list[Baseline], front: list[Point], metric: str) -> list[dict[str, str | float]]:
    """Each baseline beside the best frontier quality at no more tokens per image (the
    SPLIT point one would pick at that budget); ``-`` where the frontier has none."""
    rows = []
    for b in sorted(baselines, key=lambda b: b.tokens_per_image):
        within = [p.quality for p in front if p.tokens_per_image <= b.tokens_per_image + 1e-9]
        split = max(within) if within else float("nan")
        rows.append(
            {
                "baseline": b.label or b.baseline,
                "tokens/image": float(b.tokens_per_image),
                metric: float(b.quality),
                "SPLIT within budget": split,
                "SPLIT − baseline": split - float(b.quality),
                **_held_out_cells(b.held_out or {}, metric),
            }
        )
    return rows


def _held_out_cells(figures: dict[str, float], metric: str) -> dict[str, float]:
    """A table's held-out columns (``test <metric>``, ``test ratio``), where evaluated."""
    if f"test_{metric}" not in figures:
        return {}
    return {f"test {metric}": figures[f"test_{metric}"], "test ratio": figures.get("test_token_ratio", float("nan"))}


def _held_out_text(figures: dict[str, float], metric: str) -> str:
    """``; on the test split: accuracy 0.71 at token ratio 0.49`` where evaluated there."""
    if f"test_{metric}" not in figures:
        return ""
    return (
        f"; on the held-out split: {metric} {figures[f'test_{metric}']:.4g} at token ratio "
        f"{figures.get('test_token_ratio', float('nan')):.3g}"
    )
