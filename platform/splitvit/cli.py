"""The ``splitvit`` command.

Each subcommand parses its arguments, calls the library, prints its figures and,
with ``--json PATH``, writes them as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("splitvit")


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write a command's figures to ``path`` (no-op when ``path`` is None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


def _print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


# ---------------------------------------------------------------------- demo
def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train a tiny SPLIT model and a full-resolution ViT on synthetic data, compare them")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the demo's)")
    p.add_argument("--samples", type=int, default=None, help="training images (default: the demo's)")
    p.add_argument("--target-ratio", type=float, default=0.3, help="SPLIT's token budget as a fraction of full resolution")
    p.add_argument("--out", default="runs/demo", help="folder for checkpoints and split maps")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from .demo import run_demo

    result = run_demo(out_dir=args.out, epochs=args.epochs, samples=args.samples, target_ratio=args.target_ratio)
    _print_table(result["rows"], ["method", "accuracy", "tokens_per_image", "token_ratio", "fine_on_object"])
    print(f"split maps: {result['split_map']}")
    write_json(args.json, result)
    return 0


# ---------------------------------------------------------------------- viz
def _add_viz(sub) -> None:
    p = sub.add_parser("viz", help="draw the quadtree a policy chooses over images into a PNG")
    p.add_argument("--checkpoint", help="a SplitViT checkpoint (SplitViT.save); without it a fresh model is built")
    p.add_argument("--policy", help="policy to draw (default: the checkpoint's, or entropy)")
    p.add_argument("--thresholds", help="per-level thresholds t0,t1,... in [0, 1]")
    p.add_argument("--dataset", default="synthetic", help="dataset the images come from (its val split)")
    p.add_argument("--root", help="dataset folder or shard URI, for datasets read from files")
    p.add_argument("--count", type=int, default=8, help="number of images")
    p.add_argument("--seed", type=int, default=1, help="dataset seed of the images drawn")
    p.add_argument("--out", default="split_maps.png", help="PNG to write")
    p.add_argument("--json", help="write tokens per image to this JSON file")
    p.set_defaults(func=_run_viz)


def parse_thresholds(text: str | None) -> list[float] | None:
    """``"0.4,0.6"`` -> ``[0.4, 0.6]``; a clear error for anything else."""
    if text is None:
        return None
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"--thresholds: expected comma-separated numbers in [0, 1], got {text!r}") from None


def _run_viz(args) -> int:
    import torch

    from .data import build_dataset
    from .demo import build_demo_model
    from .model import SplitViT
    from .viz import split_map_grid

    if args.checkpoint:
        overrides = {"policy": args.policy} if args.policy else {}
        model = SplitViT.load(args.checkpoint, **overrides)
    else:
        model = build_demo_model(args.policy or "entropy")
    model.eval()
    size = model.geometry.image_size[0]
    options = {"num_samples": args.count} if args.dataset == "synthetic" else {}
    if args.root:
        options["uri" if args.dataset == "parquet" else "root"] = args.root
    data = build_dataset(args.dataset, "val", image_size=size, seed=args.seed, **options)
    count = min(args.count, len(data))
    images = torch.stack([data[i][0] for i in range(count)])
    with torch.no_grad():
        out = model(images, thresholds=parse_thresholds(args.thresholds))
    captions = [f"{int(t)} tok" for t in out.tokens]
    split_map_grid(images, out.decisions, model.geometry, captions).save(args.out)
    print(f"wrote {args.out}: {model.policy.name} policy, mean {out.tokens.float().mean():.1f} of {out.full_tokens} tokens")
    write_json(args.json, {"png": args.out, "policy": model.policy.name, "tokens": out.tokens.tolist(), "full_tokens": out.full_tokens})
    return 0


# ---------------------------------------------------------------------- bench
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="SPLIT vs full-resolution ViT: forward speed, overhead, memory (side by side)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=96)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10, help="timed forward passes per model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from .bench import format_report, run_forward_benchmark

    result = run_forward_benchmark(
        batch_size=args.batch_size, image_size=args.image_size, patch_size=args.patch_size,
        levels=args.levels, repeats=args.repeats, device=args.device,
    )
    print(format_report(result))
    write_json(args.json, result)
    return 0


# ---------------------------------------------------------------------- data
def _add_data(sub) -> None:
    p = sub.add_parser("data", help="convert datasets to parquet shards and push them to S3")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prep = dsub.add_parser("prepare", help="write a dataset split as parquet shards to a folder or s3://bucket/prefix")
    prep.add_argument("dataset", help="dataset name (see splitvit.data.DATASET_NAMES)")
    prep.add_argument("--split", default="train", choices=["train", "val", "test"])
    prep.add_argument("--out", required=True, help="output folder or s3://bucket/prefix")
    prep.add_argument("--image-size", type=int, default=64, help="side of the stored images")
    prep.add_argument("--seed", type=int, default=0, help="dataset seed")
    prep.add_argument("--root", help="dataset folder (imagefolder, ade20k, Fashion-MNIST files) or shard URI (parquet)")
    prep.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                      help="extra dataset option, repeatable (e.g. clutter_fraction=0.5)")
    prep.add_argument("--limit", type=int, help="write only the first N items")
    prep.add_argument("--rows-per-shard", type=int, default=1000)
    prep.add_argument("--workers", type=int, default=0, help="DataLoader workers that decode items in parallel")
    prep.add_argument("--strict", action="store_true", help="stop at a corrupt file instead of skipping it")
    prep.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    prep.add_argument("--json", help="write the figures to this JSON file")
    prep.set_defaults(func=_run_data_prepare)
    push = dsub.add_parser("push", help="upload a local folder (e.g. prepared shards) to s3://bucket/prefix with boto3")
    push.add_argument("source", help="local folder")
    push.add_argument("destination", help="s3://bucket/prefix (endpoint from AWS_ENDPOINT_URL)")
    push.add_argument("--json", help="write the figures to this JSON file")
    push.set_defaults(func=_run_data_push)


def _run_data_prepare(args) -> int:
    from .data import build_dataset, write_shards

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
    dataset = build_dataset(args.dataset, args.split, image_size=args.image_size, seed=args.seed, **options)
    result = write_shards(
        dataset, args.out, args.rows_per_shard, limit=args.limit, strict=args.strict, overwrite=args.overwrite,
        num_workers=args.workers, progress=sys.stderr.isatty(),
        metadata={"dataset": args.dataset, "split": args.split, "seed": args.seed, "options": options},
    )
    payload = {"dataset": args.dataset, "split": args.split, **result.as_dict()}
    payload.pop("extra", None)
    print(f"wrote {result.rows} rows ({result.task}) in {len(result.shards)} shards, {result.bytes} bytes, "
          f"to {result.uri} in {result.seconds:.1f}s; skipped {result.skipped} corrupt")
    for path in result.skipped_files:
        print(f"  skipped: {path}")
    print(f"manifest: {result.manifest}")
    write_json(args.json, payload)
    return 0


def _run_data_push(args) -> int:
    from .storage import is_s3, upload_dir

    if not is_s3(args.destination):
        raise ValueError(f"destination must be s3://bucket/prefix, got {args.destination!r}")
    result = upload_dir(args.source, args.destination)
    print(f"pushed {result.files} files, {result.bytes} bytes, from {result.source} to {result.destination} "
          f"in {result.seconds:.1f}s")
    write_json(args.json, result.as_dict())
    return 0


# ---------------------------------------------------------------------- train / eval
def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train an experiment with Ray Train (config YAML + key=value overrides), tracked in MLflow")
    p.add_argument("config", help="experiment YAML (e.g. jobs/configs/smoke.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.epochs=3 storage.name=run1")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--json", help="write final metrics, checkpoint URI and MLflow run id to this JSON file")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from .config import load_config
    from .train.ray_trainer import TrainingError, run_training

    config = load_config(args.config, args.overrides)  # a ConfigError stops here, before Ray
    print(f"run {config.storage.name}: storage {config.storage.run_uri()}")
    try:
        result = run_training(config, ray_address=args.address)
    except TrainingError as exc:
        print(f"splitvit train: error: {exc}", file=sys.stderr)
        return 1
    keys = [k for k in ("accuracy", "miou", "tokens_per_image", "token_ratio", "images_per_s", "train_loss") if k in result.metrics]
    _print_table([{"metric": k, "value": result.metrics[k]} for k in keys], ["metric", "value"])
    print(f"status: {result.status}")
    print(f"checkpoint: {result.checkpoint_uri}")
    if result.mlflow_run_id:
        print(f"mlflow run: {result.mlflow_run_id} ({result.tracking_uri})")
    if result.mlflow_model_uri:
        print(f"mlflow model: {result.mlflow_model_uri}")
    write_json(args.json, result.to_dict())
    if result.status != "completed":
        print(f"splitvit train: error: run {result.status}: {result.message}; last good checkpoint {result.checkpoint_uri}",
              file=sys.stderr)
        return 1
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a training checkpoint (local or s3://): accuracy or mIoU, tokens, images/s")
    p.add_argument("checkpoint", help="checkpoint folder or its model.pt, local or s3://bucket/...")
    p.add_argument("--thresholds", help="per-level thresholds t0,t1,... in [0, 1]")
    p.add_argument("--policy", help="evaluate with this split policy instead of the checkpoint's")
    p.add_argument("--split", default="val", choices=["val", "test"], help="data split of the experiment's dataset")
    p.add_argument("--batch-size", type=int, help="evaluation batch size (default: the experiment's)")
    p.add_argument("--samples", type=int, help="number of images (default: the experiment's split size)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=_run_eval)


def _run_eval(args) -> int:
    from .train.evaluation import evaluate_checkpoint

    result = evaluate_checkpoint(
        args.checkpoint, thresholds=parse_thresholds(args.thresholds), policy=args.policy, split=args.split,
        batch_size=args.batch_size, samples=args.samples, device=args.device,
    )
    quality = "miou" if "miou" in result else "accuracy"
    _print_table([{"metric": k, "value": result[k]} for k in (quality, "tokens_per_image", "token_ratio", "images_per_s")],
                 ["metric", "value"])
    print(f"policy {result['policy']}, thresholds {result['thresholds']}, {result['images']} {args.split} images")
    write_json(args.json, result)
    return 0


COMMANDS: list[Callable] = [_add_demo, _add_viz, _add_bench, _add_data, _add_train, _add_eval]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitvit", description="SPLIT: learned hierarchical patch splitting for ViTs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # bad input, missing files, storage (StorageError is an OSError)
        name = " ".join(filter(None, [args.command, getattr(args, "data_command", None)]))
        print(f"splitvit {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
