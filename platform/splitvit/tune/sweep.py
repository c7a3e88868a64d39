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
5. **Baselines** — with a ``reference:``, full resolution, entropy and random each
   fine-tuned from the reference like the trials (trials Optuna never sees), then
   evaluated at ``baselines.ratios``; without one, the backbone of the frontier point
   with the largest hypervolume contribution evaluated at full resolution, with entropy
   splitting at several thresholds and random splitting at the frontier's budgets.
6. **MLflow** — a parent run for the sweep, a child per trial (a grandchild per
   threshold point); on the parent the frontier table (``log_table`` + CSV), the
   plot with the baselines, the hypervolume, the best point's split maps and the
   frontier points' models.
7. **Speed** — the frontier points (at most ``speed.max_points``) and the
   full-resolution model timed side by side, interleaved, on the device the sweep
   evaluated on (:func:`~splitvit.bench.speed.time_operating_points`; the space's
   ``speed`` section, on by default). Each point's ``speedup_vs_full`` goes to the
   frontier table, its run's metrics and the JSON (``frontier_speed``); the parent
   gets ``pareto_speed.png`` (quality against measured speed-up),
   ``frontier_speed.json``, the device (tag ``splitvit.speed_device``) and
   ``speedup_max``, ``speedup_best_point``, ``speedup_within_1pt_of_full``.

**The modules, by stage.** This module holds :func:`run_sweep` and the steps that
tie the stages together (settle, start, the ``Tuner``, finish); each stage lives in a
module of its own:

* :mod:`.location` — before Ray starts: the MLflow store, the sweep's folder, the
  plan saved with it and the resume check against it;
* :mod:`.search` — stage one's proposals: the Optuna sampler behind ``OptunaSearch``;
* :mod:`.trial` — one trial (training, then stage two on its checkpoint);
  :mod:`.callback` — the Ray Tune callback that records trials as they run;
* :mod:`.outcomes` — after ``Tuner.fit``: the trials' outcomes and their MLflow runs
  made whole, as points;
* :mod:`.frontier_eval` — evaluation on the frontier: baselines, the held-out split,
  the frontier timed against full resolution;
* :mod:`.artifacts` — the frontier's models, registry aliases, split maps, plots,
  speed-ups and tables on the parent run;
* :mod:`.closing` — the result, the summary and description, the parent run closed;
* :mod:`.state` — what the stages hand each other (setup, the started sweep, the
  result) and the sweep's errors; :mod:`.read_back` — a frontier read back from MLflow.

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

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from ..config import config_layers, redact_uri, shared_canvas_cache
from ..storage import join_uri
from ..train.console import environment, ray_console, ray_output_shown, tune_verbosity
from .artifacts import log_sweep_artifacts
from .baseline_store import settle_reused, store_baselines
from .closing import close_sweep_run, sweep_result
from .frontier_eval import evaluate_held_out, run_baselines, time_frontier
from .location import build_tracking, check_plan, sweep_location, warn_if_temporary
from .mlflow_records import REFERENCE_TAG, SPACE_ARTIFACT, SweepRecorder, search_space_yaml, sweep_params
from .outcomes import collect, record_trials
from .pareto import Baseline, annotate, best_point, frontier
from .reference import Reference, check_reference, convergence_line, locate_reference, train_reference
from .search import build_searcher
from .space import SearchSpace, load_space
from .state import (
    Sweep,
    SweepError,
    SweepResult,
    SweepSetup,
    TrialSummary,
    fine_tuned_baselines,
    planned_trials,
    tune_trials,
)
from .trial import SweepPlan, TrialFinal, sweep_trial

log = logging.getLogger(__name__)


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
        # Tune saves its experiment state (what Tuner.restore reads) at most every
        # TUNE_GLOBAL_CHECKPOINT_S seconds, by default at least 10: a driver killed within
        # that window restarts trials that had finished. A sweep's state is small: save it
        # often; a setting in the environment wins
        period = {"TUNE_GLOBAL_CHECKPOINT_S": str(sweep.space.search.state_period_s)}
        with environment(period, override=False), ray_console():
            grid = tuner.fit()
    trials, finals = with_reused_baselines(sweep, *collect(grid, sweep.space, setup.sweep_dir))
    unfinished = [t for t in trials if t.status == "unfinished"]
    planned = planned_trials(sweep.space)
    if unfinished or len(trials) < planned:
        sweep.recorder.close("interrupted")
        raise stopped_early(sweep.name, len(trials), len(unfinished), planned)
    with sweep.recorder.parent.closed_on_error():
        return _finish(sweep, trials, finals)


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


def _settle_sweep(
    space_path: str | Path, overrides: list[str] | None, *, name: str | None, resume: bool, ray_address: str | None
) -> SweepSetup:
    """Load the space, run the preflight checks, find the sweep's folder and check its
    plan: all before Ray starts, so a bad space or a taken name costs seconds."""
    space = load_space(space_path, overrides)  # a bad space stops here, before Ray
    base, tracking_uri, experiment = build_tracking(space)
    from ..cluster.preflight import preflight  # capacity, Ray, MLflow, storage, data: seconds, before Ray starts

    preflight(base, ray_address=ray_address, tracking_uri=tracking_uri, trial_resources=space.search.trial_resources)
    name, sweep_dir = sweep_location(space, base, name, resume)
    checked = check_plan(space, sweep_dir, overrides, resume)
    if checked is not space:  # resumed with the overrides the sweep started with
        space = checked
        base, tracking_uri, experiment = build_tracking(space)
    # where the canvases are kept, like the storage path, is not part of the plan a resume checks
    cache = shared_canvas_cache(base)
    if cache:
        space = dataclasses.replace(space, fixed={**space.fixed, **cache})
        base = space.config()
    storage = base.storage.resolved_path()
    warn_if_temporary(storage)
    reference = locate_reference(space, base, tracking_uri)
    if reference is not None:
        check_reference(space, base, reference)  # the same ViT, before any trial starts
    return SweepSetup(
        space=space,
        base=base,
        tracking_uri=tracking_uri,
        experiment=experiment,
        name=name,
        sweep_dir=sweep_dir,
        storage=storage,
        reference=reference,
    )


def _start_sweep(setup: SweepSetup, *, ray_address: str | None, started: float, resume: bool) -> Sweep:
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
    reused = settle_reused(plan, setup.storage, setup.sweep_dir, resume=resume) if fine_tuned_baselines(space) else {}
    for policy, stored in sorted(reused.items()):
        log.info(
            "baseline %s: reused from sweep %s (trial %s), not trained again", policy, stored.sweep, stored.trial_id
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
    return Sweep(
        setup=setup,
        plan=plan,
        recorder=recorder,
        reference=reference,
        started=started,
        resumed=resume or reopened,
        reused=reused,
    )


def trial_dirname(trial) -> str:
    """Trial folders are named by trial id (the Train run and MLflow keys use it too)."""
    return trial.trial_id


def _trainable(sweep: Sweep) -> Any:
    """:func:`~splitvit.tune.trial.sweep_trial` with the plan and each trial's resources."""
    from ray import tune

    trainable = tune.with_parameters(sweep_trial, plan=sweep.plan)
    return tune.with_resources(trainable, dict(sweep.space.search.trial_resources))


def _tuner(sweep: Sweep, trainable: Any, *, resume: bool) -> Any:
    """The sweep's ``Tuner``: restored from its folder on resume (finished trials kept,
    unfinished ones restarted, failed ones left failed), else a new one."""
    from ray import tune

    from .callback import SweepCallback  # imports Ray

    space, setup = sweep.space, sweep.setup
    if resume:
        log.info("resuming sweep %s from %s", setup.name, setup.sweep_dir)
        return tune.Tuner.restore(
            setup.sweep_dir, trainable=trainable, resume_unfinished=True, resume_errored=False, restart_errored=False
        )
    baselines = [b for b in fine_tuned_baselines(space) if b not in sweep.reused]
    search = build_searcher(space)
    if baselines:
        from .baseline_search import BaselinesLast  # imports Ray

        search = BaselinesLast(search, baselines, searched=space.search.num_samples)
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=search,
            num_samples=tune_trials(sweep),
            max_concurrent_trials=space.search.max_concurrent,
            trial_dirname_creator=trial_dirname,
            # a trial's driver function only waits on its TorchTrainer: keep its
            # process (torch imported) for the next trial instead of starting one
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=setup.name,
            storage_path=setup.storage,
            callbacks=[SweepCallback(sweep.recorder, sweep.plan, tune_trials(sweep))],
            # a failed trial stays failed: Ray Train already retried its workers
            failure_config=tune.FailureConfig(max_failures=0),
            # Ray's per-trial boxes and status tables off (the callback prints a line per
            # trial event instead); back with -v
            verbose=tune_verbosity(),
        ),
    )


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


def _finish(sweep: Sweep, trials: list[TrialSummary], finals: dict[str, TrialFinal]) -> SweepResult:
    """Stage-two points, frontier, hypervolume, baselines, plot and MLflow records."""
    space, recorder = sweep.space, sweep.recorder
    points, tuned_baselines = record_trials(sweep, trials, finals)
    _keep_baselines(sweep, trials)
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
        baselines = run_baselines(space, sweep.plan, best, front)
    if space.evaluation.split is not None and front:
        evaluate_held_out(sweep, front, baselines, {t.trial_id: t.checkpoint for t in trials if t.checkpoint})
    speed = time_frontier(space, sweep.plan, front, best) if front and space.speed.enabled else None
    result = sweep_result(sweep, trials, points, baselines, hv)
    speed_metrics = log_sweep_artifacts(sweep, result, front=front, best=best, speed=speed, local_dir=local_dir)
    close_sweep_run(sweep, result, front=front, best=best, speed_metrics=speed_metrics, local_dir=local_dir)
    return result


def with_reused_baselines(
    sweep: Sweep, trials: list[TrialSummary], finals: dict[str, TrialFinal]
) -> tuple[list[TrialSummary], dict[str, TrialFinal]]:
    """The trials Tune ran and the baselines reused from earlier sweeps, as completed
    trials of their own (their first sweep's trial ids, checkpoints and figures)."""
    trials, finals = list(trials), dict(finals)
    for policy, stored in sorted(sweep.reused.items()):
        trials.append(
            TrialSummary(
                stored.trial_id,
                "completed",
                {},
                checkpoint=stored.checkpoint,
                baseline=policy,
                reused_from=f"sweep {stored.sweep}, trial {stored.trial_id}",
            )
        )
        finals[stored.trial_id] = stored.final(sweep.metric, sweep.space.companion_metrics)
    return sorted(trials, key=lambda t: t.trial_id), finals


def _keep_baselines(sweep: Sweep, trials: list[TrialSummary]) -> None:
    """The baselines this sweep fine-tuned, kept for later sweeps (:mod:`.baseline_store`);
    trouble keeping them is logged, never the sweep's end."""
    trained = {t.baseline: t.trial_id for t in trials if t.baseline and t.status == "completed" and not t.reused_from}
    if not trained:
        return
    try:
        for uri in store_baselines(sweep.plan, sweep.setup.storage, trained):
            log.info("kept for later sweeps: %s", uri)
    except (OSError, ValueError) as exc:
        log.warning("could not keep the baselines for later sweeps: %s", exc)
