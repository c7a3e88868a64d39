"""``splitvit train``: one experiment (config YAML + overrides) trained with Ray Train, tracked in MLflow."""

from __future__ import annotations

import argparse

from .options import TRACKING_HELP, add_set_option, check_address, check_run_settings, common_options, overrides
from .output import emit, fail, print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit train`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "train",
        parents=[common_options(TRACKING_HELP)],
        help="train an experiment with Ray Train (config YAML + --set KEY=VALUE overrides), tracked in MLflow",
    )
    p.add_argument("config", help="experiment YAML (e.g. jobs/configs/smoke.yaml)")
    p.add_argument(
        "positional_overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="the same as --set KEY=VALUE (kept as an alias)",
    )
    add_set_option(p, "a dotted config override, e.g. --set train.epochs=3 --set storage.name=run1")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--json", help="write final metrics, checkpoint URI and MLflow run id to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check the config and the cluster, train, print the final metrics; exit 1 unless completed."""
    from ..config import load_config
    from ..train.names import check_names

    # the file's, the settings' and the names' mistakes, where the run writes, the
    # dataset's annotation files, the MLflow server and the Ray address's form: before torch loads
    settings = load_config(args.config, overrides(args))
    check_names(settings)
    check_run_settings(settings)
    check_address(args)
    from ..train.experiment import load_experiment
    from ..train.ray_trainer import run_training

    config = load_experiment(args.config, overrides(args))  # a ConfigError stops here, before Ray
    print(f"run {config.storage.name}: storage {config.storage.run_uri()}")
    from ..cluster.preflight import preflight

    # what only fails once Ray runs (capacity, Ray, MLflow, storage, data): seconds, a PreflightError
    print(preflight(config, ray_address=args.address).data_line)  # which data, from which folder
    # a TrainingError (a worker's error, unwrapped) or Ctrl-C/SIGTERM: main() prints one line
    # the workers' output (Ray's own log lines and tracebacks among it) reaches the
    # console with -v; without it, each committed epoch is one line from here
    on_epoch = None if args.verbose else print_epoch
    result = run_training(config, ray_address=args.address, on_epoch=on_epoch)
    keys = [k for k in (*QUALITY_FIGURES, *TOKEN_FIGURES, "train_loss") if k in result.metrics]
    if keys:
        print_table([{"metric": k, "value": result.metrics[k]} for k in keys], ["metric", "value"])
    else:
        print("no epoch completed: no metrics")
    print(f"status: {result.status}")
    print(f"checkpoint: {result.checkpoint_uri or 'none (no epoch completed)'}")
    if result.mlflow_run_id:
        print(f"mlflow run: {result.mlflow_run_id} ({result.tracking_uri})")
    if result.mlflow_model_uri:
        print(f"mlflow model: {result.mlflow_model_uri}")
    data = result.to_dict()
    data["run_status"] = data.pop("status")  # "status" is the envelope's: ok, failed, interrupted
    emit(args, data, tracking_uri=result.tracking_uri, run_id=result.mlflow_run_id)
    if result.status != "completed":
        kept = (
            f"last good checkpoint {result.checkpoint_uri}"
            if result.checkpoint_uri
            else "no epoch completed, so no checkpoint was kept"
        )
        return fail(args, f"run {result.status}: {result.message}; {kept}")
    return 0


#: The figures an epoch line shows, in order, when the epoch has them.
QUALITY_FIGURES = ("accuracy", "miou", "box_ap", "mask_ap")  # each task's quality
TOKEN_FIGURES = ("tokens_per_image", "token_ratio", "images_per_s")
EPOCH_FIGURES = ("train_loss", *QUALITY_FIGURES, *TOKEN_FIGURES)


def print_epoch(epoch: int, metrics: dict[str, float]) -> None:
    """One line per committed epoch: ``epoch 2: train_loss 0.913, accuracy 0.662, ...``."""
    shown = [f"{k} {metrics[k]:.4g}" for k in EPOCH_FIGURES if isinstance(metrics.get(k), (int, float))]
    skipped = int(metrics.get("train_skipped_items") or 0) + int(metrics.get("val_skipped_items") or 0)
    if skipped:  # corrupt files passed over (named in the workers' log; the epoch's metrics count them)
        shown.append(f"{skipped} corrupt item{'s' if skipped > 1 else ''} skipped")
    print(f"epoch {epoch}: {', '.join(shown)}", flush=True)
