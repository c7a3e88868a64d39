"""Two classifiers' operating points on the same images: each one's accuracy and token
ratio, and their accuracy difference with its paired standard error.

    python scripts/paired_difference.py CHECKPOINT_A:0.41,0.41 CHECKPOINT_B:0.67,0.67 \
        [--split test] [--samples 5000] [--json OUT.json]

Each point is a checkpoint (a folder or its ``model.pt``) and its per-level thresholds
after a colon. Both are evaluated image by image on the first ``--samples`` images of
``--split`` (the first checkpoint's data). Two models evaluated on the same images err
on mostly the same ones, so the standard error of their difference is the paired one:
the spread of the per-image difference over the square root of the count. It is
smaller than that of two independent figures. A sweep's goal line against a recipe's
curve is only as sharp as this figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def parse_point(text: str) -> tuple[str, list[float]]:
    """``CHECKPOINT:T1,T2,...`` as ``(checkpoint, thresholds)``; a missing or malformed
    thresholds list exits with one line naming the argument."""
    checkpoint, sep, taus = text.rpartition(":")
    try:
        thresholds = [float(t) for t in taus.split(",")] if sep and checkpoint else []
    except ValueError:
        thresholds = []
    if not thresholds:
        raise SystemExit(f"paired_difference: {text!r} is not CHECKPOINT:T1,T2,... (per-level thresholds)")
    return checkpoint, thresholds


def classifier(checkpoint: str, split: str, samples: int | None):
    """The checkpoint's evaluator on ``split`` (model and data loaded, nothing
    evaluated); refuses a model that is not a classifier."""
    from splitvit.train.evaluation import CheckpointEvaluator

    evaluator = CheckpointEvaluator(checkpoint, split=split, samples=samples, cache=False)
    task = getattr(evaluator.model, "task", "detection")
    if task != "classification":
        raise SystemExit(f"paired_difference: {checkpoint} is a {task} model; accuracy needs a classifier")
    return evaluator


def correct_per_image(evaluator, thresholds: list[float]):
    """Per image, 1 where the evaluator's class at ``thresholds`` is right, else 0 (an
    int8 tensor), and the mean token ratio."""
    import torch

    correct, tokens, full = [], 0.0, 0
    with torch.no_grad():
        for images, labels, *_ in evaluator.batches():
            out = evaluator.model(images.to(evaluator.device), thresholds=thresholds)
            correct.append((out.logits.argmax(-1).cpu() == labels).to(torch.int8))
            tokens += float(out.tokens.float().sum())
            full += out.full_tokens * len(labels)
    return torch.cat(correct), tokens / full


def paired(a, b) -> dict[str, float]:
    """Accuracy of each, their difference and its paired standard error (in points), and
    the share of images on which they disagree."""
    diff = (a.float() - b.float()).double()
    n = diff.numel()
    spread = float(diff.std(unbiased=True)) if n > 1 else 0.0
    return {
        "images": n,
        "accuracy_a": float(a.float().mean()),
        "accuracy_b": float(b.float().mean()),
        "difference_points": float(diff.mean()) * 100,
        "standard_error_points": spread / math.sqrt(n) * 100,
        "discordant": float((a != b).float().mean()),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the comparison (and write it with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="CHECKPOINT:T1,T2,... the first point")
    parser.add_argument("b", help="CHECKPOINT:T1,T2,... the second point")
    parser.add_argument("--split", default="test", help="the data split (default: test)")
    parser.add_argument("--samples", type=int, help="its first N images (default: all)")
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    (ckpt_a, taus_a), (ckpt_b, taus_b) = parse_point(args.a), parse_point(args.b)
    # both models and splits first: the images must be the same ones before any is evaluated
    evaluator_a = classifier(ckpt_a, args.split, args.samples)
    evaluator_b = evaluator_a if ckpt_b == ckpt_a else classifier(ckpt_b, args.split, args.samples)
    if len(evaluator_a.dataset) != len(evaluator_b.dataset):
        sizes = f"{len(evaluator_a.dataset)} vs {len(evaluator_b.dataset)} images"
        raise SystemExit(f"paired_difference: the two checkpoints' {args.split} splits differ ({sizes})")
    a, ratio_a = correct_per_image(evaluator_a, taus_a)
    b, ratio_b = correct_per_image(evaluator_b, taus_b)
    result = {"split": args.split, "token_ratio_a": ratio_a, "token_ratio_b": ratio_b, **paired(a, b)}
    print(f"{result['images']} {args.split} images")
    print(f"A {args.a}: accuracy {result['accuracy_a']:.4f} at {ratio_a:.2%} of the tokens")
    print(f"B {args.b}: accuracy {result['accuracy_b']:.4f} at {ratio_b:.2%} of the tokens")
    print(
        f"A - B: {result['difference_points']:+.2f} points, paired standard error "
        f"{result['standard_error_points']:.2f}; they disagree on {result['discordant']:.1%} of the images"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
