"""Does each level of a learned policy rank its nodes? Per-level, nested and mixed targets.

    .venv/bin/python scripts/policy_level_ranking.py CHECKPOINT [CHECKPOINT ...] [--samples 500]

For each study checkpoint and each non-finest level of the quadtree, on the test
canvases: the policy's mean split score, the share of scores above 0.9 (saturated),
the mean within-image spread (std) of the scores, and the mean within-image Spearman
correlation between the scores and the model's own attention relevance (the teacher
the study trains with). A level whose scores are all near 1 with no correlation has
learned no ranking: calibrated to a low budget, its thresholds then pick nodes at
random. This tests why nested targets lose at 10% of the tokens (docs/results.md,
the dense study's teacher targets).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's splitvit

from splitvit.train.evaluation import CheckpointEvaluator  # noqa: E402


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks along dim 1 (ties broken by order; scores are continuous)."""
    return values.argsort(1).argsort(1).float()


def _spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row Spearman correlation of ``(B, N)`` tensors (NaN where a row is constant)."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return (ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))


def level_figures(checkpoint: str, samples: int, split: str = "test") -> list[dict[str, float]]:
    """Per level: mean score, saturated share, within-image std, Spearman to relevance."""
    evaluator = CheckpointEvaluator(checkpoint, samples=samples, split=split)
    model = evaluator.model
    sums: list[dict[str, float]] = []
    images_seen = 0
    with torch.no_grad():
        for batch in evaluator.batches():
            images = batch[0]
            relevance = model.relevance(images, "attention")
            probs = model(images).split_probs
            if not sums:
                sums = [dict.fromkeys(("mean", "saturated", "spread", "spearman"), 0.0) for _ in probs]
            for level, (p, r) in enumerate(zip(probs, relevance)):
                p, r = p.flatten(1).float(), r.flatten(1).float()
                sums[level]["mean"] += float(p.mean(1).sum())
                sums[level]["saturated"] += float((p > 0.9).float().mean(1).sum())
                sums[level]["spread"] += float(p.std(1).sum()) if p.shape[1] > 1 else 0.0
                sums[level]["spearman"] += float(_spearman(p, r).nan_to_num(0.0).sum())
            images_seen += images.shape[0]
    return [{k: v / images_seen for k, v in level.items()} for level in sums]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="study runs' checkpoint folders")
    parser.add_argument("--samples", type=int, default=500, help="test canvases")
    parser.add_argument("--split", default="test", choices=["val", "test"], help="data split")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for checkpoint in args.checkpoints:
        print(checkpoint)
        for level, f in enumerate(level_figures(checkpoint, args.samples, args.split)):
            print(
                f"  level {level}: mean score {f['mean']:.3f}, above 0.9 {f['saturated']:.1%}, "
                f"within-image std {f['spread']:.3f}, Spearman to relevance {f['spearman']:+.3f}"
            )


if __name__ == "__main__":
    main()
