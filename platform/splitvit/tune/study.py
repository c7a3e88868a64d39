"""The evidence study: SPLIT against full resolution, all-coarse, entropy and random
splitting, trained alike and compared at matched token budgets, over several seeds.

A study file (``search_spaces/study_*.yaml``) names an experiment config and:

* ``seeds``: each seed is one repetition (its own canvases, initialisation, draws);
* ``backbone``: a warm-up run per seed (full resolution first, then random splits
  at every rate, docs/design.md §3.2) that every method of that seed starts from, so methods
  differ only in what they do after it;
* ``methods``: name -> config overrides (at least ``model.policy``); every method
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
  of the timings against full resolution: the matched point (:func:`matched_speed`)
  and every method's evaluated points (:func:`points_speed`).

One code path runs every study (:func:`execute_study`): it plans the runs (the
backbones, one per seed, then the methods, one per seed and method), reuses the runs
an earlier invocation finished (each run's :data:`STUDY_RESULT_FILE`), evaluates
every method at the matched token ratios (:func:`study_run`), aggregates over seeds,
checks the goals, times the speed comparison and records MLflow (a parent run with
the table, the plot, the goals and the speed figures; a child run per method and
seed). Only where runs execute (a :class:`StudyExecutor`) and how one run is trained
(its :class:`RunTrainer`) differ:

* on the platform (:func:`run_study`, ``splitvit study``), like a sweep: Ray Tune
  trials (:class:`TuneExecutor`), each training a Ray Train ``TorchTrainer``
  (:class:`RayTrainer`); only the driver writes MLflow;
* on one machine without Ray (:func:`splitvit.tune.study_local.run_study_local`,
  ``infra/gpu-check/single_gpu_study.py``): in this process or a pool of processes
  sharing one device, each run trained by the plain single-process loop with the
  config's schedule; MLflow optional.

Re-running a study under the same name reuses every run that finished and resumes
unfinished training (from its checkpoints on Ray; a local run whose training
finished keeps it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import yaml

from ..config import ConfigError, ExperimentConfig, quality_metric, set_dotted
from ..storage import exists, join_uri, read_bytes, write_bytes
from ..train.experiment import experiment_from_dict
from .console import Progress, ray_console, tune_verbosity
from .space import SearchSpaceError, _resolve_base

log = logging.getLogger(__name__)

STUDY_RESULT_FILE = "study_result.json"  # a finished run's stored result, in its run folder
STUDY_STARTED_FILE = "study_started.json"  # the config a run started training with (an unfinished run's settings)
THRESHOLDED = ("learned", "entropy", "random")
EPS = 1e-9  # points: means of seeds' accuracies are not exact in binary
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
    they reach these)."""

    match_points: float = 0.5  # SPLIT within this many points of full resolution ...
    match_ratio: float = 0.5  # ... at no more than this share of its tokens
    # a point counts at a share when its measured share on the evaluated images exceeds it by at
    # most this: thresholds calibrated on validation images meet a target on other images only to
    # within a few tenths of a point (a 50% point measured 50.03% once, and the goal read the 40% one)
    ratio_tolerance: float = 0.005
    also_match_at: tuple[float, ...] = ()  # the same test at these shares too (reported beside it)
    beat_range: tuple[float, float] | None = (0.1, 0.6)  # SPLIT above entropy and random at every ratio here
    margin_at: float | None = 0.25  # and this many points above entropy at this ratio
    margin: float = 3.0
    converge_epochs: int = 3  # the reference (backbone) has converged when its validation quality ...
    converge_points: float | None = None  # ... gained less than this over its last converge_epochs epochs
    max_minutes: float | None = None  # the whole study, timed when one invocation trained every run


@dataclass
class StudySpec:
    """A validated study (see the module docstring)."""

    source: str
    base: Path
    base_raw: dict[str, Any]  # the base experiment config as read (read once)
    description: str
    seeds: list[int]
    config: dict[str, Any]
    backbone: dict[str, Any]
    method: dict[str, Any]
    methods: dict[str, dict[str, Any]]
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
    overrides: dict[str, Any] = field(default_factory=dict)  # command-line settings: win over every section
    fixed: dict[str, Any] = field(default_factory=dict)  # set by the study itself (the canvas cache)

    def run_config(
        self, seed: int, method: str | None, name: str, storage: str | None = None, init_from: str | None = None
    ) -> ExperimentConfig:
        """The validated experiment config of the backbone (``method=None``) or a method
        run, its Ray Train run ``name`` under ``storage`` (default: the config's)."""
        raw = copy.deepcopy(self.base_raw)
        values = {
            **self.config,
            **(self.backbone if method is None else {**self.method, **self.methods[method]}),
            **self.overrides,
            **self.fixed,
        }
        values.update({"data.seed": seed, "tracking.enabled": False, "storage.name": name})
        if storage is not None:
            values["storage.path"] = storage
        if method is None:
            # by default the backbone is the learned policy's warm-up curriculum (random
            # splits at every rate); a study may make it a full-resolution reference instead
            values.setdefault("model.policy", "learned")
        else:
            # methods start from a trained backbone: no warm-up unless the study asks for one
            if "train.warmup_epochs" not in {**self.method, **self.methods[method]}:
                values["train.warmup_epochs"] = 0
            if init_from is not None:
                values["model.init_from"] = init_from
        for key, value in values.items():
            set_dotted(raw, key, value)
        return experiment_from_dict(raw, default_name=name)

    @property
    def parity_ratios(self) -> list[float]:
        """The token shares parity with full resolution is tested at (the goals'
        ``match_ratio`` and ``also_match_at``), ascending: the ablation's columns."""
        return sorted({self.goals.match_ratio, *self.goals.also_match_at})

    @property
    def metric(self) -> str:
        return quality_metric(
            self.config.get("model.task") or (self.base_raw.get("model") or {}).get("task") or "classification"
        )

    def policy(self, method: str) -> str:
        return str(self.methods[method]["model.policy"])


def _merge(raw: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` (a ``scales`` entry) over ``raw``: a section's keys are replaced one by
    one (the sections are flat: dotted config keys, evaluation settings...)."""
    out = copy.deepcopy(raw)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _section(raw: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise SearchSpaceError(source, key, f"must be a mapping, got {type(value).__name__}")
    return dict(value)


_SPEED = {
    "enabled": (True, bool, None),
    "batch_size": (64, int, 1),
    "rounds": (10, int, 1),
    "warmup": (2, int, 0),
    "max_points": (24, int, 1),
}


def _speed_section(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``speed`` section, checked: ``enabled`` (time anything at all), ``batch_size``,
    ``rounds``, ``warmup`` and ``max_points`` (``null``: every operating point)."""
    section = _section(raw, "speed", source)
    out = {}
    for key in section:
        if key not in _SPEED:
            raise SearchSpaceError(source, f"speed.{key}", f"unknown setting; known: {', '.join(_SPEED)}")
    for key, (default, kind, least) in _SPEED.items():
        value = section.get(key, default)
        if value is None and key == "max_points":
            out[key] = None
            continue
        if kind is bool and not isinstance(value, bool):
            raise SearchSpaceError(source, f"speed.{key}", f"expected true or false, got {value!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise SearchSpaceError(
                source,
                f"speed.{key}",
                f"expected an integer >= {least}"
                f"{' or null (every point)' if key == 'max_points' else ''}, got {value!r}",
            )
        out[key] = value
    return out


def _goals(raw: dict[str, Any], source: str) -> Goals:
    """The ``goals`` section, checked: ratios in ``(0, 1]``, points and epochs in range;
    an unknown key or a bad value is one error naming ``goals.<key>``."""
    section = _section(raw, "goals", source)
    known = [f.name for f in fields(Goals)]
    for key in section:
        if key not in known:
            raise SearchSpaceError(source, f"goals.{key}", f"unknown goal; known: {', '.join(known)}")

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
            raise SearchSpaceError(source, f"goals.{key}", f"expected {expected}, got {value!r}")
    return Goals(**{k: (tuple(v) if k in ("beat_range", "also_match_at") and v else v) for k, v in section.items()})


def load_study(
    path: str | Path,
    *,
    scale: str | None = None,
    overrides: list[str] | None = None,
    methods: list[str] | None = None,
) -> StudySpec:
    """Read and validate a study file; every run's config is built (and so validated)
    before anything starts. ``scale`` merges the file's ``scales.<scale>`` section over
    it (e.g. ``gpu``); ``overrides`` are ``key=value`` config settings for every run;
    ``methods`` runs these of the file's methods and levers instead of its headline
    (``methods``): a lever beside the control, or a study cut to fit a machine; the
    rest of the file applies as it is.

    Raises :class:`SearchSpaceError` (study keys) or :class:`ConfigError` (config keys).
    """
    from ..model import POLICY_NAMES

    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise SearchSpaceError(source, "<file>", "study file not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise SearchSpaceError(source, "<root>", "a study file is a mapping")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise SearchSpaceError(source, unknown[0], f"unknown key; known: {', '.join(sorted(_KEYS))}")
    scales = _section(raw, "scales", source)
    if scale is not None:
        if scale not in scales:
            raise SearchSpaceError(source, "scales", f"no scale {scale!r}; the file has {', '.join(scales) or 'none'}")
        raw = _merge(raw, scales[scale])
    seeds = raw.get("seeds") or [0]
    if (
        not isinstance(seeds, list)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise SearchSpaceError(source, "seeds", f"must be a list of distinct non-negative integers, got {seeds!r}")
    headline = _section(raw, "methods", source)
    if not headline:
        raise SearchSpaceError(source, "methods", "name at least one method")
    levers = _section(raw, "levers", source)
    both = [name for name in levers if name in headline]
    if both:
        raise SearchSpaceError(source, f"levers.{both[0]}", "also under methods; a method is one or the other")
    all_methods = {**headline, **levers}
    for name, settings in all_methods.items():
        if not isinstance(settings, dict) or settings.get("model.policy") not in POLICY_NAMES:
            section = "methods" if name in headline else "levers"
            raise SearchSpaceError(source, f"{section}.{name}", f"needs model.policy, one of {', '.join(POLICY_NAMES)}")
    if methods is not None and not methods:
        raise SearchSpaceError(source, "methods", "--methods names no method; name at least one of the file's")
    unknown = [m for m in methods or [] if m not in all_methods]
    if unknown:
        raise SearchSpaceError(
            source,
            "methods",
            f"no method {unknown[0]!r} (asked for by --methods); the file has {', '.join(all_methods)}",
        )
    # the headline by default; --methods picks from both sections, in the file's order
    methods = headline if methods is None else {k: v for k, v in all_methods.items() if k in methods}
    policies = [m["model.policy"] for m in methods.values()]
    for needed in ("full", "learned"):
        if needed not in policies:
            raise SearchSpaceError(
                source, "methods", f"needs a method with model.policy: {needed} (the study compares against it)"
            )
    evaluation = _section(raw, "evaluation", source)
    ratios = evaluation.get("ratios") or [0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6]
    if not all(isinstance(r, (int, float)) and 0 < r <= 1 for r in ratios):
        raise SearchSpaceError(source, "evaluation.ratios", f"token ratios must be in (0, 1], got {ratios!r}")
    run = _section(raw, "run", source)
    goals = _goals(raw, source)
    speed = _speed_section(raw, source)
    config = _section(raw, "config", source)
    settings: dict[str, Any] = {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(item, "expected key=value")
        settings[key.strip()] = yaml.safe_load(value)
    base = _resolve_base(raw.get("base"), path.parent, source)
    spec = StudySpec(
        source=source,
        base=base,
        base_raw=yaml.safe_load(base.read_text()) or {},
        description=str(raw.get("description") or ""),
        seeds=list(seeds),
        config=config,
        backbone=_section(raw, "backbone", source),
        method=_section(raw, "method", source),
        methods={k: dict(v) for k, v in methods.items()},
        ratios=sorted(float(r) for r in ratios),
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
    # every run's config, validated now: a bad key stops here, before Ray starts
    for seed in spec.seeds:
        spec.run_config(seed, None, "check")
        for method in spec.methods:
            spec.run_config(seed, method, "check")
    return spec


# ---------------------------------------------------------------------- trials
class StudyError(ValueError):
    """A study that cannot run as asked (the message says why and what to do)."""


def run_name(seed: int, method: str | None) -> str:
    """The run folder's name: seed ``seed``'s backbone (``method=None``) or a method run."""
    return f"backbone-s{seed}" if method is None else f"{method}-s{seed}"


def _stored(run_uri: str, file: str = STUDY_RESULT_FILE) -> dict[str, Any] | None:
    uri = join_uri(run_uri, file)
    return json.loads(read_bytes(uri)) if exists(uri) else None


def _evaluation(spec: StudySpec) -> dict[str, Any]:
    """The evaluation settings a method's stored points were made with."""
    return {
        "split": spec.split,
        "samples": spec.samples,
        "ratios": spec.ratios,
        "calibration_samples": spec.calibration_samples,
    }


def stale_runs(spec: StudySpec, storage: str, methods: Sequence[str | None] | None = None) -> list[str]:
    """The runs under ``storage`` whose settings differ from what ``spec`` asks for now
    (e.g. the study file changed but kept its name): finished ones, whose reuse would
    mix settings in one table, and unfinished ones, which would resume training from a
    checkpoint made with the old settings. Each entry names the run and the differing
    keys. A setting the code gained after a run was made counts as its default there:
    new settings default to the behaviour the run had. Other evaluation settings are
    not stale: :func:`study_run` evaluates the finished checkpoint again. ``methods``: the runs to check
    (``None`` for the references); default the references and every method."""
    defaults = json.loads(json.dumps(ExperimentConfig().flat(), default=float))
    stale = []
    for seed in spec.seeds:
        for method in (None, *spec.methods) if methods is None else methods:
            name = run_name(seed, method)
            stored = _stored(join_uri(storage, name))
            finished = stored is not None
            if not finished:
                stored = _stored(join_uri(storage, name), STUDY_STARTED_FILE)
            if stored is None or "config" not in stored:
                continue
            # through JSON, as stored (tuples become lists); the backbone's path is checked as the backbone
            now = json.loads(json.dumps(spec.run_config(seed, method, name, storage).flat(), default=float))
            keys = sorted(
                k
                for k in set(now) | set(stored["config"])
                if k != "model.init_from" and now.get(k) != stored["config"].get(k, defaults.get(k))
            )
            if keys:
                stale.append(f"{name} ({'' if finished else 'unfinished; '}{', '.join(keys)})")
    return stale


def begun_runs(spec: StudySpec, storage: str, methods: Sequence[str | None]) -> list[str]:
    """The runs under ``storage`` that an invocation has started or finished (a
    later one resumes or reuses them), by name: for :func:`study_time`, which
    times only a study that this invocation ran from the start."""
    return [
        name
        for seed in spec.seeds
        for method in methods
        for name in [run_name(seed, method)]
        if exists(join_uri(storage, name, STUDY_STARTED_FILE)) or exists(join_uri(storage, name, STUDY_RESULT_FILE))
    ]


# ---------------------------------------------------------------------- one run
class RunTrainer(Protocol):
    """How one run of a study is trained, and where its evaluations run."""

    def train(self, config: ExperimentConfig) -> dict[str, Any]:
        """Train ``config``: ``status`` (``completed``, or why not), ``metrics`` (the last
        epoch's), ``checkpoint`` (``None`` without one), ``message``, and any further keys
        to store with the run (e.g. per-epoch ``history``)."""
        ...

    def evaluate(self, config: ExperimentConfig, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, device=<where config trains>, **kwargs)``, run there."""
        ...


@dataclass(frozen=True)
class RayTrainer:
    """Ray Train, inside a Tune trial (:func:`~splitvit.tune.trial.fit_trial`); evaluations
    where training ran (:func:`~splitvit.tune.trial.run_evaluation`: a GPU task for GPU runs)."""

    def train(self, config: ExperimentConfig) -> dict[str, Any]:
        """:func:`~splitvit.tune.trial.fit_trial`."""
        from .trial import fit_trial

        return fit_trial(config)

    def evaluate(self, config: ExperimentConfig, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """:func:`~splitvit.tune.trial.run_evaluation`."""
        from .trial import run_evaluation

        return run_evaluation(config, fn, *args, **kwargs)


_TRAINED = ("status", "metrics", "checkpoint", "message")  # what every trainer returns; the rest is stored as is


def study_run(
    spec: StudySpec, storage: str, params: dict[str, Any], trainer: RunTrainer, backbones: dict[int, str] | None = None
) -> dict[str, Any]:
    """One run of the study, the same under every executor: seed ``params['seed']``'s
    backbone, or with ``params['method']`` that method trained by ``trainer`` from the
    seed's backbone checkpoint (``backbones``) and evaluated at every matched token
    ratio on the held-out split (:func:`evaluate_points`). The result is stored in the
    run folder under ``storage`` (:data:`STUDY_RESULT_FILE`); a run an earlier
    invocation finished is not trained again but its stored result returned.

    A finished method run whose points were made with other evaluation settings is
    evaluated again from its checkpoint (``reevaluated``), not trained again.

    Returns the stored result with ``reused`` (finished earlier: its training times are
    that invocation's) and ``reevaluated``. Raises :class:`~splitvit.tune.trial.TrialFailed` when training
    does not complete with a checkpoint.
    """
    from .trial import TrialFailed

    seed = int(params["seed"])
    method = None if params.get("method") is None else str(params["method"])
    name = run_name(seed, method)
    run_uri = join_uri(storage, name)
    stored = _stored(run_uri)
    if stored is not None and (method is None or _same_evaluation(spec, stored)):
        return {**stored, "reused": True, "reevaluated": False}
    # validated (the backbone checkpoint included) only for a run that trains or evaluates
    config = spec.run_config(seed, method, name, storage, init_from=None if method is None else backbones[seed])
    if stored is not None:
        # finished under other evaluation settings (ratios, samples...): evaluation only
        started = time.time()
        stored = {
            **stored,
            "points": _evaluate_run(spec, config, trainer, stored["checkpoint"], method, seed),
            "eval_seconds": time.time() - started,
            "evaluation": _evaluation(spec),
        }
        write_bytes(join_uri(run_uri, STUDY_RESULT_FILE), json.dumps(stored, default=float).encode())
        log.info("%s: evaluated again at the study's evaluation settings (its training is reused)", name)
        return {**stored, "reused": True, "reevaluated": True}
    started = time.time()
    # what an interrupted run would resume with, for the next invocation's stale check
    write_bytes(join_uri(run_uri, STUDY_STARTED_FILE), json.dumps({"config": config.flat()}, default=float).encode())
    trained = trainer.train(config)
    if trained["status"] != "completed" or trained["checkpoint"] is None:
        raise TrialFailed(f"{'backbone ' if method is None else ''}{name} {trained['status']}: {trained['message']}")
    extra = {k: v for k, v in trained.items() if k not in _TRAINED}
    train_seconds = time.time() - started
    if method is None:
        stored = {
            "seed": seed,
            "checkpoint": trained["checkpoint"],
            "metrics": trained["metrics"],
            "train_seconds": train_seconds,
            "run_uri": run_uri,
            "config": config.flat(),
            **extra,
        }
    else:
        policy = spec.policy(method)
        points = _evaluate_run(spec, config, trainer, trained["checkpoint"], method, seed)
        stored = {
            "seed": seed,
            "method": method,
            "policy": policy,
            "checkpoint": trained["checkpoint"],
            "train_metrics": trained["metrics"],
            "points": points,
            "train_seconds": train_seconds,
            "eval_seconds": time.time() - started - train_seconds,
            "run_uri": run_uri,
            "config": config.flat(),
            "evaluation": _evaluation(spec),
            **extra,
        }
    write_bytes(join_uri(run_uri, STUDY_RESULT_FILE), json.dumps(stored, default=float).encode())
    return {**stored, "reused": False, "reevaluated": False}


def _same_evaluation(spec: StudySpec, stored: dict[str, Any]) -> bool:
    """Whether a finished method run's points were made with ``spec``'s evaluation settings."""
    return json.loads(json.dumps(_evaluation(spec))) == stored.get("evaluation", _evaluation(spec))


def _evaluate_run(
    spec: StudySpec, config: ExperimentConfig, trainer: RunTrainer, checkpoint: str, method: str, seed: int
) -> list[dict[str, Any]]:
    """A method run's points (:func:`evaluate_points`), where ``config`` trains."""
    policy = spec.policy(method)
    return trainer.evaluate(
        config,
        evaluate_points,
        checkpoint,
        policy=policy,
        ratios=spec.ratios if policy in THRESHOLDED else [],
        split=spec.split,
        samples=spec.samples,
        calibration_samples=spec.calibration_samples,
        seed=seed,
    )


def backbone_trial(params: dict[str, Any], spec: StudySpec, storage: str) -> None:
    """Tune trial: seed ``params['seed']``'s warm-up backbone (:func:`study_run` on Ray Train)."""
    from ray import tune

    tune.report({"done": 1, "result": json.dumps(study_run(spec, storage, params, RayTrainer()), default=float)})


def method_trial(params: dict[str, Any], spec: StudySpec, storage: str, backbones: dict[int, str]) -> None:
    """Tune trial: one method from its seed's backbone, evaluated at every matched token
    ratio (:func:`study_run` on Ray Train)."""
    from ray import tune

    result = study_run(spec, storage, params, RayTrainer(), backbones)
    tune.report({"done": 1, "result": json.dumps(result, default=float)})


def evaluate_points(
    checkpoint: str,
    *,
    policy: str,
    ratios: list[float],
    split: str,
    samples: int | None,
    calibration_samples: int,
    seed: int,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Quality, tokens per image and images/s of ``checkpoint`` on ``split``: one point
    for ``full``/``coarse``, else one per token ratio, its thresholds calibrated on the
    first ``calibration_samples`` validation images (never on the evaluated ones)."""
    import torch

    from ..train.evaluation import CheckpointEvaluator

    evaluator = CheckpointEvaluator(checkpoint, samples=samples, device=device, split=split)
    if not ratios:
        return [{"target_ratio": None, **evaluator.evaluate(None)}]
    calibration = evaluator.first_images(calibration_samples, split="val")
    points = []
    for ratio in ratios:
        # the random policy draws fresh scores on every call: seeded, so a rerun repeats it
        torch.manual_seed(seed * 1009 + round(ratio * 1000))
        thresholds = evaluator.calibrate(calibration, ratio)
        points.append({"target_ratio": ratio, **evaluator.evaluate(thresholds)})
        log.info(
            "%s @ %.2f: %s %.4f at %.1f tokens/image",
            policy,
            ratio,
            "quality",
            points[-1]["quality"],
            points[-1]["tokens_per_image"],
        )
    return points


# ---------------------------------------------------------------------- aggregation
def aggregate(results: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """One row per (method, target ratio): mean, standard deviation, min and max over
    seeds of the quality, and the means of tokens per image, token ratio and images/s."""
    groups: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    policies: dict[str, str] = {}
    for result in results:
        policies[result["method"]] = result["policy"]
        for point in result["points"]:
            groups.setdefault((result["method"], point["target_ratio"]), []).append({**point, "seed": result["seed"]})
    rows = []
    for (method, ratio), points in groups.items():
        q = [float(p["quality"]) for p in points]
        rows.append(
            {
                "method": method,
                "policy": policies[method],
                "target_ratio": ratio,
                "seeds": len(points),
                metric: statistics.fmean(q),
                f"{metric}_std": statistics.stdev(q) if len(q) > 1 else 0.0,
                f"{metric}_min": min(q),
                f"{metric}_max": max(q),
                "tokens_per_image": statistics.fmean(float(p["tokens_per_image"]) for p in points),
                "token_ratio": statistics.fmean(float(p["token_ratio"]) for p in points),
                "images_per_s": statistics.fmean(float(p["images_per_s"]) for p in points),
                "per_seed": {str(p["seed"]): float(p["quality"]) for p in points},
            }
        )
    rows.sort(key=lambda r: (r["policy"] != "full", r["policy"] != "learned", r["method"], r["target_ratio"] or 0.0))
    return rows


def check_goals(rows: list[dict[str, Any]], goals: Goals, metric: str) -> dict[str, Any]:
    """The goals, measured on the aggregated rows (means over seeds; points)."""
    pts = 100.0
    full = next((r for r in rows if r["policy"] == "full"), None)
    if full is None:
        return {}

    def best(policy: str, ratio: float) -> dict[str, Any] | None:
        found = [
            r
            for r in rows
            if r["policy"] == policy and r["target_ratio"] is not None and math.isclose(r["target_ratio"], ratio)
        ]
        return max(found, key=lambda r: r[metric]) if found else None

    out: dict[str, Any] = {"full_" + metric: full[metric]}
    match = _match(rows, full, goals.match_ratio, goals, metric)
    if match:
        out["match"] = match
    also = [_match(rows, full, ratio, goals, metric) for ratio in goals.also_match_at]
    if any(also):
        out["match_also"] = [m for m in also if m]
    if goals.beat_range:
        lo, hi = goals.beat_range
        margins = []
        for ratio in sorted({r["target_ratio"] for r in rows if r["target_ratio"] is not None}):
            if not lo - 1e-9 <= ratio <= hi + 1e-9:
                continue
            split = best("learned", ratio)
            for other in ("entropy", "random"):
                rival = best(other, ratio)
                if split and rival:
                    margins.append(
                        {"target_ratio": ratio, "versus": other, "margin_points": (split[metric] - rival[metric]) * pts}
                    )
        if margins:
            worst = min(margins, key=lambda m: m["margin_points"])
            out["above_baselines"] = {
                "range": [lo, hi],
                "margins": margins,
                "worst": worst,
                "met": worst["margin_points"] > 0,
            }
    if goals.margin_at is not None:
        split, rival = best("learned", goals.margin_at), best("entropy", goals.margin_at)
        if split and rival:
            margin = (split[metric] - rival[metric]) * pts
            out["margin_over_entropy"] = {
                "target_ratio": goals.margin_at,
                "margin_points": margin,
                "goal_points": goals.margin,
                "met": margin >= goals.margin - EPS,
            }
    return out


def gap_spread(full: dict[str, Any], row: dict[str, Any]) -> float | None:
    """The standard deviation over seeds, in points, of ``row``'s gap to ``full`` taken
    seed by seed (each method starts from its seed's reference, so a seed's reference
    lifts or lowers both): how much of a mean gap is more than noise. ``None`` with
    fewer than two seeds in common."""
    seeds = sorted(set(full.get("per_seed", {})) & set(row.get("per_seed", {})))
    if len(seeds) < 2:
        return None
    return statistics.stdev((full["per_seed"][s] - row["per_seed"][s]) * 100.0 for s in seeds)


def _gap_text(gap: float, spread: float | None) -> str:
    return f"{-gap:+.2f}" + ("" if spread is None else f" ± {spread:.2f}")


def _match(
    rows: list[dict[str, Any]], full: dict[str, Any], max_ratio: float, goals: Goals, metric: str
) -> dict[str, Any] | None:
    """The most accurate SPLIT row at no more than ``max_ratio`` of the tokens (measured,
    within ``goals.ratio_tolerance``), and its gap to full resolution in points (``met``:
    at most ``goals.match_points``)."""
    goal_points = goals.match_points
    within = [
        r for r in rows if r["policy"] == "learned" and r["token_ratio"] <= max_ratio + goals.ratio_tolerance + 1e-9
    ]
    if not within:
        return None
    top = max(within, key=lambda r: r[metric])
    gap = (full[metric] - top[metric]) * 100.0
    return {
        "method": top["method"],
        "target_ratio": top["target_ratio"],
        "token_ratio": top["token_ratio"],
        metric: top[metric],
        "gap_points": gap,
        "gap_std_points": gap_spread(full, top),
        "goal_points": goal_points,
        "max_token_ratio": max_ratio,
        "ratio_tolerance": goals.ratio_tolerance,
        "met": gap <= goal_points + EPS,
    }


def reference_convergence(backbones: list[dict[str, Any]], goals: Goals, metric: str) -> dict[str, Any] | None:
    """Whether each seed's backbone (the reference every method starts from) had
    converged: its validation ``metric`` gained less than ``goals.converge_points``
    over its last ``goals.converge_epochs`` epochs. Each seed's curve comes along
    (``curve``: the metric per epoch). None when the study sets no such goal."""
    if goals.converge_points is None:
        return None
    k = goals.converge_epochs
    seeds: dict[str, dict[str, Any]] = {}
    for backbone in backbones:
        curve = [float(h[metric]) for h in backbone.get("history") or [] if metric in h]
        record: dict[str, Any] = {"curve": curve, "epochs": len(curve)}
        if len(curve) > k:
            record["gain_points"] = (curve[-1] - curve[-1 - k]) * 100.0
            record["met"] = record["gain_points"] < goals.converge_points
        else:  # too short a curve to tell (or one stored before curves were kept)
            record["gain_points"] = None
            record["met"] = False
        seeds[str(backbone["seed"])] = record
    if not seeds:
        return None
    return {
        "over_epochs": k,
        "goal_points": goals.converge_points,
        "seeds": seeds,
        "met": all(s["met"] for s in seeds.values()),
    }


def study_time(
    seconds: float,
    backbones: list[dict[str, Any]],
    runs: int,
    goals: Goals,
    *,
    begun: Sequence[str] = (),
    failed: int = 0,
    borrowed_references: bool = False,
) -> dict[str, Any] | None:
    """How long this invocation of a study of ``runs`` runs took, against
    ``goals.max_minutes``; None when the study sets no such goal.

    The verdict (``met``) is given only for an invocation that ran the whole study
    from the start, every run finishing: runs an earlier invocation had started or
    finished (``begun``, by name: :func:`begun_runs`), references borrowed from another
    study, or failed runs would make the time a part of the study's. The machine comes
    along, as the time is as much its as the study's: its CPU count and the references'
    training throughput (``backbones``' last epoch, images/s per run, the mean over seeds),
    of the references this invocation trained: a ``reused`` one's (borrowed, or finished
    earlier) is another invocation's, maybe another machine's.
    """
    if goals.max_minutes is None:
        return None
    speeds = [
        b["metrics"]["train_images_per_s"]
        for b in backbones
        if not b.get("reused") and "train_images_per_s" in b.get("metrics", {})
    ]
    record: dict[str, Any] = {
        "minutes": seconds / 60.0,
        "goal_minutes": goals.max_minutes,
        "runs": runs,
        "begun_earlier": list(begun),
        "failed_runs": failed,
        "borrowed_references": borrowed_references,
        "cpus": os.cpu_count(),
        "reference_images_per_s": sum(map(float, speeds)) / len(speeds) if speeds else None,
    }
    if not begun and not failed and not borrowed_references:
        record["met"] = record["minutes"] <= goals.max_minutes
    return record


def matched_point(rows: list[dict[str, Any]], goals: Goals, metric: str) -> dict[str, Any] | None:
    """The SPLIT point for the speed comparison: the fewest tokens among those within
    ``goals.match_points`` of full resolution; failing that, the most accurate one at
    or under ``goals.match_ratio``."""
    full = next((r for r in rows if r["policy"] == "full"), None)
    learned = [r for r in rows if r["policy"] == "learned"]
    if full is None or not learned:
        return None
    close = [r for r in learned if (full[metric] - r[metric]) * 100.0 <= goals.match_points + EPS]
    if close:
        return {**min(close, key=lambda r: r["token_ratio"]), "matches_full": True}
    capped = [r for r in learned if r["token_ratio"] <= goals.match_ratio + goals.ratio_tolerance + 1e-9] or learned
    return {**max(capped, key=lambda r: r[metric]), "matches_full": False}


def speed_comparison(
    split_checkpoint: str,
    full_checkpoint: str,
    *,
    target_ratio: float,
    split: str,
    batch_size: int,
    rounds: int,
    calibration_samples: int,
    seed: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """Forward images/s of a trained SPLIT checkpoint at ``target_ratio`` against the
    trained full-resolution checkpoint, timed interleaved on the same batch."""
    import torch

    from ..bench.timing import time_interleaved
    from ..train.evaluation import CheckpointEvaluator

    split_eval = CheckpointEvaluator(split_checkpoint, samples=batch_size, device=device, split=split)
    full_eval = CheckpointEvaluator(full_checkpoint, samples=batch_size, device=device, split=split)
    calibration = split_eval.first_images(calibration_samples, split="val")
    torch.manual_seed(seed)
    thresholds = split_eval.calibrate(calibration, target_ratio)
    images = split_eval.first_images(batch_size)
    sync = torch.cuda.synchronize if images.device.type == "cuda" else (lambda: None)
    with torch.no_grad(), split_eval.autocast():  # the precision the study evaluated in
        tokens = split_eval.model(images, thresholds=thresholds)
        fns = {
            "split": lambda: split_eval.model(images, thresholds=thresholds),
            "full": lambda: full_eval.model(images),
        }
        times = time_interleaved(fns, repeats=rounds, warmup=2, sync=sync)
    fraction = float(tokens.tokens.float().mean()) / tokens.full_tokens
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "batch_size": batch_size,
        "rounds": rounds,
        "device": str(images.device),
        "thresholds": thresholds,
        "token_fraction": fraction,
        "ideal_ratio": 1.0 / fraction,
        "split_images_per_s": batch_size / median["split"],
        "full_images_per_s": batch_size / median["full"],
        "ratio": median["full"] / median["split"],
        "ratio_fastest_round": min(times["full"]) / min(times["split"]),
    }


def matched_speed(
    spec: StudySpec, rows: list[dict[str, Any]], runs: list[dict[str, Any]], metric: str, run=None
) -> dict[str, Any] | None:
    """:func:`speed_comparison` of the :func:`matched_point` against full resolution,
    on the lowest seed that trained both (``None`` when there is no such pair).
    ``run(fn, *args, **kwargs)`` runs it where the checkpoints' device is (default:
    here, on the CPU)."""
    point = matched_point(rows, spec.goals, metric)
    if point is None:
        return None
    seed = min(int(s) for s in point["per_seed"])
    checkpoints = {(r["method"], r["seed"]): r["checkpoint"] for r in runs}
    full = next(m for m in spec.methods if spec.policy(m) == "full")
    if (full, seed) not in checkpoints:
        return None
    run = run or (lambda fn, *args, **kw: fn(*args, **kw))
    speed = run(
        speed_comparison,
        checkpoints[(point["method"], seed)],
        checkpoints[(full, seed)],
        target_ratio=point["target_ratio"],
        split=spec.split,
        batch_size=spec.speed_batch,
        rounds=spec.speed_rounds,
        calibration_samples=spec.calibration_samples,
        seed=seed,
    )
    speed.update(
        {
            "method": point["method"],
            "target_ratio": point["target_ratio"],
            "seed": seed,
            "matches_full": point["matches_full"],
            metric: point[metric],
        }
    )
    return speed


def points_speed(spec: StudySpec, runs: list[dict[str, Any]], run=None) -> dict[str, Any] | None:
    """Every method's evaluated operating points timed against full resolution, side
    by side in one interleaved run (:func:`~splitvit.tune.speed.time_operating_points`).

    What is timed, to stay within a bounded time: one seed (the lowest that trained
    the ``full`` method); the ``full`` method's checkpoint is the full-resolution
    model; every other method's points of that seed at the evaluation ratios (one
    point for ``coarse``), each with the thresholds its evaluation calibrated (as
    stored with the point), so the timed point is the evaluated one. At most
    ``speed.max_points`` points: each method gets an equal share, spread over its
    ratios (both ends kept). The cost is ``(warmup + rounds) x (points + 1)``
    forward passes of ``speed.batch_size`` images. ``run(fn, *args, **kwargs)`` runs
    it where the checkpoints' device is (default: here, on the CPU).

    Returns the timing record, its points labelled with ``method``, ``target_ratio``
    and ``seed`` (``None`` when there is no full-resolution run or nothing to time).
    """
    from .speed import spread, time_operating_points

    full = next(m for m in spec.methods if spec.policy(m) == "full")
    seeds = sorted(int(r["seed"]) for r in runs if r["method"] == full)
    if not seeds:
        return None
    seed = seeds[0]
    by_method = {r["method"]: r for r in runs if int(r["seed"]) == seed}
    others = [m for m in spec.methods if m != full and m in by_method]
    if not others:
        return None
    share = None if spec.speed_max_points is None else max(1, spec.speed_max_points // len(others))
    chosen = []
    for method in others:
        stored = sorted(
            by_method[method]["points"], key=lambda p: (p["target_ratio"] is None, p["target_ratio"] or 0.0)
        )
        for point in spread(stored, share):
            chosen.append(
                {
                    "checkpoint": by_method[method]["checkpoint"],
                    "thresholds": point.get("thresholds"),
                    "budget": point["target_ratio"],  # what a budget-conditioned policy was told
                    "label": f"{method}@{point['target_ratio']}",
                    "method": method,
                    "target_ratio": point["target_ratio"],
                }
            )
    run = run or (lambda fn, *args, **kw: fn(*args, **kw))
    record = run(
        time_operating_points,
        [{k: p[k] for k in ("checkpoint", "thresholds", "budget", "label")} for p in chosen],
        full_checkpoint=by_method[full]["checkpoint"],
        split=spec.split,
        batch_size=spec.speed_batch,
        rounds=spec.speed_rounds,
        warmup=spec.speed_warmup,
    )
    for point, row in zip(chosen, record["points"]):
        row.update({"method": point["method"], "target_ratio": point["target_ratio"], "seed": seed})
    record["full"][0].update({"method": full, "seed": seed})
    record["seed"] = seed
    return record


def point_speed_lines(record: dict[str, Any] | None) -> list[str]:
    """The operating points' measured speed-ups, one line per method."""
    if not record:
        return []
    full = record["full"][0]
    lines = [
        f"measured speed-up vs {full.get('method', 'full')} ({full['images_per_s']:.0f} images/s; seed "
        f"{record.get('seed')}, batch {record['batch_size']}, "
        f"{record['rounds']} interleaved rounds on {record['device']}):"
    ]
    for method in dict.fromkeys(p.get("method") for p in record["points"]):
        points = [p for p in record["points"] if p.get("method") == method]
        lines.append(
            f"  {method}: "
            + ", ".join(
                (f"@{p['target_ratio']:g}" if p.get("target_ratio") is not None else "")
                + f" {p['speedup_vs_full']:.2f}x ({p['token_ratio']:.0%} tokens)"
                for p in points
            ).strip()
        )
    return lines


def lever_table(rows: list[dict[str, Any]], metric: str, ratios: list[float]) -> list[dict[str, Any]]:
    """The recipe ablation: every SPLIT method's quality at each of ``ratios`` (mean and
    standard deviation over seeds) and its gap to the full-resolution control in
    points; one row per method, ``None`` where the method was not evaluated there."""
    full = next((r for r in rows if r["policy"] == "full"), None)
    table = []
    for method in dict.fromkeys(r["method"] for r in rows if r["policy"] == "learned"):
        entry: dict[str, Any] = {"method": method}
        for ratio in ratios:
            row = next(
                (
                    r
                    for r in rows
                    if r["method"] == method
                    and r["target_ratio"] is not None
                    and math.isclose(r["target_ratio"], ratio)
                ),
                None,
            )
            entry[f"r{ratio:g}"] = (
                None
                if row is None
                else {
                    metric: row[metric],
                    "std": row[f"{metric}_std"],
                    "seeds": row["seeds"],
                    "token_ratio": row["token_ratio"],
                    "gap_points": None if full is None else (full[metric] - row[metric]) * 100.0,
                    "gap_std_points": None if full is None else gap_spread(full, row),
                }
            )
        table.append(entry)
    return table


def lever_lines(table: list[dict[str, Any]], metric: str) -> list[str]:
    """:func:`lever_table` as text: a column per ratio, ``mean ± std (points vs full)``."""
    if not table:
        return []
    ratios = [float(key[1:]) for key in table[0] if key != "method"]
    width = max(len("method"), *(len(row["method"]) for row in table))
    head = "  ".join(f"{metric} @ {ratio:.0%} tokens".ljust(34) for ratio in ratios)
    lines = [f"{'method'.ljust(width)}  {head}"]
    for row in table:
        cells = []
        for ratio in ratios:
            cell = row.get(f"r{ratio:g}")
            if cell is None:
                text = "-"
            else:
                gap = cell["gap_points"]
                versus = "" if gap is None else f" ({_gap_text(gap, cell.get('gap_std_points'))} vs full)"
                text = f"{cell[metric]:.4f} ± {cell['std']:.4f}{versus}"
            cells.append(text.ljust(34))
        lines.append(f"{row['method'].ljust(width)}  {'  '.join(cells)}")
    return lines


def _verdict(goal: dict[str, Any]) -> str:
    return "met" if goal["met"] else "MISSED"


def reuse_phrase(runs: list[dict[str, Any]]) -> str:
    """How many of a study's runs an earlier invocation finished, and how many of those
    were evaluated again (other evaluation settings), for the study's first printed line."""
    reused = sum(bool(r.get("reused")) for r in runs)
    again = sum(bool(r.get("reevaluated")) for r in runs)
    if not reused:
        return ""
    return f" ({reused} finished earlier, reused{f'; {again} evaluated again' if again else ''})"


def _study_time_line(g: dict[str, Any]) -> str:
    machine = f"{g['cpus']} CPUs"
    if g["reference_images_per_s"]:
        machine += f", references training at {g['reference_images_per_s']:.0f} images/s each"
    if "met" in g:
        verdict = _verdict(g)
    else:
        why = []
        if g["begun_earlier"]:
            why.append(f"{len(g['begun_earlier'])} of its {g['runs']} runs begun by an earlier invocation")
        if g["borrowed_references"]:
            why.append("references from another study")
        if g["failed_runs"]:
            why.append(f"{g['failed_runs']} failed")
        verdict = f"not timed ({'; '.join(why)})"
    return (
        f"study time: {g['minutes']:.1f} minutes for {g['runs']} runs on {machine} "
        f"(goal: at most {g['goal_minutes']:g}): {verdict}"
    )


def summary_lines(
    goals: dict[str, Any], speed: dict[str, Any] | None, failed: list[str], point_speed: dict[str, Any] | None = None
) -> list[str]:
    """The goals as measured, the speed comparison, the operating points' measured
    speed-ups (:func:`points_speed`) and the failed runs, one line each
    (``splitvit study`` and the single-GPU runner print these under their table)."""
    lines = []
    if "reference_converged" in goals:
        g = goals["reference_converged"]
        seeds = ", ".join(
            f"seed {seed} "
            + (f"{s['gain_points']:+.2f}" if s["gain_points"] is not None else f"n/a ({s['epochs']} epochs)")
            for seed, s in g["seeds"].items()
        )
        lines.append(
            f"reference converged (gain over its last {g['over_epochs']} epochs < {g['goal_points']} points): "
            f"{seeds}: {_verdict(g)}"
        )
    for g in ([goals["match"]] if "match" in goals else []) + goals.get("match_also", []):
        spread = "" if g.get("gap_std_points") is None else f" (± {g['gap_std_points']:.2f} over seeds)"
        over = g["token_ratio"] - g["max_token_ratio"]
        # a share over the goal's counts only within the tolerance: say so where it is used
        tolerated = f" (within the {g.get('ratio_tolerance', 0):.1%} tolerance)" if over > 1e-9 else ""
        side = "below" if g["gap_points"] > 0 else "above"
        lines.append(
            f"SPLIT vs full resolution: best SPLIT at <= {g['max_token_ratio']:.0%} tokens is {g['method']} @ "
            f"{g['token_ratio']:.2%}{tolerated}: {abs(g['gap_points']):.2f} points {side} "
            f"full{spread} (goal: at most {g['goal_points']} below): "
            f"{_verdict(g)}"
        )
    if "above_baselines" in goals:
        g = goals["above_baselines"]
        w = g["worst"]
        lines.append(
            f"SPLIT above entropy and random at every ratio in {g['range']}: smallest margin "
            f"{w['margin_points']:+.2f} points (vs {w['versus']} at {w['target_ratio']:.2f}): "
            f"{_verdict(g)}"
        )
    if "margin_over_entropy" in goals:
        g = goals["margin_over_entropy"]
        lines.append(
            f"SPLIT over entropy at {g['target_ratio']:.0%} tokens: {g['margin_points']:+.2f} points (goal >= "
            f"{g['goal_points']}): {_verdict(g)}"
        )
    if "study_time" in goals:
        lines.append(_study_time_line(goals["study_time"]))
    if speed:
        s = speed
        which = "matches full resolution" if s["matches_full"] else "best SPLIT point (none matches full resolution)"
        lines.append(
            f"speed ({which}: {s['method']} @ {s['target_ratio']}, seed {s['seed']}, batch {s['batch_size']} "
            f"on {s['device']}): {s['split_images_per_s']:.0f} vs {s['full_images_per_s']:.0f} images/s = "
            f"{s['ratio']:.2f}x (ideal {s['ideal_ratio']:.2f}x at {s['token_fraction']:.1%} tokens)"
        )
    lines += point_speed_lines(point_speed)
    lines += [f"failed: {failure}" for failure in failed]
    return lines


# ---------------------------------------------------------------------- driver
@dataclass
class StudyResult:
    """What :func:`execute_study` produced (also the ``--json`` output of ``splitvit study``)."""

    name: str
    source: str
    study_dir: str
    metric: str
    seeds: list[int]
    rows: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    goals: dict[str, Any]
    speed: dict[str, Any] | None
    failed: list[str]
    mlflow_run_id: str | None  # None: recorded nowhere (a local study without MLflow)
    tracking_uri: str | None
    seconds: float
    point_speed: dict[str, Any] | None = None  # :func:`points_speed`: every method's points timed vs full
    levers: list[dict[str, Any]] = field(default_factory=list)  # :func:`lever_table` at the parity ratios
    references_dir: str | None = None  # the study whose backbones the methods fine-tuned from (None: its own)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data (every field)."""
        from dataclasses import asdict

        return asdict(self)


class StudyExecutor(Protocol):
    """Where a study's runs execute; ``trainer`` says how each is trained and where
    evaluations (and the speed comparison) run."""

    trainer: RunTrainer

    def start(self, spec: StudySpec) -> None:
        """Get ready to run ``spec``'s runs (called once, with its settings final)."""
        ...

    def run(
        self,
        spec: StudySpec,
        storage: str,
        grid: dict[str, list[Any]],
        stage: str,
        backbones: dict[int, str] | None = None,
    ) -> list[dict[str, Any]]:
        """:func:`study_run` for every combination of ``grid`` (``seed``; and ``method``
        in the ``methods`` stage, where ``backbones`` maps seeds to checkpoints); one
        result per run, ``{"config": params, "error": text}`` for a failed one."""
        ...


def _run_label(config: dict[str, Any]) -> str:
    """A grid run by its parameters: ``seed=1 method=split``."""
    return " ".join(f"{k}={v}" for k, v in sorted(config.items()))


def _run_outcome(result: dict[str, Any], metric: str) -> str:
    """A finished run's objectives in a few words: quality and tokens per point."""
    points = result.get("points")
    if points:
        nan = float("nan")
        return "; ".join(
            f"{p.get('target_ratio') if p.get('target_ratio') is not None else 'full'}: "
            f"{metric} {float(p.get('quality', nan)):.4f} at {float(p.get('tokens_per_image', nan)):.1f} tokens/image"
            for p in points
        )
    metrics = result.get("metrics") or {}
    return f"{metric} {float(metrics.get(metric, float('nan'))):.4f}" if metric in metrics else "trained"


def _grid_callback(total: int, stage: str, metric: str) -> Any:
    """The study's console for one Tune grid: a line when a run starts and when it
    ends (with its objectives), and a bar over the runs on a terminal."""
    from ray import tune

    class GridProgress(tune.Callback):
        def __init__(self) -> None:
            self.progress = Progress(f"{stage} runs", total)
            self.ended = 0

        def on_trial_start(self, iteration, trials, trial, **info):
            self.progress.log(log, logging.INFO, "%s run %s started", stage, _run_label(trial.config))

        def on_trial_complete(self, iteration, trials, trial, **info):
            self.ended += 1
            raw = (trial.last_result or {}).get("result")
            try:
                outcome = _run_outcome(json.loads(raw), metric) if raw else "no result"
            except (TypeError, ValueError):
                outcome = "no result"
            self.progress.log(
                log,
                logging.INFO,
                "%s run %s finished (%d/%d): %s",
                stage,
                _run_label(trial.config),
                self.ended,
                total,
                outcome,
            )
            self.progress.update(self.ended)

        def on_trial_error(self, iteration, trials, trial, **info):
            self.ended += 1
            self.progress.log(
                log, logging.WARNING, "%s run %s failed (%d/%d)", stage, _run_label(trial.config), self.ended, total
            )
            self.progress.update(self.ended)

    return GridProgress()


def _tune_grid(trainable, grid: dict[str, list[Any]], spec: StudySpec, storage: str, name: str) -> list[dict[str, Any]]:
    """Run one Tune grid; returns each trial's stored result (``{"config", "error"}`` for a failed one)."""
    from ray import tune

    trainable = tune.with_resources(trainable, dict(spec.trial_resources))
    total = math.prod(len(v) for v in grid.values())
    stage = name.split("-")[0]  # "backbones" or "methods"
    tuner = tune.Tuner(
        trainable,
        param_space={k: tune.grid_search(v) for k, v in grid.items()},
        tune_config=tune.TuneConfig(max_concurrent_trials=spec.max_concurrent, reuse_actors=True),
        run_config=tune.RunConfig(
            name=name,
            storage_path=storage,
            failure_config=tune.FailureConfig(max_failures=0),
            callbacks=[_grid_callback(total, stage, spec.metric)],
            # Ray's per-trial boxes and status tables off (the callback prints a line per
            # run instead); back with -v
            verbose=tune_verbosity(),
        ),
    )
    results = []
    with ray_console():
        fitted = tuner.fit()
    unfinished = [r for r in fitted if r.error is None and "result" not in (r.metrics or {})]
    if unfinished:
        # neither a result nor an error: Tune's own Ctrl-C/SIGTERM handler returned from fit
        from ..errors import Interrupted, as_interrupted

        raise Interrupted(
            as_interrupted(KeyboardInterrupt()).signum,
            f"{len(unfinished)} of {total} {stage} runs unfinished; the finished ones are kept "
            "and the same study command continues the study",
        )
    for result in fitted:
        if result.error is not None:
            log.error("trial %s failed: %s", result.config, result.error)
            results.append({"config": result.config, "error": str(result.error)})
        else:
            results.append(json.loads(result.metrics["result"]))
    return results


@dataclass
class TuneExecutor:
    """Ray Tune grid trials (``run.max_concurrent`` at once, ``run.trial_resources``
    each), one per run, each training with Ray Train (:class:`RayTrainer`); the Tune
    experiments go under ``study_dir``."""

    study_dir: str
    ray_address: str | None = None
    trainer: RunTrainer = field(default_factory=RayTrainer)
    stamp: str = ""

    def start(self, spec: StudySpec) -> None:
        """Start (or join) Ray; the Tune experiments' names get this invocation's time."""
        from ..train.ray_trainer import init_ray

        # Ray's forwarded worker output stays on: a study's runs train inside its Tune
        # trials, and their per-epoch lines come only from there (a sweep prints its own)
        init_ray(self.ray_address)
        self.stamp = time.strftime("%Y%m%d-%H%M%S")

    def run(
        self,
        spec: StudySpec,
        storage: str,
        grid: dict[str, list[Any]],
        stage: str,
        backbones: dict[int, str] | None = None,
    ) -> list[dict[str, Any]]:
        """One Tune grid of :func:`backbone_trial` or (with ``backbones``) :func:`method_trial`."""
        from ray import tune

        if backbones is None:
            trainable = tune.with_parameters(backbone_trial, spec=spec, storage=storage)
        else:
            trainable = tune.with_parameters(method_trial, spec=spec, storage=storage, backbones=backbones)
        return _tune_grid(trainable, grid, spec, self.study_dir, f"{stage}-{self.stamp}")


def study_name(study_path: str | Path, scale: str | None = None, name: str | None = None) -> str:
    """The study's folder name: ``name``, else ``study-<file>`` (the file's stem when it
    starts with ``study``) with ``-<scale>``."""
    stem = Path(study_path).stem
    return name or (stem if stem.startswith("study") else f"study-{stem}") + (f"-{scale}" if scale else "")


def execute_study(
    spec: StudySpec,
    executor: StudyExecutor,
    *,
    name: str,
    study_dir: str,
    tracking_uri: str | None = None,
    started: float | None = None,
    references_dir: str | None = None,
) -> tuple[StudyResult, list[dict[str, Any]]]:
    """Run (or, where ``study_dir`` holds finished runs, finish) the study ``spec`` with
    ``executor``: the backbones, then every method from its seed's backbone (the
    costliest first), the aggregation over seeds, the goals and the speed comparison
    (where ``executor.trainer`` evaluates). With ``tracking_uri``, MLflow records a
    parent run and a child run per method and seed (:func:`_record`). With
    ``references_dir`` (another study's folder), the methods fine-tune from that
    study's finished backbones instead of training their own (e.g. a scale that only
    lengthens the fine-tune); their settings must be what ``spec`` asks for.

    Returns the result and the backbones' stored results. Raises :class:`StudyError`
    when ``study_dir`` holds runs (finished, or started and unfinished) made with other
    settings, or ``references_dir`` lacks a finished backbone or holds other settings.
    """
    started = time.time() if started is None else started
    train_storage = join_uri(study_dir, "train")
    metric = spec.metric
    begun = begun_runs(spec, train_storage, [None, *spec.methods])  # before this invocation
    if references_dir is None:
        reference_storage = train_storage
        stale = stale_runs(spec, train_storage)
    else:
        reference_storage = join_uri(references_dir, "train")
        missing = [s for s in spec.seeds if _stored(join_uri(reference_storage, run_name(s, None))) is None]
        if missing:
            raise StudyError(
                f"the references in {references_dir} are not finished for seed(s) "
                f"{', '.join(map(str, missing))}: finish that study's backbones first, or train this "
                "study's own (without --references-from)"
            )
        stale_references = stale_runs(spec, reference_storage, [None])
        if stale_references:
            raise StudyError(
                f"the references in {references_dir} were made with other settings than {spec.source} "
                f"asks for now: {'; '.join(stale_references)}. Only studies with the same reference "
                "(backbone) settings can share references."
            )
        stale = stale_runs(spec, train_storage, list(spec.methods))
    if stale:
        raise StudyError(
            f"study {name} in {study_dir} holds runs made with other settings than "
            f"{spec.source} asks for now: {'; '.join(stale)}. Run it under another --name, or delete "
            "those runs' folders to train them again."
        )

    executor.start(spec)
    parent = None
    if tracking_uri is not None:
        from ..tracking import RunTracker
        from ..tracking.runs import close_stale_runs
        from .mlflow_records import KIND_TAG, METRIC_TAG, flat_params

        params = {
            **flat_params(
                {
                    "seeds": spec.seeds,
                    "ratios": spec.ratios,
                    "scale": spec.scale or "cpu",
                    "methods": spec.methods,
                    "backbone": spec.backbone,
                    "method": spec.method,
                    **({"references": references_dir} if references_dir is not None else {}),
                }
            ),
            **{f"config.{k}": v for k, v in flat_params({**spec.config, **spec.overrides}).items()},
        }
        parent, _ = RunTracker.open(
            tracking_uri,
            spec.experiment,
            study_dir,
            name,
            params=params,
            tags={KIND_TAG: "study", METRIC_TAG: metric, "splitvit.study": spec.source},
        )
        close_stale_runs(parent)  # runs a driver that died left RUNNING end KILLED
    log.info(
        "study %s: %d seeds x %d methods%s",
        name,
        len(spec.seeds),
        len(spec.methods),
        f", MLflow run {parent.run_id}" if parent else "",
    )
    with parent.closed_on_error() if parent is not None else contextlib.nullcontext():
        backbones = executor.run(spec, reference_storage, {"seed": spec.seeds}, "backbones")
        ready = {int(b["seed"]): b["checkpoint"] for b in backbones if "checkpoint" in b}
        failed = [f"backbone seed {b['config'].get('seed')}: {b['error']}" for b in backbones if "error" in b]
        # the costliest methods first, so the last runs to finish are short ones
        order = sorted(spec.methods, key=lambda m: (spec.policy(m) != "learned", spec.policy(m) != "full"))
        runs: list[dict[str, Any]] = []
        if ready:
            runs = executor.run(
                spec, train_storage, {"seed": sorted(ready), "method": order}, "methods", backbones=ready
            )
        failed += [
            f"{r['config'].get('method')} seed {r['config'].get('seed')}: {r['error']}" for r in runs if "error" in r
        ]
        runs = [r for r in runs if "points" in r]
        rows = aggregate(runs, metric)
        goals = check_goals(rows, spec.goals, metric)
        converged = reference_convergence([b for b in backbones if "checkpoint" in b], spec.goals, metric)
        if converged is not None:
            goals["reference_converged"] = converged
        base = spec.run_config(spec.seeds[0], None, "base")
        # the speed comparison runs where training ran
        on_device = lambda fn, *args, **kw: executor.trainer.evaluate(base, fn, *args, **kw)  # noqa: E731
        speed = matched_speed(spec, rows, runs, metric, run=on_device) if spec.speed_enabled else None
        point_speed = None
        if spec.speed_enabled and runs:
            try:
                point_speed = points_speed(spec, runs, run=on_device)
            except Exception as exc:  # noqa: BLE001 - a timing that fails must not lose the study
                log.warning("could not time the operating points: %s", exc)
        seconds = time.time() - started
        timed = study_time(
            seconds,
            [b for b in backbones if "checkpoint" in b],
            # this study's runs: borrowed references are another study's
            len(spec.seeds) * (len(spec.methods) + (references_dir is None)),
            spec.goals,
            begun=begun,
            failed=len(failed),
            borrowed_references=references_dir is not None,
        )
        if timed is not None:
            goals["study_time"] = timed
        result = StudyResult(
            name=name,
            source=spec.source,
            study_dir=study_dir,
            metric=metric,
            seeds=spec.seeds,
            rows=rows,
            runs=[{k: v for k, v in r.items() if k != "config"} for r in runs],
            goals=goals,
            speed=speed,
            failed=failed,
            mlflow_run_id=parent.run_id if parent else None,
            tracking_uri=tracking_uri,
            seconds=seconds,
            point_speed=point_speed,
            levers=lever_table(rows, metric, spec.parity_ratios),
            references_dir=references_dir,
        )
        if parent is not None:
            _record(result, spec, parent, runs, tracking_uri)
    if parent is not None:
        parent.close("completed" if not failed else "partial")
    return result, [b for b in backbones if "checkpoint" in b]


def run_study(
    study_path: str | Path,
    overrides: list[str] | None = None,
    *,
    scale: str | None = None,
    name: str | None = None,
    ray_address: str | None = None,
    methods: list[str] | None = None,
    references_from: str | None = None,
) -> StudyResult:
    """Run (or, under an existing ``name``, finish) a study on the platform: Ray Tune
    trials training with Ray Train, recorded in MLflow (see the module docstring).
    ``references_from``: another study's name under the same storage path, whose
    finished references (backbones) the methods fine-tune from."""
    started = time.time()
    spec = load_study(study_path, scale=scale, overrides=overrides, methods=methods)  # bad input stops here
    name = study_name(study_path, scale, name)
    if references_from == name:
        raise StudyError(f"--references-from {references_from} names this study itself; leave it out")
    base = spec.run_config(spec.seeds[0], None, "base")
    from ..cluster.preflight import preflight  # capacity, Ray, MLflow, storage, data: seconds, before Ray starts

    preflight(
        base,
        ray_address=ray_address,
        tracking_uri=base.tracking_uri(),
        trial_resources=spec.trial_resources,
        trial_key="run.trial_resources",
    )
    root = base.storage.resolved_path()
    study_dir = join_uri(root, name)
    references_dir = None if references_from is None else join_uri(root, references_from)
    if base.data.name.startswith("cluttered") and not base.storage.is_remote and "cache_dir" not in base.data.options:
        # render every canvas once, for every run of the study (and of later studies)
        spec.fixed["data.options.cache_dir"] = str(Path(root) / "canvas-cache")
    result, _ = execute_study(
        spec,
        TuneExecutor(study_dir, ray_address),
        name=name,
        study_dir=study_dir,
        tracking_uri=base.tracking_uri(),
        started=started,
        references_dir=references_dir,
    )
    return result


def _record(result: StudyResult, spec: StudySpec, parent, runs: list[dict[str, Any]], tracking_uri: str) -> None:
    """MLflow: a child run per method and seed; the table, plot, goals and speed on the parent."""
    import tempfile

    import matplotlib.pyplot as plt
    import mlflow
    from mlflow.entities import Metric

    from ..tracking import RunTracker
    from .mlflow_records import KIND_TAG, METRIC_TAG, PARENT_TAG

    metric = result.metric
    client = mlflow.MlflowClient(tracking_uri)
    timed = _timed_points(result.point_speed)
    for run in runs:
        child, _ = RunTracker.open(
            tracking_uri,
            spec.experiment,
            run["run_uri"],
            f"{run['method']}-s{run['seed']}",
            params=run.get("config") or {},
            tags={
                PARENT_TAG: parent.run_id,
                KIND_TAG: "study-run",
                METRIC_TAG: metric,
                "splitvit.method": run["method"],
                "splitvit.seed": str(run["seed"]),
            },
        )
        recorded = client.get_run(child.run_id).data.metrics
        timed_before = "speedup_vs_full" in recorded and not run.get("reevaluated")
        if result.point_speed and int(run["seed"]) == result.point_speed["seed"] and not timed_before:
            # the measured speed-up at the step of the evaluated point it timed (full resolution: 1.0)
            now = int(time.time() * 1000)
            speed_batch = [
                Metric(key, float(row[src]), now, step)
                for step, point in enumerate(run["points"])
                for row in [timed.get((run["method"], point["target_ratio"]))]
                if row
                for key, src in (
                    ("speedup_vs_full", "speedup_vs_full"),
                    ("timed_images_per_s", "images_per_s"),
                    ("timed_token_ratio", "token_ratio"),
                )
            ]
            if speed_batch:
                client.log_batch(child.run_id, metrics=speed_batch)
        if recorded and not run.get("reevaluated"):
            child.close("completed")
            continue  # recorded by an earlier run of this study
        # (a run evaluated again logs its new points at the same steps: the latest value is the current one)
        # one step per evaluated token ratio: MLflow's metric charts draw the threshold sweep
        now = int(time.time() * 1000)
        batch = [
            Metric(key, float(point[src]), now, step)
            for step, point in enumerate(run["points"])
            for key, src in (
                (metric, "quality"),
                ("tokens_per_image", "tokens_per_image"),
                ("token_ratio", "token_ratio"),
                ("images_per_s", "images_per_s"),
            )
        ]
        client.log_batch(child.run_id, metrics=batch)
        child.log_dict({"points": run["points"], "checkpoint": run["checkpoint"]}, "study_points.json")
        child.close("completed")
    flat_rows = [{k: v for k, v in r.items() if k != "per_seed"} for r in result.rows]
    if timed:  # measured on one seed: the columns say which
        for row in flat_rows:
            found = timed.get((row["method"], row["target_ratio"]))
            row.update(
                {
                    "speedup_vs_full": found["speedup_vs_full"] if found else None,
                    "timed_images_per_s": found["images_per_s"] if found else None,
                    "speed_seed": result.point_speed["seed"] if found else None,
                }
            )
    client.log_table(parent.run_id, data=_columns(flat_rows), artifact_file="study_table.json")
    metrics = {f"goal_{k}_met": float(v["met"]) for k, v in result.goals.items() if isinstance(v, dict) and "met" in v}
    matches = [("", result.goals["match"])] if "match" in result.goals else []
    matches += [(f".r{g['max_token_ratio']:g}", g) for g in result.goals.get("match_also", [])]
    for suffix, g in matches:
        metrics[f"match_gap_points{suffix}"] = g["gap_points"]
        if g.get("gap_std_points") is not None:  # the gap's spread over seeds, seed by seed
            metrics[f"match_gap_std_points{suffix}"] = g["gap_std_points"]
    if "study_time" in result.goals:
        metrics["study_minutes"] = result.goals["study_time"]["minutes"]
    reference = result.goals.get("reference_converged")
    if reference:
        # the reference's validation curve per seed, one step per epoch (MLflow's chart view draws it)
        now = int(time.time() * 1000)
        curves = [
            Metric(f"reference_{metric}.s{seed}", value, now, epoch)
            for seed, record in reference["seeds"].items()
            for epoch, value in enumerate(record["curve"])
        ]
        if (
            curves
            and f"reference_{metric}.s{next(iter(reference['seeds']))}"
            not in client.get_run(parent.run_id).data.metrics
        ):
            client.log_batch(parent.run_id, metrics=curves)
    if result.speed:
        metrics.update({"speed_ratio": result.speed["ratio"], "speed_ideal_ratio": result.speed["ideal_ratio"]})
    if result.point_speed:
        from .mlflow_records import SPEED_DEVICE_TAG, SPEED_TIMING_TAG

        ps = result.point_speed
        metrics["speed_full_images_per_s"] = ps["full"][0]["images_per_s"]
        for (method, ratio), row in timed.items():
            if method != ps["full"][0]["method"]:
                metrics[f"speedup_vs_full.{method}" + (f".r{ratio:g}" if ratio is not None else "")] = row[
                    "speedup_vs_full"
                ]
        client.set_tag(parent.run_id, SPEED_DEVICE_TAG, ps["device"])
        client.set_tag(
            parent.run_id,
            SPEED_TIMING_TAG,
            f"seed {ps['seed']}, batch {ps['batch_size']}, {ps['rounds']} "
            f"interleaved rounds after {ps['warmup']} warm-up, {ps['precision']}",
        )
        client.log_dict(parent.run_id, json.loads(json.dumps(ps, default=str)), "point_speed.json")
    for key, value in metrics.items():
        client.log_metric(parent.run_id, key, float(value))
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "study.json").write_text(json.dumps(result.to_dict(), indent=2, default=float) + "\n")
        fig = study_figure(result.rows, metric, title=f"{result.name}: {metric} vs tokens ({len(result.seeds)} seeds)")
        fig.savefig(Path(folder) / "study.png")
        plt.close(fig)
        client.log_artifact(parent.run_id, str(Path(folder) / "study.json"))
        client.log_artifact(parent.run_id, str(Path(folder) / "study.png"))
        if timed:
            fig = study_speed_figure(
                result.rows,
                timed,
                metric,
                title=f"{result.name}: {metric} vs measured speed-up ({result.point_speed['device']})",
            )
            fig.savefig(Path(folder) / "study_speed.png")
            plt.close(fig)
            client.log_artifact(parent.run_id, str(Path(folder) / "study_speed.png"))


def _timed_points(record: dict[str, Any] | None) -> dict[tuple[str, float | None], dict[str, Any]]:
    """(method, target ratio) -> the timed point of :func:`points_speed` (the full
    method's entry at 1.0x included)."""
    if not record:
        return {}
    out = {(p["method"], p["target_ratio"]): p for p in record["points"]}
    full = record["full"][0]
    out[(full["method"], None)] = {**full, "target_ratio": None}
    return out


def study_speed_figure(
    rows: list[dict[str, Any]], timed: dict[tuple[str, float | None], dict[str, Any]], metric: str, title: str = ""
):
    """Mean quality (over seeds) against the speed-up measured on one seed, per method;
    full resolution at 1.0x."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted(
            (timed[(r["method"], r["target_ratio"])]["speedup_vs_full"], r[metric])
            for r in rows
            if r["method"] == method and (r["method"], r["target_ratio"]) in timed
        )
        if not points:
            continue
        policy = next(r["policy"] for r in rows if r["method"] == method)
        fmt = {"full": "*", "coarse": "v"}.get(policy, "o-")
        ax.plot(
            [x for x, _ in points],
            [y for _, y in points],
            fmt,
            ms=10 if policy in ("full", "coarse") else 5,
            label=f"{method} ({policy})",
        )
    ax.axvline(1.0, color="black", lw=0.8, ls=":")
    ax.set_xlabel("measured speed-up vs full resolution (median images/s ratio, same run)")
    ax.set_ylabel(f"{metric} (mean over seeds)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    return fig


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: [r.get(k) for r in rows] for k in keys}


def study_figure(rows: list[dict[str, Any]], metric: str, title: str = ""):
    """Mean quality versus tokens per image per method, error bars one standard
    deviation over seeds; full resolution and all-coarse as single points."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    styles = {"learned": ("o-", None), "entropy": ("s--", "#2ca02c"), "random": ("x:", "#7f7f7f")}
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r for r in rows if r["method"] == method), key=lambda r: r["tokens_per_image"])
        policy = points[0]["policy"]
        xs = [r["tokens_per_image"] for r in points]
        ys = [r[metric] for r in points]
        errs = [r[f"{metric}_std"] for r in points]
        if policy in styles:
            fmt, colour = styles[policy]
            label = f"SPLIT {method}" if policy == "learned" else method
            ax.errorbar(xs, ys, yerr=errs, fmt=fmt, color=colour, ms=5, capsize=3, label=label)
        else:
            marker = "*" if policy == "full" else "v"
            ax.errorbar(xs, ys, yerr=errs, fmt=marker, color="black", ms=12, capsize=3, label=f"{method} ({policy})")
    ax.set_xlabel("tokens per image")
    ax.set_ylabel(f"{metric} (mean ± std over seeds)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig
