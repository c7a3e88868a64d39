"""``splitvit demo``: a tiny SPLIT model and a full-resolution ViT trained on synthetic data, compared."""

from __future__ import annotations

import argparse

from .options import common_options
from .output import emit, print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``splitvit demo`` and its options to the subcommands ``sub``."""
    p = sub.add_parser(
        "demo",
        parents=[common_options(None)],
        help="train a tiny SPLIT model and a full-resolution ViT on synthetic data, compare them",
    )
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the demo's)")
    p.add_argument("--samples", type=int, default=None, help="training images (default: the demo's)")
    p.add_argument(
        "--target-ratio", type=float, default=0.3, help="SPLIT's token budget as a fraction of full resolution"
    )
    p.add_argument("--out", default="runs/demo", help="folder for checkpoints and split maps")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train both models, print the comparison table and where the split maps went."""
    from ..train.demo import run_demo

    result = run_demo(out_dir=args.out, epochs=args.epochs, samples=args.samples, target_ratio=args.target_ratio)
    print_table(result["rows"], ["method", "accuracy", "tokens_per_image", "token_ratio", "fine_on_object"])
    print(f"split maps: {result['split_map']}")
    emit(args, result)
    return 0
