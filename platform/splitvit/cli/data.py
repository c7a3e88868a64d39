"""``splitvit data``: datasets as parquet shards (``prepare``), folders uploaded to S3 (``push``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from .options import common_options, non_negative_int, positive_int
from .output import emit


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit data`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "data", parents=[common_options(None)], help="convert datasets to parquet shards and push them to S3"
    )
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prep = dsub.add_parser(
        "prepare",
        parents=[common_options(None)],
        help="write a dataset split as parquet shards to a folder or s3://bucket/prefix",
    )
    prep.add_argument(
        "dataset",
        help="dataset name (see splitvit.data.DATASET_NAMES); coco and fashion-det give detection shards that "
        "keep boxes, masks and the COCO ground truth",
    )
    prep.add_argument("--split", default="train", choices=["train", "val", "test"])
    prep.add_argument("--out", required=True, help="output folder or s3://bucket/prefix")
    prep.add_argument(
        "--image-size",
        type=positive_int,
        default=64,
        help="side of the stored images in pixels, >= 1 (detection: the model's canvas)",
    )
    prep.add_argument(
        "--interpolation",
        default="bicubic",
        help="filter that resizes (coco: letterboxes) the images: the model's, e.g. bicubic, bilinear",
    )
    prep.add_argument("--seed", type=int, default=0, help="dataset seed")
    prep.add_argument("--root", help="dataset folder (imagefolder, ade20k, Fashion-MNIST files) or shard URI (parquet)")
    prep.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra dataset option, repeatable (e.g. clutter_fraction=0.5, val_annotations=FILE)",
    )
    prep.add_argument("--limit", type=positive_int, help="write only the first N items (>= 1)")
    prep.add_argument("--rows-per-shard", type=positive_int, default=1000)
    prep.add_argument(
        "--workers",
        type=non_negative_int,
        default=0,
        help="DataLoader workers that decode items in parallel (0: in this process)",
    )
    prep.add_argument("--strict", action="store_true", help="stop at a corrupt file instead of skipping it")
    prep.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    prep.add_argument("--json", help="write the figures to this JSON file")
    prep.set_defaults(func=run_prepare)
    push = dsub.add_parser(
        "push",
        parents=[common_options(None)],
        help="upload a local folder (e.g. prepared shards) to s3://bucket/prefix with boto3",
    )
    push.add_argument("source", help="local folder")
    push.add_argument("destination", help="s3://bucket/prefix (endpoint from AWS_ENDPOINT_URL)")
    push.add_argument("--workers", type=positive_int, default=8, help="files uploaded at once (default 8)")
    push.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress on stderr: a bar on a terminal, else a line every 100 files (default: on)",
    )
    push.add_argument("--json", help="write the figures to this JSON file")
    push.set_defaults(func=run_push)


def run_prepare(args: argparse.Namespace) -> int:
    """Write a dataset split as parquet shards and report rows, shards and bytes."""
    options: dict[str, Any] = {}
    for text in args.option:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise ValueError(f"--option: expected KEY=VALUE, got {text!r}")
        try:
            options[key] = json.loads(value)  # numbers, true/false, null
        except json.JSONDecodeError:
            options[key] = value
    if args.root:
        options["uri" if args.dataset == "parquet" else "root"] = args.root
    if args.strict and args.dataset in ("imagefolder", "ade20k", "parquet"):
        options["strict"] = True
    _check_before_loading(args, options)
    from ..data import build_dataset, write_shards

    dataset = build_dataset(
        args.dataset,
        args.split,
        image_size=args.image_size,
        seed=args.seed,
        interpolation=args.interpolation,
        **options,
    )
    result = write_shards(
        dataset,
        args.out,
        args.rows_per_shard,
        limit=args.limit,
        strict=args.strict,
        overwrite=args.overwrite,
        num_workers=args.workers,
        progress=sys.stderr.isatty(),
        metadata={
            "dataset": args.dataset,
            "split": args.split,
            "seed": args.seed,
            "interpolation": args.interpolation,
            "options": options,
        },
    )
    payload = {"dataset": args.dataset, "split": args.split, **result.as_dict()}
    payload.pop("extra", None)
    print(
        f"wrote {result.rows} rows ({result.task}) in {len(result.shards)} shards, {result.bytes} bytes, "
        f"to {result.uri} in {result.seconds:.1f}s; skipped {result.skipped} corrupt"
    )
    for path in result.skipped_files:
        print(f"  skipped: {path}")
    print(f"manifest: {result.manifest}")
    emit(args, payload)
    return 0


def _check_before_loading(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """What the command line and the files alone show, before torch loads: an unknown
    dataset, and a COCO annotation file that is missing or not COCO's shape (its
    entries are checked when the dataset opens)."""
    from ..data.coco_format import check_coco_file
    from ..data.names import DATASET_NAMES

    if args.dataset not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {args.dataset!r}; expected one of {', '.join(DATASET_NAMES)}")
    if args.dataset == "coco":
        key = f"{args.split}_annotations"
        if isinstance(options.get(key), str) and options[key]:
            check_coco_file(options[key], f"--option {key}")


def run_push(args: argparse.Namespace) -> int:
    """Upload a local folder to ``s3://bucket/prefix`` and report files and bytes."""
    from ..storage import is_s3, upload_dir

    if not is_s3(args.destination):
        raise ValueError(f"destination must be s3://bucket/prefix, got {args.destination!r}")
    if args.progress:  # off a terminal, progress is logged: shown without -v
        logging.getLogger("splitvit.storage").setLevel(logging.INFO)
    result = upload_dir(args.source, args.destination, workers=args.workers, progress=args.progress)
    print(
        f"pushed {result.files} files, {result.bytes} bytes, from {result.source} to {result.destination} "
        f"in {result.seconds:.1f}s"
    )
    emit(args, result.as_dict())
    return 0
