"""``splitvit viz``: the quadtree a policy chooses over images, drawn into a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import TRACKING_HELP, check_policy, common_options, model_source, parse_thresholds, positive_int
from .output import emit


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit viz`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "viz",
        parents=[common_options(f"for models:/ and runs:/ URIs: the {TRACKING_HELP}")],
        help="draw the quadtree a policy chooses over images into a PNG",
    )
    p.add_argument(
        "--checkpoint",
        help="a SplitViT checkpoint (SplitViT.save), or an MLflow model (models:/<name>@<alias>, runs:/<run id>); "
        "without it a fresh model is built",
    )
    p.add_argument("--policy", help="policy to draw (default: the checkpoint's, or entropy)")
    p.add_argument("--thresholds", help="per-level thresholds t0,t1,... in [0, 1]")
    p.add_argument("--dataset", default="synthetic", help="dataset the images come from (its val split)")
    p.add_argument("--root", help="dataset folder or shard URI, for datasets read from files")
    p.add_argument("--count", type=positive_int, default=8, help="number of images (>= 1)")
    p.add_argument("--seed", type=int, default=1, help="dataset seed of the images drawn")
    p.add_argument("--out", default="split_maps.png", help="PNG to write")
    p.add_argument("--json", help="write tokens per image to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Draw the split maps of ``--count`` images and report their token counts."""
    check_options(args)  # the options' own mistakes: before torch loads
    checkpoint, thresholds = model_source(args, args.checkpoint)  # a mistyped path: before torch loads
    import torch

    from ..data import build_dataset
    from ..model.detection import split_backbone
    from ..tracking.split_maps import MIN_SCORE, split_map_grid
    from ..train.checkpoints import load_payload, model_from_payload
    from ..train.demo import build_demo_model

    if checkpoint:
        overrides = {"policy": args.policy} if args.policy else {}
        # a missing, truncated or foreign file is one error line naming it
        model = model_from_payload(load_payload(checkpoint), checkpoint, **overrides)
    else:
        model = build_demo_model(args.policy or "entropy")
    model.eval()
    backbone = split_backbone(model)  # a detector's quadtree is its backbone's
    size = backbone.geometry.image_size[0]
    options = {"num_samples": args.count} if args.dataset == "synthetic" else {}
    if args.root:
        options["uri" if args.dataset == "parquet" else "root"] = args.root
    interpolation = backbone.data_config["interpolation"]
    data = build_dataset(args.dataset, "val", image_size=size, interpolation=interpolation, seed=args.seed, **options)
    count = min(args.count, len(data))
    images = torch.stack([data[i][0] for i in range(count)])
    with torch.no_grad():
        out = model(images, thresholds=thresholds)
    detections = getattr(out, "detections", None)  # a detector's: drawn over its quadtree
    split = out.split if detections is not None else out
    captions = [f"{int(t)} tok" for t in split.tokens]
    if detections is not None:
        drawn = [int((d["scores"] >= MIN_SCORE).sum()) for d in detections]
        captions = [f"{c}, {n} found" for c, n in zip(captions, drawn)]
    names = list(getattr(data, "categories", []) or []) or None
    split_map_grid(images, split.decisions, backbone.geometry, captions, detections=detections, names=names).save(
        args.out
    )
    print(
        f"wrote {args.out}: {backbone.policy.name} policy, "
        f"mean {split.tokens.float().mean():.1f} of {split.full_tokens} tokens"
        + (f", detections scoring >= {MIN_SCORE} drawn" if detections is not None else "")
    )
    result = {"png": args.out, "policy": backbone.policy.name, "tokens": split.tokens.tolist()}
    result["full_tokens"] = split.full_tokens
    if detections is not None:
        result["detections"] = drawn
    emit(args, result)
    return 0


def check_options(args: argparse.Namespace) -> None:
    """What the options alone show, one line before torch loads: a policy or dataset
    that does not exist, thresholds outside [0, 1], a ``--root`` folder that is not
    there, an ``--out`` whose folder is missing or whose suffix is no image format."""
    from PIL import Image

    from ..data.names import DATASET_NAMES

    check_policy("--policy", args.policy)
    if args.dataset not in DATASET_NAMES:
        raise ValueError(f"--dataset: unknown dataset {args.dataset!r}; expected one of {', '.join(DATASET_NAMES)}")
    parse_thresholds(args.thresholds)
    if args.root and "://" not in args.root and not Path(args.root).expanduser().exists():
        raise FileNotFoundError(f"--root: {args.root} does not exist")
    out = Path(args.out).expanduser()
    Image.init()  # the formats PIL writes, by suffix
    if out.suffix.lower() not in Image.registered_extensions():
        raise ValueError(f"--out: {args.out} has no image suffix PIL writes (e.g. .png)")
    if not out.absolute().parent.is_dir():
        raise FileNotFoundError(f"--out: folder {out.absolute().parent} does not exist")
