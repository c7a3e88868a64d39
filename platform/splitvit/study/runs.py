"""Running and reusing a study's runs, the same under every executor.

A run is seed ``s``'s backbone (``backbone-s<s>``) or one method trained from it
(``<method>-s<s>``), in its own folder under the study's ``train/``. :func:`study_run`
trains it with a :class:`RunTrainer` (:class:`RayTrainer` on the platform) and, for a
method, evaluates it at every matched token ratio (:func:`~splitvit.train.evaluation.evaluate_points`). A finished
run's result is stored in its folder (:data:`STUDY_RESULT_FILE`) and reused by a later
invocation; :func:`stale_runs` and :func:`begun_runs` read what earlier invocations left.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import ExperimentConfig, inert_keys, upgrade_flat
from ..storage import exists, join_uri, read_bytes, write_bytes
from .spec import StudySpec

log = logging.getLogger(__name__)

STUDY_RESULT_FILE = "study_result.json"  # a finished run's stored result, in its run folder
STUDY_STARTED_FILE = "study_started.json"  # the config a run started training with (an unfinished run's settings)
THRESHOLDED = ("learned", "entropy", "random")


def run_name(seed: int, method: str | None) -> str:
    """The run folder's name: seed ``seed``'s backbone (``method=None``) or a method run."""
    return f"backbone-s{seed}" if method is None else f"{method}-s{seed}"


def stored_result(run_uri: str, file: str = STUDY_RESULT_FILE) -> dict[str, Any] | None:
    """What the run at ``run_uri`` stored in ``file`` (its result, by default), or ``None``."""
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
            stored = stored_result(join_uri(storage, name))
            finished = stored is not None
            if not finished:
                stored = stored_result(join_uri(storage, name), STUDY_STARTED_FILE)
            if stored is None or "config" not in stored:
                continue
            # through JSON, as stored (tuples become lists); the backbone's path is checked as the backbone
            now = json.loads(json.dumps(spec.run_config(seed, method, name, storage).flat(), default=float))
            # keys the run never reads (a control's recipe keys, the recipe's name) are no difference
            # and the workers' allocator changes a run's pace, not its results
            ignored = {"model.init_from", "scaling.allocator"} | inert_keys(now)
            then = upgrade_flat(stored["config"])  # a run stored before the keys were grouped: the new names
            keys = sorted(
                k for k in set(now) | set(then) if k not in ignored and now.get(k) != then.get(k, defaults.get(k))
            )
            if keys:
                stale.append(f"{name} ({'' if finished else 'unfinished; '}{', '.join(keys)})")
    return stale


def begun_runs(spec: StudySpec, storage: str, methods: Sequence[str | None]) -> list[str]:
    """The runs under ``storage`` that an invocation has started or finished (a
    later one resumes or reuses them), by name: for :func:`~splitvit.study.goals.study_time`, which
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
    """Ray Train, inside a Tune trial (:func:`~splitvit.train.trial.fit_trial`); evaluations
    where training ran (:func:`~splitvit.train.trial.run_evaluation`: a GPU task for GPU runs)."""

    def train(self, config: ExperimentConfig) -> dict[str, Any]:
        """:func:`~splitvit.train.trial.fit_trial`."""
        from ..train.trial import fit_trial

        return fit_trial(config)

    def evaluate(self, config: ExperimentConfig, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """:func:`~splitvit.train.trial.run_evaluation`."""
        from ..train.trial import run_evaluation

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
    that invocation's) and ``reevaluated``. Raises :class:`~splitvit.train.trial.TrialFailed` when training
    does not complete with a checkpoint.
    """
    from ..train.trial import TrialFailed

    seed, method = _run_of(params)
    name = run_name(seed, method)
    run_uri = join_uri(storage, name)
    stored = stored_result(run_uri)
    if _reusable(spec, method, stored):
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


def finished_run(spec: StudySpec, storage: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """What :func:`study_run` returns for a run (``params``: its ``seed``, and
    ``method`` unless a backbone) that an earlier invocation finished, with this
    study's evaluation settings for a method run: its stored result, ``reused``.
    ``None`` when the run has training or evaluation to do."""
    seed, method = _run_of(params)
    stored = stored_result(join_uri(storage, run_name(seed, method)))
    return {**stored, "reused": True, "reevaluated": False} if _reusable(spec, method, stored) else None


def _run_of(params: dict[str, Any]) -> tuple[int, str | None]:
    """A run's seed and method (``None``: the seed's backbone) from its parameters."""
    return int(params["seed"]), None if params.get("method") is None else str(params["method"])


def _reusable(spec: StudySpec, method: str | None, stored: dict[str, Any] | None) -> bool:
    """Whether a run's stored result stands as it is: finished, and for a method run
    evaluated with ``spec``'s evaluation settings."""
    return stored is not None and (method is None or _same_evaluation(spec, stored))


def _same_evaluation(spec: StudySpec, stored: dict[str, Any]) -> bool:
    """Whether a finished method run's points were made with ``spec``'s evaluation settings."""
    return json.loads(json.dumps(_evaluation(spec))) == stored.get("evaluation", _evaluation(spec))


def _evaluate_run(
    spec: StudySpec, config: ExperimentConfig, trainer: RunTrainer, checkpoint: str, method: str, seed: int
) -> list[dict[str, Any]]:
    """A method run's points (:func:`~splitvit.train.evaluation.evaluate_points`), where ``config`` trains."""
    from ..train.evaluation import evaluate_points  # torch: only for a run that evaluates

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
