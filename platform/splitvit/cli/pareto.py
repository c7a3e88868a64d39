"""``splitvit pareto``: the Pareto frontier of an MLflow experiment's sweeps, read back from the store."""

from __future__ import annotations

import argparse

from .options import checked_tracking_uri, common_options
from .output import emit, frontier_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit pareto`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "pareto",
        parents=[common_options("MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db)")],
        help="print the Pareto frontier (accuracy vs tokens) of an MLflow experiment's latest sweep (or all of them)",
    )
    p.add_argument("experiment", help="MLflow experiment name (e.g. smoke-sweep)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--sweep", help="only this sweep (its parent run id); default: the experiment's latest sweep")
    which.add_argument(
        "--all", dest="all_sweeps", action="store_true", help="merge every sweep of the experiment into one frontier"
    )
    p.add_argument("--plot", metavar="PATH", help="also draw the frontier into this image (PNG)")
    p.add_argument("--json", help="write the points, the frontier and the hypervolume to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the frontier of the latest sweep (or all of them), optionally draw it."""
    from ..tracking.runs import missing_store

    if args.tracking_uri and (missing := missing_store(args.tracking_uri)):
        raise FileNotFoundError(missing)  # before Ray and MLflow load; nothing is created
    checked_tracking_uri(args)  # a server that does not answer: one line in seconds, not minutes of retries
    from ..tune import frontier_from_mlflow

    read = frontier_from_mlflow(args.experiment, args.tracking_uri, args.sweep, all_sweeps=args.all_sweeps)
    data = read.to_dict()
    print(
        f"experiment {read.experiment!r} (id {read.experiment_id}, {read.tracking_uri}): "
        f"{len(read.sweeps)} sweep(s), {len(read.points)} points, {len(data['frontier'])} on the frontier, "
        f"hypervolume {read.hypervolume:.4f}"
    )
    if data["frontier"]:
        frontier_table(data["frontier"], read.metric)
        for speed in read.speed:
            print(
                f"speed-up: measured against the full-resolution model in the same run, on {speed.device} "
                f"({speed.timing}; sweep run {speed.sweep})"
            )
        if not any(p.extras.get("speedup_vs_full") is not None for p in read.frontier):
            print(
                "speed-up: not recorded: the sweep(s) did not time their frontier (sweeps before frontier timing, "
                "or speed.enabled: false)"
            )
    if args.plot:
        from ..tune.plot import save_frontier_plot

        data["plot"] = str(save_frontier_plot(read, args.plot))
        print(f"plot: {data['plot']}")
    emit(
        args,
        data,
        tracking_uri=read.tracking_uri,
        experiment_id=read.experiment_id,
        # one sweep read: its parent run; several merged: no single run
        run_id=read.sweeps[0] if len(read.sweeps) == 1 else None,
    )
    return 0
