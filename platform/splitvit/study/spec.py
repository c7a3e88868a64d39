"""The study file (``studies/study_*.yaml``): read, validated, and turned into
every run's experiment config.

A study file names an experiment config (``base``) and:

* ``seeds``: each seed is one repetition (its own canvases, initialisation, draws);
* ``backbone``: a warm-up run per seed (full resolution first, then random splits
  at every rate, docs/design.md §3.2) that every method of that seed starts from, so methods
  differ only in what they do after it;
* ``methods``: name -> config overrides (at least ``model.policy.kind``); every method
  trains ``method`` epochs from its seed's backbone (``model.init_from``). These are
  the headline, what a plain invocation runs;
* ``levers`` (optional): more methods in the same form, the recipe's ablation: each
  runs only when ``--methods`` names it (beside ``full``, the control);
* ``evaluation``: the held-out split and the token ratios at which every thresholded
  method (learned, entropy, random) is evaluated: per ratio, thresholds are
  calibrated on validation images (:func:`~splitvit.train.steps.calibrate_thresholds`),
  then the test images are evaluated: a threshold sweep at matched budgets;
* ``goals``: what the study is meant to show (checked and reported, never tuned);
* ``speed``: ``batch_size``, ``rounds``, ``warmup``, ``max_points`` and ``enabled``
  of the timings against full resolution (:mod:`splitvit.study.speed`);
* ``run``, ``mlflow``, ``config``, ``scales``, ``description``: how runs execute, the
  MLflow experiment, settings for every run, named variants (``--scale``), prose.

:func:`load_study` reads one into a :class:`StudySpec`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ..config import (
    RECIPE_KEY,
    BaseConfigError,
    ConfigError,
    ExperimentConfig,
    Layer,
    companion_metrics,
    legacy_warnings,
    quality_metric,
    resolve_base_config,
    resolve_config,
    upgrade_dotted,
    upgrade_keys,
)
from ..jsontypes import JsonObject
from ..model.names import POLICY_NAMES

#: a method entry's list of its recipe's keys to leave at the library's defaults
WITHOUT = "without"
_NO_WARMUP = {"train.policy.warmup_epochs": 0}
_KEYS = {
    "base",
    "description",
    "seeds",
    "config",
    "backbone",
    "method",
    "methods",
    "levers",
    "evaluation",
    "run",
    "goals",
    "speed",
    "mlflow",
    "scales",
}


@dataclass
class Goals:
    """What the study should show (DESIGN: report figures as measured, whether or not
    they reach these). The defaults are the shipped studies' common goals (parity at 70% and
    50% of the tokens, above entropy and random from 10% to 70%); a study file states the
    goals it holds differently, and the time and convergence goals it checks."""

    match_points: float = 0.5  # SPLIT within this many points of full resolution ...
    match_ratio: float = 0.7  # ... at no more than this share of its tokens (the paper's claim)
    # a point counts at a share when its measured share on the evaluated images exceeds it by at
    # most this: thresholds calibrated on validation images meet a target on other images only to
    # within a few tenths of a point (a 50% point measured 50.03% once, and the goal read the 40% one)
    ratio_tolerance: float = 0.005
    also_match_at: tuple[float, ...] = (0.5,)  # the same test at these shares too (reported beside it)
    beat_range: tuple[float, float] | None = (0.1, 0.7)  # SPLIT above entropy and random at every ratio here
    margin_at: float | None = None  # and ``margin`` points above entropy at this ratio (None: not checked)
    margin: float = 3.0
    converge_epochs: int = 3  # the reference (backbone) has converged when its validation quality ...
    converge_points: float | None = None  # ... gained less than this over its last converge_epochs epochs
    max_minutes: float | None = None  # the whole study, timed when one invocation trained every run


@dataclass(frozen=True)
class MethodEntry:
    """A method or lever of the study file, checked (:func:`_entry`): its layer of its
    runs' config, and the policy it trains (what the study ranks and times it by)."""

    #: as checked: dotted config keys, among them ``model.policy.kind`` and maybe
    #: ``recipe``, and ``without`` (the recipe's keys it leaves at the library's defaults)
    settings: JsonObject

    @property
    def policy(self) -> str:
        """Its ``model.policy.kind`` (``learned`` where it names a recipe)."""
        return str(self.settings["model.policy.kind"])

    @property
    def recipe(self) -> str | None:
        """The recipe it names (None: none named)."""
        return self.settings.get(RECIPE_KEY)

    def layer(self, name: str) -> Layer:
        """Its layer of a run's config (``method <name>``): its keys, its ``without``
        the recipe's keys the layer drops."""
        keys = {k: v for k, v in self.settings.items() if k != WITHOUT}
        return Layer(f"method {name}", keys, without=tuple(self.settings.get(WITHOUT, ())))


@dataclass
class StudySpec:
    """A validated study (see the module docstring)."""

    source: str
    base: Path
    base_raw: JsonObject  # the base experiment config as read (read once)
    description: str
    seeds: list[int]
    config: JsonObject
    backbone: JsonObject
    method: JsonObject
    methods: dict[str, MethodEntry]
    ratios: list[float]
    split: str = "test"
    samples: int | None = None
    calibration_samples: int = 512
    max_concurrent: int = 2
    trial_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 0.5})
    goals: Goals = field(default_factory=Goals)
    speed_batch: int = 64
    speed_rounds: int = 10
    speed_enabled: bool = True  # time the matched point and every method's operating points
    speed_warmup: int = 2
    speed_max_points: int | None = 24  # operating points timed side by side (spread over each method's ratios)
    experiment: str = "study"
    scale: str | None = None
    overrides: JsonObject = field(default_factory=dict)  # command-line settings: win over every section
    fixed: JsonObject = field(default_factory=dict)  # set by the study itself (the canvas cache)

    def run_config(
        self,
        seed: int,
        method: str | None,
        name: str,
        storage: str | None = None,
        init_from: str | None = None,
        *,
        settings_only: bool = False,
    ) -> ExperimentConfig:
        """The validated experiment config of the backbone (``method=None``) or a method
        run, its Ray Train run ``name`` under ``storage`` (default: the config's).
        ``settings_only``: the settings' own checks (types, ranges), without those that
        need timm and the model (which load torch)."""
        stack = self.layers(seed, method, name, storage, init_from)
        if settings_only:
            from ..train.names import check_names

            config = resolve_config(stack, default_name=name)
            check_names(config)
            return config
        from ..train.experiment import experiment_from_layers  # loads torch and timm

        return experiment_from_layers(stack, default_name=name)

    def layers(
        self, seed: int, method: str | None, name: str, storage: str | None = None, init_from: str | None = None
    ) -> list[Layer]:
        """The layers of a run's config, lowest first (docs/design.md §3.1): the base
        file, the study's ``config:``, its stage (``backbone:`` or ``method:``), the
        method's entry (its ``recipe`` and ``without`` among them), the command line's
        ``--set``, and what the study fixes itself (the seed, the run's name and storage,
        the reference it starts from). The recipe goes under them all
        (:func:`~splitvit.config.resolve_config`)."""
        stack = [Layer(f"file {_shown(self.base)}", self.base_raw, nested=True)]
        if method is None:
            # by default the backbone is the learned policy's warm-up curriculum (random
            # splits at every rate); a study may make it a full-resolution reference instead
            stack += [Layer("study (the backbone's default)", {"model.policy.kind": "learned"})]
            stack += [Layer("study config", self.config), Layer("study backbone", self.backbone)]
        else:
            # methods start from a trained backbone: no warm-up unless the study asks for one
            stack += [Layer("study config", self.config), Layer("study (methods start trained)", _NO_WARMUP)]
            stack += [Layer("study method", self.method), self.methods[method].layer(method)]
        fixed = {**self.fixed, "data.seed": seed, "tracking.enabled": False, "storage.name": name}
        if storage is not None:
            fixed["storage.path"] = storage
        if method is not None and init_from is not None:
            fixed["model.init_from"] = init_from
        return [*stack, Layer("--set", self.overrides), Layer("study", fixed)]

    @property
    def parity_ratios(self) -> list[float]:
        """The token shares parity with full resolution is tested at (the goals'
        ``match_ratio`` and ``also_match_at``), ascending: the ablation's columns."""
        return sorted({self.goals.match_ratio, *self.goals.also_match_at})

    @property
    def task(self) -> str:
        """Every run's ``model.task``."""
        return self.config.get("model.task") or (self.base_raw.get("model") or {}).get("task") or "classification"

    @property
    def metric(self) -> str:
        """The quality the study ranks points by (``accuracy``, ``miou``, ``box_ap``)."""
        return quality_metric(self.task)

    @property
    def companions(self) -> tuple[str, ...]:
        """Qualities aggregated and held to the parity goals beside :attr:`metric` (a
        detector's ``mask_ap``)."""
        return companion_metrics(self.task)

    def policy(self, method: str) -> str:
        """``method``'s policy (:attr:`MethodEntry.policy`)."""
        return self.methods[method].policy


def _shown(path: Path) -> str:
    """``path`` as a person gave it: relative to the working directory where it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _merge(raw: JsonObject, extra: JsonObject) -> JsonObject:
    """``extra`` (a ``scales`` entry) over ``raw``: a section's keys are replaced one by
    one (the sections are flat: dotted config keys, evaluation settings...)."""
    out = copy.deepcopy(raw)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _section(raw: JsonObject, key: str, source: str) -> JsonObject:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise study_file_error(source, key, f"must be a mapping, got {type(value).__name__}")
    if key in _SETTINGS_SECTIONS:  # dotted config keys: old names read as the new ones
        return dict(upgrade_dotted(value, f"{source} {key}"))
    return dict(value)


#: the sections of a study file that hold dotted config keys
_SETTINGS_SECTIONS = ("config", "backbone", "method")


_SPEED = {
    "enabled": (True, bool, None),
    "batch_size": (64, int, 1),
    "rounds": (10, int, 1),
    "warmup": (2, int, 0),
    "max_points": (24, int, 1),
}


def _speed_section(raw: JsonObject, source: str) -> dict[str, int | bool | None]:
    """The ``speed`` section, checked: ``enabled`` (time anything at all), ``batch_size``,
    ``rounds``, ``warmup`` and ``max_points`` (``null``: every operating point)."""
    section = _section(raw, "speed", source)
    out: dict[str, int | bool | None] = {}
    for key in section:
        if key not in _SPEED:
            raise study_file_error(source, f"speed.{key}", f"unknown setting; known: {', '.join(_SPEED)}")
    for key, (default, kind, least) in _SPEED.items():
        value = section.get(key, default)
        if value is None and key == "max_points":
            out[key] = None
            continue
        if kind is bool and not isinstance(value, bool):
            raise study_file_error(source, f"speed.{key}", f"expected true or false, got {value!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise study_file_error(
                source,
                f"speed.{key}",
                f"expected an integer >= {least}"
                f"{' or null (every point)' if key == 'max_points' else ''}, got {value!r}",
            )
        out[key] = value
    return out


def _goals(raw: JsonObject, source: str) -> Goals:
    """The ``goals`` section, checked: ratios in ``(0, 1]``, points and epochs in range;
    an unknown key or a bad value is one error naming ``goals.<key>``."""
    section = _section(raw, "goals", source)
    known = [f.name for f in fields(Goals)]
    for key in section:
        if key not in known:
            raise study_file_error(source, f"goals.{key}", f"unknown goal; known: {', '.join(known)}")

    def ratio(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1

    def number(value: Any, least: float = 0.0) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= least

    checks = {
        "match_points": (number, "a number of points >= 0"),
        "match_ratio": (ratio, "a token ratio in (0, 1]"),
        "ratio_tolerance": (lambda v: number(v) and v <= 0.05, "a token share in [0, 0.05]"),
        "also_match_at": (lambda v: isinstance(v, list) and all(map(ratio, v)), "a list of token ratios in (0, 1]"),
        "beat_range": (
            lambda v: v is None or (isinstance(v, list) and len(v) == 2 and all(map(ratio, v)) and v[0] <= v[1]),
            "[low, high] token ratios in (0, 1], or null",
        ),
        "margin_at": (lambda v: v is None or ratio(v), "a token ratio in (0, 1], or null"),
        "margin": (number, "a number of points >= 0"),
        "converge_epochs": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
        "converge_points": (lambda v: v is None or number(v), "a number of points >= 0, or null (not checked)"),
        "max_minutes": (lambda v: v is None or (number(v) and v > 0), "a number of minutes > 0, or null (not checked)"),
    }
    for key, value in section.items():
        valid, expected = checks[key]
        if not valid(value):
            raise study_file_error(source, f"goals.{key}", f"expected {expected}, got {value!r}")
    return Goals(**{k: (tuple(v) if k in ("beat_range", "also_match_at") and v else v) for k, v in section.items()})


def load_study(
    path: str | Path,
    *,
    scale: str | None = None,
    overrides: list[str] | None = None,
    methods: list[str] | None = None,
    settings_only: bool = False,
) -> StudySpec:
    """Read and validate a study file; every run's config is built (and so validated)
    before anything starts. ``scale`` merges the file's ``scales.<scale>`` section over
    it (e.g. ``gpu``); ``overrides`` are ``key=value`` config settings for every run;
    ``methods`` runs these of the file's methods and levers instead of its headline
    (``methods``): a lever beside the control, or a study cut to fit a machine; the
    rest of the file applies as it is.

    ``settings_only`` checks the runs' settings alone (the command line's check, in a
    second, before torch loads); the full check builds each run's model on PyTorch's
    ``meta`` device.

    Raises :class:`StudyError` (study keys) or :class:`ConfigError` (config keys).
    """
    with legacy_warnings(str(path)):  # the file's old key names (every section's), one line
        return _load_study(path, scale=scale, overrides=overrides, methods=methods, settings_only=settings_only)


def _load_study(
    path: str | Path,
    *,
    scale: str | None = None,
    overrides: list[str] | None = None,
    methods: list[str] | None = None,
    settings_only: bool = False,
) -> StudySpec:
    """:func:`load_study`'s reading and checks."""
    path = Path(path)
    source = str(path)
    raw = _read_file(path, scale)
    seeds = _seeds(raw, source)
    selected = _methods(raw, source, methods)
    evaluation = _section(raw, "evaluation", source)
    ratios = _ratios(evaluation, source)
    run = _section(raw, "run", source)
    goals = _goals(raw, source)
    speed = _speed_section(raw, source)
    config = _section(raw, "config", source)
    settings = _settings(overrides)
    try:
        base = resolve_base_config(raw.get("base"), path.parent)
    except BaseConfigError as exc:
        raise study_file_error(source, exc.key, exc.reason) from None
    spec = StudySpec(
        source=source,
        base=base,
        base_raw=yaml.safe_load(base.read_text()) or {},
        description=str(raw.get("description") or ""),
        seeds=seeds,
        config=config,
        backbone=_section(raw, "backbone", source),
        method=_section(raw, "method", source),
        methods=selected,
        ratios=ratios,
        split=str(evaluation.get("split", "test")),
        samples=evaluation.get("samples"),
        calibration_samples=int(evaluation.get("calibration_samples", 512)),
        max_concurrent=int(run.get("max_concurrent", 2)),
        trial_resources=dict(run.get("trial_resources") or {"CPU": 0.5}),
        goals=goals,
        speed_batch=speed["batch_size"],
        speed_rounds=speed["rounds"],
        speed_enabled=speed["enabled"],
        speed_warmup=speed["warmup"],
        speed_max_points=speed["max_points"],
        experiment=str((raw.get("mlflow") or {}).get("experiment") or f"study-{path.stem}"),
        scale=scale,
        overrides=settings,
    )
    # every run's config, validated now: a bad key stops here, before Ray starts (the
    # settings' own checks at every run first: those need no torch)
    for only in (True,) if settings_only else (True, False):
        for seed in spec.seeds:
            spec.run_config(seed, None, "check", settings_only=only)
            for method in spec.methods:
                spec.run_config(seed, method, "check", settings_only=only)
    return spec


def _read_file(path: Path, scale: str | None) -> JsonObject:
    """The study file as a mapping of known keys, its ``scales.<scale>`` merged over it."""
    source = str(path)
    if not path.is_file():
        raise study_file_error(source, "<file>", "study file not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise study_file_error(source, "<root>", "a study file is a mapping")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise study_file_error(source, unknown[0], f"unknown key; known: {', '.join(sorted(_KEYS))}")
    if isinstance(raw.get("levers"), str):
        raw["levers"] = _levers_file(path.parent / raw["levers"], source)
    scales = _section(raw, "scales", source)
    if scale is not None:
        if scale not in scales:
            raise study_file_error(source, "scales", f"no scale {scale!r}; the file has {', '.join(scales) or 'none'}")
        raw = _merge(raw, scales[scale])
    return raw


def _levers_file(path: Path, source: str) -> JsonObject:
    """``levers: FILE``: the levers kept in a file of their own beside the study (an
    ablation that outgrew it), a mapping of entries as ``levers:`` holds."""
    if not path.is_file():
        raise study_file_error(source, "levers", f"levers file {path} not found")
    try:
        levers = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise study_file_error(source, "levers", f"{path} is not valid YAML: {exc}") from None
    if not isinstance(levers, dict):
        raise study_file_error(source, "levers", f"{path}: expected a mapping of lever names to entries")
    return levers


def _seeds(raw: JsonObject, source: str) -> list[int]:
    """The ``seeds``: distinct non-negative integers (default ``[0]``)."""
    seeds = raw.get("seeds") or [0]
    if (
        not isinstance(seeds, list)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise study_file_error(source, "seeds", f"must be a list of distinct non-negative integers, got {seeds!r}")
    return list(seeds)


def _methods(raw: JsonObject, source: str, names: list[str] | None) -> dict[str, MethodEntry]:
    """The methods to run: the headline (``methods``), or those of ``methods`` and
    ``levers`` that ``names`` (``--methods``) picks, in the file's order; each needs a
    policy, and among them a ``full`` and a ``learned`` one."""
    headline = _section(raw, "methods", source)
    if not headline:
        raise study_file_error(source, "methods", "name at least one method")
    levers = _section(raw, "levers", source)
    both = [name for name in levers if name in headline]
    if both:
        raise study_file_error(source, f"levers.{both[0]}", "also under methods; a method is one or the other")
    all_methods = {
        name: _entry(name, settings, "methods" if name in headline else "levers", source)
        for name, settings in {**headline, **levers}.items()
    }
    if names is not None and not names:
        raise study_file_error(source, "methods", "--methods names no method; name at least one of the file's")
    unknown = [m for m in names or [] if m not in all_methods]
    if unknown:
        raise study_file_error(
            source,
            "methods",
            f"no method {unknown[0]!r} (asked for by --methods); the file has {', '.join(all_methods)}",
        )
    # the headline by default; --methods picks from both sections, in the file's order
    selected = {k: v for k, v in all_methods.items() if (k in headline if names is None else k in names)}
    policies = [m.policy for m in selected.values()]
    for needed in ("full", "learned"):
        if needed not in policies:
            raise study_file_error(
                source, "methods", f"needs a method with model.policy.kind: {needed} (the study compares against it)"
            )
    return selected


def _entry(name: str, settings: Any, section: str, source: str) -> MethodEntry:
    """A method entry, checked: config keys, among them ``model.policy.kind`` (an entry that
    names a recipe is the learned policy's) and ``recipe``, and ``without``: keys of the
    recipe this method leaves at the library's defaults (checked against the recipe
    when the run's config is built)."""
    where = f"{section}.{name}"
    if not isinstance(settings, dict):
        raise study_file_error(source, where, f"expected a mapping of config keys, got {type(settings).__name__}")
    entry = upgrade_dotted(dict(settings), f"{source} {where}")
    if isinstance(entry.get(WITHOUT), list):
        entry[WITHOUT] = upgrade_keys(entry[WITHOUT])
    if entry.get(RECIPE_KEY) not in (None, "none"):
        entry.setdefault("model.policy.kind", "learned")
    if entry.get("model.policy.kind") not in POLICY_NAMES:
        raise study_file_error(
            source,
            where,
            f"needs model.policy.kind, one of {', '.join(POLICY_NAMES)} (or a recipe: the learned policy's)",
        )
    without = entry.get(WITHOUT, [])
    if not isinstance(without, list) or not all(isinstance(k, str) for k in without):
        raise study_file_error(source, f"{where}.{WITHOUT}", f"expected a list of the recipe's keys, got {without!r}")
    return MethodEntry(entry)


def _ratios(evaluation: JsonObject, source: str) -> list[float]:
    """The evaluation's token ratios, ascending: each in ``(0, 1]``."""
    ratios = evaluation.get("ratios") or [0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6]
    if not all(isinstance(r, (int, float)) and 0 < r <= 1 for r in ratios):
        raise study_file_error(source, "evaluation.ratios", f"token ratios must be in (0, 1], got {ratios!r}")
    return sorted(float(r) for r in ratios)


def _settings(overrides: list[str] | None) -> JsonObject:
    """Command-line ``key=value`` settings, each value read as YAML."""
    settings: JsonObject = {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(item, "expected key=value")
        settings[key.strip()] = yaml.safe_load(value)
    return upgrade_dotted(settings, "--set")


class StudyError(ValueError):
    """A study that cannot run as asked (the message says why and what to do)."""


def study_file_error(source: str, key: str, reason: str) -> StudyError:
    """A mistake in a study file, as one line naming the file and the key:
    ``study studies/x.yaml: seeds: must be a list ...``."""
    return StudyError(f"study {source}: {key}: {reason}")
