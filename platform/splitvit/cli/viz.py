"""``splitvit viz``: the quadtree a policy chooses over images, drawn into a PNG."""

from __future__ import annotations

import argparse

from .options import TRACKING_HELP, common_options, model_source, positive_int
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
    checkpoint, thresholds = model_source(args, args.checkpoint)  # a mistyped path: before torch loads
    import torch

    from ..data import build_dataset
    from ..model.detection import split_backbone
    from ..tracking.split_maps import split_map_grid
    from ..train.checkpoints import load_payload, model_from_payload
    from ..train.demo import build_demo_model

    if checkpoint:
        overrides = {"policy": args.policy} if args.policy else {}
        # a missing, truncated or foreign file is one error line naming it
        # a detector's quadtree is its backbone's (its boxes and masks are not drawn yet)
        model = split_backbone(model_from_payload(load_payload(checkpoint), checkpoint, **overrides))
    else:
        model = build_demo_model(args.policy or "entropy")
    model.eval()
    size = model.geometry.image_size[0]
    options = {"num_samples": args.count} if args.dataset == "synthetic" else {}
    if args.root:
        options["uri" if args.dataset == "parquet" else "root"] = args.root
    interpolation = model.data_config["interpolation"]
    data = build_dataset(args.dataset, "val", image_size=size, interpolation=interpolation, seed=args.seed, **options)
    count = min(args.count, len(data))
    images = torch.stack([data[i][0] for i in range(count)])
    with torch.no_grad():
        out = model(images, thresholds=thresholds)
    captions = [f"{int(t)} tok" for t in out.tokens]
    split_map_grid(images, out.decisions, model.geometry, captions).save(args.out)
    print(
        f"wrote {args.out}: {model.policy.name} policy, "
        f"mean {out.tokens.float().mean():.1f} of {out.full_tokens} tokens"
    )
    emit(
        args,
        {"png": args.out, "policy": model.policy.name, "tokens": out.tokens.tolist(), "full_tokens": out.full_tokens},
    )
    return 0
