"""``splitvit sweep``: the multi-objective sweep (Ray Tune + Optuna): quality up, tokens down."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .options import (
    TRACKING_HELP,
    add_set_option,
    check_address,
    check_run_settings,
    common_options,
    folder_name,
    overrides,
)
from .output import emit, fail, frontier_table, print_table

if TYPE_CHECKING:  # the type only: the command loads the sweep (and Ray) when it runs
    from ..tune.state import SweepResult


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit sweep`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "sweep",
        parents=[common_options(TRACKING_HELP)],
        help="multi-objective sweep (Ray Tune + Optuna): accuracy up, tokens down; frontier in MLflow",
    )
    p.add_argument("space", help="search space YAML (e.g. search_spaces/smoke.yaml)")
    add_set_option(
        p,
        "a config key fixes that value (train.epochs=1), any other key sets the space's "
        "settings (search.num_samples=3, stage_two.points=2)",
    )
    p.add_argument(
        "--name",
        type=folder_name,
        help="the sweep's folder under the storage path (default: the space's name and a timestamp; "
        "with --resume, the latest sweep of this space)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted sweep (Tuner.restore): finished trials "
        "are not run again, MLflow runs are not duplicated",
    )
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument(
        "--json", help="write every point, the frontier, the hypervolume and the MLflow ids to this JSON file"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run (or resume) the sweep, print its frontier, baselines and where MLflow has it."""
    from ..tune.space import load_space

    # the space file's and the settings' mistakes, before Ray, torch and MLflow load
    space = load_space(args.space, overrides(args), settings_only=True)  # run_sweep makes the full check
    check_before_ray(args, space)
    import ray

    from ..train.console import show_ray_output
    from ..tune import SweepError, run_sweep

    # progress of the sweep (trials starting, epochs, trials finishing) is shown by
    # default, as the project's lines; Ray Tune's own console only with -v
    for logger in ("splitvit.tune", "splitvit.bench.speed"):  # the frontier's timing (bench.speed) too
        logging.getLogger(logger).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    show_ray_output(args.verbose)
    ours = not ray.is_initialized()
    try:
        result = run_sweep(args.space, overrides(args), name=args.name, resume=args.resume, ray_address=args.address)
    except SweepError as exc:
        return fail(args, str(exc))
    finally:
        if ours and ray.is_initialized():
            # Ray forwards the workers' last log lines late; ending it here keeps them
            # above the summary, which is the last thing the command prints
            ray.shutdown()
    data = result.to_dict()
    print_summary(result)
    print_baselines(result)
    print_locations(result)
    data["sweep_status"] = data.pop("status")  # "status" is the envelope's: ok, failed, interrupted
    data.pop("wall_time_s", None)  # the envelope's wall_time_s: the whole command
    emit(args, data, tracking_uri=result.tracking_uri, experiment_id=result.experiment_id, run_id=result.parent_run_id)
    if result.status != "completed":
        return fail(args, "no trial completed, so there is no frontier")
    return 0


def print_summary(result: SweepResult) -> None:
    """The sweep's counts, hypervolume, reference and its frontier table."""
    metric = result.metric
    front = result.frontier()
    counts: dict[str, int] = {}
    for trial in result.trials:
        counts[trial.status] = counts.get(trial.status, 0) + 1
    print()
    print(
        f"sweep {result.name}: {len(result.trials)} trials "
        f"({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}), "
        f"{len(result.points)} points, {len(front)} on the Pareto frontier"
    )
    print(
        f"hypervolume {result.hypervolume:.4f} (reference point: {metric} {result.reference_point['quality']:g}, "
        f"token ratio {result.reference_point['token_ratio']:g})"
    )
    if result.reference is not None:
        print(f"every trial fine-tuned from the reference: {result.reference.source} ({result.reference.checkpoint})")
    held_out = f"; test columns: the {result.held_out_split} split" if result.held_out_split else ""
    print(f"\nPareto frontier ({metric} vs tokens per image on validation{held_out}; searched parameters as columns):")
    if front:
        frontier_table([p.to_dict(metric) for p in front], metric)  # as the JSON lists it
        noise = selection_noise(result)
        if noise:
            print(noise)
    else:
        print("  (empty: no trial completed)")


def selection_noise(result: SweepResult) -> str | None:
    """For an accuracy frontier measured on a known number of validation images, one
    line: the standard error of its figures, and how many neighbouring frontier points
    differ by less (their order is noise, and more images would sharpen the choice)."""
    from ..tune.pareto import standard_error, within_noise

    front = result.frontier()
    if result.metric != "accuracy" or not result.validation_images or len(front) < 2:
        return None
    images = result.validation_images
    mean = sum(p.quality for p in front) / len(front)
    close = within_noise(front, images)
    verdict = (
        f"{len(close)} of {len(front) - 1} neighbouring frontier points differ by less: which of each such "
        "pair is better is noise (stage_two.samples: more validation images)"
        if close
        else "every pair of neighbouring frontier points differs by more"
    )
    return (
        f"chosen on {images} validation images: an accuracy near {mean:.2f} is measured to within about "
        f"{100 * standard_error(mean, images):.1f} points (one standard error); {verdict}"
    )


def print_baselines(result: SweepResult) -> None:
    """The baselines' table (with their held-out figures where the sweep has them) and
    each failed trial's last error line."""
    metric = result.metric
    if result.baselines:
        tuned = result.reference is not None
        where = "fine-tuned from the same reference" if tuned else f"on trial {result.baselines[0].trial_id}'s backbone"
        print(f"\nbaselines {where}, same data:")
        test = [f"test {metric}", "test ratio"] if any(b.held_out for b in result.baselines) else []
        print_table(
            [
                {
                    "baseline": b.label,
                    "tokens/image": b.tokens_per_image,
                    metric: b.quality,
                    "token ratio": b.token_ratio,
                    f"test {metric}": (b.held_out or {}).get(f"test_{metric}", "-"),
                    "test ratio": (b.held_out or {}).get("test_token_ratio", "-"),
                }
                for b in result.baselines
            ],
            ["baseline", "tokens/image", metric, "token ratio", *test],
        )
    for trial in result.trials:
        if trial.status in ("failed", "diverged"):
            last = trial.error.strip().splitlines()[-1] if trial.error.strip() else ""
            print(f"trial {trial.trial_id} {trial.status}: {last[:200]}")


def print_locations(result: SweepResult) -> None:
    """Where the sweep's plot, tables, models and MLflow runs are, and its wall time."""
    print()
    print(f"plot:           {result.plot}")
    if result.split_map:
        print(f"split maps:     {result.split_map}")
    print(f"frontier table: {result.frontier_csv}")
    if result.chart:
        print(f"chart:          {result.chart} (also the run's pareto.html in the UI: hover a point)")
    registered = result.registered_models
    if registered:
        budgets = ", ".join(a for a in registered.aliases if a != "best")
        print(f"models:         registered as {registered.name}, aliases best, {budgets}")
        print(f"                e.g. splitvit eval {registered.aliases['best']}")
    print(
        f"MLflow:         experiment {result.experiment!r} (id {result.experiment_id}), "
        f"parent run {result.parent_run_id}"
    )
    print(f"                the frontier's runs: {result.frontier_url()}")
    command = result.mlflow_ui_command()
    if command.startswith("mlflow ui"):
        print(f"open the UI:    {command}")
        print(f"                then {result.mlflow_url()}")
    else:
        print(f"open the UI:    {result.mlflow_url()}")
    print(f"wall time:      {result.wall_time_s:.0f} s")


def check_before_ray(args: argparse.Namespace, space) -> None:
    """What the settings and the files alone show, before torch, Ray and MLflow load:
    the base config's tracking URI and server, storage path and annotation files
    (:func:`.options.check_run_settings`), the Ray address's form, and, on local
    storage, that ``--resume`` has a sweep to resume and that ``--name`` without it
    names no sweep there already (the words of ``tune.sweep``'s own check, which reads
    the same ``tuner.pkl`` once Ray has loaded)."""
    base = space.config(settings_only=True)
    check_run_settings(base)
    check_address(args)
    if base.storage.is_remote:
        return
    storage = Path(base.storage.resolved_path())
    restorable = args.name is not None and (storage / args.name / "tuner.pkl").is_file()
    if args.resume and args.name is not None and not restorable:
        raise FileNotFoundError(f"--resume: {storage / args.name} holds no sweep to resume")
    if args.resume and args.name is None:
        if not any((p / "tuner.pkl").is_file() for p in storage.glob(f"{Path(space.source).stem}-*")):
            raise FileNotFoundError(f"--resume: no sweep of {space.source} under {storage} to resume")
    if not args.resume and restorable:
        raise FileExistsError(
            f"sweep {storage / args.name} already exists: pass --resume to continue it, or another --name"
        )
