"""What the stages of a sweep hand each other: its setup (settled before Ray starts),
the started sweep, each trial's outcome, the result :func:`~splitvit.tune.sweep.run_sweep`
returns, the sweep's errors, and the trials it plans (searched ones and fine-tuned
baselines).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ..config import ExperimentConfig, redact_uri
from ..jsontypes import JsonObject
from ..tracking.runs import ui_url
from .mlflow_records import RegisteredFrontier, SweepRecorder
from .pareto import Baseline, Point, frontier
from .reference import Reference
from .space import BASELINE_POLICIES, ConfigValue, SearchSpace
from .trial import SweepPlan

if TYPE_CHECKING:
    from .baseline_store import StoredBaseline
    from .frontier_eval import FrontierSpeed


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
        reused_from: a baseline taken from an earlier sweep: that sweep and trial, in words
            (its MLflow run in this sweep is a new one, keyed as this sweep's trials are).
    """

    trial_id: str
    status: str
    params: dict[str, ConfigValue]
    error: str = ""
    run_id: str | None = None
    checkpoint: str | None = None
    baseline: str = ""
    reused_from: str = ""


@dataclass(frozen=True)
class RegisteredModels:
    """The frontier's models in the Model Registry: the name, the newest sweep's
    aliases (``best``, ``tokens-42pct``) and this sweep's own, each a ``models:/`` URI."""

    name: str
    aliases: dict[str, str]
    sweep_aliases: dict[str, str]

    def to_dict(self) -> JsonObject:
        """Its part of the sweep's JSON (``registered_models``)."""
        return {"name": self.name, "aliases": dict(self.aliases), "sweep_aliases": dict(self.sweep_aliases)}


@dataclass
class SweepResult:
    """What :func:`~splitvit.tune.sweep.run_sweep` returns (and ``splitvit sweep --json`` writes)."""

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
    validation_images: int | None = None  # what every point was measured on (None: not known)
    # what the closing and the artifacts add (None: not made, left out of the JSON)
    base_config: dict[str, ConfigValue] | None = None  # the flat config every point's params apply to
    registered_models: RegisteredModels | None = None
    chart: str | None = None  # the interactive chart's file
    frontier_speed: FrontierSpeed | None = None
    speed_plot: str | None = None  # the quality-against-speed-up figure's file

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

    def to_dict(self) -> JsonObject:
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
            **self._added(),
        }

    def _added(self) -> JsonObject:
        """The JSON of what the closing and the artifacts added, those made, in the order they are made."""
        added = {
            "validation_images": self.validation_images,
            "base_config": self.base_config,
            "registered_models": None if self.registered_models is None else self.registered_models.to_dict(),
            "chart": self.chart,
            "frontier_speed": None if self.frontier_speed is None else self.frontier_speed.to_dict(),
            "speed_plot": self.speed_plot,
        }
        return {k: v for k, v in added.items() if v is not None}


class SweepError(RuntimeError):
    """A sweep could not run or finish (nothing to resume, no trial completed...)."""


class SweepNotFound(SweepError, ValueError):
    """Bad input: the MLflow store, experiment or sweep named is not there (exit 2)."""


@dataclass
class SweepSetup:
    """What :func:`~splitvit.tune.sweep.run_sweep` settles before Ray starts.

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
class Sweep:
    """A started sweep: what the steps of :func:`~splitvit.tune.sweep.run_sweep` after its setup need.

    Attributes:
        setup: where it runs and what it searches.
        plan: what every trial gets.
        recorder: its MLflow records (the parent run and the trials' runs).
        reference: the hypervolume's reference point, ``(quality, token_ratio)``.
        started: ``time.time()`` when :func:`~splitvit.tune.sweep.run_sweep` began (for ``wall_time_s``).
        resumed: continued with ``resume``, or its MLflow parent run was re-opened.
        registered: the frontier's models in the Model Registry, once registered.
        reused: the fine-tuned baselines taken from earlier sweeps, by policy.
    """

    setup: SweepSetup
    plan: SweepPlan
    recorder: SweepRecorder
    reference: tuple[float, float]
    started: float
    resumed: bool
    registered: RegisteredFrontier | None = None
    reused: dict[str, StoredBaseline] = field(default_factory=dict)  # baselines from earlier sweeps, by policy

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


def fine_tuned_baselines(space: SearchSpace) -> list[str]:
    """The baseline trials a sweep runs besides its search: with a reference, each
    baseline policy fine-tunes from it like the searched trials; without one, none (the
    baselines are evaluations of the best point's backbone)."""
    return list(BASELINE_POLICIES) if space.reference.enabled and space.baselines.enabled else []


def planned_trials(space: SearchSpace) -> int:
    """The trials a sweep has: the searched ones and the fine-tuned baselines (those
    reused from an earlier sweep included)."""
    return space.search.num_samples + len(fine_tuned_baselines(space))


def tune_trials(sweep: Sweep) -> int:
    """The trials Tune runs: the planned ones but the baselines reused from earlier sweeps."""
    return planned_trials(sweep.space) - len(sweep.reused)
