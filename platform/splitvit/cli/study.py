"""``splitvit study``: the evidence study, SPLIT against its baselines at matched token budgets, over seeds."""

from __future__ import annotations

import argparse
import logging
import sys

from .options import (
    TRACKING_HELP,
    add_set_option,
    check_address,
    check_run_settings,
    common_options,
    folder_name,
    overrides,
)
from .output import emit, fail, print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit study`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "study",
        parents=[common_options(TRACKING_HELP)],
        help="the evidence study: SPLIT vs full resolution, all-coarse, entropy and random "
        "splitting, trained alike, at matched token budgets, over seeds",
    )
    p.add_argument("study", help="study YAML (e.g. studies/study_fashion.yaml)")
    add_set_option(p, "a config setting for every run (train.epochs=1, data.options.train_samples=512)")
    p.add_argument("--scale", help="apply the study file's scales.<SCALE> section (e.g. gpu: more data, epochs, GPUs)")
    p.add_argument(
        "--methods",
        type=lambda value: [m.strip() for m in value.split(",") if m.strip()],
        metavar="NAME,NAME",
        help="run these of the file's methods and levers instead of its headline (a lever beside the "
        "control, or a study cut to fit a machine); it still needs a full-resolution and a learned one",
    )
    p.add_argument(
        "--name",
        type=folder_name,
        help="the study's folder under the storage path (default: study-<file>); an existing "
        "study of this name is finished, not repeated",
    )
    p.add_argument(
        "--references-from",
        metavar="NAME",
        help="fine-tune from the finished references (backbones) of the study NAME under the same "
        "storage path instead of training them (e.g. the default study's, for --scale long-finetune, "
        "which only changes the fine-tune); their settings must match this study's",
    )
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument(
        "--json",
        help="write the table (per method and token ratio: mean, std, min, max over seeds), the "
        "per-run points, the goals and the speed comparison to this JSON file",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run (or finish) the study, print its table, levers, goals and speed comparison."""
    from ..study.ray_executor import check_study, run_study

    # the file's and the settings' mistakes (check_study), where the runs write, the
    # MLflow server and the Ray address's form: one line in a second, before torch and
    # Ray load (run_study checks the file again, as for any caller)
    spec = check_study(
        args.study,
        overrides(args),
        scale=args.scale,
        name=args.name,
        methods=args.methods,
        references_from=args.references_from,
    )
    # the study's parent run logs to the base config's store, whatever its runs do
    check_run_settings(spec.run_config(spec.seeds[0], None, "base", settings_only=True), tracked=True)
    check_address(args)
    from ..study.report import lever_lines, reuse_phrase, summary_lines
    from ..train.console import show_ray_output

    # the speed step's line (bench.speed: the timing routine sweeps share) shows as the study's own
    for logger in ("splitvit.study", "splitvit.tune", "splitvit.bench.speed"):
        logging.getLogger(logger).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    show_ray_output(args.verbose)
    ours = not _ray_running()
    try:
        result = run_study(
            args.study,
            overrides(args),
            scale=args.scale,
            name=args.name,
            ray_address=args.address,
            methods=args.methods,
            references_from=args.references_from,
        )
    finally:
        if ours and _ray_running():
            sys.modules["ray"].shutdown()
    metric = result.metric
    print(
        f"\nstudy {result.name}: {len(result.seeds)} seeds, {len(result.runs)} runs"
        f"{reuse_phrase(result.runs)}, {result.seconds / 60:.1f} min"
        + (f"; references from {result.references_dir}" if result.references_dir else "")
    )
    companions = list(dict.fromkeys(c for r in result.rows for c in r.companions))
    # a detector's backbone alone, timed beside the whole detector
    backbones = ["backbone vs full"] if any(r.backbone_speedup_vs_full is not None for r in result.rows) else []
    print_table(
        [
            {
                "method": r.method,
                "target ratio": r.target_ratio if r.target_ratio is not None else "-",
                "token ratio": r.token_ratio,
                "tokens/image": r.tokens_per_image,
                metric: f"{r.quality:.4f} ± {r.quality_std:.4f}",
                "min": r.quality_min,
                "max": r.quality_max,
                **{c: f"{r.companion(c):.4f}" for c in companions if c in r.companions},
                "timed images/s": r.timed_images_per_s,
                "vs full": f"{r.speedup_vs_full:.2f}x" if r.speedup_vs_full is not None else None,
                "backbone vs full": (
                    f"{r.backbone_speedup_vs_full:.2f}x" if r.backbone_speedup_vs_full is not None else None
                ),
            }
            for r in result.rows
        ],
        [
            "method",
            "target ratio",
            "token ratio",
            "tokens/image",
            metric,
            "min",
            "max",
            *companions,
            "timed images/s",
            "vs full",
            *backbones,
        ],
    )
    print()
    for line in lever_lines(result.levers, metric):
        print(line)
    for line in summary_lines(result.goals, result.speed, result.failed, result.point_speed, result.runs):
        print(line)
    print(f"MLflow: experiment run {result.mlflow_run_id} in {result.tracking_uri}")
    emit(args, result.to_dict(), tracking_uri=result.tracking_uri, run_id=result.mlflow_run_id)
    if result.failed and not result.runs:
        return fail(args, f"no run finished: {result.failed[0]}")
    return 0


def _ray_running() -> bool:
    """Ray is imported and initialised (asked without importing it: a study that stops
    at its checks never loads Ray)."""
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()
