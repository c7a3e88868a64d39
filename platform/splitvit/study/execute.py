"""One code path runs every study (:func:`execute_study`): it plans the runs (the
backbones, one per seed, then the methods, one per seed and method), reuses the runs
an earlier invocation finished, evaluates every method at the matched token ratios,
aggregates over seeds, checks the goals, times the speed comparison and records MLflow.
Only where runs execute (a :class:`StudyExecutor`) and how one run is trained (its
:class:`~splitvit.study.runs.RunTrainer`) differ. Its result, :class:`StudyResult`, is
the ``--json`` output of ``splitvit study`` (docs/usage.md, "The study JSON").
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from ..config import redact_uri
from ..jsontypes import JsonObject
from ..storage import join_uri
from .goals import (
    GoalVerdicts,
    LeverRow,
    StudyRow,
    aggregate,
    check_goals,
    lever_table,
    reference_convergence,
    study_time,
)
from .records import open_study_run, record_study
from .runs import (
    BackboneRun,
    MethodRun,
    RunFailure,
    RunOutcome,
    RunRequest,
    RunTrainer,
    begun_runs,
    finished_run,
    run_name,
    stale_runs,
    stored_result,
)
from .spec import StudyError, StudySpec
from .speed import MatchedSpeed, PointSpeed, matched_speed, points_speed, with_timed_speed

log = logging.getLogger(__name__)


@dataclass
class StudyResult:
    """What :func:`execute_study` produced (also the ``--json`` output of ``splitvit study``)."""

    name: str
    source: str  # the study file
    study_dir: str  # its runs (train/) and Tune experiments
    metric: str  # the quality metric ("accuracy", "miou")
    seeds: list[int]
    rows: list[StudyRow]  # the table: one per method and target ratio, over seeds
    runs: list[MethodRun]  # every finished method run's stored result (its config left out)
    goals: GoalVerdicts
    speed: MatchedSpeed | None  # the matched point against full resolution (None: not timed)
    failed: list[str]  # one line per failed run
    mlflow_run_id: str | None  # None: recorded nowhere (a local study without MLflow)
    tracking_uri: str | None
    seconds: float
    point_speed: PointSpeed | None = None  # every method's points timed against full resolution
    levers: list[LeverRow] = field(default_factory=list)  # the recipe ablation at the parity ratios
    references_dir: str | None = None  # the study whose backbones the methods fine-tuned from (None: its own)

    def to_dict(self) -> JsonObject:
        """The result as JSON-ready data (every field, in field order)."""
        return {
            "name": self.name,
            "source": self.source,
            "study_dir": self.study_dir,
            "metric": self.metric,
            "seeds": list(self.seeds),
            "rows": [row.to_dict() for row in self.rows],
            "runs": [run.to_dict() for run in self.runs],
            "goals": self.goals.to_dict(),
            "speed": None if self.speed is None else self.speed.to_dict(),
            "failed": list(self.failed),
            "mlflow_run_id": self.mlflow_run_id,
            "tracking_uri": self.tracking_uri,
            "seconds": self.seconds,
            "point_speed": None if self.point_speed is None else self.point_speed.to_dict(),
            "levers": [row.to_dict() for row in self.levers],
            "references_dir": self.references_dir,
        }

    @classmethod
    def from_dict(cls, data: JsonObject) -> StudyResult:
        """The inverse of :meth:`to_dict`, e.g. a study's JSON read back (keys besides
        the result's, like the command's envelope, are left out)."""
        metric = data["metric"]
        return cls(
            name=data["name"],
            source=data["source"],
            study_dir=data["study_dir"],
            metric=metric,
            seeds=list(data["seeds"]),
            rows=[StudyRow.from_dict(row, metric) for row in data["rows"]],
            runs=[MethodRun.from_dict(run) for run in data["runs"]],
            goals=GoalVerdicts.from_dict(data["goals"], metric),
            speed=None if data["speed"] is None else MatchedSpeed.from_dict(data["speed"], metric),
            failed=list(data["failed"]),
            mlflow_run_id=data["mlflow_run_id"],
            tracking_uri=data["tracking_uri"],
            seconds=data["seconds"],
            point_speed=None if data["point_speed"] is None else PointSpeed.from_dict(data["point_speed"]),
            levers=[LeverRow.from_dict(row, metric) for row in data["levers"]],
            references_dir=data["references_dir"],
        )


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
        runs: list[RunRequest],
        stage: str,
        backbones: dict[int, str] | None = None,
    ) -> list[RunOutcome]:
        """:func:`~splitvit.study.runs.study_run` for each of ``runs`` (a backbone; or
        a method in the ``methods`` stage, where ``backbones`` maps seeds to
        checkpoints); one result per run, in order, a :class:`~splitvit.study.runs.RunFailure`
        for a failed one. Runs an earlier invocation finished are not among them."""
        ...


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
) -> tuple[StudyResult, list[BackboneRun]]:
    """Run (or, where ``study_dir`` holds finished runs, finish) the study ``spec`` with
    ``executor``: the backbones, then every method from its seed's backbone (the
    costliest first), the aggregation over seeds, the goals and the speed comparison
    (where ``executor.trainer`` evaluates). With ``tracking_uri``, MLflow records a
    parent run and a child run per method and seed (:func:`~splitvit.study.records.record_study`). With
    ``references_dir`` (another study's folder), the methods fine-tune from that
    study's finished backbones instead of training their own (e.g. a scale that only
    lengthens the fine-tune); their settings must be what ``spec`` asks for.

    Returns the result and the backbones' stored results. Raises :class:`~splitvit.study.spec.StudyError`
    when ``study_dir`` holds runs (finished, or started and unfinished) made with other
    settings, or ``references_dir`` lacks a finished backbone or holds other settings.
    """
    started = time.time() if started is None else started
    train_storage = join_uri(study_dir, "train")
    begun = begun_runs(spec, train_storage, [None, *spec.methods])  # before this invocation
    reference_storage = _check_stored_runs(spec, name, study_dir, references_dir)
    executor.start(spec)
    parent = None if tracking_uri is None else open_study_run(spec, tracking_uri, study_dir, name, references_dir)
    log.info(
        "study %s: %d seeds x %d methods%s",
        name,
        len(spec.seeds),
        len(spec.methods),
        f", MLflow run {parent.run_id}" if parent else "",
    )
    with parent.closed_on_error() if parent is not None else contextlib.nullcontext():
        backbones, runs, failed = _run_stages(spec, executor, reference_storage, train_storage)
        rows = aggregate(runs, spec.metric, spec.companions)
        speed, point_speed = _speed_step(spec, executor, rows, runs)
        rows = with_timed_speed(rows, point_speed)
        seconds = time.time() - started
        result = StudyResult(
            name=name,
            source=spec.source,
            study_dir=study_dir,
            metric=spec.metric,
            seeds=spec.seeds,
            rows=rows,
            runs=[replace(r, config=None) for r in runs],
            goals=_goal_verdicts(spec, rows, backbones, seconds, begun, len(failed), references_dir),
            speed=speed,
            failed=failed,
            mlflow_run_id=parent.run_id if parent else None,
            tracking_uri=tracking_uri,
            seconds=seconds,
            point_speed=point_speed,
            levers=lever_table(rows, spec.parity_ratios),
            references_dir=references_dir,
        )
        if parent is not None and tracking_uri is not None:
            record_study(result, spec, parent, runs, tracking_uri)
    if parent is not None:
        parent.close("completed" if not failed else "partial")
    return result, backbones


def _check_stored_runs(spec: StudySpec, name: str, study_dir: str, references_dir: str | None) -> str:
    """Where the references (backbones) are, once the runs already there are checked:
    every one made with the settings ``spec`` asks for now, and, with ``references_dir``,
    that study's references finished. Raises :class:`~splitvit.study.spec.StudyError`
    naming the runs and keys otherwise, before anything starts."""
    train_storage = join_uri(study_dir, "train")
    if references_dir is None:
        reference_storage = train_storage
        stale = stale_runs(spec, train_storage)
    else:
        reference_storage = join_uri(references_dir, "train")
        missing = [s for s in spec.seeds if stored_result(join_uri(reference_storage, run_name(s, None))) is None]
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
    return reference_storage


def _run_stages(
    spec: StudySpec, executor: StudyExecutor, reference_storage: str, train_storage: str
) -> tuple[list[BackboneRun], list[MethodRun], list[str]]:
    """The backbones, then every method of every seed with a finished backbone (the
    costliest methods first, so the last runs to finish are short ones). Returns the
    finished backbones' and method runs' stored results, and a line per failed run."""
    backbones = _run_stage(spec, executor, reference_storage, [RunRequest(s) for s in spec.seeds], "backbones")
    finished = [b for b in backbones if isinstance(b, BackboneRun)]
    ready = {int(b.seed): b.checkpoint for b in finished}
    failed = [f"backbone seed {b.run.seed}: {b.error}" for b in backbones if isinstance(b, RunFailure)]
    order = sorted(spec.methods, key=lambda m: (spec.policy(m) != "learned", spec.policy(m) != "full"))
    methods = [RunRequest(s, m) for m in order for s in sorted(ready)]  # method-major: costliest first
    runs = _run_stage(spec, executor, train_storage, methods, "methods", ready) if ready else []
    failed += [f"{r.run.method} seed {r.run.seed}: {r.error}" for r in runs if isinstance(r, RunFailure)]
    return finished, [r for r in runs if isinstance(r, MethodRun)], failed


def _run_stage(
    spec: StudySpec,
    executor: StudyExecutor,
    storage: str,
    runs: list[RunRequest],
    stage: str,
    backbones: dict[int, str] | None = None,
) -> list[RunOutcome]:
    """Each of ``runs``' results, in order: a run an earlier invocation finished is read
    here (no Ray trial or process started for it); the rest go to ``executor``."""
    results: dict[int, RunOutcome] = {
        i: r for i, run in enumerate(runs) if (r := finished_run(spec, storage, run)) is not None
    }
    todo = [i for i in range(len(runs)) if i not in results]
    if results:
        where = redact_uri(storage)
        log.info("%s: %d of %d runs finished earlier, read from %s", stage, len(results), len(runs), where)
    if todo:
        results.update(zip(todo, executor.run(spec, storage, [runs[i] for i in todo], stage, backbones)))
    return [results[i] for i in range(len(runs))]


def _speed_step(
    spec: StudySpec, executor: StudyExecutor, rows: list[StudyRow], runs: list[MethodRun]
) -> tuple[MatchedSpeed | None, PointSpeed | None]:
    """The matched point and every method's points timed against full resolution, where
    training ran (``executor.trainer``); nothing with ``speed.enabled: false``. A timing
    of the points that fails is logged, not raised: it must not lose the study."""
    if not spec.speed_enabled:
        return None, None
    base = spec.run_config(spec.seeds[0], None, "base")

    def on_device(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return executor.trainer.evaluate(base, fn, *args, **kwargs)

    point_speed = None
    if runs:
        try:
            point_speed = points_speed(spec, runs, run=on_device)
        except Exception as exc:  # noqa: BLE001 - a timing that fails must not lose the study
            log.warning("could not time the operating points: %s", exc)
    # the matched point's figures are the points' timing where it timed that point
    return matched_speed(spec, rows, runs, point_speed, run=on_device), point_speed


def _goal_verdicts(
    spec: StudySpec,
    rows: list[StudyRow],
    backbones: list[BackboneRun],
    seconds: float,
    begun: list[str],
    failed: int,
    references_dir: str | None,
) -> GoalVerdicts:
    """The goals measured on the rows, the references' convergence and the study's time."""
    timed = study_time(
        seconds,
        backbones,
        # this study's runs: borrowed references are another study's
        len(spec.seeds) * (len(spec.methods) + (references_dir is None)),
        spec.goals,
        begun=begun,
        failed=failed,
        borrowed_references=references_dir is not None,
    )
    return replace(
        check_goals(rows, spec.goals, spec.metric),
        reference_converged=reference_convergence(backbones, spec.goals, spec.metric),
        study_time=timed,
    )
