"""Multi-objective sweeps: Ray Tune + Optuna over SPLIT training, thresholds swept on
every checkpoint, the Pareto frontier of quality versus tokens in MLflow.

:func:`run_sweep` runs a sweep end to end:

1. **Space** — :func:`~splitvit.tune.space.load_space` validates the YAML space (and
   its ``--set`` overrides) against the experiment config before Ray starts.
2. **Stage one** — a Ray Tune ``Tuner`` over :func:`~splitvit.tune.trial.sweep_trial`,
   a driver function that launches a ``TorchTrainer`` per trial (Ray's Train V2 +
   Tune pattern; never ``Tuner(trainer)``). ``OptunaSearch`` proposes the
   parameters with a two-objective metric (quality max, ``tokens_per_image`` min)
   and the sampler ``search.sampler`` names (``auto``: Optuna's own rule, GP for a
   small budget over numbers, multivariate TPE with categorical parameters, NSGA-II
   from 250 trials), behind Tune's concurrency limit; the config's own point first.
3. **Stage two** — each finished trial sweeps its per-level split thresholds with
   Optuna on its own checkpoint (evaluation only), adding points cheaply.
4. **Frontier** — non-dominated points over every trial and threshold point (Optuna's
   ``best_trials``) and their hypervolume against the space's reference point.
5. **Baselines** — the reference backbone (the trial of the frontier point with the
   largest hypervolume contribution) evaluated at full resolution, with entropy
   splitting at several thresholds and with random splitting at the frontier's
   token budgets: same data, same backbone.
6. **MLflow** — a parent run for the sweep, a child per trial (a grandchild per
   threshold point); on the parent the frontier table (``log_table`` + CSV), the
   plot with the baselines, the hypervolume, the best point's split maps and the
   frontier points' models.
7. **Speed** — the frontier points (at most ``speed.max_points``) and the
   full-resolution model timed side by side, interleaved, on the device the sweep
   evaluated on (:func:`~splitvit.tune.speed.time_operating_points`; the space's
   ``speed`` section, on by default). Each point's ``speedup_vs_full`` goes to the
   frontier table, its run's metrics and the JSON (``frontier_speed``); the parent
   gets ``pareto_speed.png`` (quality against measured speed-up),
   ``frontier_speed.json``, the device (tag ``splitvit.speed_device``) and
   ``speedup_max``, ``speedup_best_point``, ``speedup_within_1pt_of_full``.

**Resilience.** ``resume=True`` restores the Tuner from the sweep folder
(``Tuner.restore``): finished trials keep their results, unfinished ones restart
(their training resumes from the latest checkpoint), failed ones stay failed, and
the MLflow runs found by their storage keys are re-used, never duplicated. A trial
that raises or diverges (non-finite loss) is recorded as failed (its child run says
``failed`` or ``diverged``), the sweep goes on, and the frontier excludes it.

**No early stopping.** ``search.scheduler: asha`` is refused when the space loads. A
scheduler ranks one metric (Tune offers no multi-objective one), and with the sweep's
two objectives ``OptunaSearch`` ignores intermediate results: a trial ASHA stopped
early would be told to Optuna as finished, with its truncated accuracy, and land on
the frontier.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import ExperimentConfig, config_layers, redact_uri, upgrade_flat, upgrade_sections
from ..storage import exists, is_s3, join_uri, read_bytes, write_bytes
from ..tracking.runs import ui_url
from .console import Progress, ray_console, ray_output_shown, tune_verbosity
from .mlflow_records import (
    CHART_ARTIFACT,
    PLOT_ARTIFACT,
    REFERENCE_TAG,
    SPACE_ARTIFACT,
    SPEED_DEVICE_TAG,
    SPEED_TIMING_TAG,
    RegisteredFrontier,
    SweepRecorder,
    search_space_yaml,
    sweep_note,
    sweep_params,
)
from .pareto import Baseline, Point, annotate, best_point, frontier, round_figures
from .reference import (
    Reference,
    check_reference,
    convergence_line,
    convergence_verdict,
    locate_reference,
    train_reference,
)
from .space import (
    BASELINE_POLICIES,
    NSGA2_DEFAULT_POPULATION,
    SearchSpace,
    first_points,
    load_space,
    resolve_sampler,
)
from .trial import (
    BASELINE_KEY,
    FINAL_KEY,
    SweepPlan,
    TrialDiverged,
    run_evaluation,
    sweep_trial,
    threshold_points,
    trained_thresholds,
)

log = logging.getLogger(__name__)

PLAN_FILE = "sweep_space.json"
SWEEP_RESULT_FILE = "sweep.json"


@dataclass
class TrialSummary:
    """One trial's outcome.

    Attributes:
        trial_id: the Tune trial id (also its Train run name).
        status: ``completed``, ``stopped`` (early stopping), ``failed``,
            ``diverged`` or ``unfinished``.
        params: the sampled parameters (config values).
        error: what went wrong, for failed trials.
        run_id: its MLflow child run.
        checkpoint: its last checkpoint.
        baseline: a fine-tuned baseline's policy (``full``, ``entropy``, ``random``);
            empty for a searched trial.
    """

    trial_id: str
    status: str
    params: dict[str, Any]
    error: str = ""
    run_id: str | None = None
    checkpoint: str | None = None
    baseline: str = ""


@dataclass
class SweepResult:
    """What :func:`run_sweep` returns (and ``splitvit sweep --json`` writes)."""

    name: str
    space: str
    sweep_dir: str
    metric: str
    points: list[Point]
    baselines: list[Baseline]
    hypervolume: float
    reference_point: dict[str, float]
    trials: list[TrialSummary]
    tracking_uri: str
    experiment: str
    experiment_id: str
    parent_run_id: str
    plot: str | None = None
    frontier_csv: str | None = None
    split_map: str | None = None
    wall_time_s: float = 0.0
    resumed: bool = False
    status: str = "completed"
    reference: Reference | None = None
    held_out_split: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def frontier(self) -> list[Point]:
        """Frontier points by tokens per image."""
        return frontier(self.points)

    @property
    def _server(self) -> bool:
        return self.tracking_uri.startswith(("http://", "https://", "databricks"))

    def mlflow_ui_command(self) -> str:
        """The command that opens the MLflow UI on this sweep's store (for a tracking
        server, the server is the UI: nothing to start)."""
        if self._server:
            return f"open {self.mlflow_url()} (the MLflow server)"
        return f"mlflow ui --backend-store-uri {redact_uri(self.tracking_uri)}"

    def mlflow_url(self, host: str = "http://127.0.0.1:5000") -> str:
        """The parent run's page in the MLflow UI (a local ``mlflow ui``, or the server)."""
        if self._server and not self.tracking_uri.startswith("databricks"):
            host = redact_uri(self.tracking_uri).rstrip("/")
        return ui_url(host, self.experiment_id, self.parent_run_id)

    def frontier_url(self, host: str = "http://127.0.0.1:5000") -> str:
        """The frontier's runs view in the MLflow UI (a local ``mlflow ui``, or the server):
        its point runs, best quality first, with their figure columns."""
        from .mlflow_records import frontier_link

        page = self.mlflow_url(host).split("#", 1)[0]
        return page + frontier_link(self.experiment_id, self.parent_run_id)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {
            "name": self.name,
            "status": self.status,
            "space": self.space,
            "sweep_dir": self.sweep_dir,
            "metric": self.metric,
            "objectives": {self.metric: "max", "tokens_per_image": "min"},
            "hypervolume": self.hypervolume,
            "reference_point": self.reference_point,
            "points": [p.to_dict(self.metric) for p in self.points],
            "frontier": [p.to_dict(self.metric) for p in self.frontier()],
            "baselines": [b.to_dict(self.metric) for b in self.baselines],
            "reference": self.reference.to_dict() if self.reference is not None else None,
            "held_out_split": self.held_out_split,
            "trials": [asdict(t) for t in self.trials],
            "mlflow": {
                "tracking_uri": redact_uri(self.tracking_uri),
                "experiment": self.experiment,
                "experiment_id": self.experiment_id,
                "parent_run_id": self.parent_run_id,
                "ui": self.mlflow_ui_command(),
                "url": self.mlflow_url(),
                "frontier_url": self.frontier_url(),
            },
            "plot": self.plot,
            "frontier_csv": self.frontier_csv,
            "split_map": self.split_map,
            "wall_time_s": self.wall_time_s,
            "resumed": self.resumed,
            **self.extras,
        }


class SweepError(RuntimeError):
    """A sweep could not run or finish (nothing to resume, no trial completed...)."""


class SweepNotFound(SweepError, ValueError):
    """Bad input: the MLflow store, experiment or sweep named is not there (exit 2)."""


# ---------------------------------------------------------------------- Tune pieces
def trial_dirname(trial) -> str:
    """Trial folders are named by trial id (the Train run and MLflow keys use it too)."""
    return trial.trial_id


def _build_tracking(space: SearchSpace) -> tuple[ExperimentConfig, str, str]:
    base = space.config()
    experiment = space.mlflow.experiment or base.tracking.experiment
    return base, base.tracking_uri(), experiment


def startup_trials(num_samples: int) -> int:
    """Trials the GP (or TPE) sampler draws at random before it models the objectives.

    Optuna's default, 10, would leave a sweep of up to 10 trials pure random search;
    a third of the budget (at least 2, for a first model to fit; at most Optuna's 10)
    leaves most trials to the model. The points evaluated first (the config's own)
    are finished trials, so they count toward it."""
    return max(2, min(10, num_samples // 3))


def build_sampler(space: SearchSpace):
    """The Optuna sampler of stage one: :func:`~splitvit.tune.space.resolve_sampler`'s
    choice (``auto`` resolved), seeded by ``search.seed``."""
    import warnings

    import optuna

    s = space.search
    name = resolve_sampler(space)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=s.population_size or NSGA2_DEFAULT_POPULATION, seed=s.seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=s.seed, n_startup_trials=startup_trials(s.num_samples))
    with warnings.catch_warnings():  # multivariate TPE is "experimental" in Optuna, and Optuna's recommendation
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            multivariate=True, seed=s.seed, n_startup_trials=startup_trials(s.num_samples)
        )


def _searcher(space: SearchSpace):
    from ray.tune.search.optuna import OptunaSearch

    name = resolve_sampler(space)
    if space.search.sampler == "auto":
        log.info("sampler auto: %s for %d trials over %s", name, space.search.num_samples, _parameter_kinds(space))
    points = [{k: space.parameters[k].encode(v) for k, v in p.items()} for p in first_points(space)]
    complete = [p for p in points if len(p) == len(space.parameters)]
    searcher = OptunaSearch(
        space=space.optuna_space(),
        metric=[space.quality_metric, "tokens_per_image"],
        mode=["max", "min"],
        sampler=build_sampler(space),
        points_to_evaluate=complete or None,
    )
    if len(complete) < len(points):
        # the config's own point without the values outside their range: Ray refuses a
        # partial point, Optuna takes one (the sampler fills in the rest), so it goes to
        # the study directly, as Ray does with its points_to_evaluate
        for point in points:
            if len(point) < len(space.parameters):
                searcher._ot_study.enqueue_trial(point)
    return searcher


def _parameter_kinds(space: SearchSpace) -> str:
    """``4 numeric parameters``, ``7 numeric and 1 categorical parameters``."""
    kinds = Counter("categorical" if p.distribution == "categorical" else "numeric" for p in space.parameters.values())
    return " and ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), reverse=True)) + " parameters"


def _callback_class():
    from ray import tune

    class SweepCallback(tune.Callback):
        """Records trials in MLflow from the Tune driver as they start, report and end.

        MLflow trouble never stops the sweep: it is logged, and the records are made
        whole again after ``Tuner.fit`` returns.
        """

        def __init__(self, recorder: SweepRecorder, plan: SweepPlan) -> None:
            self.recorder = recorder
            self.plan = plan
            self._params: dict[str, dict[str, Any]] = {}
            # a bar over the trials on a terminal; the lines below are the record elsewhere
            self.progress = Progress("trials", planned_trials(plan.space))

        def _config_params(self, trial) -> dict[str, Any]:
            if trial.trial_id not in self._params:
                self._params[trial.trial_id] = _config_params(self.plan, trial.config, trial.trial_id)
            return self._params[trial.trial_id]

        def _safe(self, what: str, fn, *args) -> Any:
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001 - MLflow trouble must not end the sweep
                log.warning("could not record %s in MLflow: %s", what, exc)
                return None

        def on_trial_start(self, iteration, trials, trial, **info):
            sampled = self.plan.space.decode(trial.config)
            self.progress.log(log, logging.INFO, "trial %s started: %s", trial.trial_id, _short(sampled))
            run_id = self._safe(
                f"trial {trial.trial_id}",
                self.recorder.trial_started,
                trial.trial_id,
                self.plan.run_uri(trial.trial_id),
                sampled,
                self._config_params(trial),
                {t.trial_id for t in trials},
                _trial_data(self.plan, sampled, trial.trial_id),
            )
            if run_id:
                self._safe(f"trial {trial.trial_id}'s config layers", self._log_layers, run_id, sampled, trial)

        def _log_layers(self, run_id: str, sampled: dict[str, Any], trial) -> None:
            """The trial's config with each key's layer (recipe, base file, the space's
            fixed values, sampled): ``config_layers.json``, as a training run has it."""
            from ..tracking import RunTracker

            try:
                config = self.plan.trial_config(sampled, trial.trial_id)
            except ValueError:  # the trial fails the same way and says why
                return
            tracker = RunTracker(self.recorder.tracking_uri, self.recorder.experiment_id, run_id)
            tracker.log_dict(config_layers(config), "config_layers.json")

        def on_trial_result(self, iteration, trials, trial, result, **info):
            if result.get(FINAL_KEY):
                return
            metric = self.plan.space.quality_metric
            if "epoch" in result:
                self.progress.log(
                    log,
                    logging.INFO,
                    "trial %s epoch %d: %s %.4f, %.1f tokens/image",
                    trial.trial_id,
                    int(result["epoch"]),
                    metric,
                    float(result.get(metric, float("nan"))),
                    float(result.get("tokens_per_image", float("nan"))),
                )
            self._safe(
                f"an epoch of trial {trial.trial_id}",
                self.recorder.trial_epoch,
                trial.trial_id,
                self.plan.run_uri(trial.trial_id),
                result,
            )

        def on_trial_complete(self, iteration, trials, trial, **info):
            final = trial.last_result or {}
            done = sum(t.status in ("TERMINATED", "ERROR") for t in trials) + 1
            total = planned_trials(self.plan.space)
            if not final.get(FINAL_KEY):
                self.progress.log(log, logging.INFO, "trial %s stopped early (%d/%d)", trial.trial_id, done, total)
                self.progress.update(done)
                return  # recorded after the Tuner returns, from its last epoch
            metric = self.plan.space.quality_metric
            self.progress.log(
                log,
                logging.INFO,
                "trial %s finished (%d/%d): %s %.4f at %.1f tokens/image, %d threshold points",
                trial.trial_id,
                done,
                total,
                metric,
                final.get(metric, float("nan")),
                final.get("tokens_per_image", float("nan")),
                len(threshold_points(final)),
            )
            self.progress.update(done)
            self._safe(
                f"trial {trial.trial_id}",
                self.recorder.trial_completed,
                trial.trial_id,
                self.plan.run_uri(trial.trial_id),
                self.plan.space.decode(trial.config),
                self._config_params(trial),
                final,
                _trial_data(self.plan, self.plan.space.decode(trial.config), trial.trial_id),
            )

        def on_trial_error(self, iteration, trials, trial, **info):
            message = _trial_error(trial)
            self.progress.log(
                log,
                logging.WARNING,
                "trial %s failed: %s",
                trial.trial_id,
                message.strip().splitlines()[-1] if message.strip() else "?",
            )
            self.progress.update(sum(t.status in ("TERMINATED", "ERROR") for t in trials) + 1)
            self._safe(
                f"trial {trial.trial_id}",
                self.recorder.trial_failed,
                trial.trial_id,
                self.plan.run_uri(trial.trial_id),
                self.plan.space.decode(trial.config),
                self._config_params(trial),
                message,
            )

    return SweepCallback


def _trial_error(trial) -> str:
    """The trial's error text: Tune writes it next to the trial on the driver first
    (its copy in storage follows at the next sync)."""
    try:
        local = trial.error_file
        if local and Path(local).is_file():
            return Path(local).read_text()
        return str(trial.get_error() or "trial failed")
    except Exception:  # noqa: BLE001 - an unreadable error file must not hide the failure
        return "trial failed"


def _short(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _trial_data(plan: SweepPlan, sampled: dict[str, Any], trial_id: str) -> Any:
    """The trial's data config (its runs' MLflow dataset inputs); ``None`` when its
    config does not build (the trial fails the same way and says why)."""
    try:
        return plan.trial_config(sampled, trial_id).data
    except ValueError:
        return None


def _config_params(plan: SweepPlan, sampled: dict[str, Any], trial_id: str) -> dict[str, Any]:
    """A trial run's params: its experiment config, flattened. Without
    ``tracking.enabled``: the trial's own Train run logs nothing (``False`` in its
    config), its MLflow run is the sweep driver's record of it, which a ``False``
    there would contradict."""
    try:
        params = plan.trial_config(sampled, trial_id).flat(redact=True)
    except ValueError as exc:  # the trial will fail the same way; record what it was
        log.warning("trial %s: %s", trial_id, exc)
        return {}
    params.pop("tracking.enabled", None)
    return params


# ---------------------------------------------------------------------- location
def _sweep_location(space: SearchSpace, base: ExperimentConfig, name: str | None, resume: bool) -> tuple[str, str]:
    from ray import tune

    storage = base.storage.resolved_path()
    stem = Path(space.source).stem
    if name is None and resume:
        if is_s3(storage):
            raise SweepError(f"--resume on {storage}: name the sweep to resume (--name)")
        candidates = sorted(
            (p for p in Path(storage).glob(f"{stem}-*") if (p / "tuner.pkl").is_file()), key=lambda p: p.stat().st_mtime
        )
        if not candidates:
            raise SweepError(f"--resume: no sweep of {space.source} under {storage} to resume")
        name = candidates[-1].name
    name = name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if "/" in name or name in (".", ".."):
        raise SweepError(f"sweep name must be a plain folder name, got {name!r}")
    sweep_dir = join_uri(storage, name)
    restorable = tune.Tuner.can_restore(sweep_dir)
    if resume and not restorable:
        raise SweepError(f"--resume: {sweep_dir} holds no sweep to resume")
    if not resume and restorable:
        raise SweepError(f"sweep {sweep_dir} already exists: pass --resume to continue it, or another --name")
    return name, sweep_dir


def _upgrade_plan(stored: dict[str, Any]) -> dict[str, Any]:
    """A saved plan's space with its settings' old key names (:data:`~splitvit.config.LEGACY_KEYS`)
    under the new ones: its parameters, fixed values and initial points."""
    stored = dict(stored)
    for section in ("parameters", "fixed"):
        if isinstance(stored.get(section), dict):
            stored[section] = upgrade_flat(stored[section])
    search = stored.get("search")
    if isinstance(search, dict) and isinstance(search.get("initial_points"), list):
        points = [upgrade_flat(p) if isinstance(p, dict) else p for p in search["initial_points"]]
        stored["search"] = {**search, "initial_points": points}
    return stored


def _check_plan(space: SearchSpace, sweep_dir: str, overrides: list[str] | None, resume: bool) -> SearchSpace:
    """Save the space a sweep starts with; on resume, insist on the same one."""
    plan_uri = join_uri(sweep_dir, PLAN_FILE)
    current = {k: v for k, v in space.to_dict().items() if k != "source"}
    if not resume:
        write_bytes(
            plan_uri,
            json.dumps(
                {
                    "space": current,
                    "overrides": overrides or [],
                    "source": space.source,
                    "base_config": space.base_raw,
                },
                indent=2,
                sort_keys=True,
                default=str,
            ).encode(),
        )
        return space
    if not exists(plan_uri):
        return space
    saved = json.loads(read_bytes(plan_uri))
    if not overrides and saved.get("overrides"):
        # resume with the overrides the sweep started with
        space = load_space(space.source, saved["overrides"])
        current = {k: v for k, v in space.to_dict().items() if k != "source"}
    stored = saved["space"]
    normal = json.loads(json.dumps(current, sort_keys=True, default=str))
    if "speed" not in stored:
        normal.pop("speed", None)  # a sweep started before frontier timing: timed with the defaults
    if "ratios" not in stored.get("stage_two", {}) and not normal["stage_two"].get("ratios"):
        normal["stage_two"].pop("ratios", None)  # started before calibrated points: none asked for
    stored = _upgrade_plan(stored)  # a plan saved before the keys were grouped: the new names
    if "base_config" in saved:
        # the base config by what it says, not by where the checkout lies: a sweep resumes
        # from a moved or fresh clone of the same files (old key names read as the new ones)
        stored = {**stored, "base": upgrade_sections(saved["base_config"], warn=False)}
        base = upgrade_sections(space.base_raw, warn=False)
        normal["base"] = json.loads(json.dumps(base, sort_keys=True, default=str))
    if normal != stored:
        changed = sorted(k for k in set(normal) | set(stored) if normal.get(k) != stored.get(k))
        raise SweepError(
            f"--resume: the space differs from the one {sweep_dir} started with (in {', '.join(changed)}); "
            f"resume with the same file and --set values ({saved.get('overrides') or 'none'})"
        )
    return space


@contextlib.contextmanager
def _experiment_state_period(seconds: float):
    """Tune saves its experiment state (what ``Tuner.restore`` reads) at most every
    ``TUNE_GLOBAL_CHECKPOINT_S`` seconds — by default at least 10 — so a driver
    killed within that window restarts trials that had already finished. A sweep's
    state is small; save it often. An explicit setting in the environment wins."""
    key = "TUNE_GLOBAL_CHECKPOINT_S"
    previous = os.environ.get(key)
    if previous is None:
        os.environ[key] = str(seconds)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)


def _warn_if_temporary(storage: str) -> None:
    """A Ray job runs in a temporary copy of its working_dir; a relative storage path lands there."""
    if is_s3(storage) or not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return
    if Path(os.getcwd()) in Path(storage).parents or Path(storage) == Path(os.getcwd()):
        log.warning(
            "sweep storage %s lies in this Ray job's temporary working directory, which Ray may delete; "
            "pass --set storage.path=s3://... or an absolute shared folder",
            storage,
        )


# ---------------------------------------------------------------------- the sweep
@dataclass
class _SweepSetup:
    """What :func:`run_sweep` settles before Ray starts.

    Attributes:
        space: the validated space (on resume, with the overrides the sweep started with).
        base: the experiment config the space's fixed values make.
        tracking_uri: the MLflow store.
        experiment: the MLflow experiment.
        name: the sweep's name (its folder under the storage path).
        sweep_dir: the sweep's folder (Tune's experiment folder).
        storage: the storage path, as Ray gets it.
        reference: the reference the trials fine-tune from, where it exists already
            (``None``: none, or a ``train`` reference still to train).
    """

    space: SearchSpace
    base: ExperimentConfig
    tracking_uri: str
    experiment: str
    name: str
    sweep_dir: str
    storage: str
    reference: Reference | None = None


@dataclass
class _Sweep:
    """A started sweep: what the steps of :func:`run_sweep` after its setup need.

    Attributes:
        setup: where it runs and what it searches.
        plan: what every trial gets.
        recorder: its MLflow records (the parent run and the trials' runs).
        reference: the hypervolume's reference point, ``(quality, token_ratio)``.
        started: ``time.time()`` when :func:`run_sweep` began (for ``wall_time_s``).
        resumed: continued with ``resume``, or its MLflow parent run was re-opened.
        registered: the frontier's models in the Model Registry, once registered.
    """

    setup: _SweepSetup
    plan: SweepPlan
    recorder: SweepRecorder
    reference: tuple[float, float]
    started: float
    resumed: bool
    registered: RegisteredFrontier | None = None

    @property
    def space(self) -> SearchSpace:
        """The search space."""
        return self.setup.space

    @property
    def name(self) -> str:
        """The sweep's name."""
        return self.setup.name

    @property
    def metric(self) -> str:
        """The quality the task is judged by (the first objective)."""
        return self.setup.space.quality_metric


def run_sweep(
    space_path: str | Path,
    overrides: list[str] | None = None,
    *,
    name: str | None = None,
    resume: bool = False,
    ray_address: str | None = None,
) -> SweepResult:
    """Run (or with ``resume`` continue) the sweep of a search space; see the module docstring.

    Args:
        space_path: the YAML search space.
        overrides: ``key=value`` settings (config keys fix values; others set the
            space's own settings, e.g. ``search.num_samples=3``).
        name: the sweep's folder under the storage path (default: the space's stem
            and a timestamp; with ``resume``, the latest sweep of this space).
        resume: restore an interrupted sweep instead of starting one.
        ray_address: a Ray cluster to join (default: ``$RAY_ADDRESS``, else local Ray).

    Raises:
        SearchSpaceError: the space is invalid (before Ray starts).
        SweepError: nothing to resume, or a name that is taken.
    """
    started = time.time()
    setup = _settle_sweep(space_path, overrides, name=name, resume=resume, ray_address=ray_address)
    sweep = _start_sweep(setup, ray_address=ray_address, started=started, resume=resume)
    trainable = _trainable(sweep)
    with sweep.recorder.parent.closed_on_error():
        tuner = _tuner(sweep, trainable, resume=resume)
        with _experiment_state_period(sweep.space.search.state_period_s), ray_console():
            grid = tuner.fit()
    trials, raw = _collect(grid, sweep.space, setup.sweep_dir)
    unfinished = [t for t in trials if t.status == "unfinished"]
    planned = planned_trials(sweep.space)
    if unfinished or len(trials) < planned:
        sweep.recorder.close("interrupted")
        raise stopped_early(sweep.name, len(trials), len(unfinished), planned)
    with sweep.recorder.parent.closed_on_error():
        return _finish(sweep, trials, raw)


def _settle_sweep(
    space_path: str | Path, overrides: list[str] | None, *, name: str | None, resume: bool, ray_address: str | None
) -> _SweepSetup:
    """Load the space, run the preflight checks, find the sweep's folder and check its
    plan: all before Ray starts, so a bad space or a taken name costs seconds."""
    space = load_space(space_path, overrides)  # a bad space stops here, before Ray
    base, tracking_uri, experiment = _build_tracking(space)
    from ..cluster.preflight import preflight  # capacity, Ray, MLflow, storage, data: seconds, before Ray starts

    preflight(base, ray_address=ray_address, tracking_uri=tracking_uri, trial_resources=space.search.trial_resources)
    name, sweep_dir = _sweep_location(space, base, name, resume)
    checked = _check_plan(space, sweep_dir, overrides, resume)
    if checked is not space:  # resumed with the overrides the sweep started with
        space = checked
        base, tracking_uri, experiment = _build_tracking(space)
    storage = base.storage.resolved_path()
    _warn_if_temporary(storage)
    reference = locate_reference(space, base, tracking_uri)
    if reference is not None:
        check_reference(space, base, reference)  # the same ViT, before any trial starts
    return _SweepSetup(
        space=space,
        base=base,
        tracking_uri=tracking_uri,
        experiment=experiment,
        name=name,
        sweep_dir=sweep_dir,
        storage=storage,
        reference=reference,
    )


def _start_sweep(setup: _SweepSetup, *, ray_address: str | None, started: float, resume: bool) -> _Sweep:
    """Start (or join) Ray and open the sweep's MLflow parent run (re-opened on resume);
    runs that a driver which died left RUNNING end KILLED."""
    from ..tracking.runs import close_stale_runs
    from ..train.ray_trainer import init_ray

    space = setup.space
    init_ray(ray_address, worker_logs=ray_output_shown())
    if setup.reference is None and space.reference.train is not None:
        setup.reference = train_reference(space, setup.base, setup.tracking_uri)
        check_reference(space, setup.base, setup.reference)
    if setup.reference is not None:
        log.info(convergence_line(space, setup.reference))
    plan = SweepPlan(
        space=space,
        train_storage=join_uri(setup.sweep_dir, "train"),
        name=setup.name,
        reference=setup.reference.checkpoint if setup.reference is not None else None,
    )
    reference = (space.pareto.quality, space.pareto.token_ratio)
    recorder, reopened = SweepRecorder.open(
        setup.tracking_uri,
        setup.experiment,
        setup.sweep_dir,
        setup.name,
        space.quality_metric,
        # a handful of readable params; the whole space is the search_space.yaml artifact
        params=sweep_params(space),
        tags={
            "splitvit.space": space.source,
            "splitvit.sweep_dir": setup.sweep_dir,
            REFERENCE_TAG: json.dumps(list(reference)),
            **reference_tags(setup.reference, space),
        },
    )
    close_stale_runs(recorder.parent)  # left RUNNING by a dead driver: KILLED (a resumed trial re-opens its own)
    recorder.log_text(search_space_yaml(space), SPACE_ARTIFACT)
    # the base point's config with each key's layer (recipe, base file, the space's fixed values)
    recorder.parent.log_dict(config_layers(setup.base), "config_layers.json")
    log.info(
        "sweep %s: %s, %d trials%s (%d at a time), MLflow run %s in %s",
        setup.name,
        setup.sweep_dir,
        space.search.num_samples,
        f" and {len(fine_tuned_baselines(space))} fine-tuned baselines" if fine_tuned_baselines(space) else "",
        space.search.max_concurrent,
        recorder.parent_run_id,
        redact_uri(setup.tracking_uri),
    )
    return _Sweep(
        setup=setup, plan=plan, recorder=recorder, reference=reference, started=started, resumed=resume or reopened
    )


def _trainable(sweep: _Sweep) -> Any:
    """:func:`~splitvit.tune.trial.sweep_trial` with the plan and each trial's resources."""
    from ray import tune

    trainable = tune.with_parameters(sweep_trial, plan=sweep.plan)
    return tune.with_resources(trainable, dict(sweep.space.search.trial_resources))


def _tuner(sweep: _Sweep, trainable: Any, *, resume: bool) -> Any:
    """The sweep's ``Tuner``: restored from its folder on resume (finished trials kept,
    unfinished ones restarted, failed ones left failed), else a new one."""
    from ray import tune

    space, setup = sweep.space, sweep.setup
    if resume:
        log.info("resuming sweep %s from %s", setup.name, setup.sweep_dir)
        return tune.Tuner.restore(
            setup.sweep_dir, trainable=trainable, resume_unfinished=True, resume_errored=False, restart_errored=False
        )
    baselines = fine_tuned_baselines(space)
    search = _searcher(space)
    if baselines:
        from .baseline_search import BaselinesFirst  # imports Ray

        search = BaselinesFirst(search, baselines)
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=search,
            num_samples=planned_trials(space),
            max_concurrent_trials=space.search.max_concurrent,
            trial_dirname_creator=trial_dirname,
            # a trial's driver function only waits on its TorchTrainer: keep its
            # process (torch imported) for the next trial instead of starting one
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=setup.name,
            storage_path=setup.storage,
            callbacks=[_callback_class()(sweep.recorder, sweep.plan)],
            # a failed trial stays failed: Ray Train already retried its workers
            failure_config=tune.FailureConfig(max_failures=0),
            # Ray's per-trial boxes and status tables off (the callback prints a line per
            # trial event instead); back with -v
            verbose=tune_verbosity(),
        ),
    )


def fine_tuned_baselines(space: SearchSpace) -> list[str]:
    """The baseline trials a sweep runs besides its search: with a reference, each
    baseline policy fine-tunes from it like the searched trials; without one, none (the
    baselines are evaluations of the best point's backbone)."""
    return list(BASELINE_POLICIES) if space.reference.enabled and space.baselines.enabled else []


def planned_trials(space: SearchSpace) -> int:
    """The Tune trials a sweep runs: the searched ones and the fine-tuned baselines."""
    return space.search.num_samples + len(fine_tuned_baselines(space))


def reference_tags(reference: Reference | None, space: SearchSpace) -> dict[str, str]:
    """The sweep parent's tags on its reference: the checkpoint, where it came from, its
    MLflow run (the UI links it) and the convergence verdict."""
    if reference is None:
        return {}
    tags = {
        "splitvit.reference_checkpoint": reference.checkpoint,
        "splitvit.reference_source": reference.source,
        "splitvit.reference_convergence": convergence_line(space, reference),
    }
    if reference.run_id:
        tags["splitvit.reference_run"] = reference.run_id
    return tags


def stopped_early(name: str, started: int, unfinished: int, planned: int) -> Exception:
    """What a sweep that ended before its last trial raises. Trials left unfinished
    mean Ray Tune stopped on a signal (its own Ctrl-C handler returns from ``fit``):
    :class:`~splitvit.errors.Interrupted`, so the CLI exits 130 (143 for SIGTERM);
    otherwise a :class:`SweepError`. Both say how to continue."""
    from ..errors import Interrupted, as_interrupted

    what = f"sweep {name} stopped with {started} of {planned} trials started and {unfinished} unfinished"
    if unfinished:
        return Interrupted(
            as_interrupted(KeyboardInterrupt()).signum,
            f"{what}; its finished trials are kept: continue it with --resume --name {name}",
        )
    return SweepError(f"{what}; continue it with --resume --name {name}")


def _collect(grid, space: SearchSpace, sweep_dir: str) -> tuple[list[TrialSummary], dict[str, dict[str, Any]]]:
    """Trial outcomes from Tune's ResultGrid; ``raw`` maps trial id -> last result."""
    metric = space.quality_metric
    trials, raw = [], {}
    for i in range(len(grid)):
        result = grid[i]
        trial_id = Path(str(result.path)).name
        metrics = dict(result.metrics or {})
        sampled = _sampled_config(result)
        params = space.decode({k: v for k, v in sampled.items() if k in space.parameters})
        baseline = str(sampled.get(BASELINE_KEY) or "")
        if result.error is not None:
            text = str(result.error)
            status = "diverged" if ("diverged:" in text or isinstance(result.error, TrialDiverged)) else "failed"
            trials.append(TrialSummary(trial_id, status, params, error=text[-2000:], baseline=baseline))
        elif metrics.get(FINAL_KEY):
            trials.append(
                TrialSummary(trial_id, "completed", params, checkpoint=metrics.get("checkpoint"), baseline=baseline)
            )
        elif metric in metrics and metrics.get("checkpoint_path"):
            trials.append(
                TrialSummary(trial_id, "stopped", params, checkpoint=_full_uri(metrics["checkpoint_path"], sweep_dir))
            )
        else:
            trials.append(TrialSummary(trial_id, "unfinished", params, baseline=baseline))
        raw[trial_id] = metrics
    return sorted(trials, key=lambda t: t.trial_id), raw


def _sampled_config(result) -> dict[str, Any]:
    """A trial's sampled values: Tune's Result has them only with a reported result,
    so a trial that failed before reporting is read from its ``params.json``."""
    if result.config:
        return dict(result.config)
    try:
        with result.filesystem.open_input_stream(f"{result.path}/params.json") as stream:
            return json.loads(stream.readall())
    except (OSError, ValueError):
        return {}


def _full_uri(path: str, sweep_dir: str) -> str:
    if is_s3(sweep_dir) and "://" not in path:
        return f"s3://{path.lstrip('/')}"
    return path


def _finish(sweep: _Sweep, trials: list[TrialSummary], raw: dict[str, dict[str, Any]]) -> SweepResult:
    """Stage-two points, frontier, hypervolume, baselines, plot and MLflow records."""
    space, recorder = sweep.space, sweep.recorder
    points, tuned_baselines = _record_trials(sweep, trials, raw)
    superseded = recorder.close_orphans({t.trial_id for t in trials})
    if superseded:
        log.info("closed %d run(s) of trials lost with a stopped driver: %s", len(superseded), ", ".join(superseded))
    hv = annotate(points, sweep.reference)
    front = frontier(points)
    best = best_point(points)
    local_dir = Path(sweep.setup.base.local_runs_dir()) / sweep.name
    local_dir.mkdir(parents=True, exist_ok=True)
    log.info(
        "frontier: %d of %d points, hypervolume %.4f (reference %s %.2f, token ratio %.2f)",
        len(front),
        len(points),
        hv,
        sweep.metric,
        sweep.reference[0],
        sweep.reference[1],
    )
    baselines: list[Baseline] = tuned_baselines
    if best is not None and space.baselines.enabled and not fine_tuned_baselines(space):
        baselines = _run_baselines(space, sweep.plan, best, front)
    if space.evaluation.split is not None and front:
        _evaluate_held_out(sweep, front, baselines, {t.trial_id: t.checkpoint for t in trials if t.checkpoint})
    speed = _time_frontier(space, sweep.plan, front, best) if front and space.speed.enabled else None
    result = _sweep_result(sweep, trials, points, baselines, hv)
    speed_metrics = _log_sweep_artifacts(sweep, result, front=front, best=best, speed=speed, local_dir=local_dir)
    _close_sweep_run(sweep, result, front=front, best=best, speed_metrics=speed_metrics, local_dir=local_dir)
    return result


def _record_trials(
    sweep: _Sweep, trials: list[TrialSummary], raw: dict[str, dict[str, Any]]
) -> tuple[list[Point], list[Baseline]]:
    """Make each trial's MLflow run whole (completed with its stage-two points, stopped
    early, or failed) and set its ``run_id``; returns the points of the completed and
    stopped trials, and the fine-tuned baselines' figures."""
    points: list[Point] = []
    baselines: list[Baseline] = []
    for trial in trials:
        sampled = {BASELINE_KEY: trial.baseline} if trial.baseline else trial.params
        config_params = _config_params(sweep.plan, sampled, trial.trial_id)
        if trial.status == "completed" and trial.baseline:
            baselines += _baseline_trial_rows(sweep, trial, raw[trial.trial_id], config_params)
        elif trial.status == "completed":
            points += _completed_trial_points(sweep, trial, raw[trial.trial_id], config_params)
        elif trial.status == "stopped":
            points.append(_stopped_trial_point(sweep, trial, raw[trial.trial_id], config_params))
        else:
            _record_failed_trial(sweep, trial, config_params)
    return points, baselines


def _baseline_trial_rows(
    sweep: _Sweep, trial: TrialSummary, final: dict[str, Any], config_params: dict[str, Any]
) -> list[Baseline]:
    """A fine-tuned baseline's MLflow run (tagged ``splitvit.baseline``) and its figures:
    full resolution's last validation, or entropy's and random's at each ratio."""
    metric = sweep.metric
    record = {**final, "threshold_points": "[]"}  # its ratio points are the parent's baselines, not point runs
    run_id, _ = sweep.recorder.trial_completed(
        trial.trial_id,
        sweep.plan.run_uri(trial.trial_id),
        {BASELINE_KEY: trial.baseline},
        config_params,
        record,
        _trial_data(sweep.plan, {BASELINE_KEY: trial.baseline}, trial.trial_id),
    )
    trial.run_id = run_id
    sweep.recorder.tag_run(run_id, {"splitvit.baseline": trial.baseline})
    if trial.baseline == "full":
        rows = [{metric: final[metric], **{k: final[k] for k in ("tokens_per_image", "token_ratio", "thresholds")}}]
        labels = ["full resolution (fine-tuned)"]
    else:
        rows = threshold_points(final)
        labels = [f"{trial.baseline} @ {row.get('target_ratio', row['token_ratio']):.2f} (fine-tuned)" for row in rows]
    return [
        Baseline(
            baseline=trial.baseline,
            label=label,
            quality=float(row[metric]),
            tokens_per_image=float(row["tokens_per_image"]),
            token_ratio=float(row["token_ratio"]),
            thresholds=list(row.get("thresholds") or []),
            trial_id=trial.trial_id,
            images_per_s=row.get("images_per_s"),
            target_ratio=row.get("target_ratio"),
        )
        for row, label in zip(rows, labels)
    ]


def _evaluate_held_out(
    sweep: _Sweep, front: list[Point], baselines: list[Baseline], checkpoints: dict[str, str]
) -> None:
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
                f"test_{metric}": float(row["quality"]),
                "test_tokens_per_image": float(row["tokens_per_image"]),
                "test_token_ratio": float(row["token_ratio"]),
            }
            if isinstance(item, Point):
                item.extras.update(figures)
                if item.run_id:
                    sweep.recorder.log_run_metrics(item.run_id, figures)
            else:
                item.held_out = figures


def _completed_trial_points(
    sweep: _Sweep, trial: TrialSummary, final: dict[str, Any], config_params: dict[str, Any]
) -> list[Point]:
    """A finished trial's point and its stage-two threshold points, each with its MLflow run."""
    metric = sweep.metric
    run_id, point_ids = sweep.recorder.trial_completed(
        trial.trial_id,
        sweep.plan.run_uri(trial.trial_id),
        trial.params,
        config_params,
        final,
        _trial_data(sweep.plan, trial.params, trial.trial_id),
    )
    trial.run_id = run_id
    points = [
        Point(
            final[metric],
            final["tokens_per_image"],
            final["token_ratio"],
            "trial",
            trial.trial_id,
            list(final["thresholds"]),
            trial.params,
            final["checkpoint"],
            run_id,
            extras={"images_per_s": final.get("images_per_s", 0.0), **_companions(sweep, final)},
        )
    ]
    for row, point_id in zip(threshold_points(final), point_ids):
        points.append(
            Point(
                row[metric],
                row["tokens_per_image"],
                row["token_ratio"],
                "threshold",
                trial.trial_id,
                list(row["thresholds"]),
                trial.params,
                final["checkpoint"],
                point_id,
                extras={
                    "images_per_s": row.get("images_per_s", 0.0),
                    **_companions(sweep, row),
                    # a point calibrated to a ratio (stage_two.ratios) says which
                    **({"target_ratio": row["target_ratio"]} if "target_ratio" in row else {}),
                },
            )
        )
    return points


def _companions(sweep: _Sweep, figures: dict[str, Any]) -> dict[str, float]:
    """The companion qualities (a detector's ``mask_ap``) among a point's ``figures``."""
    return {c: float(figures[c]) for c in sweep.space.companion_metrics if c in figures}


def _stopped_trial_point(
    sweep: _Sweep, trial: TrialSummary, last: dict[str, Any], config_params: dict[str, Any]
) -> Point:
    """An early-stopped trial's point: its last reported epoch, with the thresholds of
    its checkpoint (no stage two), recorded as a completed run."""
    metric, plan = sweep.metric, sweep.plan
    thresholds = trained_thresholds(plan.trial_config(trial.params, trial.trial_id), trial.checkpoint)
    final = {
        metric: last[metric],
        "tokens_per_image": last["tokens_per_image"],
        "token_ratio": last.get("token_ratio"),
        "epochs": int(last.get("epoch", 0)) + 1,
        "thresholds": thresholds,
        "checkpoint": trial.checkpoint,
    }
    run_id, _ = sweep.recorder.trial_completed(
        trial.trial_id,
        plan.run_uri(trial.trial_id),
        trial.params,
        config_params,
        final,
        _trial_data(plan, trial.params, trial.trial_id),
    )
    trial.run_id = run_id
    return Point(
        last[metric],
        last["tokens_per_image"],
        last.get("token_ratio", float("nan")),
        "trial",
        trial.trial_id,
        thresholds,
        trial.params,
        trial.checkpoint,
        run_id,
        extras={"stopped_early": 1.0},
    )


def _record_failed_trial(sweep: _Sweep, trial: TrialSummary, config_params: dict[str, Any]) -> None:
    """A failed, diverged or unfinished trial's run, marked so (a run already marked
    failed or diverged is kept as it is)."""
    run_uri = sweep.plan.run_uri(trial.trial_id)
    existing = sweep.recorder.find_run(run_uri)
    if existing is None or existing.data.tags.get("splitvit.status") not in ("failed", "diverged"):
        trial.run_id = sweep.recorder.trial_failed(
            trial.trial_id, run_uri, trial.params, config_params, trial.error or trial.status
        )
    else:
        trial.run_id = existing.info.run_id


def _sweep_result(
    sweep: _Sweep, trials: list[TrialSummary], points: list[Point], baselines: list[Baseline], hypervolume: float
) -> SweepResult:
    """The sweep's result, before its artifacts (plot, tables, split map) are written."""
    setup, recorder = sweep.setup, sweep.recorder
    return SweepResult(
        name=setup.name,
        space=setup.space.source,
        sweep_dir=setup.sweep_dir,
        metric=sweep.metric,
        points=points,
        baselines=baselines,
        hypervolume=hypervolume,
        reference_point={"quality": sweep.reference[0], "token_ratio": sweep.reference[1]},
        trials=trials,
        tracking_uri=recorder.tracking_uri,
        experiment=recorder.experiment,
        experiment_id=recorder.experiment_id,
        parent_run_id=recorder.parent_run_id,
        resumed=sweep.resumed,
        status="completed" if points else "failed",
        reference=sweep.setup.reference,
        held_out_split=sweep.space.evaluation.split,
        # a point's whole configuration is this plus its searched ``params``
        extras={"base_config": setup.base.flat(redact=True)},
    )


def _log_sweep_artifacts(
    sweep: _Sweep,
    result: SweepResult,
    *,
    front: list[Point],
    best: Point | None,
    speed: dict[str, Any] | None,
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
    result.extras["chart"] = _interactive_chart(sweep, result, local_dir)
    speed_metrics: dict[str, float] = {}
    if speed is not None:
        result.extras["frontier_speed"] = speed
        speed_metrics = _record_speed(result, recorder, speed, best, local_dir)
    result.frontier_csv = _tables(result, recorder, local_dir)
    return speed_metrics


def _close_sweep_run(
    sweep: _Sweep,
    result: SweepResult,
    *,
    front: list[Point],
    best: Point | None,
    speed_metrics: dict[str, float],
    local_dir: Path,
) -> None:
    """The summary metrics and ``sweep.json`` on the parent run (and in ``local_dir``);
    then end the parent run: completed with the best point's run, or failed when no
    trial completed."""
    recorder, trials = sweep.recorder, result.trials
    completed = sum(t.status in ("completed", "stopped") for t in trials)
    failed = sum(t.status in ("failed", "diverged") for t in trials)
    result.wall_time_s = time.time() - sweep.started
    recorder.log_parent_metrics(
        {
            "hypervolume": result.hypervolume,
            "frontier_size": len(front),
            "points": len(result.points),
            "trials_completed": completed,
            "trials_failed": failed,
            "wall_time_s": result.wall_time_s,
            **speed_metrics,
        }
    )
    try:
        recorder.describe(
            sweep_note(
                name=result.name,
                metric=result.metric,
                hypervolume=result.hypervolume,
                reference=sweep.reference,
                points=result.points,
                best=best,
                baselines=result.baselines,
                trial_status=dict(Counter(t.status for t in trials)),
                experiment_id=recorder.experiment_id,
                parent_run_id=recorder.parent_run_id,
                plot=PLOT_ARTIFACT if result.plot else None,
                best_uris=sweep.registered.by_run.get(best.run_id or "") if sweep.registered and best else None,
                reference_note=_reference_note(sweep),
            )
        )
        recorder.describe_experiment(
            result.name, result.hypervolume, len(front), len(result.points), best, sweep.registered
        )
    except Exception as exc:  # noqa: BLE001 - a description that will not save must not lose the sweep
        log.warning("could not write the sweep's description: %s", exc)
    payload = result.to_dict()
    (local_dir / SWEEP_RESULT_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    recorder.parent.log_dict(json.loads(json.dumps(payload, default=str)), SWEEP_RESULT_FILE)
    if result.points:
        recorder.close("completed", tags={"splitvit.best_run": (best.run_id or "") if best else ""})
    else:
        recorder.close("failed", tags={"splitvit.error": "no trial completed"})


def _reference_note(sweep: _Sweep) -> str | None:
    """The parent description's line on the reference: where it came from, a link to its
    MLflow run (in whichever experiment holds it), its convergence."""
    from ..tracking.runs import mlflow_client
    from .mlflow_records import run_link

    reference = sweep.setup.reference
    if reference is None:
        return None
    where = f"`{reference.source}`"
    if reference.run_id:
        try:
            experiment_id = mlflow_client(sweep.recorder.tracking_uri).get_run(reference.run_id).info.experiment_id
            where = f"[{reference.source}]({run_link(experiment_id, reference.run_id)})"
        except Exception as exc:  # noqa: BLE001 - a run the store lost: name it without a link
            log.warning("the reference's MLflow run %s: %s", reference.run_id, exc)
    return (
        f"**Every trial fine-tuned from the reference** {where} (`{reference.checkpoint}`): "
        f"{convergence_verdict(sweep.space, reference)}."
    )


def _run_baselines(space: SearchSpace, plan: SweepPlan, best: Point, front: list[Point]) -> list[Baseline]:
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
    rows = run_evaluation(
        plan.trial_config({}, best.trial_id),
        evaluate_baselines,
        best.checkpoint,
        entropy_thresholds=list(space.baselines.entropy_thresholds),
        random_ratios=ratios,
        samples=space.baselines.samples,
        seed=space.search.seed,
    )
    return [Baseline.from_dict({**row, "trial_id": best.trial_id}) for row in rows]


def _time_frontier(
    space: SearchSpace, plan: SweepPlan, front: list[Point], best: Point | None
) -> dict[str, Any] | None:
    """Time the frontier points (at most ``speed.max_points``, spread by tokens) against
    the full-resolution model in one interleaved run, on the device the sweep
    evaluated on (:func:`~splitvit.tune.speed.time_operating_points`). Each timed
    point gets ``speedup_vs_full``, ``timed_images_per_s`` and ``timed_token_ratio``
    in its ``extras``. The full-resolution model is the reference backbone (the best
    point's checkpoint, on which the baselines ran) with the ``full`` policy.
    Returns the timing record's JSON (:meth:`~splitvit.tune.speed.SpeedRecord.to_dict`, each
    point labelled with its ``run_id``, ``trial_id`` and ``kind``), or ``None`` when nothing
    could be timed (logged)."""
    from .speed import spread, time_operating_points

    s = space.speed
    chosen = spread([p for p in front if p.checkpoint], s.max_points)
    if not chosen:
        return None
    reference = best if best is not None and best.checkpoint else chosen[0]
    try:
        record = run_evaluation(
            plan.trial_config({}, reference.trial_id),
            time_operating_points,
            [{"checkpoint": p.checkpoint, "thresholds": p.thresholds, "label": p.run_id or p.trial_id} for p in chosen],
            full_checkpoint=reference.checkpoint,
            batch_size=s.batch_size,
            rounds=s.rounds,
            warmup=s.warmup,
        )
    except Exception as exc:  # noqa: BLE001 - a timing that fails must not lose the frontier
        log.warning("could not time the frontier: %s", exc)
        return None
    data = record.to_dict()  # the sweep's JSON (frontier_speed), each timed point labelled with its trial
    for point, timed, row in zip(chosen, record.points, data["points"]):
        point.extras.update(
            {
                "speedup_vs_full": timed.speedup_vs_full,
                "timed_images_per_s": timed.images_per_s,
                "timed_token_ratio": timed.token_ratio,
            }
        )
        row["run_id"], row["trial_id"], row["kind"] = point.run_id, point.trial_id, point.kind
    log.info(
        "frontier timed on %s (batch %d, %d rounds): speed-ups vs full resolution %s",
        record.device,
        record.batch_size,
        record.rounds,
        ", ".join(f"{r.speedup_vs_full:.2f}x@{r.token_ratio:.2f}" for r in record.points),
    )
    return data


def _record_speed(
    result: SweepResult, recorder: SweepRecorder, speed: dict[str, Any], best: Point | None, local_dir: Path
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
        title=f"sweep {result.name}: {result.metric} vs measured speed-up ({speed['device']}, "
        f"batch {speed['batch_size']})",
    )
    result.extras["speed_plot"] = _save_figure(fig, local_dir / "pareto_speed.png", recorder)
    recorder.parent.log_dict(json.loads(json.dumps(speed, default=str)), "frontier_speed.json")
    recorder.parent.set_tags(
        {
            SPEED_DEVICE_TAG: speed["device"],
            SPEED_TIMING_TAG: f"batch {speed['batch_size']}, {speed['rounds']} interleaved rounds "
            f"after {speed['warmup']} warm-up, {speed['precision']}",
        }
    )
    metrics: dict[str, float] = {}
    if timed:
        metrics["speedup_max"] = max(p.extras["speedup_vs_full"] for p in timed)
        metrics["speed_full_images_per_s"] = float(speed["full"][0]["images_per_s"])
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
    payloads: dict[str, dict[str, Any]] = {}
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


def _register_frontier(sweep: _Sweep, result: SweepResult, front: list[Point], best: Point) -> None:
    """The frontier's models in the Model Registry (one name per search space, aliases
    per budget: the sweep's own and the newest sweep's bare ones); the name and the
    aliases' ``models:/`` URIs in ``result.extras``."""
    try:
        registered = sweep.recorder.register_frontier(Path(sweep.space.source).stem, result.name, front, best)
    except Exception as exc:  # noqa: BLE001 - a registry that refuses must not lose the frontier
        log.warning("could not register the frontier's models: %s", exc)
        return
    if registered is not None:
        own = f"{_alias_prefix(result.name)}-"
        result.extras["registered_models"] = {
            "name": registered.name,
            # the newest sweep's (best, tokens-42pct) and this sweep's own, which never move
            "aliases": {a: u for a, u in registered.aliases.items() if not a.startswith(own)},
            "sweep_aliases": {a: u for a, u in registered.aliases.items() if a.startswith(own)},
        }
        sweep.registered = registered
        log.info(
            "frontier models registered as %s (aliases: %s; this sweep's own: %s*)",
            registered.name,
            ", ".join(result.extras["registered_models"]["aliases"]),
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


def _interactive_chart(sweep: _Sweep, result: SweepResult, local_dir: Path) -> str:
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
    params: dict[str, Any]
    timed: bool = False
    speedup_vs_full: float | None = None
    timed_images_per_s: float | None = None
    timed_token_ratio: float | None = None
    held_out: dict[str, float] = field(default_factory=dict)

    def to_dict(self, metric: str) -> dict[str, Any]:
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


def _csv(rows: list[dict[str, Any]]) -> str:
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


# ---------------------------------------------------------------------- reading back
def frontier_from_mlflow(
    experiment: str, tracking_uri: str | None = None, sweep_run_id: str | None = None, *, all_sweeps: bool = False
) -> dict[str, Any]:
    """The frontier of an MLflow experiment's latest sweep (or of one sweep, or of all
    of them), recomputed from the recorded trial and threshold-point runs (failed runs
    excluded).

    Args:
        experiment: the MLflow experiment.
        tracking_uri: the store (default: the default config's, ``$MLFLOW_TRACKING_URI``
            or the local SQLite store).
        sweep_run_id: one sweep, by its parent run id.
        all_sweeps: merge every sweep of the experiment (the latest one's reference
            point and metric apply); default: the latest started sweep only.

    Returns ``{"experiment", "experiment_id", "tracking_uri", "sweeps", "sweep_names",
    "metric", "hypervolume", "reference_point", "points", "frontier", "baselines",
    "speed"}`` (points as dicts; a timed point's ``extras`` hold ``speedup_vs_full``;
    ``baselines`` are the sweep's ``baselines.json`` when one sweep is read, else
    empty: baselines of different backbones do not share axes; ``speed`` lists, per
    sweep that timed its frontier, the device and timing settings).

    Raises:
        SweepError: the store is missing (a local store is never created), or the
            experiment or the sweep is not in it.
    """
    from mlflow.exceptions import MlflowException

    from .mlflow_records import points_from_mlflow

    uri = tracking_uri or ExperimentConfig().tracking_uri()
    try:
        data = points_from_mlflow(uri, experiment, sweep_run_id, all_sweeps=all_sweeps)
    except ValueError as exc:  # missing store, experiment or sweep: one line for the command line
        raise SweepNotFound(str(exc)) from None
    except (MlflowException, OSError) as exc:  # a server that does not answer (requests' errors are OSErrors)
        raise SweepError(f"could not read MLflow store {redact_uri(uri)}: {type(exc).__name__}: {exc}") from None
    points: list[Point] = data["points"]
    hv = annotate(points, data["reference"])
    metric = data["metric"]
    baselines = _read_baselines(uri, data["sweeps"][0]) if len(data["sweeps"]) == 1 else []
    return {
        "experiment": experiment,
        "experiment_id": data["experiment_id"],
        "tracking_uri": redact_uri(uri),
        "sweeps": data["sweeps"],
        "sweep_names": data["sweep_names"],
        "metric": metric,
        "hypervolume": hv,
        "reference_point": {"quality": data["reference"][0], "token_ratio": data["reference"][1]},
        "points": [p.to_dict(metric) for p in points],
        "frontier": [p.to_dict(metric) for p in frontier(points)],
        "baselines": [b.to_dict(metric) for b in baselines],
        "speed": data["speed"],
    }


def _read_baselines(tracking_uri: str, sweep_run_id: str) -> list[Baseline]:
    """A sweep's ``baselines.json`` (empty when it has none: baselines off, or a sweep
    that did not finish, or when it cannot be read)."""
    import tempfile

    from ..tracking.runs import mlflow_client

    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = mlflow_client(tracking_uri).download_artifacts(sweep_run_id, "baselines.json", tmp)
            rows = json.loads(Path(path).read_text())
        return [Baseline.from_dict(row) for row in rows] if isinstance(rows, list) else []
    except Exception as exc:  # noqa: BLE001 - the frontier stands without its baselines
        log.debug("no baselines for sweep %s: %s", sweep_run_id, exc)
        return []
