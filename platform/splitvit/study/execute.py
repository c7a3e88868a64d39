"""One code path runs every study (:func:`execute_study`): it plans the runs (the
backbones, one per seed, then the methods, one per seed and method), reuses the runs
an earlier invocation finished, evaluates every method at the matched token ratios,
aggregates over seeds, checks the goals, times the speed comparison and records MLflow.
Only where runs execute (a :class:`StudyExecutor`) and how one run is trained (its
:class:`~splitvit.study.runs.RunTrainer`) differ.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..storage import join_uri
from .goals import aggregate, check_goals, lever_table, reference_convergence, study_time
from .records import record_study
from .runs import RunTrainer, _stored, begun_runs, run_name, stale_runs
from .spec import StudyError, StudySpec
from .speed import matched_speed, points_speed

log = logging.getLogger(__name__)


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
    point_speed: dict[str, Any] | None = None  # points_speed: every method's points timed vs full
    levers: list[dict[str, Any]] = field(default_factory=list)  # lever_table at the parity ratios
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
        """:func:`~splitvit.study.runs.study_run` for every combination of ``grid`` (``seed``; and ``method``
        in the ``methods`` stage, where ``backbones`` maps seeds to checkpoints); one
        result per run, ``{"config": params, "error": text}`` for a failed one."""
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
) -> tuple[StudyResult, list[dict[str, Any]]]:
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
        from ..tune.mlflow_records import KIND_TAG, METRIC_TAG, flat_params

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
            record_study(result, spec, parent, runs, tracking_uri)
    if parent is not None:
        parent.close("completed" if not failed else "partial")
    return result, [b for b in backbones if "checkpoint" in b]
