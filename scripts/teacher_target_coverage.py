"""What the relevance teacher's targets show of the item, per-level against nested.

    .venv/bin/python scripts/teacher_target_coverage.py CHECKPOINT [--samples 1000]

For a study checkpoint (cluttered Fashion-MNIST: its test canvases carry item masks),
the teacher's split targets at token ratios 0.5 and 0.7 are built from the model's
own relevance (``train.teacher.kind``: attention, and gradient) both ways
(``train.teacher.targets``: ``per_level`` and ``nested``, see
``splitvit.train.losses.relevance_targets``), pruned to the tree they describe, and
scored like a policy by ``splitvit eval``: the token ratio that tree has, the share of
the item's fine cells it keeps fine (``object_coverage``) and the share of its fine
tokens on the item (``fine_on_object``). Compare with the policy's own figures
(``splitvit eval CHECKPOINT --thresholds ...``) and the oracle's (scripts/oracle_item_coverage.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's splitvit

from splitvit.model import token_counts, top_down_decisions  # noqa: E402
from splitvit.train.evaluation import CheckpointEvaluator  # noqa: E402
from splitvit.train.losses import relevance_targets, split_fraction_for_ratio  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a study run's checkpoint folder")
    parser.add_argument("--samples", type=int, default=1000, help="test canvases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    evaluator = CheckpointEvaluator(args.checkpoint, samples=args.samples, split="test")
    model = evaluator.model
    for teacher in ("attention", "gradient"):
        for ratio in (0.5, 0.7):
            for kind in ("per_level", "nested"):
                tokens = full = covered = on_item = fine_total = 0.0
                for images, labels, masks in evaluator.batches():
                    geometry = model.geometry_for(tuple(images.shape[-2:]))
                    relevance = model.relevance(images, teacher, target=labels)
                    marks = relevance_targets(relevance, split_fraction_for_ratio(ratio, geometry), kind)
                    tree = top_down_decisions([m.bool() for m in marks])
                    tokens += float(token_counts(tree).sum())
                    full += geometry.full_tokens * images.shape[0]
                    # a fine cell is a token where its parent node split
                    parent = tree[-1].float()
                    fine = parent.repeat_interleave(2, 1).repeat_interleave(2, 2)
                    item = F.avg_pool2d(masks.float().unsqueeze(1), model.patch_size).squeeze(1) > 0
                    covered += float((fine * item).sum())
                    on_item += float(item.sum())
                    fine_total += float(fine.sum())
                print(
                    f"{teacher:9s} {kind:9s} @{ratio}: token ratio {tokens / full:.3f}, "
                    f"object_coverage {covered / on_item:.3f}, fine_on_object {covered / max(fine_total, 1):.3f}"
                )


if __name__ == "__main__":
    main()
