"""Running and reusing a study's runs, the same under every executor.

A run is seed ``s``'s backbone (``backbone-s<s>``) or one method trained from it
(``<method>-s<s>``), in its own folder under the study's ``train/``. :func:`study_run`
trains it with a :class:`RunTrainer` (:class:`RayTrainer` on the platform) and, for a
method, evaluates it at every matched token ratio (:func:`~splitvit.train.evaluation.evaluate_points`). A finished
run's result is stored in its folder (:data:`STUDY_RESULT_FILE`) and reused by a later
invocation; :func:`stale_runs` and :func:`begun_runs` read what earlier invocations left.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

from ..config import ExperimentConfig, inert_keys, upgrade_flat
from ..jsontypes import JsonObject
from ..storage import exists, join_uri, read_bytes, write_bytes
from ..train.points import EvaluatedPoint
from .spec import StudySpec

if TYPE_CHECKING:
    from ..train.trial import TrainedRun

log = logging.getLogger(__name__)

STUDY_RESULT_FILE = "study_result.json"  # a finished run's stored result, in its run folder
STUDY_STARTED_FILE = "study_started.json"  # the config a run started training with (an unfinished run's settings)
THRESHOLDED = ("learned", "entropy", "random")


def run_name(seed: int, method: str | None) -> str:
    """The run folder's name: seed ``seed``'s backbone (``method=None``) or a method run."""
    return f"backbone-s{seed}" if method is None else f"{method}-s{seed}"


# ---------------------------------------------------------------------- the records
@dataclass(frozen=True)
class RunRequest:
    """A run to make: seed ``seed``'s backbone (``method`` ``None``) or that method
    trained from it."""

    seed: int
    method: str | None = None

    @property
    def name(self) -> str:
        """Its folder's name (:func:`run_name`)."""
        return run_name(self.seed, self.method)

    @property
    def label(self) -> str:
        """The run by its parameters, for the console: ``method=split seed=1``."""
        return " ".join(f"{k}={v}" for k, v in sorted(self.to_dict().items()))

    def to_dict(self) -> JsonObject:
        """``{"seed": ...}``, with ``"method"`` for a method run (a Tune trial's parameters)."""
        return {"seed": self.seed} if self.method is None else {"seed": self.seed, "method": self.method}

    @classmethod
    def from_dict(cls, data: JsonObject) -> RunRequest:
        """The inverse of :meth:`to_dict`."""
        return cls(int(data["seed"]), None if data.get("method") is None else str(data["method"]))


@dataclass(frozen=True)
class StudyEvaluation:
    """The evaluation settings a study's method points are made with (its file's
    ``evaluation``), as a method run stores them beside its points: a run made with
    others is evaluated again."""

    split: str
    samples: int | None
    ratios: tuple[float, ...]
    calibration_samples: int

    @classmethod
    def of(cls, spec: StudySpec) -> StudyEvaluation:
        """The settings ``spec`` evaluates every method's points with."""
        return cls(spec.split, spec.samples, tuple(spec.ratios), spec.calibration_samples)

    def to_dict(self) -> JsonObject:
        """``{"split", "samples", "ratios", "calibration_samples"}``, as a run's JSON holds them."""
        return {
            "split": self.split,
            "samples": self.samples,
            "ratios": list(self.ratios),
            "calibration_samples": self.calibration_samples,
        }

    @classmethod
    def from_dict(cls, data: JsonObject) -> StudyEvaluation:
        """The inverse of :meth:`to_dict`."""
        return cls(data["split"], data["samples"], tuple(data["ratios"]), data["calibration_samples"])


@dataclass(frozen=True)
class BackboneRun:
    """A seed's finished backbone (the reference its methods fine-tune from), as stored
    in its run folder (:data:`STUDY_RESULT_FILE`) and returned by :func:`study_run`.
    An optional field that is ``None`` is left out of the JSON."""

    seed: int
    checkpoint: str
    metrics: dict[str, float]  # the last epoch's
    train_seconds: float
    run_uri: str
    config: dict[str, Any] | None = None  # the flat config it trained (None: left out, as in a study's JSON)
    history: list[dict[str, float]] | None = None  # every epoch's figures
    steps: int | None = None  # its optimiser steps (the local trainer's)
    reused: bool | None = None  # finished by an earlier invocation (None: as stored)
    reevaluated: bool | None = None  # evaluated again under other evaluation settings (None: as stored)

    def to_dict(self) -> JsonObject:
        """The JSON-ready record (every field set, in field order)."""
        return _record_dict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> BackboneRun:
        """The inverse of :meth:`to_dict` (a missing required key raises ``KeyError``)."""
        return cls(**_record_fields(cls, data))


@dataclass(frozen=True)
class MethodRun:
    """One method of one seed trained from the seed's backbone and evaluated at the
    matched token ratios, as stored in its run folder and returned by :func:`study_run`.
    An optional field that is ``None`` is left out of the JSON."""

    seed: int
    method: str
    policy: str
    checkpoint: str
    train_metrics: dict[str, float]  # the last epoch's
    points: list[EvaluatedPoint]  # one per evaluated token ratio (evaluate_points')
    train_seconds: float
    eval_seconds: float
    run_uri: str
    config: dict[str, Any] | None = None  # the flat config it trained (None: left out, as in a study's JSON)
    evaluation: StudyEvaluation | None = None  # the settings its points were made with (None: not kept then)
    history: list[dict[str, float]] | None = None  # every epoch's figures
    steps: int | None = None  # its optimiser steps (the local trainer's)
    reused: bool | None = None  # finished by an earlier invocation (None: as stored)
    reevaluated: bool | None = None  # evaluated again under other evaluation settings (None: as stored)

    def to_dict(self) -> JsonObject:
        """The JSON-ready record (every field set, in field order)."""
        return _record_dict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> MethodRun:
        """The inverse of :meth:`to_dict` (a missing required key raises ``KeyError``)."""
        values = _record_fields(cls, data)
        values["points"] = [EvaluatedPoint.from_dict(p) for p in values["points"]]
        if values.get("evaluation") is not None:
            values["evaluation"] = StudyEvaluation.from_dict(values["evaluation"])
        return cls(**values)


@dataclass(frozen=True)
class RunFailure:
    """A run that did not finish, and the error in one line."""

    run: RunRequest
    error: str

    def to_dict(self) -> JsonObject:
        """``{"config": <the run's parameters>, "error": error}``."""
        return {"config": self.run.to_dict(), "error": self.error}


StudyRun = BackboneRun | MethodRun
#: what an executor returns for each run it was given
RunOutcome = BackboneRun | MethodRun | RunFailure


def run_from_dict(data: JsonObject) -> StudyRun:
    """A stored run read back: a method run where it names its method, else a backbone."""
    return MethodRun.from_dict(data) if "method" in data else BackboneRun.from_dict(data)


def outcome_from_dict(data: JsonObject) -> RunOutcome:
    """A run's outcome read back (e.g. from a Tune trial's report): a failure where it
    has an ``error``, else the run."""
    return RunFailure(RunRequest.from_dict(data["config"]), data["error"]) if "error" in data else run_from_dict(data)


def _record_dict(record: BackboneRun | MethodRun) -> JsonObject:
    """A run record's fields, those set (not ``None``), in field order, copied (a
    method run's points and evaluation settings as their JSON)."""
    return {
        f.name: _field_json(f.name, value)
        for f in fields(record)
        if (value := getattr(record, f.name)) is not None or f.default is MISSING
    }


def _field_json(name: str, value: Any) -> Any:
    """One field of a run record as its JSON."""
    if name == "points":
        return [p.to_dict() for p in value]
    return value.to_dict() if isinstance(value, StudyEvaluation) else copy.deepcopy(value)


def _record_fields(cls: type, data: JsonObject) -> dict[str, Any]:
    """``cls``'s fields read from ``data``: a required one missing raises ``KeyError``."""
    required = {f.name for f in fields(cls) if f.default is MISSING}
    missing = required - set(data)
    if missing:
        raise KeyError(", ".join(sorted(missing)))
    return {f.name: copy.deepcopy(data[f.name]) for f in fields(cls) if f.name in data}


def stored_result(run_uri: str, file: str = STUDY_RESULT_FILE) -> JsonObject | None:
    """What the run at ``run_uri`` stored in ``file`` (its result, by default), or ``None``."""
    uri = join_uri(run_uri, file)
    return json.loads(read_bytes(uri)) if exists(uri) else None


def stored_run(run_uri: str) -> StudyRun | None:
    """The run at ``run_uri`` as it stored its result, or ``None`` when it has none."""
    stored = stored_result(run_uri)
    return None if stored is None else run_from_dict(stored)


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

    def train(self, config: ExperimentConfig) -> TrainedRun:
        """Train ``config``: how it ended, the last epoch's figures, the checkpoint
        (``None`` without one) and what is stored with the run (per-epoch ``history``)."""
        ...

    def evaluate(self, config: ExperimentConfig, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, device=<where config trains>, **kwargs)``, run there."""
        ...


@dataclass(frozen=True)
class RayTrainer:
    """Ray Train, inside a Tune trial (:func:`~splitvit.train.trial.fit_trial`); evaluations
    where training ran (:func:`~splitvit.train.trial.run_evaluation`: a GPU task for GPU runs)."""

    def train(self, config: ExperimentConfig) -> TrainedRun:
        """:func:`~splitvit.train.trial.fit_trial`."""
        from ..train.trial import fit_trial

        return fit_trial(config)

    def evaluate(self, config: ExperimentConfig, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """:func:`~splitvit.train.trial.run_evaluation`."""
        from ..train.trial import run_evaluation

        return run_evaluation(config, fn, *args, **kwargs)


def study_run(
    spec: StudySpec, storage: str, run: RunRequest, trainer: RunTrainer, backbones: dict[int, str] | None = None
) -> StudyRun:
    """One run of the study, the same under every executor: seed ``run.seed``'s
    backbone, or with ``run.method`` that method trained by ``trainer`` from the
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

    seed, method, name = run.seed, run.method, run.name
    run_uri = join_uri(storage, name)
    stored = stored_run(run_uri)
    if _reusable(spec, method, stored):
        return replace(stored, reused=True, reevaluated=False)
    # validated (the backbone checkpoint included) only for a run that trains or evaluates
    config = spec.run_config(seed, method, name, storage, init_from=None if method is None else backbones[seed])
    if isinstance(stored, MethodRun):
        # finished under other evaluation settings (ratios, samples...): evaluation only
        started = time.time()
        stored = replace(
            stored,
            points=_evaluate_run(spec, config, trainer, stored.checkpoint, method, seed),
            eval_seconds=time.time() - started,
            evaluation=StudyEvaluation.of(spec),
        )
        _store(run_uri, stored)
        log.info("%s: evaluated again at the study's evaluation settings (its training is reused)", name)
        return replace(stored, reused=True, reevaluated=True)
    started = time.time()
    # what an interrupted run would resume with, for the next invocation's stale check
    write_bytes(join_uri(run_uri, STUDY_STARTED_FILE), json.dumps({"config": config.flat()}, default=float).encode())
    trained = trainer.train(config)
    if trained.status != "completed" or trained.checkpoint is None:
        raise TrialFailed(f"{'backbone ' if method is None else ''}{name} {trained.status}: {trained.message}")
    train_seconds = time.time() - started
    # the trainer's own training time where it keeps one (the local trainer's), else this clock's
    trained_for = train_seconds if trained.train_seconds is None else trained.train_seconds
    made: StudyRun
    if method is None:
        made = BackboneRun(
            seed=seed,
            checkpoint=trained.checkpoint,
            metrics=trained.metrics,
            train_seconds=trained_for,
            run_uri=run_uri,
            config=config.flat(),
            history=trained.history,
            steps=trained.steps,
        )
    else:
        points = _evaluate_run(spec, config, trainer, trained.checkpoint, method, seed)
        made = MethodRun(
            seed=seed,
            method=method,
            policy=spec.policy(method),
            checkpoint=trained.checkpoint,
            train_metrics=trained.metrics,
            points=points,
            train_seconds=trained_for,
            eval_seconds=time.time() - started - train_seconds,
            run_uri=run_uri,
            config=config.flat(),
            evaluation=StudyEvaluation.of(spec),
            history=trained.history,
            steps=trained.steps,
        )
    _store(run_uri, made)
    return replace(made, reused=False, reevaluated=False)


def _store(run_uri: str, run: StudyRun) -> None:
    """``run``'s result in its folder (:data:`STUDY_RESULT_FILE`), as a later invocation reads it."""
    write_bytes(join_uri(run_uri, STUDY_RESULT_FILE), json.dumps(run.to_dict(), default=float).encode())


def finished_run(spec: StudySpec, storage: str, run: RunRequest) -> StudyRun | None:
    """What :func:`study_run` returns for ``run`` where an earlier invocation finished
    it, with this study's evaluation settings for a method run: its stored result,
    ``reused``. ``None`` when the run has training or evaluation to do."""
    stored = stored_run(join_uri(storage, run.name))
    return replace(stored, reused=True, reevaluated=False) if _reusable(spec, run.method, stored) else None


def _reusable(spec: StudySpec, method: str | None, stored: StudyRun | None) -> bool:
    """Whether a run's stored result stands as it is: finished, and for a method run
    evaluated with ``spec``'s evaluation settings."""
    return stored is not None and (method is None or _same_evaluation(spec, stored))


def _same_evaluation(spec: StudySpec, stored: StudyRun) -> bool:
    """Whether a finished method run's points were made with ``spec``'s evaluation settings."""
    evaluation = stored.evaluation if isinstance(stored, MethodRun) else None
    return evaluation is None or evaluation == StudyEvaluation.of(spec)


def _evaluate_run(
    spec: StudySpec, config: ExperimentConfig, trainer: RunTrainer, checkpoint: str, method: str, seed: int
) -> list[EvaluatedPoint]:
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
