"""Do a detector's items need their neighbours fine too? Dilated policy scores, evaluation only.

    .venv/bin/python scripts/score_dilation.py CHECKPOINT [--ratios 0.5,0.7] \
        [--variants none,max:1.0,max:0.9,max:0.8,mean:0.3,mean:0.5]

The context oracle (`splitvit eval --oracle --oracle-context 8`) says a detector wants
the items' surroundings fine as well as the items. Here the trained policy's scores at
the finest scored level are spread to each node's 3x3 neighbourhood before the
thresholds: ``max:W`` splits a node when ``W`` times a neighbour's score beats the
threshold (``max(s, W * maxpool3(s))``), ``mean:W`` blends each score with its
neighbourhood's mean (``(1 - W) s + W avgpool3(s)``). Each variant's thresholds are
calibrated to each ratio on the study's validation canvases, as the study does, and
evaluated on the test canvases; ``none`` is the policy as trained. Nothing is trained.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's splitvit

from splitvit.train.evaluation import CheckpointEvaluator  # noqa: E402


def dilate_scores(scores: list[torch.Tensor], variant: str) -> list[torch.Tensor]:
    """The finest scored level's ``(B, H, W)`` scores spread over each node's 3x3
    neighbourhood (``variant`` as in the module docstring); the coarser levels as they are."""
    kind, _, weight = variant.partition(":")
    if kind == "none":
        return scores
    w = float(weight)
    finest = scores[-1].unsqueeze(1)
    if kind == "max":
        spread = torch.maximum(finest, w * F.max_pool2d(finest, 3, stride=1, padding=1))
    elif kind == "mean":
        spread = (1 - w) * finest + w * F.avg_pool2d(finest, 3, stride=1, padding=1, count_include_pad=False)
    else:
        raise ValueError(f"unknown variant {variant!r}: none, max:W or mean:W")
    return [*scores[:-1], spread.squeeze(1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a detection study run's checkpoint folder")
    parser.add_argument("--ratios", default="0.5,0.7")
    parser.add_argument("--variants", default="none,max:1.0,max:0.9,max:0.8,mean:0.3,mean:0.5")
    parser.add_argument("--calibration-samples", type=int, default=500, help="validation canvases, as the study")
    parser.add_argument("--test-samples", type=int, default=1000)
    args = parser.parse_args()
    variants = args.variants.split(",")
    for variant in variants:
        dilate_scores([torch.zeros(1, 2, 2)], variant)  # a bad variant fails before any evaluation
    evaluator = CheckpointEvaluator(args.checkpoint, split="test", samples=args.test_samples)
    calibration = evaluator.first_images(args.calibration_samples, split="val")
    policy = evaluator.backbone.policy
    trained = policy.forward
    for variant in variants:
        policy.forward = lambda images, geometry, context, v=variant: dilate_scores(
            trained(images, geometry, context), v
        )
        for ratio in (float(r) for r in args.ratios.split(",")):
            result = evaluator.evaluate(evaluator.calibrate(calibration, ratio))
            box_ap, mask_ap, coverage = (result.metrics[k] for k in ("box_ap", "mask_ap", "object_coverage"))
            print(
                f"{variant:9s} @{ratio}: box AP {100 * box_ap:.1f}, mask AP {100 * mask_ap:.1f} "
                f"at token ratio {result.token_ratio:.3f}, object_coverage {coverage:.3f}",
                flush=True,
            )
    policy.forward = trained


if __name__ == "__main__":
    main()
