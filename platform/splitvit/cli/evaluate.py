"""``splitvit eval``: a training checkpoint's quality, tokens and speed."""

from __future__ import annotations

import argparse

from .options import (
    TRACKING_HELP,
    check_device,
    check_policy,
    common_options,
    model_source,
    non_negative_int,
    positive_int,
)
from .output import emit, print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit eval`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "eval",
        parents=[common_options(f"for models:/ and runs:/ URIs: the {TRACKING_HELP}")],
        help="evaluate a training checkpoint (local or s3://) or an MLflow model (models:/, runs:/): "
        "accuracy, mIoU or box and mask AP, tokens, images/s",
    )
    p.add_argument(
        "checkpoint",
        help="checkpoint folder or its model.pt, local or s3://bucket/...; or an MLflow model: "
        "models:/<name>@<alias> (a sweep's frontier: @best, @tokens-42pct), models:/<name>/<version>, "
        "models:/<model id>, runs:/<run id> (its checkpoint, at the thresholds the model was recorded with)",
    )
    p.add_argument(
        "--thresholds", help="per-level thresholds t0,t1,... in [0, 1] (default: the checkpoint's or the model's)"
    )
    p.add_argument("--policy", help="evaluate with this split policy instead of the checkpoint's")
    p.add_argument(
        "--oracle",
        action="store_true",
        help="detectors: split exactly where the data's instance masks are, not by the policy: the box and "
        "mask AP a perfect policy would give this backbone, at the tokens it takes",
    )
    p.add_argument(
        "--oracle-context",
        type=non_negative_int,
        default=0,
        metavar="PX",
        help="with --oracle: grow the instance masks by PX pixels first, so that the fine tokens also "
        "cover the items' surroundings (default 0)",
    )
    p.add_argument("--split", default="val", choices=["val", "test"], help="data split of the experiment's dataset")
    p.add_argument("--batch-size", type=positive_int, help="evaluation batch size (>= 1; default: the experiment's)")
    p.add_argument("--samples", type=positive_int, help="number of images (>= 1; default: the experiment's split size)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default cpu)")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate the checkpoint on the experiment's data and print the figures."""
    if args.oracle and (args.thresholds or args.policy):
        raise ValueError("--oracle splits where the annotations' instances are: it takes no --thresholds or --policy")
    if args.oracle_context and not args.oracle:
        raise ValueError("--oracle-context grows the masks the oracle splits on: it goes with --oracle")
    check_policy("--policy", args.policy)  # the options' own mistakes: before torch loads
    check_device(args.device)
    checkpoint, thresholds = model_source(args, args.checkpoint)  # a mistyped path: before torch loads
    from ..cluster.preflight import preflight_eval
    from ..train.evaluation import evaluate_checkpoint

    preflight_eval(checkpoint, args.device)  # the device, an s3:// checkpoint's endpoint: seconds
    result = evaluate_checkpoint(
        checkpoint,
        thresholds=thresholds,
        policy=args.policy,
        split=args.split,
        batch_size=args.batch_size,
        samples=args.samples,
        device=args.device,
        oracle=args.oracle,
        oracle_context=args.oracle_context,
    )
    print_table(
        [
            {"metric": k, "value": result[k]}
            for k in (
                *("accuracy", "miou", "box_ap", "box_ap50", "mask_ap", "mask_ap50"),
                *("tokens_per_image", "token_ratio", "images_per_s", "fine_on_object", "object_coverage"),
            )
            if k in result  # a task's own quality; the object figures on data with object masks
        ],
        ["metric", "value"],
    )
    if args.oracle:
        splits = "the annotations' instances" + (f" grown by {args.oracle_context} px" if args.oracle_context else "")
    else:
        splits = f"thresholds {result['thresholds']}"
    print(f"policy {result['policy']}, {splits}, {result['images']} {args.split} images")
    emit(args, result)
    return 0
