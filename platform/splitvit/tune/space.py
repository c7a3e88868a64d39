"""Search spaces: YAML files in ``search_spaces/``, data only, with a small schema.

A space names the experiment config it applies to (``base``, relative to the space
file) and lists parameters by their dotted config key. A parameter is either a
distribution with bounds, or a fixed value that passes through unchanged::

    base: ../jobs/configs/smoke.yaml
    parameters:
      train.budget.weight: {distribution: loguniform, low: 0.3, high: 3.0}
      train.budget.target_ratio: {distribution: uniform, low: 0.2, high: 0.6}
      model.thresholds[0]: {distribution: uniform, low: 0.3, high: 0.7}   # one level
      train.policy.warmup_epochs: {distribution: int, low: 1, high: 3}
      train.budget.penalty: {distribution: categorical, choices: [squared, hinge]}
      train.epochs: 3                                                    # fixed
    search:     {num_samples: 8, max_concurrent: 2, sampler: auto, seed: 0}
    stage_two:  {points: 4}            # threshold points per finished trial
    baselines:  {entropy_thresholds: [0.3, 0.5, 0.7], random_budgets: 3}
    pareto:     {reference_point: {quality: 0.0, token_ratio: 1.0}}
    speed:      {enabled: true, batch_size: 32, rounds: 5}   # frontier timed vs full resolution
    mlflow:     {experiment: my-sweep, log_models: 3, split_map_images: 8}

:func:`load_space` checks everything before any Ray work starts: the schema, each
distribution and its bounds, and every parameter against the experiment config's
own validation at its bounds (an unknown key, a wrong type, a value out of range).
Any problem raises :class:`SearchSpaceError` with one message naming the file and
the key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..config import (
    RECIPE_KEY,
    SECTIONS,
    BaseConfigError,
    ConfigError,
    ExperimentConfig,
    Layer,
    build_dataclass,
    companion_metrics,
    parse_override,
    quality_metric,
    resolve_base_config,
    resolve_config,
    set_dotted,
    split_key,
    upgrade_dotted,
    upgrade_flat,
)
from ..jsontypes import JsonObject

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

log = logging.getLogger(__name__)

#: One config value as a point of the space sets it (a searched parameter's sampled value,
#: a fixed value, an entry of a flat or nested config): what YAML holds, a number, text,
#: a flag or null, or a list, tuple or mapping of those. A point is a
#: ``dict[str, ConfigValue]`` keyed by dotted config key (a parameter's name).
ConfigValue = (
    bool | int | float | str | None | list["ConfigValue"] | tuple["ConfigValue", ...] | dict[str, "ConfigValue"]
)

DISTRIBUTIONS = ("uniform", "loguniform", "int", "categorical")
SAMPLERS = ("auto", "gp", "tpe", "nsga2", "random")
STAGE_TWO_SAMPLERS = ("tpe", "nsga2", "random", "qmc")
TOP_LEVEL = (
    "base",
    "description",
    "reference",
    "parameters",
    "search",
    "stage_two",
    "baselines",
    "evaluation",
    "pareto",
    "speed",
    "mlflow",
)
BASELINE_POLICIES = ("full", "entropy", "random")
#: Optuna's own rule (``AutoSampler``): NSGA-II only from this many trials on
NSGA2_MIN_TRIALS = 250
#: NSGA-II's population when the space names none (Optuna's default)
NSGA2_DEFAULT_POPULATION = 50
#: settings of the ASHA scheduler the sweep no longer has: a file naming one is told why
REMOVED_SEARCH_KEYS = ("grace_period", "reduction_factor")


class SearchSpaceError(ValueError):
    """An invalid search space. The message names the file and the offending key."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        self.source = source
        self.key = key
        self.reason = reason
        super().__init__(f"search space {source}: {key}: {reason}")

    def __reduce__(self):  # Ray pickles a worker's exception: rebuild from the arguments
        return (type(self), (self.source, self.key, self.reason), dict(self.__dict__))


# ---------------------------------------------------------------------- schema
@dataclass(frozen=True)
class Parameter:
    """One searched parameter.

    Attributes:
        name: the dotted config key, optionally indexed (``model.thresholds[0]``).
        distribution: ``uniform``, ``loguniform``, ``int`` or ``categorical``.
        low, high: inclusive bounds (numeric distributions).
        step: optional discretisation step (``uniform`` and ``int``).
        log: sample ``int`` on a log scale.
        choices: the values of a ``categorical`` parameter (any YAML values).
    """

    name: str
    distribution: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()

    @property
    def encoded(self) -> bool:
        """Categorical choices that Optuna cannot store as they are (lists, mappings)
        travel as their JSON text."""
        return self.distribution == "categorical" and any(
            not isinstance(c, (type(None), bool, int, float, str)) for c in self.choices
        )

    def optuna_distribution(self) -> BaseDistribution:
        """This parameter as an ``optuna.distributions`` object."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.distribution == "uniform":
            return FloatDistribution(float(self.low), float(self.high), step=self.step)
        if self.distribution == "loguniform":
            return FloatDistribution(float(self.low), float(self.high), log=True)
        if self.distribution == "int":
            return IntDistribution(int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return CategoricalDistribution([json.dumps(c) for c in self.choices] if self.encoded else list(self.choices))

    def decode(self, value: Any) -> Any:
        """A sampled value as the config gets it."""
        if self.encoded and isinstance(value, str):
            return json.loads(value)
        if self.distribution == "int":
            return int(value)
        if self.distribution in ("uniform", "loguniform"):
            return float(value)
        return value

    def encode(self, value: Any) -> Any:
        """A config value as Optuna stores it (inverse of :meth:`decode`)."""
        return json.dumps(value) if self.encoded else value

    def contains(self, value: Any) -> bool:
        """True when ``value`` is one this parameter can take."""
        if self.distribution == "categorical":
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.distribution == "int" and int(value) != value:
            return False
        if self.step and self.distribution in ("uniform", "int"):
            steps = (value - self.low) / self.step
            if abs(steps - round(steps)) > 1e-8:  # off the grid: Optuna would not take it
                return False
        return self.low <= value <= self.high

    def describe(self) -> str:
        """``loguniform[0.001, 0.1]``, ``categorical[a, b]``..."""
        if self.distribution == "categorical":
            return f"categorical{list(self.choices)}"
        step = f" step {self.step}" if self.step else ""
        return f"{self.distribution}[{self.low}, {self.high}]{step}"


@dataclass(frozen=True)
class SearchSettings:
    """Stage one: the Tune search over training parameters.

    Attributes:
        num_samples: trials to run.
        max_concurrent: trials running at once (Tune's concurrency limit).
        sampler: Optuna sampler. ``auto`` (the default) follows Optuna's own
            ``AutoSampler`` rule (:func:`resolve_sampler`): ``nsga2`` from 250 trials
            on, else ``tpe`` when a parameter is categorical, else ``gp``. ``gp``:
            Gaussian-process Bayesian optimisation (log expected hypervolume
            improvement), the best use of a small budget over numbers; ``tpe``:
            multivariate TPE; ``nsga2``: NSGA-II, which needs generations to evolve;
            ``random``.
        population_size: NSGA-II population (default: Optuna's, 50). A population
            at or above ``num_samples`` never evolves (it is random search), so such
            a space is refused; so is a population with a sampler other than NSGA-II.
        seed: sampler seed.
        scheduler: ``null`` only: every trial runs its epochs. ``asha`` is refused:
            ASHA ranks one metric, and with the sweep's two objectives Optuna would
            record a stopped trial's truncated accuracy as a finished point, on the
            frontier. (Its settings ``grace_period`` and ``reduction_factor`` are
            gone too; a file naming them is told so.)
        trial_resources: Ray resources of each trial's driver function (the training
            workers ask for their own, from the config's ``scaling`` section). The
            function mostly waits, so a fraction of a CPU is enough; Tune cannot
            schedule an empty request.
        initial_points: parameter settings evaluated first (Optuna enqueues them),
            each giving every searched parameter a value. Unset (or ``null``): the
            config's own point first, the base config's values of the searched
            parameters (:func:`config_point`; a value outside its parameter's range
            is left to the sampler). ``[]``: no point first.
        state_period_s: how often (at most) Tune saves the sweep's state for
            ``--resume``; Tune's own default waits at least 10 s.
    """

    num_samples: int = 8
    max_concurrent: int = 2
    sampler: str = "auto"
    population_size: int | None = None
    seed: int = 0
    scheduler: str | None = None
    trial_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    # Any, not ConfigValue: build_dataclass reads these hints as the schema, and a point's
    # values are checked against the config itself (_check_initial_points), not here
    initial_points: tuple[JsonObject, ...] | None = None
    state_period_s: float = 1.0


@dataclass(frozen=True)
class StageTwoSettings:
    """Stage two: threshold points on each finished trial's checkpoint (evaluation only).

    Attributes:
        points: Optuna trials over the per-level thresholds per finished trial (0: off).
        low, high: bounds of every level's threshold.
        sampler: ``tpe``, ``nsga2``, ``random`` or ``qmc`` (even coverage for few points).
        samples: evaluation images (default: the experiment's validation split). When
            set, each trial's own point is measured again on them too, so the frontier
            is chosen among figures of one image count.
        ratios: token ratios each finished trial is also evaluated at, its thresholds
            calibrated to each on validation images (as the baselines and a study's
            methods are): every trial then has a point at each ratio a user asks about,
            which a few quasi-random thresholds need not give.
        calibration_samples: the first validation images those thresholds (and the
            fine-tuned baselines') are calibrated on (default: the data's evaluation
            batch). A study calibrates on 512: set the same to compare with its curves.
    """

    points: int = 4
    low: float = 0.0
    high: float = 1.0
    sampler: str = "tpe"
    samples: int | None = None
    ratios: tuple[float, ...] = ()
    calibration_samples: int | None = None


@dataclass(frozen=True)
class ReferenceSettings:
    """The converged full-resolution model every trial fine-tunes from (``reference:``).

    Exactly one of ``checkpoint``, ``study`` or ``train`` names it:

    Attributes:
        checkpoint: a splitvit checkpoint (a run's checkpoint folder or its ``model.pt``,
            local or ``s3://``), or an MLflow model (``models:/<name>@<alias>``,
            ``runs:/<run id>``).
        study: a finished study's reference (``splitvit study``) under the base config's
            storage path, by the study's name; ``seed`` picks the seed's reference.
        seed: the study seed whose reference is used.
        train: settings (dotted config keys) over the base config for a reference
            trained here, once: full resolution (``model.policy.kind: full``), no recipe.
            A later sweep whose reference settings are the same reuses it (it lives
            under ``<storage path>/references/``).
        converge_epochs, converge_points: the convergence check of a reference with a
            recorded curve (trained here, or a study's): converged when its validation
            quality gained less than ``converge_points`` points over its last
            ``converge_epochs`` epochs. The verdict is printed and recorded on the
            sweep's MLflow run.
    """

    checkpoint: str | None = None
    study: str | None = None
    seed: int = 0
    # Any, not ConfigValue: build_dataclass reads these hints as the schema; the settings
    # are checked against the config itself (_validate_reference_config)
    train: JsonObject | None = None
    converge_epochs: int = 3
    converge_points: float = 0.3

    @property
    def enabled(self) -> bool:
        """Whether the space names a reference at all (trials otherwise train from the base config's start)."""
        return self.checkpoint is not None or self.study is not None or self.train is not None


@dataclass(frozen=True)
class BaselineSettings:
    """The baselines: full resolution, entropy (APT-style) and random splitting.

    With a ``reference:`` each baseline is a trial of its own: fine-tuned from the
    reference like the searched trials (the base config's own settings, its policy
    changed), then evaluated at ``ratios`` (thresholds calibrated on validation
    images). Without one, the baselines are the best point's backbone evaluated under
    the other policies (no training).

    Attributes:
        enabled: evaluate baselines at all.
        target_ratio: with a reference: the token ratio entropy and random splitting
            fine-tune at (their thresholds calibrated to it during training).
        ratios: with a reference: the token ratios entropy and random are evaluated at.
        entropy_thresholds: without a reference: thresholds of the entropy policy, one
            curve point each.
        random_budgets: without a reference: random splitting at the token ratios of this
            many frontier points.
        samples: evaluation images (default: the experiment's validation split).
        reuse: with a reference: take a baseline an earlier sweep fine-tuned and
            evaluated the same way instead of training it again (:mod:`.baseline_store`);
            false trains every baseline anew.
    """

    enabled: bool = True
    target_ratio: float = 0.6
    ratios: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    entropy_thresholds: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
    random_budgets: int = 3
    samples: int | None = None
    reuse: bool = True


@dataclass(frozen=True)
class EvaluationSettings:
    """The frontier on held-out data: points are chosen on validation images; at the
    end the frontier points and the baselines are evaluated once on ``split``.

    Attributes:
        split: the held-out split (``test``); ``null``: no held-out evaluation.
        samples: its images (default: all of them).
    """

    split: str | None = "test"
    samples: int | None = None


@dataclass(frozen=True)
class ParetoSettings:
    """The hypervolume's reference point, in (quality, token ratio) space.

    Quality is accuracy (or mIoU), maximised; the token ratio is tokens per image over
    full-resolution tokens, minimised. The default ``(0, 1)`` is the worst possible
    point of both objectives, so the hypervolume is the area of the unit square
    (quality x token saving) that the frontier dominates: 0 for a useless frontier,
    1 for perfect quality at zero tokens.
    """

    quality: float = 0.0
    token_ratio: float = 1.0


@dataclass(frozen=True)
class SpeedSettings:
    """The frontier in measured speed: after the frontier is known, each of its points
    and the full-resolution model are timed side by side, interleaved, on the device
    the sweep evaluated on (:func:`splitvit.bench.speed.time_operating_points`).

    Attributes:
        enabled: time the frontier at all.
        batch_size: images in the one fixed batch every model runs on.
        rounds: interleaved rounds (every model once per round); figures are medians.
        warmup: untimed rounds first.
        max_points: time at most this many frontier points (both ends and evenly in
            between, by tokens); ``None``: every frontier point.
    """

    enabled: bool = True
    batch_size: int = 32
    rounds: int = 5
    warmup: int = 1
    max_points: int | None = 16


@dataclass(frozen=True)
class MlflowSettings:
    """What the sweep records in MLflow.

    Attributes:
        experiment: MLflow experiment (default: the base config's ``tracking.experiment``).
        log_models: frontier points whose models are logged (largest hypervolume
            contribution first); ``None`` logs every frontier point.
        split_map_images: validation images in the best point's split map (0: none).
    """

    experiment: str | None = None
    log_models: int | None = None
    split_map_images: int = 8


@dataclass
class SearchSpace:
    """A loaded, validated search space (see the module docstring)."""

    source: str
    base: str
    base_raw: dict[str, ConfigValue]
    parameters: dict[str, Parameter]
    fixed: dict[str, ConfigValue]
    reference: ReferenceSettings = field(default_factory=ReferenceSettings)
    search: SearchSettings = field(default_factory=SearchSettings)
    stage_two: StageTwoSettings = field(default_factory=StageTwoSettings)
    baselines: BaselineSettings = field(default_factory=BaselineSettings)
    evaluation: EvaluationSettings = field(default_factory=EvaluationSettings)
    pareto: ParetoSettings = field(default_factory=ParetoSettings)
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    description: str = ""

    # ------------------------------------------------------------------ configs
    def raw_config(self, params: dict[str, ConfigValue] | None = None) -> dict[str, ConfigValue]:
        """The base config's raw dict with the fixed values and ``params`` applied."""
        raw = copy.deepcopy(self.base_raw)
        for key, value in {**self.fixed, **(params or {})}.items():
            set_dotted(raw, key, value)
        return raw

    def config(
        self,
        params: dict[str, ConfigValue] | None = None,
        overrides: list[str] | None = None,
        name: str = "sweep",
        *,
        settings_only: bool = False,
    ) -> ExperimentConfig:
        """The fully validated experiment config of one point of the space
        (:func:`~splitvit.train.experiment.experiment_from_layers` of :meth:`layers`).

        ``params`` holds sampled values by parameter name (decoded: what the config
        takes); the fixed values always apply. ``settings_only``: the checks of the
        settings alone (types, ranges: :meth:`ExperimentConfig.from_dict`; the names:
        :func:`~splitvit.train.names.check_names`), without those that need timm and
        the model. Raises :class:`ConfigError`.
        """
        layers = self.layers(params, overrides)
        if settings_only:
            from ..train.names import check_names

            config = resolve_config(layers, default_name=name)
            check_names(config)
            return config
        # imported here: it loads torch and timm, which the settings' own checks do not need
        from ..train.experiment import experiment_from_layers

        return experiment_from_layers(layers, default_name=name)

    def layers(self, params: dict[str, ConfigValue] | None = None, overrides: list[str] | None = None) -> list[Layer]:
        """A point's config layers, lowest first: the base file, the space's fixed
        values, the sampled ``params``, ``--set`` overrides (the recipe goes under them:
        :func:`~splitvit.config.resolve_config`)."""
        stack = [
            Layer(f"file {self.base}", self.base_raw, nested=True),
            Layer(f"space {self.source}", self.fixed),
            Layer("sampled", params or {}),
        ]
        if overrides:
            stack.append(Layer("--set", [parse_override(item) for item in overrides]))
        return stack

    def decode(self, sampled: dict[str, ConfigValue]) -> dict[str, ConfigValue]:
        """Optuna's (or Tune's) sampled values -> config values, by parameter name."""
        return {k: self.parameters[k].decode(v) if k in self.parameters else v for k, v in sampled.items()}

    def optuna_space(self) -> dict[str, BaseDistribution]:
        """The searched parameters as Optuna distributions (for ``OptunaSearch``)."""
        return {name: p.optuna_distribution() for name, p in self.parameters.items()}

    @property
    def quality_metric(self) -> str:
        """``accuracy`` for classification, ``miou`` for the dense task, ``box_ap`` for detection."""
        return quality_metric(self.task)

    @property
    def companion_metrics(self) -> tuple[str, ...]:
        """Qualities each point records beside :attr:`quality_metric` (a detector's ``mask_ap``)."""
        return companion_metrics(self.task)

    @property
    def task(self) -> str:
        """The base config's ``model.task``."""
        return ((self.raw_config().get("model") or {}).get("task")) or "classification"

    def to_dict(self) -> JsonObject:
        """Plain dict (JSON-safe) of everything that defines the sweep."""
        return {
            "source": self.source,
            "base": self.base,
            "description": self.description,
            "parameters": {
                k: {key: v for key, v in dataclasses.asdict(p).items() if v not in (None, (), False) or key == "low"}
                for k, p in self.parameters.items()
            },
            "fixed": self.fixed,
            "reference": _reference_dict(self.reference),
            "search": dataclasses.asdict(self.search),
            "stage_two": dataclasses.asdict(self.stage_two),
            "baselines": dataclasses.asdict(self.baselines),
            "evaluation": dataclasses.asdict(self.evaluation),
            "pareto": dataclasses.asdict(self.pareto),
            "speed": dataclasses.asdict(self.speed),
            "mlflow": dataclasses.asdict(self.mlflow),
        }


# ---------------------------------------------------------------------- loading
def load_space(path: str | Path, overrides: list[str] | None = None, *, settings_only: bool = False) -> SearchSpace:
    """Read and validate a search space; ``overrides`` are ``key=value`` (``--set``).

    An override whose key starts with a config section (``train.epochs=1``) fixes
    that config value (and stops searching it); any other key sets the space's own
    settings (``search.num_samples=3``, ``stage_two.points=2``). ``settings_only``
    checks the points' settings alone (the command line's check, before torch
    loads); the full check also builds each point's model on the ``meta`` device.
    Raises :class:`SearchSpaceError` (a ``ValueError``) or ``FileNotFoundError``.
    """
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise FileNotFoundError(f"search space {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SearchSpaceError(source, "<file>", f"not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise SearchSpaceError(source, "<file>", f"expected a mapping of sections, got {type(raw).__name__}")
    return space_from_dict(raw, source=source, root=path.parent, overrides=overrides, settings_only=settings_only)


def space_from_dict(
    raw: JsonObject,
    *,
    source: str = "<dict>",
    root: str | Path = ".",
    overrides: list[str] | None = None,
    settings_only: bool = False,
) -> SearchSpace:
    """Build and validate a space from a plain dict (``base`` is relative to ``root``;
    ``settings_only`` as for :func:`load_space`)."""
    raw = copy.deepcopy(raw)
    raw.setdefault("parameters", {})
    if not isinstance(raw["parameters"], dict):
        raise SearchSpaceError(
            source, "parameters", f"expected a mapping of dotted config keys, got {type(raw['parameters']).__name__}"
        )
    for item in overrides or []:
        _apply_space_override(raw, item, source)
    # old key names read as the new ones: the parameters and the initial points that name them
    raw["parameters"] = upgrade_dotted(raw["parameters"], f"{source} parameters")
    points = (raw.get("search") or {}).get("initial_points") if isinstance(raw.get("search"), dict) else None
    if isinstance(points, list):
        raw["search"]["initial_points"] = [upgrade_flat(p) if isinstance(p, dict) else p for p in points]
    for key in raw:
        if key not in TOP_LEVEL:
            raise SearchSpaceError(source, str(key), f"unknown section{_did_you_mean(key, TOP_LEVEL)}")

    try:
        base_path = resolve_base_config(raw.get("base"), Path(root))
    except BaseConfigError as exc:
        raise SearchSpaceError(source, exc.key, exc.reason) from None
    try:
        base_raw = yaml.safe_load(base_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SearchSpaceError(source, "base", f"{base_path} is not valid YAML: {exc}") from None
    if not isinstance(base_raw, dict):
        raise SearchSpaceError(source, "base", f"{base_path} is not an experiment config (a mapping of sections)")

    parameters: dict[str, Parameter] = {}
    fixed: dict[str, ConfigValue] = {}
    for name, spec in raw["parameters"].items():
        name = str(name)
        _check_key_syntax(name, source)
        if isinstance(spec, dict) and "distribution" in spec:
            parameters[name] = _parameter(name, spec, source)
        else:
            fixed[name] = spec
    if not parameters:
        raise SearchSpaceError(source, "parameters", "nothing to search: give at least one parameter a distribution")

    search = raw.get("search")
    for key in REMOVED_SEARCH_KEYS:
        if isinstance(search, dict) and key in search:
            raise SearchSpaceError(
                source, f"search.{key}", "a setting of the ASHA scheduler, which the sweep no longer has: remove it"
            )
    space = SearchSpace(
        source=source,
        base=str(base_path),
        base_raw=base_raw,
        parameters=parameters,
        fixed=fixed,
        reference=_reference(raw.get("reference"), source),
        search=_settings(SearchSettings, raw.get("search"), "search", source),
        stage_two=_settings(StageTwoSettings, raw.get("stage_two"), "stage_two", source),
        baselines=_settings(BaselineSettings, raw.get("baselines"), "baselines", source),
        evaluation=_settings(EvaluationSettings, raw.get("evaluation"), "evaluation", source),
        pareto=_pareto(raw.get("pareto"), source),
        mlflow=_settings(MlflowSettings, raw.get("mlflow"), "mlflow", source),
        speed=_settings(SpeedSettings, raw.get("speed"), "speed", source),
        description=str(raw.get("description") or ""),
    )
    _validate_settings(space)
    _validate_against_config(space, settings_only)
    _validate_reference_config(space)
    return space


def _normalize_points(space: SearchSpace) -> None:
    """Initial points with numbers written as YAML 1.1 reads them (``1e-3`` is text) made numeric."""
    if space.search.initial_points is None:
        return
    points = []
    for point in space.search.initial_points:
        if isinstance(point, dict):
            point = {
                k: (
                    float(_number(v))
                    if k in space.parameters
                    and space.parameters[k].distribution in ("uniform", "loguniform")
                    and _number(v) is not None
                    else v
                )
                for k, v in point.items()
            }
        points.append(point)
    space.search = dataclasses.replace(space.search, initial_points=tuple(points))


def _did_you_mean(key: Any, known: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f"; did you mean {close[0]}?" if close else f"; expected one of {', '.join(known)}"


def _apply_space_override(raw: JsonObject, item: str, source: str) -> None:
    """One ``--set key=value``: a config key fixes that value, any other key sets the space's own settings."""
    try:
        key, value = parse_override(item)
        if split_key(key)[0][0] in SECTIONS or key == RECIPE_KEY:
            # a config value: fixed for this sweep, whether or not the file searches it
            ((key, value),) = upgrade_dotted([(key, value)], "--set")
            raw["parameters"][key] = value
        else:
            set_dotted(raw, key, value)
    except ConfigError as exc:
        raise SearchSpaceError(source, exc.key, exc.reason) from None


def _check_key_syntax(name: str, source: str, section: str = "parameters") -> None:
    """A dotted config key's syntax; errors name ``<section>.<name>`` (a parameter's, or
    a ``reference.train`` setting's)."""
    if name == RECIPE_KEY:  # the recipe under the config (a name, or categorical over names)
        return
    parts, _ = split_key(name)  # a malformed index leaves a "[" in a part
    if not all(re.fullmatch(r"[A-Za-z_]\w*", p) for p in parts):
        raise SearchSpaceError(
            source, f"{section}.{name}", "not a dotted config key (like train.lr or model.thresholds[0])"
        )
    if parts[0] not in SECTIONS:
        raise SearchSpaceError(
            source,
            f"{section}.{name}",
            f"unknown config key: {parts[0]} is not a config section{_did_you_mean(parts[0], SECTIONS)}",
        )
    if len(parts) < 2:
        raise SearchSpaceError(source, f"{section}.{name}", "name a key inside the section, like train.lr")


_SPEC_KEYS = {
    "uniform": {"distribution", "low", "high", "step"},
    "loguniform": {"distribution", "low", "high"},
    "int": {"distribution", "low", "high", "step", "log"},
    "categorical": {"distribution", "choices"},
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _parameter(name: str, spec: JsonObject, source: str) -> Parameter:
    key = f"parameters.{name}"
    dist = spec.get("distribution")
    if dist not in DISTRIBUTIONS:
        raise SearchSpaceError(
            source, key, f"unknown distribution {dist!r}; expected one of {', '.join(DISTRIBUTIONS)}"
        )
    unknown = sorted(set(spec) - _SPEC_KEYS[dist])
    if unknown:
        raise SearchSpaceError(
            source,
            f"{key}.{unknown[0]}",
            f"not a setting of a {dist} parameter; expected {', '.join(sorted(_SPEC_KEYS[dist]))}",
        )
    if dist == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise SearchSpaceError(
                source, f"{key}.choices", "a categorical parameter needs a non-empty list of choices"
            )
        if len({json.dumps(c, sort_keys=True, default=str) for c in choices}) != len(choices):
            raise SearchSpaceError(source, f"{key}.choices", f"choices repeat a value: {choices}")
        return Parameter(name, dist, choices=tuple(choices))
    bounds = {}
    for bound in ("low", "high"):
        if bound not in spec:
            raise SearchSpaceError(source, key, f"a {dist} parameter needs low and high")
        value = _number(spec[bound])
        if value is None or not math.isfinite(value):
            raise SearchSpaceError(source, f"{key}.{bound}", f"expected a finite number, got {spec[bound]!r}")
        if dist == "int" and int(value) != value:
            raise SearchSpaceError(
                source, f"{key}.{bound}", f"an int parameter needs integer bounds, got {spec[bound]!r}"
            )
        bounds[bound] = int(value) if dist == "int" else float(value)
    low, high = bounds["low"], bounds["high"]
    if low > high:
        raise SearchSpaceError(source, key, f"low ({low}) > high ({high})")
    if dist == "loguniform" and low <= 0:
        raise SearchSpaceError(source, f"{key}.low", f"a loguniform parameter needs low > 0, got {low}")
    step = spec.get("step")
    if step is not None:
        step_value = _number(step)
        if step_value is None or step_value <= 0 or (dist == "int" and int(step_value) != step_value):
            raise SearchSpaceError(
                source, f"{key}.step", f"expected a positive {'integer' if dist == 'int' else 'number'}, got {step!r}"
            )
        step = int(step_value) if dist == "int" else float(step_value)
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SearchSpaceError(source, f"{key}.log", f"expected true or false, got {log!r}")
    if dist == "int" and log and low < 1:
        raise SearchSpaceError(source, f"{key}.low", f"an int parameter on a log scale needs low >= 1, got {low}")
    return Parameter(name, dist, low=low, high=high, step=step, log=log)


def _settings(cls: type, raw: Any, section: str, source: str) -> Any:
    """A settings section (``search``, ``speed``...) by the config's own loader, its errors naming the file."""
    try:
        return build_dataclass(cls, raw, f"{section}.")
    except ConfigError as exc:
        raise SearchSpaceError(source, exc.key, exc.reason) from None


def _reference_dict(reference: ReferenceSettings) -> JsonObject | None:
    """The ``reference:`` section as a file writes it (what :func:`_reference` reads back):
    ``None`` without a reference; the seed only beside a study."""
    if not reference.enabled:
        return None
    return {
        k: v
        for k, v in dataclasses.asdict(reference).items()
        if v is not None and not (k == "seed" and reference.study is None)
    }


def _reference(raw: Any, source: str) -> ReferenceSettings:
    """The ``reference:`` section: one of ``checkpoint``, ``study`` (with ``seed``) or ``train``."""
    if raw is None:
        return ReferenceSettings()
    if not isinstance(raw, dict):
        raise SearchSpaceError(
            source, "reference", "expected {checkpoint: URI}, {study: NAME, seed: S} or {train: {KEY: VALUE}}"
        )
    settings = _settings(ReferenceSettings, raw, "reference", source)
    named = [k for k in ("checkpoint", "study", "train") if getattr(settings, k) is not None]
    if len(named) != 1:
        raise SearchSpaceError(
            source,
            "reference",
            f"name the reference one way: checkpoint, study or train (got {', '.join(named) or 'none of them'})",
        )
    if "seed" in raw and settings.study is None:
        raise SearchSpaceError(source, "reference.seed", "picks a study's reference: give it with reference.study")
    if settings.seed < 0:
        raise SearchSpaceError(source, "reference.seed", f"must be >= 0, got {settings.seed}")
    for key in ("checkpoint", "study"):
        value = getattr(settings, key)
        if value is not None and not value.strip():
            raise SearchSpaceError(source, f"reference.{key}", "must not be empty")
    if settings.converge_epochs < 1 or settings.converge_points <= 0:
        key = "converge_epochs" if settings.converge_epochs < 1 else "converge_points"
        raise SearchSpaceError(source, f"reference.{key}", "converge_epochs must be >= 1 and converge_points > 0")
    if settings.train is not None:
        for key in settings.train:
            _check_key_syntax(str(key), source, "reference.train")
            parts = split_key(str(key))[0]
            if str(key) == RECIPE_KEY or parts[0] not in SECTIONS or len(parts) < 2:
                raise SearchSpaceError(
                    source,
                    f"reference.train.{key}",
                    "expected a dotted config key such as train.epochs (the reference trains without a recipe)",
                )
    return settings


def _pareto(raw: Any, source: str) -> ParetoSettings:
    if raw is None:
        return ParetoSettings()
    if not isinstance(raw, dict) or set(raw) - {"reference_point"}:
        raise SearchSpaceError(source, "pareto", "expected {reference_point: {quality: Q, token_ratio: R}}")
    ref = raw.get("reference_point") or {}
    if not isinstance(ref, dict):
        raise SearchSpaceError(source, "pareto.reference_point", "expected {quality: Q, token_ratio: R}")
    # ``accuracy`` / ``miou`` are accepted as names of the quality coordinate
    ref = {("quality" if k in ("accuracy", "miou") else k): v for k, v in ref.items()}
    return _settings(ParetoSettings, ref, "pareto.reference_point", source)


def _validate_settings(space: SearchSpace) -> None:
    """Every section's ranges and names, each mistake a :class:`SearchSpaceError` naming its key."""
    _normalize_points(space)
    _check_search(space)
    _check_initial_points(space)
    _check_stage_two(space)
    _check_baselines(space)
    _check_outputs(space)


def _check_search(space: SearchSpace) -> None:
    """The ``search`` section: the budget, the sampler, the scheduler, each trial's resources."""
    src = space.source
    s = space.search
    if s.num_samples < 1:
        raise SearchSpaceError(src, "search.num_samples", f"must be >= 1, got {s.num_samples}")
    if s.max_concurrent < 1:
        raise SearchSpaceError(src, "search.max_concurrent", f"must be >= 1, got {s.max_concurrent}")
    if s.sampler not in SAMPLERS:
        raise SearchSpaceError(
            src, "search.sampler", f"unknown sampler {s.sampler!r}; expected one of {', '.join(SAMPLERS)}"
        )
    if s.population_size is not None and s.population_size < 2:
        raise SearchSpaceError(src, "search.population_size", f"must be >= 2, got {s.population_size}")
    _check_population(space)
    if s.scheduler == "asha":
        raise SearchSpaceError(
            src,
            "search.scheduler",
            "ASHA is refused: it ranks one metric, and with the sweep's two objectives (quality and "
            "tokens_per_image) Optuna would record a stopped trial's truncated accuracy as a finished "
            "point on the frontier; remove it",
        )
    if s.scheduler is not None:
        raise SearchSpaceError(
            src, "search.scheduler", f"unknown scheduler {s.scheduler!r}; expected null (every trial runs its epochs)"
        )
    if s.state_period_s < 0:
        raise SearchSpaceError(src, "search.state_period_s", f"must be >= 0, got {s.state_period_s}")
    for name, amount in s.trial_resources.items():
        if _number(amount) is None or amount < 0:
            raise SearchSpaceError(src, f"search.trial_resources.{name}", f"must be a number >= 0, got {amount!r}")
    if not any(_number(a) and a > 0 for a in s.trial_resources.values()):
        # Tune cannot schedule an empty request
        raise SearchSpaceError(
            src,
            "search.trial_resources",
            "ask for some resource, e.g. {CPU: 0.5}: the trial's driver function only waits "
            "for its training workers, so a fraction of a CPU is enough",
        )


def _check_initial_points(space: SearchSpace) -> None:
    """``search.initial_points``: each a value for every searched parameter, inside its range."""
    src = space.source
    s = space.search
    for i, point in enumerate(s.initial_points or ()):
        key = f"search.initial_points[{i}]"
        if not isinstance(point, dict):
            raise SearchSpaceError(src, key, "expected a mapping of parameter name to value")
        missing = sorted(set(space.parameters) - set(point))
        extra = sorted(set(point) - set(space.parameters))
        if extra:
            raise SearchSpaceError(
                src, f"{key}.{extra[0]}", f"not a searched parameter{_did_you_mean(extra[0], list(space.parameters))}"
            )
        if missing:
            raise SearchSpaceError(src, key, f"give every searched parameter a value; missing {', '.join(missing)}")
        for name, value in point.items():
            if not space.parameters[name].contains(value):
                raise SearchSpaceError(
                    src, f"{key}.{name}", f"{value!r} is outside {space.parameters[name].describe()}"
                )


def _check_stage_two(space: SearchSpace) -> None:
    """The ``stage_two`` section (and the baselines' evaluation samples, checked alike)."""
    src = space.source
    t = space.stage_two
    if t.points < 0:
        raise SearchSpaceError(src, "stage_two.points", f"must be >= 0, got {t.points}")
    if not 0.0 <= t.low <= t.high <= 1.0:
        raise SearchSpaceError(
            src, "stage_two", f"thresholds need 0 <= low <= high <= 1, got low {t.low}, high {t.high}"
        )
    for i, value in enumerate(t.ratios):
        if not 0.0 < value <= 1.0:
            raise SearchSpaceError(src, f"stage_two.ratios[{i}]", f"{value} is outside (0, 1]")
    if t.sampler not in STAGE_TWO_SAMPLERS:
        raise SearchSpaceError(
            src, "stage_two.sampler", f"unknown sampler {t.sampler!r}; expected one of {', '.join(STAGE_TWO_SAMPLERS)}"
        )
    for key, samples in (
        ("stage_two.samples", t.samples),
        ("stage_two.calibration_samples", t.calibration_samples),
        ("baselines.samples", space.baselines.samples),
    ):
        if samples is not None and samples < 1:
            raise SearchSpaceError(src, key, f"must be >= 1 or null, got {samples}")


def _check_baselines(space: SearchSpace) -> None:
    """The ``baselines`` section."""
    src = space.source
    b = space.baselines
    for i, value in enumerate(b.entropy_thresholds):
        if not 0.0 <= value <= 1.0:
            raise SearchSpaceError(src, f"baselines.entropy_thresholds[{i}]", f"{value} is outside [0, 1]")
    if b.random_budgets < 0:
        raise SearchSpaceError(src, "baselines.random_budgets", f"must be >= 0, got {b.random_budgets}")
    if not 0.0 < b.target_ratio <= 1.0:
        raise SearchSpaceError(src, "baselines.target_ratio", f"must be in (0, 1], got {b.target_ratio}")
    for i, value in enumerate(b.ratios):
        if not 0.0 < value <= 1.0:
            raise SearchSpaceError(src, f"baselines.ratios[{i}]", f"{value} is outside (0, 1]")


def _check_outputs(space: SearchSpace) -> None:
    """What the sweep writes: the ``evaluation``, ``pareto``, ``speed`` and ``mlflow`` sections."""
    src = space.source
    e = space.evaluation
    if e.split is not None and e.split not in ("train", "val", "test"):
        raise SearchSpaceError(src, "evaluation.split", f"expected test (or val, train) or null, got {e.split!r}")
    if e.samples is not None and e.samples < 1:
        raise SearchSpaceError(src, "evaluation.samples", f"must be >= 1 or null (every image), got {e.samples}")
    p = space.pareto
    if not 0.0 <= p.quality <= 1.0:
        raise SearchSpaceError(src, "pareto.reference_point.quality", f"must be in [0, 1], got {p.quality}")
    if p.token_ratio <= 0:
        raise SearchSpaceError(src, "pareto.reference_point.token_ratio", f"must be > 0, got {p.token_ratio}")
    v = space.speed
    for key, value, least in (
        ("batch_size", v.batch_size, 1),
        ("rounds", v.rounds, 1),
        ("warmup", v.warmup, 0),
        ("max_points", v.max_points, 1),
    ):
        if value is not None and value < least:
            null = " or null (every frontier point)" if key == "max_points" else ""
            raise SearchSpaceError(src, f"speed.{key}", f"must be >= {least}{null}, got {value}")
    m = space.mlflow
    if m.log_models is not None and m.log_models < 0:
        raise SearchSpaceError(src, "mlflow.log_models", f"must be >= 0 or null (all), got {m.log_models}")
    if m.split_map_images < 0:
        raise SearchSpaceError(src, "mlflow.split_map_images", f"must be >= 0, got {m.split_map_images}")
    if m.experiment is not None and not m.experiment.strip():
        raise SearchSpaceError(src, "mlflow.experiment", "must not be empty")


def _check_population(space: SearchSpace) -> None:
    """NSGA-II only where it has generations to evolve; a population only for NSGA-II."""
    s, src = space.search, space.source
    sampler = resolve_sampler(space)
    if sampler != "nsga2":
        if s.population_size is not None:
            picked = f"sampler auto picks {sampler} for this space" if s.sampler == "auto" else f"sampler is {sampler}"
            raise SearchSpaceError(src, "search.population_size", f"a setting of NSGA-II, and the {picked}; remove it")
        return
    population = s.population_size or NSGA2_DEFAULT_POPULATION
    if population >= s.num_samples:
        given = "" if s.population_size else f" (NSGA-II's default population is {NSGA2_DEFAULT_POPULATION})"
        raise SearchSpaceError(
            src,
            "search.population_size" if s.population_size else "search.sampler",
            f"an NSGA-II population of {population}{given} at or above the {s.num_samples} trials never "
            "evolves: that is random search; use sampler: auto, or a population well below num_samples",
        )


def resolve_sampler(space: SearchSpace) -> str:
    """The sampler the sweep uses: ``search.sampler``, with ``auto`` resolved by Optuna's
    ``AutoSampler`` rule for two objectives. NSGA-II only for large budgets (from
    :data:`NSGA2_MIN_TRIALS` trials: below that, a population of 50 gets too few
    generations); multivariate TPE where a parameter is categorical (the GP's kernel
    is for numbers); else the GP (log expected hypervolume improvement), the most out
    of a small budget over numeric parameters."""
    sampler = space.search.sampler
    if sampler != "auto":
        return sampler
    if space.search.num_samples >= NSGA2_MIN_TRIALS:
        return "nsga2"
    if any(p.distribution == "categorical" for p in space.parameters.values()):
        return "tpe"
    return "gp"


def _config_value(data: Any, name: str) -> Any:
    """The value of the dotted, optionally indexed key ``name`` in a nested config dict
    (``None`` where it has none). One number for an indexed list (``model.thresholds``
    as one threshold for every level) is that number."""
    parts, index = split_key(name)
    for part in parts:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    if index is None:
        return data
    if isinstance(data, (list, tuple)):
        return data[index] if index < len(data) else None
    return data  # one number for every level (or ``auto``, which no range holds)


def config_point(space: SearchSpace) -> tuple[dict[str, ConfigValue], dict[str, ConfigValue]]:
    """The base config's own point: ``(inside, outside)``, its values of the searched
    parameters (after the recipe, the base file and the space's fixed values), split
    into those each parameter's range holds and the rest (``auto`` thresholds, a value
    out of bounds or off the step), which the sampler picks instead."""
    data = json.loads(json.dumps(space.config(settings_only=True).to_dict(redact=False), default=str))
    inside: dict[str, ConfigValue] = {}
    outside: dict[str, ConfigValue] = {}
    for name, param in space.parameters.items():
        value = _config_value(data, name)
        if param.distribution in ("uniform", "loguniform") and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        (inside if param.contains(value) else outside)[name] = value
    return inside, outside


def first_points(space: SearchSpace) -> list[dict[str, ConfigValue]]:
    """The points the sweep evaluates first (config values, by parameter name): the
    space's ``initial_points``, or, where it sets none, the config's own point
    (:func:`config_point`; its keys outside their range are logged and left to the
    sampler, and none inside gives no point)."""
    if space.search.initial_points is not None:
        return [dict(p) for p in space.search.initial_points]
    inside, outside = config_point(space)
    if outside:
        log.info(
            "the config's own point, evaluated first, leaves to the sampler %s (outside the searched range)",
            ", ".join(f"{k} = {v!r}" for k, v in outside.items()),
        )
    return [inside] if inside else []


def _owner(space: SearchSpace, config_key: str, candidates: list[str], reason: str = "") -> str | None:
    """The parameter (or fixed key) a ConfigError's key belongs to. Several indexed
    parameters of one list (``model.thresholds[0]``, ``[1]``) are told apart by the
    index the error names (``thresholds[0] = -0.5 is outside [0, 1]``)."""
    matches = []
    for name in candidates:
        parts, _ = split_key(name)
        dotted = ".".join(parts)
        if config_key == dotted or config_key.startswith(dotted + ".") or config_key.startswith(dotted + "["):
            matches.append(name)
        elif dotted.startswith(config_key + "."):  # the error names a parent section
            matches.append(name)
    for name in matches:
        _, index = split_key(name)
        if index is not None and f"[{index}]" in f"{config_key} {reason}":
            return name
    return matches[0] if matches else None


def _validate_reference_config(space: SearchSpace) -> None:
    """A ``reference: {train: ...}``'s settings through the config's own checks (as
    :func:`~splitvit.tune.reference.reference_config` applies them: full resolution,
    no recipe), so that a wrong key or value stops the space here, naming the section."""
    train = space.reference.train
    if not train:
        return
    try:
        space.config({**train, RECIPE_KEY: "none", "model.policy.kind": "full"}, name="reference", settings_only=True)
    except ConfigError as exc:
        owner = next((k for k in train if ".".join(split_key(str(k))[0]) == exc.key), None)
        where = f"reference.train.{owner}" if owner is not None else "reference.train"
        raise SearchSpaceError(space.source, where, f"{exc.key}: {exc.reason}") from None


def _validate_against_config(space: SearchSpace, settings_only: bool = False) -> None:
    """Every parameter, at each bound (or choice), through the config's own validation.

    All parameters at their low bounds, then at their high bounds, then each further
    categorical choice: a ConfigError names the config key, which maps back to the
    parameter that set it (or, failing that, to a fixed value or the base config).
    The settings' own checks run first at every point; unless ``settings_only``, then
    those that need timm and the model.
    """
    src = space.source

    def check(params: dict[str, ConfigValue], suspects: list[str], what: str, only: bool) -> None:
        try:
            space.config(params, settings_only=only)
        except ConfigError as exc:
            owner = _owner(space, exc.key, suspects, exc.reason)
            if owner is None:
                # the base config itself (or a fixed value) is wrong
                fixed_owner = _owner(space, exc.key, list(space.fixed), exc.reason)
                where = f"parameters.{fixed_owner}" if fixed_owner else f"base ({space.base})"
                detail = exc.reason if fixed_owner == exc.key else f"{exc.key}: {exc.reason}"  # the key once
                raise SearchSpaceError(src, where, detail) from None
            if "unknown key" in exc.reason:
                raise SearchSpaceError(
                    src, f"parameters.{owner}", exc.reason.replace("unknown key", "not a config key")
                ) from None
            if "out of range" in exc.reason or "cannot index" in exc.reason:
                raise SearchSpaceError(src, f"parameters.{owner}", exc.reason) from None
            raise SearchSpaceError(
                src, f"parameters.{owner}", f"{what} is not a valid config value: {exc.key}: {exc.reason}"
            ) from None

    numeric = {n: p for n, p in space.parameters.items() if p.distribution != "categorical"}
    categorical = {n: p for n, p in space.parameters.items() if p.distribution == "categorical"}
    first_choice = {n: p.choices[0] for n, p in categorical.items()}
    lows = {n: p.decode(p.low) for n, p in numeric.items()}
    # the settings' own checks first, at every point (a mistake there is reported in a
    # second); then the checks that need timm and the model
    for only in (True,) if settings_only else (True, False):
        for bound in ("low", "high"):
            params = {n: p.decode(getattr(p, bound)) for n, p in numeric.items()}
            check({**params, **first_choice}, list(numeric) + list(categorical), f"its {bound} bound", only)
        for name, param in categorical.items():
            for choice in param.choices[1:]:
                check({**lows, **first_choice, name: choice}, [name], f"choice {choice!r}", only)
        for i, point in enumerate(space.search.initial_points or ()):
            check(
                space.decode({k: space.parameters[k].encode(v) for k, v in point.items()}),
                list(point),
                f"search.initial_points[{i}]",
                only,
            )
