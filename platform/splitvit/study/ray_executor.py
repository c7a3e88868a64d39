"""The study on the platform (:func:`run_study`, ``splitvit study``): each stage a
Ray Tune grid of trials (:class:`TuneExecutor`), each trial training one run with Ray
Train (:class:`~splitvit.study.runs.RayTrainer`); only the driver writes MLflow.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import shared_canvas_cache
from ..errors import error_line
from ..storage import join_uri
from ..train.console import ray_console, tune_verbosity
from .execute import StudyResult, execute_study, study_name
from .runs import (
    RayTrainer,
    RunFailure,
    RunOutcome,
    RunRequest,
    RunTrainer,
    outcome_from_dict,
    study_run,
)
from .spec import StudyError, StudySpec, load_study

log = logging.getLogger(__name__)

RUN_KEY = "run"  # a trial's config: {"run": {"seed": 0, "method": "split"}}


def backbone_trial(config: dict[str, Any], spec: StudySpec, storage: str) -> None:
    """Tune trial: the warm-up backbone of seed ``config['run']['seed']``
    (:func:`~splitvit.study.runs.study_run` on Ray Train)."""
    from ray import tune

    result = study_run(spec, storage, RunRequest.from_dict(config[RUN_KEY]), RayTrainer())
    tune.report({"done": 1, "result": json.dumps(result.to_dict(), default=float)})


def method_trial(config: dict[str, Any], spec: StudySpec, storage: str, backbones: dict[int, str]) -> None:
    """Tune trial: one method (``config['run']``: its ``seed`` and ``method``) from its
    seed's backbone, evaluated at every matched token ratio
    (:func:`~splitvit.study.runs.study_run` on Ray Train)."""
    from ray import tune

    result = study_run(spec, storage, RunRequest.from_dict(config[RUN_KEY]), RayTrainer(), backbones)
    tune.report({"done": 1, "result": json.dumps(result.to_dict(), default=float)})


def _tune_grid(trainable, runs: list[RunRequest], spec: StudySpec, storage: str, name: str) -> list[RunOutcome]:
    """Run one Tune grid, a trial for each of ``runs`` (its parameters in the trial's
    config under ``"run"``); returns each run's outcome in order, read from the JSON its
    trial reported (a :class:`RunFailure` with its cause's line for a failed one)."""
    from ray import tune

    from .callback import GridProgress

    trainable = tune.with_resources(trainable, dict(spec.trial_resources))
    total = len(runs)
    stage = name.split("-")[0]  # "backbones" or "methods"
    tuner = tune.Tuner(
        trainable,
        param_space={RUN_KEY: tune.grid_search([r.to_dict() for r in runs])},
        tune_config=tune.TuneConfig(max_concurrent_trials=spec.max_concurrent, reuse_actors=True),
        run_config=tune.RunConfig(
            name=name,
            storage_path=storage,
            failure_config=tune.FailureConfig(max_failures=0),
            callbacks=[GridProgress(total, stage, spec.metric, RUN_KEY)],
            # Ray's per-trial boxes and status tables off (the callback prints a line per
            # run instead); back with -v
            verbose=tune_verbosity(),
        ),
    )
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
    by_run: dict[str, RunOutcome] = {}  # Tune's result order is its own: each result back to its run
    for result in fitted:
        run = RunRequest.from_dict(result.config[RUN_KEY])
        if result.error is not None:
            # the cause's message, not Ray's wrapped traceback (that one with -v)
            message = error_line(result.error)
            log.error("trial %s failed: %s", run.to_dict(), message)
            log.debug("trial %s: %s", run.to_dict(), result.error)
            by_run[run.label] = RunFailure(run, message)
        else:
            by_run[run.label] = outcome_from_dict(json.loads(result.metrics["result"]))
    return [by_run[run.label] for run in runs]


@dataclass
class TuneExecutor:
    """Ray Tune grid trials (``run.max_concurrent`` at once, ``run.trial_resources``
    each), one per run, each training with Ray Train (:class:`~splitvit.study.runs.RayTrainer`); the Tune
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
        init_ray(self.ray_address, worker_logs=True)  # the runs' epoch lines are their workers' output
        self.stamp = time.strftime("%Y%m%d-%H%M%S")

    def run(
        self,
        spec: StudySpec,
        storage: str,
        runs: list[RunRequest],
        stage: str,
        backbones: dict[int, str] | None = None,
    ) -> list[RunOutcome]:
        """One Tune grid of :func:`backbone_trial` or (with ``backbones``) :func:`method_trial`, a trial per run."""
        from ray import tune

        if backbones is None:
            trainable = tune.with_parameters(backbone_trial, spec=spec, storage=storage)
        else:
            trainable = tune.with_parameters(method_trial, spec=spec, storage=storage, backbones=backbones)
        return _tune_grid(trainable, runs, spec, self.study_dir, f"{stage}-{self.stamp}")


def check_study(
    study_path: str | Path,
    overrides: list[str] | None = None,
    *,
    scale: str | None = None,
    name: str | None = None,
    methods: list[str] | None = None,
    references_from: str | None = None,
) -> StudySpec:
    """What the command line, the study file and the storage show, checked in a
    second (torch, Ray and MLflow not loaded): the file, its scale and methods, every
    run's settings, and the study ``references_from`` names. Raises ``ValueError``s
    (:class:`StudyError`, ``ConfigError``) naming the key."""
    from ..storage import exists

    spec = load_study(study_path, scale=scale, overrides=overrides, methods=methods, settings_only=True)
    name = study_name(study_path, scale, name)
    if references_from is not None:
        if references_from == name:
            raise StudyError(f"--references-from {references_from} names this study itself; leave it out")
        root = spec.run_config(spec.seeds[0], None, "base", settings_only=True).storage.resolved_path()
        if not exists(join_uri(root, references_from)):
            raise StudyError(
                f"--references-from {references_from}: no study of that name under {root} "
                f"({join_uri(root, references_from)} does not exist)"
            )
    return spec


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
    check_study(study_path, overrides, scale=scale, name=name, methods=methods, references_from=references_from)
    spec = load_study(study_path, scale=scale, overrides=overrides, methods=methods)  # bad input stops here
    name = study_name(study_path, scale, name)
    base = spec.run_config(spec.seeds[0], None, "base")
    from ..cluster.preflight import preflight  # capacity, Ray, MLflow, storage, data: seconds, before Ray starts

    preflight(
        base,
        ray_address=ray_address,
        tracking_uri=base.tracking_uri(),
        trial_resources=spec.trial_resources,
        trial_key="run.trial_resources",
        worker_logs=True,
    )
    root = base.storage.resolved_path()
    study_dir = join_uri(root, name)
    references_dir = None if references_from is None else join_uri(root, references_from)
    spec.fixed.update(shared_canvas_cache(base))  # every canvas rendered once, for every run and later study
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
