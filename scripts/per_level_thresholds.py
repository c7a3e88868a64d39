"""One threshold per level against the study's shared threshold, evaluation only.

    .venv/bin/python scripts/per_level_thresholds.py CHECKPOINT \
        [--ratios 0.5,0.7] [--offsets -0.3,-0.2,-0.1,0,0.1,0.2,0.3] [--val-samples 1000] [--test-samples 2000]

A study calibrates one threshold for every level (``calibrate_thresholds``: the token
ratio on the first 512 validation canvases meets the target). The policy's scores at
each level are trained against their own level's targets, so one threshold for all
is a choice, not a given. Here the finer level's threshold is the coarser one's plus
an offset; for each offset the pair is calibrated to the same token ratio on the same
validation canvases, scored on ``--val-samples`` other validation canvases, and the
best offset by validation quality is then evaluated on the test canvases beside the
shared threshold (offset 0). Nothing is trained; nothing here reads the test split
before the offset is chosen.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's splitvit

from splitvit.model import token_counts, top_down_decisions  # noqa: E402
from splitvit.train.evaluation import CheckpointEvaluator  # noqa: E402


def calibrate(model, images: torch.Tensor, ratio: float, offset: float, iterations: int = 30) -> list[float]:
    """Thresholds ``[t, t + offset]`` (clamped to [0, 1]) whose token ratio on ``images`` is
    closest to ``ratio``: bisection on ``t`` (a higher ``t`` never adds tokens)."""
    geometry = model.geometry_for(tuple(images.shape[-2:]))
    with torch.no_grad():
        scores = model.split_scores(images)

    def pair(t: float) -> list[float]:
        return [min(max(t + offset * level, 0.0), 1.0) for level in range(model.levels - 1)]

    def share(t: float) -> float:
        decisions = top_down_decisions([s > u for s, u in zip(scores, pair(t))])
        return float(token_counts(decisions).float().mean()) / geometry.full_tokens

    lo, hi = -1.0, 2.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) > ratio else (lo, mid)
    return pair(min((lo, hi), key=lambda t: abs(share(t) - ratio)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a study run's checkpoint folder")
    parser.add_argument("--ratios", default="0.5,0.7")
    parser.add_argument("--offsets", default="-0.3,-0.2,-0.1,0,0.1,0.2,0.3")
    parser.add_argument("--calibration-samples", type=int, default=512, help="validation canvases, as the study")
    parser.add_argument("--val-samples", type=int, default=1000, help="validation canvases that pick the offset")
    parser.add_argument("--test-samples", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    test = CheckpointEvaluator(args.checkpoint, split="test", samples=args.test_samples)
    # the selection canvases follow the calibration ones: none is used twice
    val = CheckpointEvaluator(args.checkpoint, split="val", samples=args.calibration_samples + args.val_samples)
    calibration = val.first_images(args.calibration_samples)
    selection = torch.utils.data.Subset(
        val.dataset, range(args.calibration_samples, args.calibration_samples + args.val_samples)
    )
    # a detector's evaluation names the categories (its ground truth comes from the subset's own items)
    for name in ("category_ids", "categories"):
        if hasattr(val.dataset, name):
            setattr(selection, name, getattr(val.dataset, name))
    val.dataset = selection
    offsets = [float(o) for o in args.offsets.split(",")]
    for ratio in (float(r) for r in args.ratios.split(",")):
        scored = []
        for offset in offsets:
            thresholds = calibrate(val.backbone, calibration, ratio, offset)
            result = val.evaluate(thresholds)
            scored.append((result.quality, offset, thresholds))
            print(
                f"@{ratio} offset {offset:+.2f}: thresholds {[round(t, 3) for t in thresholds]}, "
                f"val quality {result.quality:.4f} at token ratio {result.token_ratio:.3f}",
                flush=True,
            )
        best = max(scored, key=lambda s: s[0])
        shared = next(s for s in scored if s[1] == 0.0)
        for label, (_, offset, thresholds) in (("shared", shared), ("per-level", best)):
            result = test.evaluate(thresholds)
            coverage = (
                f", object_coverage {result.metrics['object_coverage']:.3f}"
                if "object_coverage" in result.metrics
                else ""
            )
            print(
                f"@{ratio} {label:9s} (offset {offset:+.2f}): test quality {result.quality:.4f} "
                f"at token ratio {result.token_ratio:.3f}{coverage}",
                flush=True,
            )


if __name__ == "__main__":
    main()
